"""Data parallelism in the launcher (parallel.py): --prefill-attn-dp/--decode-attn-dp (attention
DP) and --prefill-dp/--decode-dp (replica DP) validated with the flags named, carried to the
servers' command lines, counted in cores, GPUs and the dry run, checked against the model by
attention-TP size, and carried by deployment files into every rendering. Pure: no process."""

from __future__ import annotations

import re
import tomllib
from pathlib import Path

import pytest

from sglang_disagg.backends.auth import SECRET_ENV
from sglang_disagg.launch import LaunchConfig, Mode, Role, checks, dryrun, sharding
from sglang_disagg.launch.__main__ import _parser, parse
from sglang_disagg.launch.commands import DIST_STORE_ENV, server_spec
from sglang_disagg.launch.deploy import DeploymentError, parse as parse_doc
from sglang_disagg.launch.parallel import Parallel
from sglang_disagg.launch.render import kubernetes, launcher_argv, slurm
from sglang_disagg.launch.render_ome import ome
from sglang_disagg.launch.validate_manifests import problems
from sglang_disagg.messenger.dp.support import NOT_ON_DEVICE

EXAMPLE = Path(__file__).parents[2] / "launch" / "deployment.example.toml"
SMOL = {"num_attention_heads": 9, "num_key_value_heads": 3, "hidden_size": 576, "head_dim": 64,
        "intermediate_size": 1536}


def _after(argv, flag):
    argv = list(argv)
    return argv[argv.index(flag) + 1] if flag in argv else None


def test_the_flags_default_to_1_appear_in_the_help_and_reach_the_config():
    cfg, _ = parse(["--role", "all"])
    assert (cfg.prefill_attn_dp, cfg.decode_attn_dp, cfg.prefill_dp, cfg.decode_dp) == (1, 1, 1, 1)
    cfg, _ = parse(["--role", "all", "--prefill-tp", "2", "--prefill-attn-dp", "2", "--decode-dp", "2"])
    assert (cfg.prefill_attn_dp, cfg.decode_dp) == (2, 2)
    assert cfg.parallel(Role.PREFILL) == Parallel(2, 2, 1) and cfg.parallel(Role.DECODE) == Parallel(1, 1, 2)
    text = " ".join(_parser().format_help().split())
    for flag in ("--prefill-attn-dp N", "--decode-attn-dp N", "--prefill-dp N", "--decode-dp N"):
        assert flag in text
    assert "SGLang's --attn-dp-size" in text and "SGLang's --dp-size" in text


@pytest.mark.parametrize("kwargs, message", [
    ({"prefill_attn_dp": 0}, "--prefill-attn-dp must be >= 1, got 0"),
    ({"decode_dp": 0}, "--decode-dp must be >= 1, got 0"),
    ({"prefill_attn_dp": 2}, "--prefill-attn-dp 2 needs --prefill-tp divisible by it (2 groups of tp/2 attention "
                             "ranks); got --prefill-tp 1"),
    ({"decode_tp": 3, "decode_attn_dp": 2}, "--decode-attn-dp 2 needs --decode-tp divisible by it (2 groups of "
                                            "tp/2 attention ranks); got --decode-tp 3"),
    ({"prefill_tp": 2, "prefill_attn_dp": 2, "prefill_dp": 2},
     "--prefill-attn-dp 2 with --prefill-dp 2: attention DP and replica DP on one server at once are not "
     "supported by the messenger"),
    ({"mode": Mode.UPSTREAM, "decode_tp": 2, "decode_attn_dp": 2, "decode_dp": 2}, "--decode-attn-dp 2 with"),
    ({"device": "cuda", "gpus": 4, "prefill_dp": 2}, f"--prefill-dp 2 on --device cuda: {NOT_ON_DEVICE}"),
    ({"device": "cuda", "gpus": 4, "decode_tp": 2, "decode_attn_dp": 2},
     f"--decode-attn-dp 2 on --device cuda: {NOT_ON_DEVICE}"),
])
def test_invalid_data_parallelism_is_refused_naming_the_flags(kwargs, message):
    with pytest.raises(ValueError, match=re.escape(message)):
        LaunchConfig(role=Role.ALL, model="tiny-llama", **kwargs)


