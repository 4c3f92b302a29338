"""Build hook for the native libfabric shim; all metadata lives in pyproject.toml.

Needs Debian's libfabric-dev at build time and libfabric1 at run time.
"""

from setuptools import setup

setup(cffi_modules=["sglang_disagg/backends/libfabric/_build.py:ffibuilder"])
