"""What benchmarks/load.py reads from a running stack (KV page gauges, thread and fd counts
of every process) and how it turns a run into load.json and its pass/fail checks."""

from __future__ import annotations

import os
import time
import urllib.request
from dataclasses import dataclass
from pathlib import Path


@dataclass
class Idle:
    """One look at the stack: per server its KV page gauges and SGLang/messenger queues,
    per process (group) its live processes, threads and open fds."""

    pages: dict[str, dict[str, float]]
    busy: dict[str, float]                 # queued + running + in flight, per server
    procs: dict[str, dict[str, int]]
    failures: dict[str, dict[str, float]]  # the messengers' failure counters, by cause

    @property
    def pages_in_use(self) -> int:
        """Pages held outside the radix cache: by requests, or by nobody (a leak)."""
        return int(sum(p.get("allocated", 0) - p.get("cached", 0) for p in self.pages.values()))

    @property
    def locked(self) -> int:
        return int(sum(p.get("locked", 0) for p in self.pages.values()))

    @property
    def threads(self) -> int:
        return sum(p["threads"] for p in self.procs.values())

    @property
    def fds(self) -> int:
        return sum(p["fds"] for p in self.procs.values())

    def key(self) -> tuple:
        return self.pages_in_use, self.locked, sum(self.busy.values()), self.threads, self.fds

    def brief(self) -> str:
        return (f"pages in use {self.pages_in_use} (locked {self.locked}), busy {sum(self.busy.values()):.0f}, "
                f"threads {self.threads}, fds {self.fds} ({', '.join(f'{k}: {v}' for k, v in self.procs.items())})")


def scrape(host: str, port: int) -> dict[tuple, float]:
    from prometheus_client.parser import text_string_to_metric_families

    with urllib.request.urlopen(f"http://{host}:{port}/metrics", timeout=5) as r:
        text = r.read().decode()
    return {(s.name,) + tuple(sorted(s.labels.items())): s.value
            for family in text_string_to_metric_families(text) for s in family.samples}


def _group(pgid: int) -> list[int]:
    """Every live process of a process group (a server and the scheduler, detokenizer and
    helpers it forked: the launcher starts each server in its own session)."""
    pids = []
    for d in os.listdir("/proc"):
        if not d.isdigit():
            continue
        try:
            stat = Path(f"/proc/{d}/stat").read_text()
        except OSError:
            continue
        fields = stat[stat.rindex(")") + 2:].split()  # after "pid (comm) "
        if int(fields[2]) == pgid and fields[0] != "Z":
            pids.append(int(d))
    return pids


def _count(pid: int, what: str) -> int:
    try:
        return len(os.listdir(f"/proc/{pid}/{what}"))
    except OSError:  # exited meanwhile
        return 0


def idle_state(stack) -> Idle:
    # Counted before scraping: the metrics server answers each scrape on a thread of its own.
    procs = {}
    for p in stack.processes:
        pids = _group(p.pid)
        procs[p.spec.name] = {"processes": len(pids), "threads": sum(_count(x, "task") for x in pids),
                              "fds": sum(_count(x, "fd") for x in pids)}
    ports = stack.cfg.ports
    pages, busy, failures = {}, {}, {}
    for role, port in (("prefill", ports.prefill_metrics), ("decode", ports.decode_metrics)):
        samples = scrape(stack.cfg.host, port)
        pages[role] = {k[1][1]: v for k, v in samples.items() if k[0] == "sglang_disagg_kv_pages"}
        busy[role] = sum(v for k, v in samples.items()
                         if k[0] in ("sglang_disagg_requests_in_flight", "sglang_disagg_queue_depth"))
        failures[role] = {k[1][1]: v for k, v in samples.items() if k[0] == "sglang_disagg_failures_total" and v}
    return Idle(pages, busy, procs, failures)


def settle(stack, target: Idle | None, timeout_s: float, say, stable_s: float = 8.0) -> Idle:
    """Poll once a second until the stack is idle and unchanged for `stable_s` (and, given
    `target`, back at it), or `timeout_s` passed; returns the last look. The window outlasts
    the 5 s after which SGLang's HTTP servers close an idle keep-alive connection of the
    router's (SGLANG_TIMEOUT_KEEP_ALIVE): counted open, it would be mistaken for a leak."""
    deadline = time.monotonic() + timeout_s
    last, since = None, time.monotonic()
    while True:
        now = idle_state(stack)
        if last is None or now.key() != last.key():
            since = time.monotonic()
        last = now
        done = time.monotonic() - since >= stable_s and sum(now.busy.values()) == 0 and now.locked == 0
        if done and (target is None or now.key() == target.key()):
            return now
        if time.monotonic() > deadline:
            say(f"[load] not settled after {timeout_s:.0f}s: {now.brief()}")
            return now
        time.sleep(1)


