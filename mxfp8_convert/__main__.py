from mxfp8_convert.cli import script

script()
