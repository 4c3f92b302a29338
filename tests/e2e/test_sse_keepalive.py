"""Streams whose first token is slow, read through the router (issue: SGLang's own benchmark
client failed on smg's keep-alive comments).

smg puts an SSE comment (": ping") on a stream that has been silent for
`--sse-keepalive-secs` (its default: 15 s). SGLang's `bench_serving` parses every non-empty
line as JSON and fails the request on one, and a colocated SGLang server never sends them,
so the launcher starts smg with keep-alives off unless asked (LaunchConfig.sse_keepalive_s).

A slow first token is made the way it happens under load: the decoder runs one request at a
time (--max-running-requests 1) and a long request holds that slot; the request under test
waits behind it (its KV carried and waiting in the decoder's queue), silent, until the test
closes the long one's connection (SGLang aborts a departed client's request).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import socket
import sys
import threading
import time
import urllib.parse
from pathlib import Path

import pytest

from sglang_disagg.launch import LaunchConfig, Role, Stack
from sglang_disagg.launch.client import generate_ids, post_json

from .conftest import OUTPUT_TOKENS, StackSpec, next_port

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks"))
from load_client import stream_generate  # noqa: E402

SMG_DEFAULT_KEEPALIVE_S = 15.0  # smg 1.13's --sse-keepalive-secs default
QUEUED = StackSpec(model="tiny-llama", extra_args=("--max-running-requests", "1"))
BLOCKER_TOKENS = 3500  # the context holds 4096
BLOCKERS = 3


class Blocker:
    """A streamed request of BLOCKER_TOKENS that holds the decoder's only running slot (or
    waits for it, ahead of the request under test) until `release()` closes its connection.
    A raw socket: closing it is certain at any moment, even before the response began."""

    def __init__(self, url: str) -> None:
        host, port = urllib.parse.urlsplit(url).netloc.rsplit(":", 1)
        body = json.dumps({"input_ids": [1], "stream": True, "sampling_params": {
            "max_new_tokens": BLOCKER_TOKENS, "temperature": 0.0, "ignore_eos": True}}).encode()
        self.sock = socket.create_connection((host, int(port)))
        self.sock.sendall(f"POST /generate HTTP/1.1\r\nHost: {host}\r\nContent-Type: application/json\r\n"
                          f"Content-Length: {len(body)}\r\nConnection: close\r\n\r\n".encode() + body)

        self.first = threading.Event()
        self.ended = False  # the server ended the stream (finished, or aborted it)
        self._thread = threading.Thread(target=self._drain, daemon=True)
        self._thread.start()

    def _drain(self) -> None:
        """Read everything as it comes, like a client: a reader that stops would stall the
        stream behind it."""
        with contextlib.suppress(OSError):
            while chunk := self.sock.recv(1 << 20):
                if b"data:" in chunk:
                    self.first.set()
            self.ended = True

    def release(self) -> None:
        assert not self.ended, "a blocking request ended before the test released it"
        with contextlib.suppress(OSError):
            self.sock.shutdown(socket.SHUT_RDWR)
        self._thread.join(10)
        self.sock.close()


class Queue:
    """BLOCKERS requests in front of the one under test: together they last far longer than
    any wait below on this machine (tiny-llama decodes a blocker in ~12 s here), and the test
    ends them itself."""

    def __init__(self, url: str) -> None:
        self.blockers = [Blocker(url)]
        assert self.blockers[0].first.wait(60), "the first blocking request produced no token in 60 s"
        self.blockers += [Blocker(url) for _ in range(BLOCKERS - 1)]
        time.sleep(0.5)  # the others reach the decoder before the request under test

    def release_after(self, seconds: float) -> threading.Timer:
        timer = threading.Timer(seconds, lambda: [b.release() for b in self.blockers])
        timer.start()
        return timer


def sglang_client(url: str, prompt: list[int], output_len: int):
    """One request read by SGLang's own bench_serving request function (the code path that
    failed on keep-alive comments), with the globals its CLI would set."""
    from sglang.benchmark import serving

    serving.args = argparse.Namespace(
        temperature=0.0, disable_ignore_eos=False, top_p=1.0, disable_stream=False, return_logprob=False,
        return_routed_experts=False, logprob_start_len=-1, top_logprobs_num=0, token_ids_logprob=None,
        cache_report=False, header=None)
    inp = serving.RequestFuncInput(prompt=prompt, api_url=f"{url}/generate", prompt_len=len(prompt),
                                   output_len=output_len, model="", lora_name="", image_data=None,
                                   extra_request_body={})
    return asyncio.run(serving.async_request_sglang_generate(inp))


@pytest.fixture(scope="module")
def queued(stacks, references):
    """A messenger stack whose decoder runs one request at a time, and its token references."""
    prompts, outputs = references("tiny-llama")
    import sglang.benchmark.serving  # noqa: F401 - ~3 s on first import: not inside a timed wait
    return stacks.get(QUEUED), prompts, outputs


def text_of(url: str, prompt: list[int]) -> tuple[str, list[int]]:
    out = post_json(f"{url}/generate", {"input_ids": prompt, "sampling_params": {
        "max_new_tokens": OUTPUT_TOKENS, "temperature": 0.0, "ignore_eos": True}})
    return out["text"], list(out["output_ids"])


def test_sglang_client_reads_a_first_token_slower_than_smg_keepalive(queued):
    """The default stack (keep-alives off): a first token after more than smg's default
    keep-alive period reaches SGLang's own client intact, token-exact with colocated."""
    stack, prompts, outputs = queued
    assert stack.cfg.sse_keepalive_s == 0, "the launcher's default must send no keep-alives"
    prompt, expected = prompts[3], outputs[3]
    timer = Queue(stack.url).release_after(SMG_DEFAULT_KEEPALIVE_S + 2)
    try:
        out = sglang_client(stack.url, prompt, OUTPUT_TOKENS)
    finally:
        timer.join()
    assert out.success, f"SGLang's client failed: {out.error[-600:]}"
    assert out.ttft > SMG_DEFAULT_KEEPALIVE_S, f"first token after {out.ttft:.1f} s: the wait under test did not happen"
    assert out.output_len == OUTPUT_TOKENS
    text, ids = text_of(stack.url, prompt)  # the same prompt again: ids, and the text they make
    assert ids == expected, f"disaggregated {ids} != colocated {expected}"
    assert out.generated_text == text


