"""Multi-turn episodes through the trainer: the trained ids are the sampled ids plus the rendered
replies, PPO's first ratio is exactly 1 over every agent token, environment tokens take no KL, no
advantage and no reward, and GAE over the agent tokens equals GAE on them alone."""

from __future__ import annotations

import pytest
import torch

from pyppo import ops
from pyppo.agents.episodes import AgentEngine, EpisodeLimits
from pyppo.agents.render import ChatRenderer
from pyppo.trainer import PPOTrainer
from support.agent_fixture import Replies, Scripted
from support.tiny_models import tiny_causal_lm, tiny_tokenizer
from support.trainer_fixture import PROMPTS, small_config, with_eos_bias

EOS = 2


def _engine(turns, tokenizer, *, max_turns=3, max_new_tokens=16, max_episode_tokens=400):
    from pyppo.agents.adapters import environment_factory

    renderer = ChatRenderer(tokenizer, use_chat_template=True, tools=[])
    limits = EpisodeLimits(max_turns, max_new_tokens, max_episode_tokens)
    return AgentEngine(Scripted(turns), renderer, environment_factory(Replies), limits, tokenizer), renderer


def test_trained_ids_are_the_sampled_ids_and_the_rendered_replies_where_retokenising_differs():
    tok = tiny_tokenizer()
    # Turn 1 spells "<|im_start|>" one character at a time: decoded and encoded again it is ONE
    # special token, so a trainer that re-tokenised the transcript would score other ids.
    spelled = tok("<|im_start|>", add_special_tokens=False, split_special_tokens=True)["input_ids"]
    assert len(spelled) == len("<|im_start|>")
    turns = [spelled + [EOS], tok("ok", add_special_tokens=False)["input_ids"] + [EOS], [EOS]]
    engine, renderer = _engine(turns, tok)
    out = engine.run_episodes([{"prompt": "Say it."}], [0], [0])
    ids = out.response_ids[0][out.response_mask[0]].tolist()
    leading = renderer.messages("Say it.", None)
    r1 = renderer.reply_ids(leading, True, [{"role": "user", "content": "Reply 1: try again."}])
    r2 = renderer.reply_ids(leading, True, [{"role": "user", "content": "Reply 2: try again."}])
    assert ids == turns[0] + r1 + turns[1] + r2 + turns[2]
    expected_loss = [1] * len(turns[0]) + [0] * len(r1) + [1] * len(turns[1]) + [0] * len(r2) + [1]
    assert out.loss_mask[0][out.response_mask[0]].int().tolist() == expected_loss
    turn_ids = out.turn_ids[0][out.response_mask[0]].tolist()
    assert turn_ids == [0] * len(turns[0]) + [-1] * len(r1) + [1] * len(turns[1]) + [-1] * len(r2) + [2]
    # Each turn continued the very ids of the one before: prompt, turn, reply, ...
    prompt = out.query_ids[0][out.query_mask[0]].tolist()
    assert engine.engine.calls[1] == [prompt + turns[0] + r1]
    assert engine.engine.calls[2] == [prompt + turns[0] + r1 + turns[1] + r2]
    # ... where decoding the transcript and encoding it again does not give them back.
    text = tok.decode(prompt + ids, skip_special_tokens=False)
    assert tok(text, add_special_tokens=False)["input_ids"] != prompt + ids
    # The rewards of each turn sit on that turn's last token; none on an environment token.
    paid = out.turn_rewards[0]
    ends = [len(turns[0]) - 1, len(turns[0]) + len(r1) + len(turns[1]) - 1, len(ids) - 1]
    assert {i: paid[i].item() for i in torch.nonzero(paid).flatten().tolist()} == dict(zip(ends, Replies.pay))
    assert out.has_eos.tolist() == [True] and out.episodes[0].turns == 3


def test_a_turn_cut_by_max_new_tokens_truncates_the_episode_and_the_environment_still_pays():
    tok = tiny_tokenizer()
    long_turn = tok("abcdefgh", add_special_tokens=False)["input_ids"]  # no EOS within 4 tokens
    engine, _ = _engine([long_turn], tok, max_new_tokens=4)
    out = engine.run_episodes([{"prompt": "Go."}], [0], [0])
    assert out.response_ids[0][out.response_mask[0]].tolist() == long_turn[:4]
    assert out.has_eos.tolist() == [False] and out.episodes[0].truncated
    assert out.turn_rewards[0, 3].item() == Replies.pay[0]


def test_a_reply_that_leaves_no_room_truncates_the_episode_without_it():
    tok = tiny_tokenizer()
    engine, _ = _engine([[EOS]], tok, max_episode_tokens=40)
    prompt_len = len(engine.renderer.prompt_ids(engine.renderer.messages("Go.", None)))
    assert prompt_len + 1 < 40
    out = engine.run_episodes([{"prompt": "Go."}], [0], [0])
    assert out.response_mask[0].sum() == 1 and out.loss_mask[0].sum() == 1 and out.episodes[0].truncated


