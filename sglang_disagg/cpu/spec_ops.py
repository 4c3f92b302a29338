"""Native torch versions of the sgl_kernel CPU ops speculative decoding calls on CPU.

The same contract as ``ops`` (SGLang's CPU branches call ``sgl_kernel.<name>_cpu``,
which the PyPI wheel does not build): index bookkeeping for draft and verify windows,
kept plain because it is per request and small. Each mirrors the Triton kernel of the
same name in ``sglang/kernels/ops/speculative`` (read there for the layout).
"""

from __future__ import annotations

import torch


def assign_draft_cache_locs_contiguous_cpu(req_pool_indices: torch.Tensor, req_to_token: torch.Tensor,
                                           seq_lens: torch.Tensor, out_cache_loc: torch.Tensor,
                                           pool_len: int, topk: int, num_cols: int) -> None:
    """out_cache_loc[i * n : (i + 1) * n] = req_to_token[req_i, seq_len_i : seq_len_i + n], n = topk * num_cols."""
    del pool_len
    n = topk * num_cols
    for i, (req, start) in enumerate(zip(req_pool_indices.tolist(), seq_lens.tolist())):
        out_cache_loc[i * n:(i + 1) * n] = req_to_token[req, start:start + n].to(out_cache_loc.dtype)


def assign_extend_cache_locs_cpu(req_pool_indices: torch.Tensor, req_to_token: torch.Tensor,
                                 start_offset: torch.Tensor, end_offset: torch.Tensor,
                                 out_cache_loc: torch.Tensor, pool_len: int) -> None:
    """The slots req_to_token[req_i, start_i:end_i] of every request, concatenated."""
    del pool_len
    cursor = 0
    for req, start, end in zip(req_pool_indices.tolist(), start_offset.tolist(), end_offset.tolist()):
        out_cache_loc[cursor:cursor + end - start] = req_to_token[req, start:end].to(out_cache_loc.dtype)
        cursor += end - start


def fill_accept_out_cache_loc_cpu(accept_index: torch.Tensor, out_cache_loc: torch.Tensor,
                                  accept_out_cache_loc: torch.Tensor) -> None:
    """The slots of the accepted draft positions (accept_index != -1), packed in order."""
    flat = accept_index.reshape(-1)
    kept = flat[flat != -1].long()
    accept_out_cache_loc[:kept.numel()] = out_cache_loc[kept].to(accept_out_cache_loc.dtype)


def fill_bonus_tokens_cpu(accept_tokens: torch.Tensor, accept_lens: torch.Tensor,
                          bonus_tokens: torch.Tensor, accept_stride: int) -> None:
    """Each request's last accepted token (accept_lens counts the bonus token)."""
    rows = torch.arange(accept_lens.numel(), device=accept_lens.device)
    idx = rows * accept_stride + accept_lens.long() - 1
    bonus_tokens.copy_(accept_tokens.reshape(-1)[idx].to(bonus_tokens.dtype))


def build_tree_kernel_efficient_cpu(parent_list: torch.Tensor, selected_index: torch.Tensor,
                                    verified_seq_len: torch.Tensor, tree_mask: torch.Tensor,
                                    positions: torch.Tensor, retrieve_index: torch.Tensor,
                                    retrieve_next_token: torch.Tensor, retrieve_next_sibling: torch.Tensor,
                                    topk: int, depth: int, draft_token_num: int, tree_mask_mode: int) -> None:
    """The draft tree of every request: retrieve links (first child / next sibling), each
    draft token's position and its row of the tree mask. FULL_MASK (0) rows span the
    prefix and the tree; QLEN_ONLY (1) rows span the tree alone."""
    n = draft_token_num
    seq_lens = verified_seq_len.tolist()
    parents = parent_list.reshape(len(seq_lens), -1).tolist()
    selected = selected_index.reshape(len(seq_lens), -1).tolist()
    mask = tree_mask.reshape(-1)
    prefix = 0

    def parent_of(b: int, i: int) -> int | None:
        """The position (0 = the verified token) of selected token i's parent, None if unknown."""
        tb = selected[b][i] // topk
        if tb == 0:
            return 0
        want = parents[b][tb]
        for pp in range(n - 1):
            if selected[b][pp] == want:
                return pp + 1
        return None

    for b, seq_len in enumerate(seq_lens):
        base = b * n
        positions[base] = seq_len
        for i in range(n - 1, 0, -1):
            retrieve_index[b, i] = base + i
            parent = parent_of(b, i - 1)
            if parent is not None:
                older = int(retrieve_next_token[b, parent])
                retrieve_next_token[b, parent] = i
                if older != -1:
                    retrieve_next_sibling[b, i] = older
        retrieve_index[b, 0] = base
        for x in range(n):
            if tree_mask_mode == 0:
                row = prefix * n + n * n * b + (seq_len + n) * x + seq_len + 1
            else:
                row = n * n * b + n * x + 1
            mask[row - 1] = True
            mask[row:row + n - 1] = False
            if x == 0:
                continue
            cur, position = x - 1, 0
            for _ in range(depth):
                position += 1
                mask[row + cur] = True
                tb = selected[b][cur] // topk
                if tb == 0:
                    break
                want = parents[b][tb]
                found = next((cp for cp in range(n - 1) if selected[b][cp] == want), None)
                if found is None:
                    break
                cur = found
            positions[base + x] = position + seq_len
        prefix += seq_len


def verify_tree_greedy_cpu(predicts: torch.Tensor, accept_index: torch.Tensor,
                           accept_token_num: torch.Tensor, candidates: torch.Tensor,
                           retrive_index: torch.Tensor, retrive_next_token: torch.Tensor,
                           retrive_next_sibling: torch.Tensor, target_predict: torch.Tensor) -> None:
    """Greedy verification: walk each request's tree from the root, at each level taking
    the child whose draft token equals the target's choice at the last accepted node."""
    bs, n = candidates.shape
    steps = accept_index.shape[1]
    cand, nxt, sib, ridx = (t.tolist() for t in (candidates, retrive_next_token, retrive_next_sibling, retrive_index))
    target = target_predict.reshape(-1).tolist()
    flat_pred = predicts.reshape(-1)
    for b in range(bs):
        last = ridx[b][0]
        accept_index[b, 0] = last
        accepted, cur = 0, 0
        for _ in range(1, steps):
            cur = nxt[b][cur]
            want = target[last]
            while cur != -1 and cand[b][cur] != want:
                cur = sib[b][cur]
            if cur == -1:
                break
            flat_pred[last] = want
            accepted += 1
            accept_index[b, accepted] = ridx[b][cur]
            last = ridx[b][cur]
        accept_token_num[b] = accepted
        flat_pred[last] = target[last]


OPS = {f.__name__: f for f in (assign_draft_cache_locs_contiguous_cpu, assign_extend_cache_locs_cpu,
                               fill_accept_out_cache_loc_cpu, fill_bonus_tokens_cpu,
                               build_tree_kernel_efficient_cpu, verify_tree_greedy_cpu)}
