"""Our libfabric backend: a C shim (shim.c, built by cffi at install) and its Python side."""
