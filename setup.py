"""Build hook for the native libfabric shim; all metadata lives in pyproject.toml.

Needs Debian's libfabric-dev at build time and libfabric1 at run time. The shim's C
sources ship as package data so that an sdist can rebuild it.
"""

from setuptools import setup

setup(
    cffi_modules=["sglang_disagg/backends/libfabric/_build.py:ffibuilder"],
    package_data={"sglang_disagg.backends.libfabric": ["shim.c", "shim.h"],
                  # the vendored CRDs the rendered manifests are validated against, with their licenses
                  "sglang_disagg.launch": ["schemas/README.md", "schemas/*/LICENSE", "schemas/*/*.yaml.gz"]},
)
