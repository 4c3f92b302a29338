"""Our benchmarks' stream reading: SSE comments (keep-alives) are skipped, as the SSE
specification says, and a bench_serving run that lost requests fails instead of reporting
a shorter sample."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks"))
from serving import lost  # noqa: E402
from sse import Comments, data_of  # noqa: E402


def test_comments_blank_lines_and_done_carry_nothing():
    seen = Comments()
    lines = [b": ping\n", b"\n", b':{"not": "data"}\n', b"event: message\n", b'data: {"a": 1}\n',
             b"data:{\"b\": 2}\r\n", b"data: [DONE]\n"]
    assert [data_of(x, seen) for x in lines] == [None, None, None, None, {"a": 1}, {"b": 2}, None]
    assert seen.count == 2


def test_a_malformed_data_line_still_fails_loudly():
    with pytest.raises(ValueError):
        data_of(b"data: {truncated\n")


def test_a_run_that_lost_requests_fails_naming_the_errors():
    lost({"completed": 64}, 64)  # all served: nothing to say
    with pytest.raises(RuntimeError, match=r"served 58 of 64 requests.*JSONDecodeError"):
        lost({"completed": 58, "errors": ["", "Traceback ...\norjson.JSONDecodeError: unexpected character"]}, 64)
