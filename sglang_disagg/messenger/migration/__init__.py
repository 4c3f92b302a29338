"""Live migration of running requests between decoders (issue 43).

The life of a migrated request, decoder A to decoder B (same model fingerprint and wire
version; their TP sizes may differ):

  1. Cut (A's scheduler, at a step boundary): the request leaves A's running batch after A
     sampled its k-th output token, before that token runs. Its pages stay A's
     (source.MigrationSource.hold); what else moves is carry.Carried (or the request stays
     on A, with carry.refusals' reasons).
  2. Resume (A's HTTP front end, which keeps the client's connection): A sends B the
     request carry.Carried.resume() describes, naming A as the KV source instead of a
     prefill server; B allocates pages for prompt + outputs[:-1] as for any request.
  3. KV (B -> A MigrationOrder, wire.py): A checks it against what it holds, plans with the
     prefill-to-decode planner (any TP pair) and writes every layer of every page; B counts
     the writes by immediate, exactly as from a prefill server. No token is recomputed.
  4. Hand-over: once every write completed A frees the pages (source.settled); B runs the
     last output token as its first step and streams on; A relays B's tokens to the client,
     adding its k tokens to usage.
  5. Faults: no order within HOLD_S, or a write failed: the request goes back to A's batch
     and continues there (nothing lost, nothing leaked); B's deadline frees B's pages.

Modules: away.py (A: the cut, the relay, the endings), lockstep.py (every TP rank of A cuts
and settles alike), source.py and targets.py (A's held KV and its writes), carry.py (which
request states move), room.py (the authenticated source), relay.py, drain.py (/drain),
hook.py (the test hook), metrics.py; B's side is decode.py and links.py (a source link).
What migrates and what stays: docs/architecture.md, "Live migration".
"""
