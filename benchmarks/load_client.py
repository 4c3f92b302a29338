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
import json
import random
import time
from collections.abc import Callable
from dataclasses import dataclass, field


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

    @property
    def ttft(self) -> float | None:
        return self.token_times[0] - self.start if self.token_times else None

    @property
    def itls(self) -> list[float]:
        t = self.token_times
        return [b - a for a, b in zip(t, t[1:])]


def _prompt(rng: random.Random, n: int, vocab: int) -> list[int]:
    return [1] + [rng.randrange(10, vocab) for _ in range(n - 1)]


async def _one(session, url: str, klass: RequestClass, prompt: list[int], t0: float) -> Result:
    res = Result(klass.name, time.perf_counter() - t0)
    body = {"input_ids": prompt, "stream": True,
            "sampling_params": {"max_new_tokens": klass.output_len, "temperature": 0.0, "ignore_eos": True}}
    seen = 0
    try:
        async with session.post(url + "/generate", json=body) as r:
            if r.status != 200:
                res.error = f"HTTP {r.status}: {(await r.text())[:200]}"
                return res
            async for raw in r.content:
                line = raw.strip()
                if not line.startswith(b"data:") or line == b"data: [DONE]":
                    continue
                now = time.perf_counter() - t0
                n = json.loads(line[5:])["meta_info"]["completion_tokens"]
                res.token_times += [now] * (n - seen)  # a chunk may carry several tokens
                seen = n
    except Exception as e:  # noqa: BLE001 - recorded as this request's failure
        res.error = f"{type(e).__name__}: {e}"
    if not res.error and seen != klass.output_len:
        res.error = f"{seen} of {klass.output_len} tokens"
    return res


async def _run(url: str, classes: list[RequestClass], seed: int, vocab: int,
               on_done: Callable[[Result], None]) -> list[Result]:
    import aiohttp

    rng = random.Random(seed)
    plan = []  # (arrival time, class, prompt), every class its own Poisson process
    for k in classes:
        t = 0.0
        for _ in range(k.count):
            t += rng.expovariate(k.rate)
            plan.append((t, k, _prompt(rng, k.input_len, vocab)))
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
        on_done: Callable[[Result], None] = lambda r: None) -> list[Result]:
    return asyncio.run(_run(url, classes, seed, vocab, on_done))
