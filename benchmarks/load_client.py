"""Open-loop load for the end-to-end benchmark: Poisson arrivals of two request classes
(short chats and long prompts) streamed from SGLang's native ``/generate``, with the time
of every streamed chunk on one clock.

SGLang's ``bench_serving`` drives one class at a time and reports latencies relative to
each request's start, without absolute times; the prefill stalls this benchmark looks
for show as long inter-token gaps *at the moments* long prompts arrive, so this client
keeps every token's arrival time. Requests go through the stack's front door like any
client's, greedy with ``ignore_eos`` so output lengths are exact.
"""

from __future__ import annotations

import asyncio
import random
import time
from collections.abc import Callable
from dataclasses import dataclass, field

from sse import Comments, data_of


@dataclass(frozen=True)
class RequestClass:
    name: str
    input_len: int
    output_len: int
    rate: float        # requests per second (Poisson)
    count: int


@dataclass
class Result:
    klass: str
    start: float                       # seconds since the run began
    token_times: list[float] = field(default_factory=list)  # arrival of each streamed token
    error: str = ""
    output_ids: list[int] = field(default_factory=list)
    aborted: bool = False              # the client closed the connection on purpose
    end: float | None = None           # the stream ended (or was closed by the client)
    comments: Comments = field(default_factory=Comments)  # SSE keep-alive comments skipped

    @property
    def ttft(self) -> float | None:
        return self.token_times[0] - self.start if self.token_times else None

    @property
    def itls(self) -> list[float]:
        t = self.token_times
        return [b - a for a, b in zip(t, t[1:])]


def _prompt(rng: random.Random, n: int, vocab: int) -> list[int]:
    return [1] + [rng.randrange(10, vocab) for _ in range(n - 1)]


async def stream_generate(session, url: str, body: dict, t0: float, klass: str = "",
                          abort_after: int | None = None, abort_delay_s: float = 0.0,
                          res: Result | None = None) -> Result:
    """POST a streaming ``/generate`` and record each token's arrival and the output ids.
    With `abort_after`, close the connection once that many tokens arrived (0: `abort_delay_s`
    after the response headers did), as a client that goes away mid-stream. `res`: the
    Result to fill (a caller that watches tokens arrive while the stream runs)."""
    if res is None:
        res = Result(klass, time.perf_counter() - t0)
    seen = 0
    try:
        async with session.post(url + "/generate", json={**body, "stream": True}) as r:
            if r.status != 200:
                res.error = f"HTTP {r.status}: {(await r.text())[:200]}"
                return res
            if abort_after == 0:
                await asyncio.sleep(abort_delay_s)
                r.close()  # drops the connection: the server must see the client leave
                res.aborted, res.end = True, time.perf_counter() - t0
                return res
            async for raw in r.content:
                chunk = data_of(raw, res.comments)
                if chunk is None:  # a keep-alive comment, a blank line, [DONE]
                    continue
                now = time.perf_counter() - t0
                if "error" in chunk:
                    res.error = f"stream error: {str(chunk['error'])[:200]}"
                    break
                n = chunk["meta_info"]["completion_tokens"]
                ids = chunk.get("output_ids") or []
                # SGLang streams cumulative ids unless --incremental-streaming-output.
                res.output_ids = list(ids) if len(ids) == n else res.output_ids + list(ids)
                res.token_times += [now] * (n - seen)  # a chunk may carry several tokens
                seen = n
                if abort_after is not None and seen >= abort_after:
                    r.close()
                    res.aborted = True
                    break
    except Exception as e:  # noqa: BLE001 - recorded as this request's failure
        res.error = f"{type(e).__name__}: {e}"
    res.end = time.perf_counter() - t0
    want = body["sampling_params"]["max_new_tokens"]
    if not res.error and not res.aborted and seen != want:
        res.error = f"{seen} of {want} tokens"
    return res


async def _one(session, url: str, klass: RequestClass, prompt: list[int], t0: float) -> Result:
    body = {"input_ids": prompt,
            "sampling_params": {"max_new_tokens": klass.output_len, "temperature": 0.0, "ignore_eos": True}}
    return await stream_generate(session, url, body, t0, klass.name)


async def _run(url: str, classes: list[RequestClass], seed: int, prompt_seed: int, vocab: int,
               on_done: Callable[[Result], None]) -> list[Result]:
    import aiohttp

    plan = []  # (arrival time, class, prompt), every class its own Poisson process
    for k in classes:
        # Seeded per class: a class arrives at the same times whatever other classes run.
        arrivals, prompts = random.Random(f"{seed}:{k.name}"), random.Random(f"prompts:{prompt_seed}:{k.name}")
        t = 0.0
        for _ in range(k.count):
            t += arrivals.expovariate(k.rate)
            plan.append((t, k, _prompt(prompts, k.input_len, vocab)))
    plan.sort(key=lambda p: p[0])
    timeout = aiohttp.ClientTimeout(total=1800)
    async with aiohttp.ClientSession(timeout=timeout) as session:
        t0 = time.perf_counter()
        tasks = []
        for at, k, prompt in plan:
            delay = at - (time.perf_counter() - t0)
            if delay > 0:
                await asyncio.sleep(delay)
            task = asyncio.create_task(_one(session, url, k, prompt, t0))
            task.add_done_callback(lambda f: on_done(f.result()))
            tasks.append(task)
        return list(await asyncio.gather(*tasks))


def run(url: str, classes: list[RequestClass], seed: int = 1, vocab: int = 4000,
        on_done: Callable[[Result], None] = lambda r: None, prompt_seed: int | None = None) -> list[Result]:
    """`seed` draws the arrival times, `prompt_seed` (default: `seed`) the prompts: two runs
    with one seed and different prompt seeds offer the same load without sharing a prefix."""
    return asyncio.run(_run(url, classes, seed, seed if prompt_seed is None else prompt_seed, vocab, on_done))
