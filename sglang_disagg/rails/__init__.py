"""Rails: the NICs a server's messenger writes KV through, and which TP rank uses which.

choose.py turns `--rails auto|NAME,...` into the interfaces a server's backend opens an
endpoint on (the libfabric backend drives them: backends/libfabric/rails.py, pairing them with a
peer's by pairing.py and striping batches by bytes). For GPU hosts this package also reads a
node's topology (topology.py: GPUs and NICs with their PCIe and NUMA positions, from sysfs),
plans the ranks' rails (plan.py: nearest NIC(s) per GPU, round-robin on CPU) and assigns a
request's write groups a rail pair (assign.py); the device check prints the plan
(``python -m sglang_disagg.rails``). What the backend uses of it: `plan.nearest_rails`, the rails
a CUDA region's writes prefer (its GPU's nearest); on CPU every rank stripes over every rail, batch
by batch (docs/backends.md, Rails). numa.py places each rail's progress thread on its NIC's node.
"""

from __future__ import annotations

from .assign import Route, assign
from .pairing import Pairing, interface_addresses, pair_rails
from .plan import RailPlan, choose_rails, describe, plan_rails
from .topology import Gpu, Nic, NicKind, PciPosition, Topology, read_topology

__all__ = ["Gpu", "Nic", "NicKind", "Pairing", "PciPosition", "RailPlan", "Route", "Topology", "assign", "choose_rails",
           "describe", "interface_addresses", "pair_rails", "plan_rails", "read_topology"]
