from mxfp8_convert.cli import main

raise SystemExit(main())