def _ms(values: list[float], q: float) -> float | None:
    if not values:
        return None
    v = sorted(values)
    return round(1000 * v[min(len(v) - 1, int(round(q / 100 * (len(v) - 1))))], 1)


def summarize(jobs, results, wall: float, concurrency: int, reference: dict[int, list[int]],
              before: Idle, after: Idle) -> tuple[dict, list[str]]:
    stayed = [r for j, r in zip(jobs, results) if j.abort_after is None]
    leaving = [r for j, r in zip(jobs, results) if j.abort_after is not None]
    failed = [r for r in stayed if r.error]
    failed_before_leaving = [r for r in leaving if r.error]
    ok = [r for r in stayed if not r.error]
    compared = {i: results[i].output_ids == ref for i, ref in reference.items()}
    mismatches = [{"request": i, "prompt_tokens": len(jobs[i].prompt), "kind": jobs[i].kind,
                   "first_diff": next((k for k, (a, b) in enumerate(zip(results[i].output_ids, reference[i]))
                                       if a != b), min(len(results[i].output_ids), len(reference[i])))}
                  for i, same in compared.items() if not same]
    doc = {
        "requests": len(jobs), "concurrency": concurrency,
        "long_prompts": sum(j.kind == "long" for j in jobs),
        "aborted": sum(r.aborted for r in leaving), "abort_clients": len(leaving),
        "aborted_before_first_token": sum(r.aborted and not r.token_times for r in leaving),
        "aborted_at_decoder": sum(j.direct for j in jobs),
        # During the load, by cause: "aborted" are client aborts a messenger caught before hand-off.
        "messenger_failures": {role: {c: v - before.failures.get(role, {}).get(c, 0) for c, v in f.items()}
                               for role, f in after.failures.items()},
        "errors": len(failed), "errors_before_abort": len(failed_before_leaving),
        "error_samples": sorted({r.error for r in failed + failed_before_leaving})[:5],
        "wall_s": round(wall, 2), "requests_per_s": round(len(jobs) / wall, 2),
        "completed_per_s": round(len(ok) / wall, 2),
        "output_tokens_per_s": round(sum(len(r.token_times) for r in results) / wall, 1),
        "p50_latency_ms": _ms([r.end - r.start for r in ok], 50),
        "p99_latency_ms": _ms([r.end - r.start for r in ok], 99),
        "p50_ttft_ms": _ms([r.ttft for r in ok if r.ttft is not None], 50),
        "p99_ttft_ms": _ms([r.ttft for r in ok if r.ttft is not None], 99),
        "outputs_compared": len(compared), "outputs_identical": sum(compared.values()),
        "output_mismatches": mismatches,
        "pages_idle_before": before.pages_in_use, "pages_idle_after": after.pages_in_use,
        "pages_locked_after": after.locked, "busy_after": after.busy,
        "kv_pages_before": before.pages, "kv_pages_after": after.pages,
        "threads_before": before.threads, "threads_after": after.threads,
        "fds_before": before.fds, "fds_after": after.fds,
        "processes_before": before.procs, "processes_after": after.procs,
    }
    failures = []
    if failed or failed_before_leaving:
        failures.append(f"{len(failed)} request(s) failed, {len(failed_before_leaving)} more before their client "
                        f"left: {doc['error_samples']}")
    if not compared or mismatches:
        failures.append(f"outputs: {doc['outputs_identical']}/{len(compared)} identical to the colocated server "
                        f"({mismatches[:3]})")
    if after.pages_in_use != before.pages_in_use or after.locked or sum(after.busy.values()):
        failures.append(f"KV pages not back to idle: {before.pages_in_use} in use before, {after.pages_in_use} "
                        f"after, {after.locked} locked, still busy {after.busy}")
    for what in ("threads", "fds"):
        if getattr(after, what) != getattr(before, what):
            failures.append(f"{what}: {getattr(before, what)} before, {getattr(after, what)} after "
                            f"({before.procs} -> {after.procs})")
    doc["checks_failed"] = failures
    return doc, failures


def write_report(out: Path, doc: dict, record) -> Path:
    """DIR/load.json through the results writer (`record`: the run's results_doc.Run); the
    Idle snapshots in `doc` are written as their fields."""
    return record.write(out / "load.json", doc, indent=2, notes=[
        "one run, no repeats: latencies are percentiles over its requests; a check that failed is "
        "in checks_failed (the run's exit status 1)",
        "pages/threads/fds: idle values after the warm-up (before) and once settled after the load (after)"])
