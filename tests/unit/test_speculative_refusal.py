"""Speculative decoding the messenger does not carry is refused at start-up, never served cold."""

from __future__ import annotations

import os
import subprocess
import sys
from types import SimpleNamespace

import pytest

from sglang_disagg.launch.__main__ import parse
from sglang_disagg.messenger.speculative import UnsupportedSpeculation, check_argv, check_server_args

SPEC = [["--speculative-algorithm", "EAGLE3"], ["--speculative-algorithm=eagle3"],
        ["--speculative-algorithm", "NGRAM"], ["--speculative-algorithm=dflash"]]


@pytest.mark.parametrize("spec", SPEC, ids=lambda a: a[0].split("=")[0] + ("=" if "=" in a[0] else ""))
@pytest.mark.parametrize("role", ["all", "prefill", "decode"])
def test_launcher_refuses_speculation_in_messenger_mode(role, spec):
    extra = ["--prefill-messenger", "127.0.0.1:1"] if role == "decode" else []
    with pytest.raises(UnsupportedSpeculation, match="not carried by the messenger.*--role colocated"):
        parse(["--role", role, *extra, *spec])


def test_colocated_and_upstream_keep_speculation():
    cfg, _ = parse(["--role", "colocated", "--speculative-algorithm", "EAGLE"])
    assert "--speculative-algorithm" in cfg.extra_args
    cfg, _ = parse(["--role", "all", "--mode", "upstream", "--speculative-algorithm", "EAGLE"])
    assert "--speculative-algorithm" in cfg.extra_args


def test_names_the_algorithm():
    with pytest.raises(UnsupportedSpeculation, match=r"\(EAGLE3\).*Algorithms it carries: EAGLE, NEXTN, STANDALONE"):
        check_argv(["--speculative-algorithm", "eagle3"])
    check_argv(["--speculative-algorithm", "standalone", "--speculative-draft-model-path", "/d"])
    check_argv(["--speculative-algorithm=eagle", "--speculative-draft-model-path", "/d"])
    check_argv(["--speculative-algorithm=NEXTN"])  # DeepSeek's MTP layer: the draft is the target's checkpoint
    check_server_args(SimpleNamespace(speculative_algorithm="STANDALONE"))
    check_server_args(SimpleNamespace(speculative_algorithm="EAGLE"))
    with pytest.raises(UnsupportedSpeculation, match=r"\(EAGLE3\)"):
        check_server_args(SimpleNamespace(speculative_algorithm="EAGLE3"))
    check_argv(["--chunked-prefill-size", "64"])
    check_server_args(SimpleNamespace(speculative_algorithm=None))


def test_launcher_exits_with_the_reason_before_starting_anything():
    """The user's path: the launcher prints the refusal and exits non-zero at once."""
    out = subprocess.run([sys.executable, "-m", "sglang_disagg.launch", "--role", "all", "--dry-run",
                          "--speculative-algorithm", "NGRAM"],
                         capture_output=True, text=True, timeout=60, env=dict(os.environ))
    assert out.returncode != 0
    assert "speculative decoding (NGRAM) is not carried by the messenger" in out.stderr + out.stdout


def test_builtin_draft_names_resolve_to_their_directory():
    from sglang_disagg.messenger.speculative import with_draft_paths
    from sglang_disagg.models import ensure_model

    path = str(ensure_model("tiny-llama-draft"))
    assert with_draft_paths(["--speculative-draft-model-path", "tiny-llama-draft", "--x", "tiny-llama-draft"]) == \
        ["--speculative-draft-model-path", path, "--x", "tiny-llama-draft"]
    assert with_draft_paths(["--speculative-draft-model-path=tiny-llama-draft"]) == \
        [f"--speculative-draft-model-path={path}"]
    assert with_draft_paths(["--speculative-draft-model-path", "/my/draft"]) == ["--speculative-draft-model-path",
                                                                                 "/my/draft"]


def test_first_contact_reads_the_draft_hidden_size_from_its_config():
    import json

    from sglang_disagg.messenger.speculative import draft_identity
    from sglang_disagg.models import ensure_model

    for name in ("tiny-llama-draft", "tiny-llama-1l-eagle"):
        path = ensure_model(name)
        want = json.loads((path / "config.json").read_text())["hidden_size"]
        args = SimpleNamespace(speculative_algorithm="EAGLE", speculative_draft_model_path=str(path))
        draft, hidden = draft_identity(args)
        assert hidden == want > 0 and draft.startswith("EAGLE:"), name
    assert draft_identity(SimpleNamespace(speculative_algorithm=None)) == ("", 0)
    # NEXTN arrives as EAGLE with the target's own checkpoint as the draft: named NEXTN.
    path = ensure_model("tiny-deepseek-v3")
    args = SimpleNamespace(speculative_algorithm="EAGLE", speculative_draft_model_path=str(path), model_path=str(path))
    assert draft_identity(args)[0].startswith("NEXTN:")


def _pool(layers: int, heads: int = 2, dim: int = 64, page: int = 16):
    import torch

    bufs = lambda: [torch.zeros(4, heads, page, dim) for _ in range(layers)]  # noqa: E731 - HND
    return SimpleNamespace(use_hnd=True, k_buffer=bufs(), v_buffer=bufs(), layer_num=layers, head_dim=dim,
                           v_head_dim=dim, page_size=page)


