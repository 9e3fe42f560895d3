"""The optional C accelerator of the quantizer (mxfp8_convert/_cquant.c); the rest of the
package's metadata is in pyproject.toml.

Built where a C compiler is found (``pip install -e .``, ``make install``); where it is not, or
the build fails, the install goes on without it and the quantizer runs its torch path (the same
bytes). ``MXFP8_CONVERT_NO_C=1`` turns the extension off at run time.
"""

from setuptools import Extension, setup
from setuptools.command.build_ext import build_ext


class BuildExt(build_ext):
    """``-O3`` and no fused multiply-adds for gcc and clang: the quantizer's float32 operations
    must round one at a time, as torch's do."""

    def build_extensions(self) -> None:
        if self.compiler.compiler_type == "unix":
            for ext in self.extensions:
                ext.extra_compile_args = ["-O3", "-ffp-contract=off", "-fno-fast-math"]
        super().build_extensions()


setup(
    ext_modules=[Extension("mxfp8_convert._cquant", ["mxfp8_convert/_cquant.c"], optional=True)],
    cmdclass={"build_ext": BuildExt},
)