def test_max_episode_tokens_below_the_prompt_is_refused_naming_it():
    tok = tiny_tokenizer()
    engine, _ = _engine([[EOS]], tok, max_episode_tokens=5)
    with pytest.raises(ValueError, match="max_episode_tokens"):
        engine.run_episodes([{"prompt": "A prompt longer than five tokens."}], [0], [0])


@pytest.fixture(scope="module")
def three_turn_trainer():
    """A trainer after one PPO step of 3-turn episodes on the tiny model (each turn scripted to
    end with EOS), and that step's batch."""
    tok = tiny_tokenizer()
    config = small_config(max_turns=3, max_new_tokens=8, steps=1, kl_coef=0.05)
    trainer = PPOTrainer(config, tiny_causal_lm(0), None, None, tok, None, PROMPTS, environment=Replies)
    a, b = (tok(t, add_special_tokens=False)["input_ids"] for t in ("no", "maybe"))
    trainer.engine.engine = Scripted([a + [EOS], b + [EOS], [EOS]])
    return trainer, trainer.step()


@pytest.fixture(scope="module")
def three_turn_step(three_turn_trainer):
    return three_turn_trainer[1]


def test_the_first_ratio_is_exactly_one_and_the_step_1_kl_exactly_zero_over_every_agent_token(three_turn_step):
    m, batch = three_turn_step.metrics, three_turn_step.batch
    assert m["turns_mean"] == 3.0 and m["env_token_fraction"] > 0.5
    assert m["first_max_abs_logratio"] == 0.0 and m["first_ratio_min"] == m["first_ratio_max"] == 1.0
    assert m["kl_mean"] == 0.0
    # "no" + EOS, "maybe" + EOS, EOS: 10 agent tokens an episode, every one trained on
    assert int(batch.loss_mask.sum()) == 10 * len(batch)


def test_environment_tokens_take_no_kl_no_advantage_and_no_reward(three_turn_step):
    batch = three_turn_step.batch
    env = batch.response_mask & ~batch.loss_mask
    assert bool(env.any())
    for name in ("kl", "advantages", "rewards"):
        assert float(getattr(batch, name)[env].abs().sum()) == 0.0, name
    # Each episode's rewards: 0.25 and 0.5 on the last token of turns 1 and 2, the final 1.0 on its last
    # agent token; an episode's rewards sum to its score (the KL is 0 at step 1).
    torch.testing.assert_close(batch.rewards.sum(dim=1), batch.scores)
    assert batch.scores.tolist() == [sum(Replies.pay)] * len(batch)


@pytest.mark.parametrize("fused", [True, False])
def test_the_entropy_bonus_covers_agent_tokens_only(three_turn_trainer, fused):
    """The entropy term of the policy loss (both paths: the fused linear loss and the log-probs)
    is the entropy of the agent's tokens, by a float64 reference from the full logits; the
    environment's tokens are not in it."""
    from pyppo.trainer.logprob_head import PolicyObjective

    trainer, batch = three_turn_trainer[0], three_turn_trainer[1].batch
    # Summed over each episode's tokens (not averaged): counting the environment's tokens would
    # show, whatever the entropies (near log V everywhere on a random tiny model).
    changes = dict(entropy_coef=0.5, fused_policy_loss=fused, loss_agg="seq-mean-token-sum")
    objective = PolicyObjective.from_config(trainer.config.with_changes(**changes))
    head = trainer.models.policy_logprobs
    _, stats, _, _ = head(batch, objective=objective)
    with torch.no_grad():
        T = batch.response_length
        logits = (
            trainer.models.policy(
                input_ids=batch.input_ids, attention_mask=batch.attention_mask, position_ids=batch.position_ids
            )
            .logits[:, -(T + 1) : -1]
            .double()
        )
    logp = torch.log_softmax(logits / head.temperature, -1)
    entropy = -(logp.exp() * logp).sum(-1)
    agent, episode = ((entropy * m).sum(1).mean() for m in (batch.loss_mask, batch.response_mask))
    assert float(episode) > 2 * float(agent)
    assert float(stats["entropy_loss"]) == pytest.approx(float(agent), rel=1e-5)


def test_environment_tokens_get_zero_gradient():
    """The policy loss of a batch whose environment tokens carry huge advantages has the same
    gradient as with zeros there: only ``loss_mask`` tokens reach the loss."""
    torch.manual_seed(0)
    B, T = 3, 9
    logprobs = torch.randn(B, T, dtype=torch.float64, requires_grad=True)
    old = logprobs.detach() + 0.1 * torch.randn(B, T, dtype=torch.float64)
    adv = torch.randn(B, T, dtype=torch.float64)
    loss_mask = torch.rand(B, T) < 0.5
    loss_mask[:, 0] = True
    poisoned = torch.where(loss_mask, adv, torch.full_like(adv, 1e6))
    grads = []
    for a in (torch.where(loss_mask, adv, torch.zeros_like(adv)), poisoned):
        loss, _ = ops.ppo_policy_loss(logprobs, old, a, loss_mask, cliprange_low=0.2, cliprange_high=0.2)
        grads.append(torch.autograd.grad(loss, logprobs)[0])
    torch.testing.assert_close(grads[0], grads[1], rtol=0, atol=0)
    assert float(grads[0][~loss_mask].abs().sum()) == 0.0