def test_upstream_and_colocated_take_data_parallelism_on_cuda_the_colocated_server_with_the_prefill_flags():
    LaunchConfig(role=Role.ALL, mode=Mode.UPSTREAM, model="tiny-llama", device="cuda", gpus=4, prefill_dp=2)
    cfg = LaunchConfig(role=Role.COLOCATED, model="tiny-deepseek-v3", prefill_tp=2, prefill_attn_dp=2)
    argv = list(server_spec(cfg, Role.COLOCATED, "/m", builtin=True).argv)
    assert argv[argv.index("--tp"):argv.index("--tp") + 4] == ["--tp", "2", "--attn-dp-size", "2"]
    assert LaunchConfig(role=Role.COLOCATED, model="tiny-llama", device="cuda", gpus=2, prefill_dp=2).gpu_plan() \
        .prefill.gpus == (0, 1)


@pytest.mark.parametrize("mode", list(Mode))
def test_each_server_gets_sglangs_dp_flags_next_to_its_tp(mode):
    cfg, _ = parse(["--role", "all", "--mode", mode.value, "--prefill-tp", "2", "--prefill-attn-dp", "2",
                    "--decode-dp", "3"])
    prefill = list(server_spec(cfg, Role.PREFILL, "/m", builtin=True).argv)
    decode = list(server_spec(cfg, Role.DECODE, "/m", builtin=True).argv)
    i, j = prefill.index("--tp"), decode.index("--tp")
    assert prefill[i:i + 4] == ["--tp", "2", "--attn-dp-size", "2"] and "--dp-size" not in prefill
    assert decode[j:j + 4] == ["--tp", "1", "--dp-size", "3"] and "--attn-dp-size" not in decode
    plain, _ = parse(["--role", "all", "--mode", mode.value])
    assert not {"--dp-size", "--attn-dp-size"} & set(server_spec(plain, Role.PREFILL, "/m", builtin=True).argv)


def test_threads_and_core_sets_count_every_replicas_ranks(monkeypatch):
    monkeypatch.setattr("os.sched_getaffinity", lambda pid: set(range(8)))
    env = lambda cfg, role: dict(server_spec(cfg, role, "/m", builtin=True).env)  # noqa: E731
    cfg = LaunchConfig(role=Role.ALL, model="tiny-llama", prefill_dp=2, decode_tp=2, decode_attn_dp=2)
    prefill, decode = env(cfg, Role.PREFILL), env(cfg, Role.DECODE)  # 4 cores each
    # replica DP: 2 replicas of TP 1 = 2 processes; attention DP: TP 2 = 2 processes, not 4
    assert (prefill["OMP_NUM_THREADS"], prefill["SGLANG_CPU_OMP_THREADS_BIND"]) == ("2", "0-1|2-3")
    assert (decode["OMP_NUM_THREADS"], decode["SGLANG_CPU_OMP_THREADS_BIND"]) == ("2", "4-5|6-7")
    colocated = LaunchConfig(role=Role.COLOCATED, model="tiny-llama", prefill_tp=2, prefill_dp=2)
    assert env(colocated, Role.COLOCATED)["SGLANG_CPU_OMP_THREADS_BIND"] == "0-1|2-3|4-5|6-7"


def test_replica_dp_leaves_each_replica_its_own_rendezvous(tmp_path):
    """One file store for every replica's torch world would join them in one rendezvous."""
    cfg = LaunchConfig(role=Role.ALL, model="tiny-llama", prefill_dp=2, decode_tp=2, decode_attn_dp=2)
    assert DIST_STORE_ENV not in dict(server_spec(cfg, Role.PREFILL, "/m", True, tmp_path).env)
    assert dict(server_spec(cfg, Role.DECODE, "/m", True, tmp_path).env)[DIST_STORE_ENV].startswith("file://")


def test_cores_are_checked_for_tp_times_dp_ranks(monkeypatch):
    monkeypatch.setattr(sharding, "this_machines_cores", lambda: 2)
    checks.check_cores(LaunchConfig(role=Role.ALL, model="tiny-llama", prefill_dp=2, decode_tp=2, decode_attn_dp=2))
    with pytest.raises(ValueError, match=re.escape("--prefill-tp 1 --prefill-dp 3 (3 ranks) exceeds the 2 CPU cores")):
        checks.check_cores(LaunchConfig(role=Role.ALL, model="tiny-llama", prefill_dp=3))
    with pytest.raises(ValueError, match=r"3 ranks \(3 replicas of TP 1\) need 3 cores and this machine has 2; "
                                         r"TP sizes that work with dp 3: 1, 3 \(with this machine's 2 cores: none\)"):
        sharding.check("m", SMOL, {"--decode-tp": Parallel(1, 1, 3)}, 2, messenger_pair=False)


