"""Which GPUs each server of a stack runs on, and which attention kernels may read its KV
(pure: no torch; the GPU count comes in, a frozen plan goes out).

Placement is by SGLang's own ``--base-gpu-id`` / ``--gpu-id-step`` (rank r of a server
runs on GPU base + r * step), every server seeing every GPU, not by a CUDA_VISIBLE_DEVICES
per server. The messenger's same-machine device path (cumem.py) hands a KV buffer to a
peer process as (pid, fd, size, *device ordinal*), and the peer maps it on that ordinal:
an ordinal names the same GPU in both processes only when both see the same GPUs. A
CUDA_VISIBLE_DEVICES the operator sets on the launcher still applies: it is inherited by
every server, and the GPU ids here index what it leaves visible. The price: a server's GPUs
must be evenly spaced (0,1 / 2,3 / 0,2), which ``--prefill-gpus`` / ``--decode-gpus`` check.

Default split on N GPUs (``--role all``): prefill gets GPUs 0..p-1, decode the next d
when p + d <= N; otherwise the servers share GPUs (decode takes the last d) and each takes
a bounded share of a shared GPU's memory. A TP size larger than N is refused. p and d count
rank processes: a server with replica DP (``--prefill-dp``) needs tp * dp GPUs, SGLang placing
replica k's rank r on base + (k * tp + r) * step; attention DP runs inside the TP group (tp).

Memory on a shared GPU: SGLang's ``--mem-fraction-static`` is the fraction of the memory
*free when that server starts* that its weights and KV pool may take (the KV budget is
free-after-weights minus free-at-start * (1 - fraction)). Servers sharing a GPU therefore
start one after the other (stack.py: prefill healthy, then decode) and, for each to hold
``share`` of the GPU, prefill passes ``share`` and decode ``share / (1 - share)`` of what
prefill left. Started together both would measure the empty GPU and the second to size its
pool would find the first's pool in its budget.
"""

from __future__ import annotations

from dataclasses import dataclass

DEFAULT_SHARE = 0.4  # of a shared GPU's memory, per server: two leave 20 % for activations and graphs
SHARE_RANGE = (0.05, 0.45)

# Attention backends that read the messenger's HND KV pool (SGLANG_USE_HND_KVCACHE=1),
# in order of preference on CUDA.
HND_BACKENDS = ("fa3", "trtllm_mha", "torch_native")
DEFAULT_CUDA_BACKEND = "fa3"  # Hopper's FlashAttention 3: reads HND through paged_kv_view
DETERMINISTIC_HND_BACKENDS = ("fa3",)  # SGLang's deterministic mode takes fa3/fa4/flashinfer/triton
FLOAT_BACKENDS = ("torch_native",)  # fa3 and trtllm_mha run bfloat16/float16 only
WHY_NOT_HND = {
    "triton": "its kernels take the KV pool as [token, head, dim] and raise on the HND pool",
    "flashinfer": 'SGLang builds its FlashInfer wrappers with kv_layout="NHD"; the patch that passes '
                  'kv_layout="HND" is not in this patch series yet',
}
ATTENTION_FLAGS = ("--attention-backend", "--prefill-attention-backend", "--decode-attention-backend")


def parse_ids(text: str) -> tuple[int, ...]:
    """'0,1' -> (0, 1): a --prefill-gpus / --decode-gpus value."""
    try:
        ids = tuple(int(x) for x in text.split(",") if x.strip())
    except ValueError:
        raise ValueError(f"{text!r}: expected GPU ids separated by commas, e.g. 0,1") from None
    if not ids:
        raise ValueError(f"{text!r}: expected at least one GPU id")
    return ids


@dataclass(frozen=True)
class ServerGpus:
    """One server's GPUs (rank r on gpus[r]) and its --mem-fraction-static (None: SGLang's)."""

    gpus: tuple[int, ...]
    mem_fraction: float | None = None

    @property
    def step(self) -> int:
        return self.gpus[1] - self.gpus[0] if len(self.gpus) > 1 else 1

    def argv(self) -> list[str]:
        argv = ["--base-gpu-id", str(self.gpus[0])]
        if self.step != 1:
            argv += ["--gpu-id-step", str(self.step)]
        if self.mem_fraction is not None:
            argv += ["--mem-fraction-static", f"{self.mem_fraction:.3f}"]
        return argv

    def describe(self) -> str:
        gpus = ",".join(map(str, self.gpus))
        share = f", --mem-fraction-static {self.mem_fraction:.3f}" if self.mem_fraction is not None else ""
        return f"GPU{'s' if len(self.gpus) > 1 else ''} {gpus}{share}"


@dataclass(frozen=True)
class GpuPlan:
    count: int
    prefill: ServerGpus | None  # also the colocated server's
    decode: ServerGpus | None

    @property
    def shared(self) -> tuple[int, ...]:
        """GPUs both servers run on (then they start one after the other)."""
        if self.prefill is None or self.decode is None:
            return ()
        return tuple(sorted(set(self.prefill.gpus) & set(self.decode.gpus)))


def _check_set(flag: str, ids: tuple[int, ...], tp: int, dp: int, count: int, where: str) -> None:
    if len(ids) != tp * dp:
        ranks = f"TP {tp}" + (f" x {dp} replicas" if dp > 1 else "")
        raise ValueError(f"{flag} {','.join(map(str, ids))} names {len(ids)} GPU(s) for {ranks}: give one per rank")
    bad = [g for g in ids if not 0 <= g < count]
    if bad:
        raise ValueError(f"{flag}: GPU {bad[0]} does not exist: {where} has GPUs 0..{count - 1}")
    steps = {b - a for a, b in zip(ids, ids[1:])}
    if len(steps) > 1 or (steps and min(steps) < 1):
        raise ValueError(f"{flag} {','.join(map(str, ids))}: SGLang places TP rank r on --base-gpu-id + r * "
                         f"--gpu-id-step (replica d's rank r at (d * tp + r) * step), so a server's GPUs must be "
                         f"increasing and evenly spaced (e.g. 0,1 or 0,2)")


