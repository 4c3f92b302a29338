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

Module map:
- ``planner``   pure: (TP pair, heads, page geometry, layout) + page ids -> writes, counts
- ``wire``      versioned messages between a decoder's and a prefill server's messenger
- ``config``    MessengerConfig, the launcher -> server contract (env SGLANG_DISAGG_MESSENGER)
- ``compat``    what first contact compares (model fingerprint, KV geometry, layout)
- ``kvpool``    binding: one rank's SGLang KV pool as registered (layer, K|V) regions
- ``node``      one rank's endpoint: backend, regions, rank group, control reader, stats
- ``reader``    the control reader thread: peers' messages decoded and dispatched; never dies on input
- ``ranks``     keeping TP ranks in lockstep (agree() all-reduce; leader inputs)
- ``inputs``    leader decisions carried by SGLang's request broadcast
- ``links``     a decoder's links to prefill servers (first contact, health, load)
- ``decode`` / ``prefill``  the two sides; each module docstring states its
  scheduler-side / worker-side contract
- ``admission`` which requests a decoder carries, and the pages they get
- ``entry``     a decoder request's phases; the leader's decisions about a failed one
- ``intake``    the prefill leader's front door: decoders' messages checked and queued
- ``orders``    what a prefill rank keeps per decoder and per order
- ``layers``    the per-layer counter (a hook after each attention output projection)
- ``stream``    the prefill's worker thread posting each layer's writes as the counter moves
- ``faults``    test-only partial-loss injection for negative controls
- ``requests``  the short list of SGLang Req/scheduler internals the messenger touches
- ``speculative`` / ``dataparallel``  what the messenger carries of SGLang's speculative decoding
  and data parallelism, and the start-up refusals for what it does not

SGLang reaches all of this through ``sglang_disagg.hooks`` (see patches/README.md).
"""