def test_gpus_are_planned_for_every_replica(monkeypatch):
    cfg = LaunchConfig(role=Role.ALL, mode=Mode.UPSTREAM, model="tiny-llama", device="cuda", gpus=8, prefill_tp=2,
                       prefill_dp=2, decode_tp=2, decode_attn_dp=2)
    plan = cfg.gpu_plan()
    assert plan.prefill.gpus == (0, 1, 2, 3) and plan.decode.gpus == (4, 5)  # attention DP: tp GPUs
    with pytest.raises(ValueError, match=re.escape("--prefill-tp 2 with --prefill-dp 2 needs 4 GPUs and this machine "
                                                   "has 2")):
        LaunchConfig(role=Role.PREFILL, mode=Mode.UPSTREAM, model="tiny-llama", device="cuda", gpus=2, prefill_tp=2,
                     prefill_dp=2)
    with pytest.raises(ValueError, match=re.escape("names 2 GPU(s) for TP 2 x 2 replicas: give one per rank")):
        LaunchConfig(role=Role.ALL, mode=Mode.UPSTREAM, model="tiny-llama", device="cuda", gpus=8, prefill_tp=2,
                     prefill_dp=2, prefill_gpus=(0, 1))
    monkeypatch.setenv(SECRET_ENV, "s" * 40)  # off loopback its HTTP keys derive from the secret
    text = dryrun.render(LaunchConfig(role=Role.DECODE, mode=Mode.UPSTREAM, model="tiny-llama", device="cuda",
                                      decode_dp=2, host="10.255.255.254"))  # another machine's: none probed
    assert "2 GPU(s) assumed" in text and "# decode: GPUs 0,1" in text


def test_the_dry_run_names_the_data_parallelism_it_checked():
    text = dryrun.render(LaunchConfig(role=Role.ALL, model="tiny-llama", prefill_tp=2, prefill_attn_dp=2,
                                      decode_dp=2))
    assert "takes --prefill-tp 2 --prefill-attn-dp 2, --decode-tp 1 --decode-dp 2" in text
    assert "--tp 2 --attn-dp-size 2" in text and "--tp 1 --dp-size 2" in text


def test_attention_dp_shards_the_heads_over_the_attention_tp_group():
    # smollm2's 9 heads do not divide by TP 6, but by 6 / 2 = 3 attention ranks (the MLP's 1536 by 6)
    with pytest.raises(ValueError, match="9 attention heads do not divide by 6"):
        sharding.check("m", SMOL, {"--prefill-tp": 6}, None, messenger_pair=False)
    sharding.check("m", SMOL, {"--prefill-tp": Parallel(6, 2), "--decode-tp": Parallel(3)}, None, messenger_pair=True)
    with pytest.raises(ValueError, match=re.escape(
            "--prefill-tp 4 --prefill-attn-dp 2 cannot shard m (9 attention heads / 3 KV heads, MLP intermediate size "
            "1536): 9 attention heads do not divide by 2 (with attention DP the heads are split over each group's "
            "tp/attn-dp = 4/2 = 2 ranks); TP sizes that work with attn-dp 2: 2, 6")):
        sharding.check("m", SMOL, {"--prefill-tp": Parallel(4, 2)}, None, messenger_pair=False)
    # replica DP: a replica's TP size shards the model
    sharding.check("m", SMOL, {"--decode-tp": Parallel(3, 1, 2)}, None, messenger_pair=False)


def test_the_messenger_pair_is_checked_between_attention_tp_groups(monkeypatch):
    seen = []
    monkeypatch.setattr(sharding, "pair_problem", lambda shape, p, d: seen.append((p, d)) or "no plan")
    with pytest.raises(ValueError, match=re.escape(
            "prefill attention TP 3 (--prefill-tp 6 --prefill-attn-dp 2: each attention-DP group's KV pool is split "
            "over tp/attn-dp ranks) -> decode TP 1 (--decode-tp 1 --decode-dp 2: each replica's KV pool is split over "
            "its TP ranks) cannot carry m's KV")):
        sharding.check("m", SMOL, {"--prefill-tp": Parallel(6, 2), "--decode-tp": Parallel(1, 1, 2)}, None, True)
    assert seen == [(3, 1)]
    cfg = LaunchConfig(role=Role.ALL, model="tiny-llama", prefill_tp=2, prefill_attn_dp=2, decode_tp=2)
    with pytest.raises(ValueError, match=r"^prefill attention TP 1 \(.*\) -> decode TP 2 cannot carry"):
        sharding.check_config(cfg, SMOL | {"num_attention_heads": 4, "num_key_value_heads": 2}, here=False)


