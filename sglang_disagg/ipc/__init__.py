"""The process boundary of one host: memory and descriptors handed between our own processes.

What lives here and nowhere else: shared host memory another process maps (``shm``), GPU
memory another process maps (``cumem``, over the CUDA driver binding ``cuda_driver``), file
descriptors passed over Unix sockets with the peer's credentials checked (``fdpass``), a
rank's KV allocations handed to its leader (``handover``), and the framed stream channel a
data-parallel group talks to its server's owner over (``stream``).

Rooms above this one (backends, messenger, messenger.dp, devcheck) import it; it imports
nothing of the package outside itself (tests/unit/test_import_graph.py).
"""
