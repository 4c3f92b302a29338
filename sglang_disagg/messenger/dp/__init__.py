"""Data parallelism in messenger mode: one room for where a scheduler sits, the owner of the
server's one backend, the group proxy, their messages and their checks.

    support.py  what a messenger server accepts (refusals naming the launcher's flags)
    place.py    where a scheduler sits: its group, its ranks, the owner socket's name
    groups.py   this server's groups as Node sees them (the same calls with and without DP)
    owner.py    DP group 0's leader: the backend, dispatching peers' messages to groups
    proxy.py    another group's leader: the backend through the owner (a Transport)
    wire.py     their messages, one per operation, strict codec of ../fields.py

What it may import: the package's IPC layer (``sglang_disagg.ipc``: the owner's socket is
fdpass's stream mode, its frames ipc/stream.py), the backends' errors and types, and the
messenger's wire, config, fields, inputs, reader and transport modules; nothing of the
messenger imports it but node.py (through groups.py and place.py) and the checks
(support.py, from hooks and the launcher). The IPC layer never imports it
(tests/unit/test_import_graph.py).

On GPU (not built): a group's KV pool is cuMem memory the owner must map before it can
register it. The group would send its allocations' descriptors to the owner over a
SEQPACKET connection of fdpass (SCM_RIGHTS, MAX_FDS per message, as ipc/handover.py does
for a TP rank's), keyed by allocation, and its Register call would name the allocation and
offset instead of a shared-memory path; the stream channel carries no descriptors.
"""