@pytest.mark.parametrize("seed", range(5))
def test_gae_over_agent_tokens_equals_gae_on_the_agent_tokens_alone(seed):
    g = torch.Generator().manual_seed(seed)
    B, T = 4, 23
    rewards = torch.randn(B, T, generator=g, dtype=torch.float64)
    values = torch.randn(B, T, generator=g, dtype=torch.float64)
    mask = torch.rand(B, T, generator=g) < 0.6
    mask[0] = False  # an all-masked row
    gamma, lam = 0.97, 0.9
    adv, ret = ops.gae(rewards, values, mask, gamma=gamma, lam=lam)
    for i in range(B):
        idx = torch.nonzero(mask[i]).flatten()
        r, v = rewards[i, idx], values[i, idx]
        expected, last = torch.zeros_like(r), 0.0
        for t in reversed(range(len(idx))):
            nxt = v[t + 1] if t + 1 < len(idx) else 0.0
            last = r[t] + gamma * nxt - v[t] + gamma * lam * last
            expected[t] = last
        torch.testing.assert_close(adv[i, idx], expected)
        torch.testing.assert_close(ret[i, idx], expected + v)
        assert float(adv[i][~mask[i]].abs().sum()) == 0.0


def test_real_sampling_runs_three_turns_with_the_first_ratio_one():
    """The transformers engine samples each turn by continuing the token ids (EOS made likely)."""
    config = small_config(max_turns=3, max_new_tokens=6, steps=1)
    trainer = PPOTrainer(
        config, with_eos_bias(tiny_causal_lm(0), 3.0), None, None, tiny_tokenizer(), None, PROMPTS, environment=Replies
    )
    m = trainer.step().metrics
    assert m["turns_mean"] > 1.0
    assert m["first_max_abs_logratio"] == 0.0 and m["kl_mean"] == 0.0


def test_an_episode_at_max_turns_ends_on_the_agents_turn_without_the_unanswered_reply():
    tok = tiny_tokenizer()
    engine, _ = _engine([[EOS]], tok, max_turns=2)
    out = engine.run_episodes([{"prompt": "Go."}], [0], [0])
    n = int(out.response_mask[0].sum())
    assert bool(out.loss_mask[0, n - 1]) and out.turn_ids[0, n - 1].item() == 1  # the last token is the agent's
    assert out.episodes[0].truncated and out.has_eos.tolist() == [False] and out.episodes[0].turns == 2
    assert [t["role"] for t in out.episodes[0].transcript] == ["agent", "environment", "agent"]


def test_trls_environment_class_runs_in_the_trainer_and_tool_errors_are_counted_not_raised():
    """TRL's documented ``IncrementEnv`` (reset(**row), a typed tool method, get_reward), unchanged:
    a good call, a call to an unknown tool, then an answer; the unknown tool's error is the tool's
    reply and the episode goes on to be paid by ``get_reward``."""
    from support.trl_env import IncrementEnv

    tok = tiny_tokenizer()
    good = '<tool_call>{"name": "increment", "arguments": {"step": 2}}</tool_call>'
    bad = '<tool_call>{"name": "decrement", "arguments": {"step": 1}}</tool_call>'
    turns = [tok(t, add_special_tokens=False)["input_ids"] + [EOS] for t in (good, bad, "done")]
    config = small_config(max_turns=3, max_new_tokens=80, steps=1, batch_size=2, mini_batch_size=2)
    records = [{"prompt": "Bring the counter to 2.", "target": 2}, {"prompt": "Bring it to 3.", "target": 3}]
    with pytest.warns(UserWarning, match="system prompt"):  # the tiny template ignores tools=
        trainer = PPOTrainer(config, tiny_causal_lm(0), None, None, tok, None, records, environment=IncrementEnv)
    trainer.engine.engine = Scripted(turns)
    result = trainer.step()
    m, batch = result.metrics, result.batch
    assert m["tool_calls_mean"] == 2.0 and m["tool_error_fraction"] == 0.5 and m["turns_mean"] == 3.0
    assert sorted(batch.raw_scores.tolist()) == [0.0, 1.0]  # counter 2: right for target 2 only
    record = batch.episodes[0]
    replies = [t["text"] for t in record.transcript if t["role"] == "environment"]
    assert "2" in replies[0] and "decrement" in replies[1] and "rror" in replies[1]
    assert m["first_max_abs_logratio"] == 0.0