def _deployment(**groups) -> dict:
    doc = tomllib.loads(EXAMPLE.read_text())
    doc["deployment"] |= {"model": "tiny-llama"}  # 4 heads / 2 KV heads
    doc["prefill"][0] |= groups.get("prefill", {})
    for d in doc["decode"]:
        d |= groups.get("decode", {})
    return doc


def test_a_deployment_files_groups_carry_their_data_parallelism_into_every_rendering():
    dep = parse_doc(_deployment(prefill={"tp": 2, "attn_dp": 2}, decode={"dp": 2}))
    prefill, decode = dep.launch_config("prefill-0"), dep.launch_config("decode-0")
    assert prefill.parallel(Role.PREFILL) == Parallel(2, 2) and decode.parallel(Role.DECODE) == Parallel(1, 1, 2)
    for cfg in (prefill, decode):
        assert parse(launcher_argv(cfg))[0] == cfg  # the rendered flags rebuild the node's configuration
    docs = kubernetes(dep, "serving")
    assert problems(docs, "cpu") == []
    args = {d["metadata"]["name"]: d["spec"]["leaderWorkerTemplate"]["workerTemplate"]["spec"]["containers"][0]
            for d in docs if d["kind"] == "LeaderWorkerSet"}
    assert _after(args["prefill-0"]["args"], "--prefill-attn-dp") == "2"
    assert _after(args["decode-0"]["args"], "--decode-dp") == "2"
    script = slurm(dep)
    assert "--prefill-attn-dp 2" in script and "--decode-dp 2" in script
    runtime = next(d for d in ome(dep) if d["kind"] == "ServingRuntime")["spec"]
    assert _after(runtime["decoderConfig"]["runner"]["args"], "--decode-dp") == "2"
    assert problems(ome(dep), "cpu") == []


def test_a_replica_group_pod_asks_for_a_core_per_rank():
    doc = _deployment(decode={"dp": 2})
    del doc["deployment"]["cpu"]  # the default: one core per rank, plus one
    dep = parse_doc(doc)
    pod = next(d for d in kubernetes(dep) if d["metadata"]["name"] == "decode-0")
    resources = pod["spec"]["leaderWorkerTemplate"]["workerTemplate"]["spec"]["containers"][0]["resources"]
    assert resources["requests"]["cpu"] == "3"


@pytest.mark.parametrize("groups, reason", [
    ({"prefill": {"attn_dp": 2}}, "prefill[0]: attn_dp 2 needs tp divisible by it (2 groups of tp/2 attention "
                                  "ranks); got tp 1"),
    ({"decode": {"tp": 2, "attn_dp": 2, "dp": 2}}, "decode[0]: attn_dp 2 with dp 2: attention DP and replica DP"),
    ({"prefill": {"dp": 0}}, "prefill[0]: dp must be >= 1, got 0"),
    ({"prefill": {"dp": "2"}}, "prefill[0].dp: expected int"),
    ({"prefill": {"tp": 2, "nodes": 2, "dp": 2}}, "prefill[0]: dp 2 over nodes 2: the launcher runs a group's "
                                                  "replicas on one machine"),
    ({"prefill": {"tp": 6, "attn_dp": 2}}, "prefill group 'prefill-0': tp 6, attn_dp 2 cannot shard tiny-llama (4 "
                                           "attention heads / 2 KV heads, MLP intermediate size 704): 4 attention "
                                           "heads do not divide by 3"),
])
def test_a_bad_group_names_the_field_and_the_reason(groups, reason):
    with pytest.raises(DeploymentError, match=re.escape(reason)):
        parse_doc(_deployment(**groups))


def test_ome_needs_every_group_of_a_role_to_share_its_data_parallelism():
    doc = _deployment()
    doc["decode"][0] |= {"dp": 2}
    with pytest.raises(ValueError, match=r"must share tp, attn_dp, dp, nodes and gpus.*decode-0 \(tp 1, attn_dp 1, "
                                         r"dp 2"):
        ome(parse_doc(doc))


def test_a_relative_log_dir_gives_the_rendezvous_an_absolute_file(tmp_path, monkeypatch):
    """file://logs/x is host "logs", path /x: every server of a Slurm job (logs/sglang-disagg-ID/...)
    waited for ever at "Init parallel begin"."""
    monkeypatch.chdir(tmp_path)
    cfg = LaunchConfig(role=Role.DECODE, model="tiny-llama", prefill_messengers=("p:30003",))
    store = dict(server_spec(cfg, Role.DECODE, "/m", True, Path("logs/job-7/decode-0")).env)[DIST_STORE_ENV]
    assert store == f"file://{tmp_path}/logs/job-7/decode-0/decode.dist-store"
