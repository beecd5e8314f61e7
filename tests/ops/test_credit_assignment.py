"""The estimators are right, not only consistent: on a multi-turn MDP small enough to enumerate,
fed the true values, ``gae`` (over agent tokens) and ``turn_gae`` (over turns) give advantages
whose mean, for each state and action, is the true ``Q(s, a) − V(s)`` within sampling error,
while a per-turn-index group baseline (the mean return of the episodes that reached turn k) does
not. A planted error in either op (a value read at the wrong position, a reward dropped, a wrong
discount) breaks the first two.

The MDP: up to 3 agent turns; each turn the agent samples one action token (``stop``, ``a`` or
``b``) then a forced EOS token; the environment replies with 2 tokens between turns (-1 in
``turn_ids``, off the loss mask). ``stop`` or a third action ends the episode. The environment
pays 0.1 on the turn's EOS for each ``b``; the episode's final reward (on its last agent token)
depends on the whole history. The policy's probabilities depend on the turn and the last action.
"""

from __future__ import annotations

import itertools

import pytest
import torch

from pyppo import ops

STOP, A, B = 0, 1, 2
TURNS, ENV = 3, 2  # at most 3 turns; 2 environment tokens between turns
T = TURNS * 2 + (TURNS - 1) * ENV


def policy(history: tuple) -> list:
    """π(· | history): probabilities of stop, a, b."""
    table = {(): [0.1, 0.5, 0.4], (A,): [0.3, 0.2, 0.5], (B,): [0.5, 0.4, 0.1]}
    return table.get(history[-1:], [0.2, 0.3, 0.5]) if history else table[()]


def final_reward(history: tuple) -> float:
    acts = [x for x in history if x != STOP]
    bonus = 1.5 if tuple(acts[:2]) == (B, A) else 0.0
    return sum(1.0 if x == A else 0.3 for x in acts) + bonus - 0.4 * len(acts)


def turn_reward(action: int) -> float:
    return 0.1 if action == B else 0.0


def ends(history: tuple) -> bool:
    return history[-1] == STOP or len(history) == TURNS


def true_values():
    """``V[history]`` (the state before a turn) and ``Q[(history, action)]``, by enumeration (γ = 1)."""
    V, Q = {}, {}

    def value(h):
        if h in V:
            return V[h]
        total = 0.0
        for a, p in enumerate(policy(h)):
            nxt = h + (a,)
            q = turn_reward(a) + (final_reward(nxt) if ends(nxt) else value(nxt))
            Q[(h, a)] = q
            total += p * q
        V[h] = total
        return total

    value(())
    return V, Q


def sample(n: int, seed: int):
    """``n`` episodes as the trainer lays them out: ``rewards``, token-level ``values`` (the true
    value of the state before each agent token), ``loss_mask``, ``turn_ids``, and each turn's
    ``(history, action)``."""
    V, Q = true_values()
    g = torch.Generator().manual_seed(seed)
    rewards, values = torch.zeros(n, T, dtype=torch.float64), torch.zeros(n, T, dtype=torch.float64)
    mask, turn_ids = torch.zeros(n, T, dtype=torch.bool), torch.full((n, T), -1, dtype=torch.long)
    steps = []
    for i in range(n):
        h, row = (), []
        for k in range(TURNS):
            a = int(torch.multinomial(torch.tensor(policy(h)), 1, generator=g))
            t = k * (2 + ENV)
            mask[i, t : t + 2], turn_ids[i, t : t + 2] = True, k
            values[i, t] = V[h]
            values[i, t + 1] = Q[(h, a)]  # the EOS is forced: the state after the action is worth Q
            rewards[i, t + 1] = turn_reward(a)
            row.append((h, a, t))
            h = h + (a,)
            if ends(h):
                rewards[i, t + 1] += final_reward(h)
                break
        steps.append(row)
    return rewards, values, mask, turn_ids, steps, V, Q


def _cell_means(advantages, steps):
    """Per ``(history, action)``: the mean advantage at the action token, its standard error, and n."""
    cells = {}
    for row, adv in zip(steps, advantages):
        for h, a, t in row:
            cells.setdefault((h, a), []).append(float(adv[t]))
    out = {}
    for key, xs in cells.items():
        x = torch.tensor(xs, dtype=torch.float64)
        out[key] = (float(x.mean()), float(x.std() / len(xs) ** 0.5) if len(xs) > 1 else float("inf"), len(xs))
    return out


@pytest.fixture(scope="module")
def episodes():
    return sample(20000, seed=0)


def _z_scores(advantages, steps, Q, V, min_n=200):
    zs = []
    for (h, a), (mean, se, n) in _cell_means(advantages, steps).items():
        if n >= min_n:
            zs.append(abs(mean - (Q[(h, a)] - V[h])) / max(se, 1e-9))
    return zs


@pytest.mark.parametrize("lam", [1.0, 0.9, 0.5])
@pytest.mark.parametrize("estimator", ["gae", "turn_gae"])
def test_the_estimators_with_the_true_values_average_to_q_minus_v(episodes, estimator, lam):
    rewards, values, mask, turn_ids, steps, V, Q = episodes
    if estimator == "gae":
        advantages, _ = ops.gae(rewards, values, mask, gamma=1.0, lam=lam)
    else:
        advantages, _ = ops.turn_gae(rewards, values, turn_ids, gamma=1.0, lam=lam)
    zs = _z_scores(advantages, steps, Q, V)
    assert len(zs) >= 12 and max(zs) < 4.5, max(zs)


def test_turn_gae_reads_each_turns_value_at_its_first_token(episodes):
    turn_ids = episodes[3]
    starts = ops.turn_start_mask(turn_ids)
    assert torch.equal(starts, (turn_ids >= 0) & (torch.arange(T) % (2 + ENV) == 0))


def test_a_per_turn_index_group_baseline_does_not(episodes):
    rewards, values, mask, turn_ids, steps, V, Q = episodes
    total = rewards.sum(1)
    advantages = torch.zeros_like(rewards)
    for k in range(TURNS):
        reached = (turn_ids == k).any(1)
        baseline = total[reached].mean()
        advantages[reached] = torch.where(turn_ids[reached] == k, total[reached, None] - baseline, 0.0)
    zs = _z_scores(advantages, steps, Q, V)
    assert max(zs) > 20  # far outside sampling error


@pytest.mark.parametrize("plant", ["value at the turn's last token", "turn reward dropped", "discounted"])
def test_a_planted_error_in_the_inputs_of_turn_gae_is_caught(episodes, plant):
    # The same check, on inputs an estimator with that bug would compute: it must fail.
    rewards, values, mask, turn_ids, steps, V, Q = episodes
    rewards, values = rewards.clone(), values.clone()
    gamma = 1.0
    if plant == "value at the turn's last token":
        starts = torch.arange(T) % (2 + ENV) == 0
        values[:, starts] = values[:, torch.roll(starts, 1)]
    elif plant == "turn reward dropped":
        rewards[rewards == 0.1] = 0.0
    else:
        gamma = 0.8
    advantages, _ = ops.turn_gae(rewards, values, turn_ids, gamma=gamma, lam=1.0)
    assert max(_z_scores(advantages, steps, Q, V)) > 4.5


def test_the_mdp_is_enumerated_right():
    V, Q = true_values()
    for h in itertools.chain([()], [(a,) for a in (A, B)], [(a, b) for a in (A, B) for b in (A, B)]):
        assert V[h] == pytest.approx(sum(p * Q[(h, a)] for a, p in enumerate(policy(h))))
    assert len(V) == 7  # (), 2 one-action and 4 two-action histories
