"""Rails: the NICs a server's messenger writes KV through, and which TP rank uses which.

So far this package reads a node's topology (topology.py: GPUs and NICs with their PCIe and
NUMA positions, from sysfs) and plans the ranks' rails (plan.py: nearest NIC(s) per GPU,
round-robin on CPU), pairs a server's rails with a peer's by the networks they share
(pairing.py: different rail counts still link), assigns each of a request's write groups a
rail pair (assign.py: spread by bytes, seeded per request), and the device check prints the plan
(``python -m sglang_disagg.rails``).
The transports do not drive several rails yet: every backend still opens one endpoint per
server (docs/backends.md), so the plan is shown, not used.
"""

from __future__ import annotations

from .assign import Route, assign
from .pairing import Pairing, interface_addresses, pair_rails
from .plan import RailPlan, choose_rails, describe, plan_rails
from .topology import Gpu, Nic, NicKind, PciPosition, Topology, read_topology

__all__ = ["Gpu", "Nic", "NicKind", "Pairing", "PciPosition", "RailPlan", "Route", "Topology", "assign", "choose_rails",
           "describe", "interface_addresses", "pair_rails", "plan_rails", "read_topology"]
