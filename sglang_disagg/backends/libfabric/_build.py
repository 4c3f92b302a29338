"""cffi API-mode build of the libfabric shim (used by setup.py's cffi_modules).

API mode rather than ABI/ctypes: libfabric's data path (fi_writedata, fi_cq_read) is
static inline in the headers, so it only exists once compiled against them.
"""

from __future__ import annotations

import os

from cffi import FFI

_HERE = os.path.dirname(os.path.abspath(__file__))


def _read(name: str) -> str:
    with open(os.path.join(_HERE, name), encoding="utf-8") as f:
        return f.read()


def _cdef() -> str:
    # The header doubles as the cdef; drop comments cffi's parser would reject.
    lines = []
    for line in _read("shim.h").splitlines():
        if line.lstrip().startswith(("/*", "*")):
            continue
        lines.append(line.split("/*")[0].rstrip())
    return "\n".join(lines)


ffibuilder = FFI()
ffibuilder.cdef(_cdef())
ffibuilder.set_source(
    "sglang_disagg.backends.libfabric._shim",
    _read("shim.c"),
    include_dirs=[_HERE],
    libraries=["fabric"],
    extra_compile_args=["-O2", "-std=gnu11", "-Wall", "-Wno-unused-function"],
)

if __name__ == "__main__":
    # Development shortcut: build in place next to this file.
    ffibuilder.compile(tmpdir=os.path.join(_HERE, "..", "..", ".."), verbose=True)
