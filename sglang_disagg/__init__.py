"""sglang-disagg: disaggregated prefill/decode serving for SGLang.

Module map:
- ``sglang_disagg.env``        typed environment variables and paths (one place)
- ``sglang_disagg.models``     built-in random-weight models, generated deterministically
- ``sglang_disagg.launch``     launcher for prefill / decode / router / all / colocated
- ``sglang_disagg.patchtool``    the SGLang patch series tool (apply, check, status, export, rebase)
- ``sglang_disagg.cpu``        CPU operator shims SGLang reaches through hooks (sgl_kernel ops, attention, speculation)
- ``sglang_disagg.backends``   transfer backend registry and backends (libfabric, nixl, mooncake, shmem, cudaipc)
- ``sglang_disagg.devices``    device twins (cpu, cuda): the layer counter's word, the forward's fence, memory kind
- ``sglang_disagg.devcheck``   the device check (scripts/gpu-check) and its CPU twin
"""

__version__ = "0.1.0.dev0"
