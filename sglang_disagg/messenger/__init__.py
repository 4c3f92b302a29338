"""The KV messenger: sglang_disagg's disaggregated serving path (``--mode messenger``).

A decoder receives the request, allocates non-evictable pages for the prompt minus its last
token (reusing what its own radix tree holds of it) and asks a prefill server (fewest
outstanding requests) to fill the rest. The prefill server computes the prompt in its own
batch scheduler (chunked prefill, radix cache) with max_new_tokens=0, so it never samples,
and writes each layer's pages into the decoder's pages with the request's 32-bit
immediate as soon as the forward has passed that layer (a counter after each attention
output projection; ``--no-stream``: after the chunk's forward). The decoder counts those
writes (it knows how many from the planner) - there is no "done" message - and then runs
the last prompt token as an ordinary one-token extend, which samples the first output
token with the decoder's grammar, if any.

The messenger's modules, each with its summary, are in docs/modules.md (generated from their
docstrings by ``python -m harness.maps``): ``planner`` is pure, ``decode`` / ``prefill`` are the
two sides and their docstrings state each side's scheduler-side / worker-side contract, and
``transport`` is what they call on a transfer backend.

SGLang reaches all of this through ``sglang_disagg.hooks`` (see patches/README.md).
"""
