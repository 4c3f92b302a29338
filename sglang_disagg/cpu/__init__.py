"""What SGLang runs on a CPU-only machine in place of its CUDA-only pieces: the operator shims.

The PyPI ``sgl_kernel`` wheel is a CUDA build and SGLang's torch_native attention backend
(the CPU one) lacks what disaggregation, speculation and DeepSeek-shaped models need. This
subpackage holds the plain-torch stand-ins, one concern per module:

- ``ops``          the ``sgl_kernel.<name>_cpu`` ops of the request path (and the door to the rest)
- ``spec_ops``     the ``_cpu`` index ops speculative decoding calls (draft/verify windows)
- ``speculative``  speculative decoding on torch_native (draft-extend backend, verify lengths)
- ``attention``    torch_native's HND page reads and new-rows-only extend
- ``deepseek``     DeepSeek on CPU (absorbed MLA for every forward, eager MoE routing)

SGLang reaches this room only through ``sglang_disagg/hooks.py``, the one module our patches
import (``tests/unit/test_hooks_door.py``); nothing here imports ``hooks`` or the messenger.
Importing the package imports none of its modules (they load torch or SGLang).
"""
