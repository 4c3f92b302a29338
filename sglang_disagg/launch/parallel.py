"""One SGLang server's parallel shape: its TP size, and the data parallelism it runs.

SGLang runs data parallelism in two shapes, and the launcher sets them per side
(``--prefill-attn-dp``/``--decode-attn-dp``, ``--prefill-dp``/``--decode-dp``; a colocated
server takes the prefill values, as it takes ``--prefill-tp``):

- attention DP (``--attn-dp-size D``): the server's ``tp`` ranks form D groups of tp/D
  attention ranks, each group its own scheduler and KV pool, the MLP/MoE layers over all
  ``tp`` ranks. ``tp`` processes; a KV pool's heads are split over tp/D ranks (``attn_tp``).
- replica DP (``--dp-size D``): D copies of a ``tp``-rank server behind SGLang's
  data-parallel controller, each with its own model and KV pool. ``tp * D`` processes
  (cores on CPU, GPUs on CUDA); a KV pool's heads are split over ``tp`` ranks.

Both at once on one server are refused: the messenger carries one or the other, and the
launcher plans cores and GPUs for one or the other.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Parallel:
    """A server's TP size and data parallelism; `problem` says what is wrong with one, naming
    the settings as its caller spells them (LaunchConfig: flags; deploy.py: fields)."""

    tp: int = 1
    attn_dp: int = 1  # attention-DP groups inside the TP group (SGLang's --attn-dp-size)
    dp: int = 1  # replicas of the TP group (SGLang's --dp-size)

    @property
    def attn_tp(self) -> int:
        """The ranks one KV pool's heads are split over: an attention-DP group's, else the TP group's."""
        return self.tp // self.attn_dp

    @property
    def processes(self) -> int:
        """The server's rank processes: one per TP rank of each replica."""
        return self.tp * self.dp

    def argv(self) -> list[str]:
        """SGLang's flags for this shape (a size of 1 is SGLang's default and left out)."""
        argv = ["--tp", str(self.tp)]
        if self.attn_dp > 1:
            argv += ["--attn-dp-size", str(self.attn_dp)]
        if self.dp > 1:
            argv += ["--dp-size", str(self.dp)]
        return argv

    def label(self, tp_flag: str) -> str:
        """'--prefill-tp 4 --prefill-attn-dp 2' from the TP flag's name; a deployment file's
        field ('tp', 'prefill tp') gives 'tp 4, attn_dp 2'."""
        stem, cli = tp_flag[:-2], tp_flag.startswith("--")
        parts = [f"{tp_flag} {self.tp}"]
        for name, size in (("attn-dp" if cli else "attn_dp", self.attn_dp), ("dp", self.dp)):
            if size > 1:
                parts.append(f"{stem}{name} {size}")
        return (" " if cli else ", ").join(parts)


def flags(side: str) -> tuple[str, str, str]:
    """The launcher's TP, attention-DP and replica-DP flags of `side` ("prefill", "decode")."""
    return f"--{side}-tp", f"--{side}-attn-dp", f"--{side}-dp"


def problem(p: Parallel, names: tuple[str, str, str]) -> str:
    """Why a server cannot run shape `p` ("" if it can), naming its TP, attention-DP and
    replica-DP settings by `names` (the launcher's flags(side), a deployment file's fields)."""
    tp, attn, dp = names
    for flag, size in ((tp, p.tp), (attn, p.attn_dp), (dp, p.dp)):
        if size < 1:
            return f"{flag} must be >= 1, got {size}"
    if p.tp % p.attn_dp:
        return (f"{attn} {p.attn_dp} needs {tp} divisible by it ({p.attn_dp} groups of tp/{p.attn_dp} attention "
                f"ranks); got {tp} {p.tp}")
    if p.attn_dp > 1 and p.dp > 1:
        return (f"{attn} {p.attn_dp} with {dp} {p.dp}: attention DP and replica DP on one server at once are not "
                f"supported by the messenger (nor planned by the launcher's cores and GPUs); choose one")
    return ""