@pytest.fixture(scope="module")
def pinging_router(queued, tmp_path_factory):
    """A second router in front of the same decoder, with keep-alives on and short."""
    stack, _, _ = queued
    port = next_port()
    cfg = LaunchConfig(role=Role.ROUTER, model=stack.cfg.model, port=port,
                       decode_urls=(f"http://{stack.cfg.host}:{stack.cfg.ports.decode}",), sse_keepalive_s=1.0,
                       log_dir=str(tmp_path_factory.mktemp("pinging-router")))
    router = Stack.for_config(cfg)
    router.start()
    yield router
    router.stop()


def test_our_stream_reader_skips_keepalives(queued, pinging_router):
    """With keep-alives on (1 s), our benchmarks' reader skips the comments and counts the
    request as served with every token; SGLang's client, on the same stream, fails (the
    negative control: the first test's stream would have failed with pings in it)."""
    import aiohttp

    stack, prompts, outputs = queued
    prompt, expected = prompts[4], outputs[4]

    async def ours():
        async with aiohttp.ClientSession() as session:
            body = {"input_ids": prompt, "sampling_params": {
                "max_new_tokens": OUTPUT_TOKENS, "temperature": 0.0, "ignore_eos": True}}
            return await stream_generate(session, pinging_router.url, body, time.perf_counter())

    timer = Queue(stack.url).release_after(3.5)
    try:
        res = asyncio.run(ours())
    finally:
        timer.join()
    assert not res.error, res.error
    assert res.comments.count >= 2, f"{res.comments.count} keep-alive comments: the router sent none to skip"
    assert res.output_ids == expected, f"disaggregated {res.output_ids} != colocated {expected}"

    timer = Queue(stack.url).release_after(3.5)
    try:
        out = sglang_client(pinging_router.url, prompt, OUTPUT_TOKENS)
    finally:
        timer.join()
    assert not out.success and "JSONDecodeError" in out.error, (
        "SGLang's client read a stream with keep-alive comments without error: the first test proves nothing")
    assert generate_ids(stack.url, prompt, OUTPUT_TOKENS) == expected  # the decoder still serves