def test_the_draft_pool_is_planned_after_the_target_and_compared_at_first_contact():
    from sglang_disagg.messenger import compat
    from sglang_disagg.messenger.kvpool import KVPoolView, LayoutError

    target, draft = _pool(4), _pool(2)
    view = KVPoolView.from_pool(target, 2, draft)
    assert view.geometry.num_layers == 6 and view.target_layers == 4 and view.draft_layers == 2
    assert view.tensors[8] is draft.k_buffer[0] and view.tensors[11] is draft.v_buffer[1]
    with_draft = view.spec("m", "f", 1, "STANDALONE:abc", 256)
    without = KVPoolView.from_pool(target, 2).spec("m", "f", 1)
    assert with_draft.num_layers == without.num_layers == 4 and with_draft.draft_layers == 2
    assert compat.differences(without, with_draft) == [
        "speculative draft differs (decoder: none, prefill: STANDALONE:abc)", "draft_layers differs (decoder: 0, prefill: 2)",
        "draft_hidden_size differs (decoder: 0, prefill: 256)"]
    wider = view.spec("m", "f", 1, "STANDALONE:abd", 512)
    assert compat.differences(wider, with_draft) == [
        "speculative draft differs (decoder: STANDALONE:abd, prefill: STANDALONE:abc)",
        "draft_hidden_size differs (decoder: 512, prefill: 256)"]
    with pytest.raises(LayoutError, match=r"speculative draft's KV pool .* differs from the target's"):
        KVPoolView.from_pool(target, 2, _pool(2, heads=1))


@pytest.mark.parametrize("extra", [["--attn-dp-size", "2"], ["--attn-dp-size=2"], ["--dp-size", "2"],
                                   ["--data-parallel-size=4"], ["--enable-dp-attention", "--dp-size", "2"]])
def test_sglangs_own_data_parallel_flags_are_refused_in_messenger_mode_naming_the_launchers(extra):
    from sglang_disagg.messenger.dp.support import UnsupportedParallelism

    for role in (["--role", "all"], ["--role", "prefill"]):
        with pytest.raises(UnsupportedParallelism, match=r"set by the launcher's --prefill(-attn)?-dp/--decode(-attn)?"
                                                         r"-dp .*the other shape: --prefill(-attn)?-dp"):
            parse([*role, "--model-path", "tiny-deepseek-v3", "--prefill-tp", "2", *extra])
    cfg, _ = parse(["--role", "colocated", "--model-path", "tiny-deepseek-v3", "--tp", "2", *extra])
    assert extra[0].split("=")[0] in " ".join(cfg.extra_args)  # colocated runs what SGLang runs
    parse(["--role", "all", "--dp-size", "1"])  # a size of 1 is no data parallelism


def test_the_refusal_names_the_launcher_flag_for_the_shape_asked_for():
    from sglang_disagg.messenger.dp.support import UnsupportedParallelism, check_argv as check_dp_argv

    with pytest.raises(UnsupportedParallelism, match=r"^--dp-size 3: .* launcher's --prefill-dp/--decode-dp \(replica"):
        check_dp_argv(["--dp-size", "3"])
    with pytest.raises(UnsupportedParallelism, match=r"^--enable-dp-attention: .* --prefill-attn-dp/--decode-attn-dp "
                                                      r"\(attention"):
        check_dp_argv(["--enable-dp-attention"])
    check_dp_argv(["--dp-size", "1", "--attn-dp-size=1", "--dp-size", "x"])  # no DP; SGLang reports a bad size


def test_a_messenger_server_accepts_one_shape_of_data_parallelism_on_cpu_only():
    import re

    from sglang_disagg.messenger.dp.support import NOT_ON_DEVICE, UnsupportedParallelism, check_server_args

    check_server_args(SimpleNamespace(dp_size=1, attn_dp_size=2, device="cpu"))
    check_server_args(SimpleNamespace(dp_size=2, attn_dp_size=1, device="cpu"))
    check_server_args(SimpleNamespace(dp_size=1, attn_dp_size=1, device="cuda"))  # no DP: any device
    with pytest.raises(UnsupportedParallelism, match=r"dp_size=2 with attn_dp_size=2: replica DP and attention DP"):
        check_server_args(SimpleNamespace(dp_size=2, attn_dp_size=2, device="cpu"))
    with pytest.raises(UnsupportedParallelism, match=r"^attention DP \(attn_dp_size=2\) on device cuda: "
                                                      + re.escape(NOT_ON_DEVICE)):
        check_server_args(SimpleNamespace(dp_size=1, attn_dp_size=2, device="cuda"))
    # SGLang's resolution turns the deprecated --enable-dp-attention --dp-size 2 into attn_dp_size 2,
    # dp_size 1 in a declaration and leaves the raw dp_size at 2: the check reads the resolved one.
    deprecated = SimpleNamespace(dp_size=2, attn_dp_size=1, device="cuda",
                                 _resolved_overrides=[("_handle_deprecated_dp_attention",
                                                       {"attn_dp_size": 2, "dp_size": 1})])
    with pytest.raises(UnsupportedParallelism, match=r"^attention DP \(attn_dp_size=2\)"):
        check_server_args(deprecated)