def _free_block(count: int, taken: tuple[int, ...], tp: int) -> tuple[int, ...] | None:
    """The lowest run of `tp` consecutive GPUs none of which is taken."""
    for start in range(count - tp + 1):
        block = tuple(range(start, start + tp))
        if not set(block) & set(taken):
            return block
    return None


def plan(count: int, prefill_tp: int | None, decode_tp: int | None, prefill_gpus: tuple[int, ...] = (),
         decode_gpus: tuple[int, ...] = (), share: float = DEFAULT_SHARE, where: str = "this machine",
         prefill_dp: int = 1, decode_dp: int = 1) -> GpuPlan:
    """The GPUs of the servers on this machine: `prefill_tp` / `decode_tp` None when that server
    is not here; a server with `*_dp` replicas (replica DP) takes tp * dp GPUs, one per rank of
    each replica (attention DP runs inside the TP group: tp GPUs). Raises ValueError naming the
    flag at fault."""
    if count < 1:
        raise ValueError(f"{where} has no GPU")
    lo, hi = SHARE_RANGE
    if not lo <= share <= hi:
        raise ValueError(f"--shared-gpu-fraction {share}: must be in {lo}..{hi} (each of two servers sharing a "
                         f"GPU takes that share of its memory; the rest holds activations and CUDA graphs)")
    for flag, tp, dp, ids in (("--prefill-tp", prefill_tp, prefill_dp, prefill_gpus),
                              ("--decode-tp", decode_tp, decode_dp, decode_gpus)):
        if tp is None:
            if ids:
                raise ValueError(f"{flag.replace('-tp', '-gpus')}: no {flag[2:-3]} server runs on this machine")
            continue
        if tp * dp > count:
            replicas = f" with {flag[:-2]}dp {dp}" if dp > 1 else ""
            raise ValueError(f"{flag} {tp}{replicas} needs {tp * dp} GPUs and {where} has {count}")
        if ids:
            _check_set(flag.replace("-tp", "-gpus"), ids, tp, dp, count, where)
    if prefill_tp is not None:
        prefill_tp *= prefill_dp  # from here on: GPUs, one per rank process
    if decode_tp is not None:
        decode_tp *= decode_dp
    p = prefill_gpus or None
    d = decode_gpus or None
    if prefill_tp is not None and decode_tp is not None:
        if p is None and d is None:
            p = tuple(range(prefill_tp))
            d = (tuple(range(prefill_tp, prefill_tp + decode_tp)) if prefill_tp + decode_tp <= count
                 else tuple(range(count - decode_tp, count)))
        elif d is None:
            d = _free_block(count, p, decode_tp) or tuple(range(count - decode_tp, count))
        elif p is None:
            p = _free_block(count, d, prefill_tp) or tuple(range(prefill_tp))
        if set(p) & set(d):
            return GpuPlan(count, ServerGpus(p, share), ServerGpus(d, round(share / (1 - share), 3)))
        return GpuPlan(count, ServerGpus(p), ServerGpus(d))
    if prefill_tp is not None:
        return GpuPlan(count, ServerGpus(p or tuple(range(prefill_tp))), None)
    if decode_tp is not None:
        return GpuPlan(count, None, ServerGpus(d or tuple(range(decode_tp))))
    return GpuPlan(count, None, None)


def attention_backends(backend: str | None, extra_args: tuple[str, ...]) -> list[tuple[str, str]]:
    """(flag, backend) for each attention backend the servers will be given."""
    found = [("--attention-backend", backend)] if backend else []
    args = list(extra_args)
    for i, a in enumerate(args):
        for flag in ATTENTION_FLAGS:
            if a == flag and i + 1 < len(args):
                found.append((flag, args[i + 1]))
            elif a.startswith(flag + "="):
                found.append((flag, a.split("=", 1)[1]))
    return found


def attention_problem(backends: list[tuple[str, str]], deterministic: bool, dtype: str | None) -> str:
    """Why these backends cannot serve the messenger's HND KV pool on CUDA ("" if they can)."""
    chosen = backends or [("--attention-backend", DEFAULT_CUDA_BACKEND)]
    for flag, b in chosen:
        if b not in HND_BACKENDS:
            why = WHY_NOT_HND.get(b, "it does not read the HND KV layout")
            return (f"{flag} {b} cannot read the messenger's KV pool (HND layout): {why}; backends that "
                    f"can: {', '.join(HND_BACKENDS)} (or --mode upstream / --role colocated for any backend)")
        if deterministic and b not in DETERMINISTIC_HND_BACKENDS:
            return (f"{flag} {b}: --enable-deterministic-inference with the messenger needs "
                    f"{' or '.join(DETERMINISTIC_HND_BACKENDS)} (SGLang's deterministic kernels that read HND)")
        if dtype in ("float", "float32") and b not in FLOAT_BACKENDS:
            return (f"--dtype {dtype} with {flag} {b}: its kernels run bfloat16/float16 only; float32 on CUDA "
                    f"needs --attention-backend {' or '.join(FLOAT_BACKENDS)}")
    return ""
