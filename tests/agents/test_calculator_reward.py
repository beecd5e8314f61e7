"""The calculator's reward reads the agent's final turn, not the tool's replies: an agent that
calls the tool and then never answers is not paid for the tool's number; and a reward that names
``transcript`` gets each episode's turns."""

from __future__ import annotations

from pyppo.agents.envs.calculator import Calculator, final_answer_reward
from pyppo.rewards import load_reward
from pyppo.trainer import PPOTrainer
from support.agent_fixture import Scripted
from support.tiny_models import tiny_causal_lm, tiny_tokenizer
from support.trainer_fixture import EOS, small_config

CALL = '<tool_call>{"name": "calculate", "arguments": {"expression": "589 * 24"}}</tool_call>'
RECORD = {"prompt": "What is 589 * 24? Give the final answer as a number.", "answer": "14136"}


def _scores(final_turn: str):
    tok = tiny_tokenizer()
    config = small_config(max_turns=2, max_new_tokens=120, steps=1, batch_size=2, mini_batch_size=2)
    reward = load_reward(Calculator.default_reward)
    trainer = PPOTrainer(config, tiny_causal_lm(0), None, None, tok, reward, [RECORD] * 4, environment=Calculator)
    turns = [tok(t, add_special_tokens=False)["input_ids"] + [EOS] for t in (CALL, final_turn)]
    trainer.engine.engine = Scripted(turns)
    fields = {"answer": [RECORD["answer"]] * 2}
    batch = trainer.rollout([RECORD["prompt"]] * 2, fields)
    assert all(e.tool_calls == 1 and e.tool_errors == 0 for e in batch.episodes)
    assert all("14136" in e.transcript[1]["text"] for e in batch.episodes)  # the tool's reply
    return trainer.score(batch, fields)[0].tolist()


def test_an_agent_that_calls_the_tool_and_never_answers_is_not_paid():
    assert _scores("done") == [0.0, 0.0]


def test_an_agent_that_answers_after_the_tool_is_paid():
    assert _scores("The answer is 14136.") == [1.0, 1.0]


def test_final_answer_reward_reads_the_last_agent_turn():
    transcript = [
        [{"role": "agent", "turn": 0, "text": "I think 12"}, {"role": "environment", "turn": 0, "text": "7"}],
        [{"role": "agent", "turn": 0, "text": "7"}],
        [],
    ]
    assert final_answer_reward(["p"] * 3, ["x"] * 3, ["7", "7", "7"], transcript) == [0.0, 1.0, 0.0]
