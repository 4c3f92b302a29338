"""The native torch versions of speculative decoding's CPU index ops (cpu/spec_ops), on the
one-step, top-k 1 chain the CPU path runs, with expectations written out by hand."""

from __future__ import annotations

import torch

from sglang_disagg.cpu import ops as cpu_ops
from sglang_disagg.cpu.spec_ops import (assign_draft_cache_locs_contiguous_cpu, assign_extend_cache_locs_cpu,
                                        build_tree_kernel_efficient_cpu, fill_accept_out_cache_loc_cpu,
                                        fill_bonus_tokens_cpu, verify_tree_greedy_cpu)


def test_cpu_ops_hands_out_the_spec_ops():
    assert cpu_ops.verify_tree_greedy_cpu is verify_tree_greedy_cpu
    assert cpu_ops.assign_extend_cache_locs_cpu is assign_extend_cache_locs_cpu


def test_cache_locs():
    req_to_token = torch.arange(40, dtype=torch.int32).reshape(4, 10)
    out = torch.zeros(4, dtype=torch.int64)
    assign_draft_cache_locs_contiguous_cpu(torch.tensor([2, 0]), req_to_token, torch.tensor([3, 7]), out, 10, 1, 2)
    assert out.tolist() == [23, 24, 7, 8]
    out = torch.zeros(5, dtype=torch.int64)
    assign_extend_cache_locs_cpu(torch.tensor([1, 3]), req_to_token, torch.tensor([2, 5]), torch.tensor([4, 8]),
                                 out, 10)
    assert out.tolist() == [12, 13, 35, 36, 37]


def test_accepted_slots_and_bonus_tokens():
    out = torch.full((4,), -9, dtype=torch.int64)
    fill_accept_out_cache_loc_cpu(torch.tensor([[0, 1], [2, -1]]), torch.tensor([50, 51, 52, 53]), out)
    assert out[:3].tolist() == [50, 51, 52]
    bonus = torch.zeros(2, dtype=torch.int64)
    fill_bonus_tokens_cpu(torch.tensor([[5, 6], [7, 8]]), torch.tensor([2, 1]), bonus, 2)
    assert bonus.tolist() == [6, 7]


def _tree(seq_lens: list[int], mode: int):
    bs, n = len(seq_lens), 2
    rows = n * n * bs if mode == 1 else sum(n * (s + n) for s in seq_lens)
    mask = torch.ones(rows, dtype=torch.bool)  # SGLang fills it so: the prefix columns stay True
    positions = torch.zeros(bs * n, dtype=torch.int64)
    ridx = torch.full((bs, n), -1, dtype=torch.int64)
    nxt, sib = torch.full((bs, n), -1, dtype=torch.int64), torch.full((bs, n), -1, dtype=torch.int64)
    build_tree_kernel_efficient_cpu(torch.zeros((bs, 1), dtype=torch.int64), torch.zeros((bs, 1), dtype=torch.int64),
                                    torch.tensor(seq_lens), mask, positions, ridx, nxt, sib, 1, 1, n, mode)
    return mask, positions, ridx, nxt, sib


def test_one_step_chain_tree():
    """Two draft tokens per request: the verified token (root) and one draft, its child."""
    mask, positions, ridx, nxt, sib = _tree([5, 9], mode=1)  # QLEN_ONLY: rows over the tree only
    assert positions.tolist() == [5, 6, 9, 10]
    assert ridx.tolist() == [[0, 1], [2, 3]] and nxt.tolist() == [[1, -1], [1, -1]]
    assert (sib == -1).all()
    assert mask.view(2, 2, 2).tolist() == [[[True, False], [True, True]]] * 2  # causal
    full, *_ = _tree([3], mode=0)  # FULL_MASK: each row also spans the 3 prefix slots
    assert full.view(2, 5).tolist() == [[True] * 3 + [True, False], [True] * 3 + [True, True]]


def test_greedy_verify_accepts_the_draft_only_when_the_target_agrees():
    _, _, ridx, nxt, sib = _tree([4, 4], mode=1)
    candidates = torch.tensor([[10, 11], [20, 21]])  # [verified token, draft]
    target = torch.tensor([[11, 12], [99, 98]])      # target's choice after each position
    predicts = torch.full((4,), -1, dtype=torch.int64)
    accept_index = torch.full((2, 2), -1, dtype=torch.int64)
    accept_num = torch.zeros(2, dtype=torch.int64)
    verify_tree_greedy_cpu(predicts, accept_index, accept_num, candidates, ridx, nxt, sib, target)
    assert accept_num.tolist() == [1, 0]             # request 0's draft (11) is what the target chose
    assert accept_index.tolist() == [[0, 1], [2, -1]]
    assert predicts.tolist() == [11, 12, 99, -1]     # accepted token, then the bonus; a rejection's bonus
