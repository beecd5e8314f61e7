"""Eager group-relative advantages: veRL 0.9.1's outcome estimators (``verl/trainer/ppo/core_algos.py``).

veRL's ``compute_grpo_outcome_advantage``, ``compute_rloo_outcome_advantage`` and
``compute_reinforce_plus_plus_baseline_outcome_advantage`` loop over the rows in Python, with a
dict of per-row scalar tensors per group; ``compute_grpo_vectorized_outcome_advantage`` does the
same with ``index_add_``. They take ``token_level_rewards [B, T]`` (summed over the row: the score
at the last valid token) and ``index``, an array of one uid string per row. The copies here keep
veRL's code (each returns its advantages; veRL returns them twice, as the returns too). A group of
one has mean 0 and std 1 in all of them, as in :func:`pyppo.ops.group_advantages`.
"""

from __future__ import annotations

from collections import defaultdict

import torch

from .masked import masked_whiten


def _scores_by_group(token_level_rewards, index):
    scores = token_level_rewards.sum(dim=-1)
    id2score = defaultdict(list)
    for i in range(scores.shape[0]):
        id2score[index[i]].append(scores[i])
    return scores, id2score


def _group_mean(scores_of_group):
    if len(scores_of_group) == 1:
        return torch.tensor(0.0)
    return torch.mean(torch.stack(scores_of_group))


@torch.no_grad()
def verl_grpo(token_level_rewards, response_mask, index, epsilon: float = 1e-6, norm_adv_by_std_in_grpo: bool = True):
    """``compute_grpo_outcome_advantage``: ``(s − mean_g) / (std_g + eps)``, or ``s − mean_g``."""
    scores, id2score = _scores_by_group(token_level_rewards, index)
    id2mean, id2std = {}, {}
    for idx, group in id2score.items():
        id2mean[idx] = _group_mean(group)
        id2std[idx] = torch.tensor(1.0) if len(group) == 1 else torch.std(torch.stack(group))
    for i in range(scores.shape[0]):
        if norm_adv_by_std_in_grpo:
            scores[i] = (scores[i] - id2mean[index[i]]) / (id2std[index[i]] + epsilon)
        else:
            scores[i] = scores[i] - id2mean[index[i]]
    return scores.unsqueeze(-1) * response_mask


@torch.no_grad()
def verl_rloo(token_level_rewards, response_mask, index):
    """``compute_rloo_outcome_advantage``: ``s·n/(n−1) − mean_g·n/(n−1)``."""
    scores, id2score = _scores_by_group(token_level_rewards, index)
    id2mean = {idx: _group_mean(group) for idx, group in id2score.items()}
    for i in range(scores.shape[0]):
        n = len(id2score[index[i]])
        if n > 1:
            scores[i] = scores[i] * n / (n - 1) - id2mean[index[i]] * n / (n - 1)
    return scores.unsqueeze(-1) * response_mask


@torch.no_grad()
def verl_reinforce_pp_baseline(token_level_rewards, response_mask, index):
    """``compute_reinforce_plus_plus_baseline_outcome_advantage``: ``s − mean_g`` on every token,
    whitened over the batch's valid tokens, masked. (veRL's ``masked_whiten`` is TRL's,
    :func:`~pyppo.bench.eager.masked.masked_whiten`, but for a ``+ 1e-8`` in its counts.)"""
    scores, id2score = _scores_by_group(token_level_rewards, index)
    id2mean = {idx: _group_mean(group) for idx, group in id2score.items()}
    for i in range(scores.shape[0]):
        scores[i] = scores[i] - id2mean[index[i]]
    scores = scores.unsqueeze(-1).tile([1, token_level_rewards.shape[-1]]) * response_mask
    return masked_whiten(scores, response_mask) * response_mask


def _as_group_index(index, device) -> torch.Tensor:
    """veRL's ``as_torch_index`` (``verl/utils/groupwise.py``) for uid strings: not integers, so
    factorised with ``np.unique``."""
    import numpy as np  # only here: pyppo's wheel runs without numpy

    arr = np.asarray(index, dtype=object)
    try:
        return torch.from_numpy(arr.astype(np.int64)).to(device)
    except (TypeError, ValueError):
        pass
    _, inv = np.unique(arr, return_inverse=True)
    return torch.from_numpy(inv.astype(np.int64, copy=False)).to(device)


def _group_mean_std(scores, gidx):
    """veRL's ``group_mean_std`` (``verl/utils/groupwise.py``) with ``eps = 0``, as the vectorized
    GRPO calls it: float32 ``index_add_`` sums (atomics on CUDA)."""
    scores = scores.reshape(-1).to(dtype=torch.float32)
    G = int(torch.max(gidx).item()) + 1
    ones = torch.ones_like(scores, dtype=torch.float32)
    count = torch.zeros(G, device=scores.device, dtype=torch.float32).index_add_(0, gidx, ones)
    s1 = torch.zeros(G, device=scores.device, dtype=torch.float32).index_add_(0, gidx, scores)
    mean = s1 / count.clamp_min(1.0)
    centered = scores - mean[gidx]
    var_num = torch.zeros(G, device=scores.device, dtype=torch.float32).index_add_(0, gidx, centered * centered)
    std = torch.sqrt(torch.clamp(var_num / (count - 1.0).clamp_min(1.0), min=0.0))
    single = count <= 1.0
    if torch.any(single):
        mean, std = mean.clone(), std.clone()
        mean[single], std[single] = 0.0, 1.0
    return mean, std


@torch.no_grad()
def verl_grpo_vectorized(
    token_level_rewards, response_mask, index, epsilon: float = 1e-6, norm_adv_by_std_in_grpo: bool = True
):
    """``compute_grpo_vectorized_outcome_advantage``."""
    scores = token_level_rewards.sum(dim=-1)
    g = _as_group_index(index, scores.device)
    mean_g, std_g = _group_mean_std(scores, g)
    if norm_adv_by_std_in_grpo:
        scalars = (scores - mean_g[g]) / (std_g[g] + epsilon)
    else:
        scalars = scores - mean_g[g]
    return scalars.unsqueeze(-1) * response_mask
