"""reasoning-gym's procedural tasks as prompt sets (``--prompts reasoning-gym:TASK?...``) and their
scorers as a reward (``--reward reasoning-gym``): pyppo.tasks.reasoning_gym."""

from __future__ import annotations

import json
import sys

import pytest

from pyppo import cli
from pyppo.prompts import load_prompt_records, prompt_columns, resolve_prompt_source
from pyppo.rewards import load_reward, score_responses
from pyppo.tasks.reasoning_gym import (
    ANSWER_INSTRUCTION,
    canonical_task_spec,
    check_held_out,
    parse_task_spec,
    reasoning_gym_reward,
    task_names,
    task_records,
)
from support.tiny_models import save_tiny_causal_lm

pytest.importorskip("reasoning_gym", reason="reasoning-gym is not installed (pip install 'pyppo[reasoning-gym]')")

SPEC = "reasoning-gym:basic_arithmetic?size=6&seed=0&max_terms=3&max_digits=2"


def _error_line(capsys) -> str:
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1, err  # one line, no traceback
    assert err[0].startswith("pyppo: error: ")
    return err[0]


# ------------------------------------------------------------------------------------- the spec


def test_the_spec_reads_json_values_and_keeps_plus_signs():
    options = 'operators=["+","-"]&allow_negation=false&format_style=natural'
    spec = parse_task_spec(f"reasoning-gym:basic_arithmetic?{options}")
    assert spec.task == "basic_arithmetic" and spec.size is None and spec.seed == 0 and spec.system_prompt is None
    assert spec.options == (("allow_negation", False), ("format_style", "natural"), ("operators", ["+", "-"]))
    assert parse_task_spec("reasoning-gym:chain_sum?seed=7&size=3&system_prompt=default").seed == 7
    # The canonical spec: the options sorted, size and seed included; it reads back the same.
    canonical = canonical_task_spec("reasoning-gym:basic_arithmetic?whitespace=no_space&max_terms=3")
    assert canonical == "reasoning-gym:basic_arithmetic?max_terms=3&seed=0&size=500&whitespace=no_space"
    assert canonical_task_spec("reasoning-gym:basic_arithmetic?max_terms=3&size=500&whitespace=no_space") == canonical
    assert canonical_task_spec(canonical) == canonical == resolve_prompt_source(canonical)
    odd = canonical_task_spec('reasoning-gym:basic_arithmetic?operators=["+"]&format_style=natural&size=2')
    assert parse_task_spec(odd).options == (("format_style", "natural"), ("operators", ["+"]))


@pytest.mark.parametrize(
    "spec, pattern",
    [
        ("reasoning-gym:", r"no task name after 'reasoning-gym:'"),
        ("reasoning-gym:chain_sum?size", r"option 'size' is not key=value"),
        ("reasoning-gym:chain_sum?seed=1&seed=2", r"option 'seed' is given twice"),
        ("reasoning-gym:chain_sum?size=0", r"size must be an int >= 1, got 0"),
        ("reasoning-gym:chain_sum?seed=-1", r"seed must be an int >= 0, got -1"),
        ("reasoning-gym:chain_sum?seed=x", r"seed must be an int >= 0, got 'x'"),
        ("reasoning-gym:basic_arithmetc", r"no task 'basic_arithmetc' \(did you mean 'basic_arithmetic', .*pyppo info"),
        ("reasoning-gym:CHAIN_SUM", r"no task 'CHAIN_SUM' \(did you mean 'chain_sum'(, |\?)"),
        (
            "reasoning-gym:chain_sum?max_terms=abc",
            r"option max_terms=abc must be an int \(ChainSumConfig\.max_terms: int, default 6\)$",
        ),
        ("reasoning-gym:chain_sum?max_terms=true", r"option max_terms=true must be an int \("),
        ("reasoning-gym:chain_sum?max_terms=2.5", r"option max_terms=2\.5 must be an int \("),
        (
            "reasoning-gym:basic_arithmetic?format_style=fancy",
            r"option format_style=fancy must be one of 'simple', 'natural' \(.*format_style: Literal\[",
        ),
        ("reasoning-gym:basic_arithmetic?operators=3", r"option operators=3 must be a JSON list of strings \("),
        ("reasoning-gym:chain_sum?terms=2", r"task 'chain_sum' has no option 'terms'; its options are min_terms, "),
        ("reasoning-gym:basic_arithmetic?min_terms=0", r"task 'basic_arithmetic' refuses its options: .*min_terms"),
        ("reasoning-gym:chain_sum?system_prompt=nope", r"system_prompt must be one of 'DeepSeekZero', 'default'"),
        (
            "reasoning-gym:decimal_arithmetic?max_num_decimal_places=2",
            r"task 'decimal_arithmetic' failed to generate problem 0 \(seed 0\): ValueError: empty range",
        ),
    ],
)
def test_a_bad_spec_is_one_line_naming_it(spec, pattern):
    with pytest.raises(ValueError, match=pattern) as info:
        load_prompt_records(spec, flag="--eval-prompts")
    assert str(info.value).startswith(f"--eval-prompts {spec!r}: ") and "\n" not in str(info.value)


def test_a_missing_package_names_the_extra(monkeypatch):
    monkeypatch.setitem(sys.modules, "reasoning_gym", None)  # import reasoning_gym now raises
    with pytest.raises(ModuleNotFoundError, match=r"the reasoning-gym package is not installed \(pip install 'pyppo\["):
        load_prompt_records(SPEC)
    with pytest.raises(ModuleNotFoundError, match=r"pip install 'pyppo\[reasoning-gym\]'"):
        task_names()


# ---------------------------------------------------------------------------------- the records


def test_records_hold_the_question_the_answer_and_what_the_scorer_needs():
    import reasoning_gym

    records = load_prompt_records(SPEC)
    canonical = canonical_task_spec(SPEC)
    entries = list(reasoning_gym.create_dataset("basic_arithmetic", size=6, seed=0, max_terms=3, max_digits=2))
    assert len(records) == 6
    for record, entry in zip(records, entries):
        assert record == {
            "prompt": f"{entry['question']}\n\n{ANSWER_INSTRUCTION}",
            "answer": entry["answer"],
            "question": entry["question"],
            "metadata": entry["metadata"],
            "task": canonical,
        }
        assert record["metadata"]["num_terms"] <= 3  # the options reached the generator
    assert load_prompt_records(SPEC) == records  # the same every time
    # With system_prompt: reasoning-gym's own system prompt, and the question as the user's message.
    from reasoning_gym.utils import SYSTEM_PROMPTS

    chat = task_records("reasoning-gym:basic_arithmetic?size=2&system_prompt=default")
    assert chat[0]["prompt"] == [
        {"role": "system", "content": SYSTEM_PROMPTS["default"]},
        {"role": "user", "content": chat[0]["question"]},
    ]


def test_a_held_out_seed_gives_other_questions_and_an_overlap_is_refused():
    train = {r["question"] for r in load_prompt_records(SPEC)}
    other = SPEC.replace("seed=0", "seed=6")
    held_out = {r["question"] for r in load_prompt_records(other, flag="--eval-prompts")}
    assert len(held_out) == 6 and not train & held_out
    # reasoning-gym seeds problem i with seed + i: seed=1 repeats five of the six training problems.
    near = SPEC.replace("seed=0", "seed=1")
    assert len(train & {r["question"] for r in load_prompt_records(near)}) == 5
    with pytest.raises(ValueError, match=r"shares 5 of its 6 problems with --prompts .* held-out set a seed >= 6"):
        check_held_out(canonical_task_spec(SPEC), canonical_task_spec(near))
    check_held_out(canonical_task_spec(SPEC), canonical_task_spec(other))
    later = canonical_task_spec(SPEC.replace("seed=0", "seed=10"))
    with pytest.raises(ValueError, match=r"a seed >= 16 \(or <= 4\)$"):
        check_held_out(later, canonical_task_spec(SPEC.replace("seed=0", "seed=5")))
    check_held_out(canonical_task_spec(SPEC), None)  # no held-out set: nothing to check


def test_an_option_written_at_its_default_is_the_same_set():
    # min_terms=2 is chain_sum's default: the same problems, so the same canonical spec.
    plain, written = "reasoning-gym:chain_sum?size=50&seed=0", "reasoning-gym:chain_sum?size=50&seed=0&min_terms=2"
    assert canonical_task_spec(written) == canonical_task_spec(plain) == "reasoning-gym:chain_sum?seed=0&size=50"
    assert load_prompt_records(written) == load_prompt_records(plain)
    assert (
        canonical_task_spec("reasoning-gym:chain_sum?min_terms=3&size=2")
        == "reasoning-gym:chain_sum?min_terms=3&seed=0&size=2"
    )
    # A float field's default given as an int (-100 for -100.0), and JSON's true is not 1.
    floats = "reasoning-gym:number_sorting?size=2&min_value=-100"
    assert canonical_task_spec(floats) == "reasoning-gym:number_sorting?seed=0&size=2"
    # Either spelling on either side: the held-out set overlaps the training set.
    for train, held_out in ((written, "reasoning-gym:chain_sum?size=20&seed=0"), (plain, f"{written}&size=20")):
        held_out = held_out.replace("size=50&", "")
        with pytest.raises(ValueError, match=r"shares 20 of its 20 problems with --prompts .* a seed >= 50$"):
            check_held_out(train, held_out)


def test_a_held_out_set_with_other_options_is_refused_where_its_questions_repeat_training_ones():
    # The same seeds under other options draw the same numbers: 10 of the 50 questions are training questions.
    train, held_out = "reasoning-gym:chain_sum?size=50&seed=0", "reasoning-gym:chain_sum?size=50&seed=0&max_terms=3"
    questions = {r["question"] for r in load_prompt_records(train)}
    repeated = [r["question"] for r in load_prompt_records(held_out) if r["question"] in questions]
    assert len(repeated) == 10
    pattern = r"shares 10 of its 50 questions word for word with --prompts .*: give the held-out set another seed "
    pattern += r"\(seed=50 shares none\)$"
    with pytest.raises(ValueError, match=pattern):
        check_held_out(train, held_out)
    check_held_out(train, held_out.replace("seed=0", "seed=50"))  # the seed it named
    # Seeds apart, but a task with few distinct questions (200 sums of two one-digit numbers) repeats
    # them whatever the seed: no seed to offer, so a warning, not a refusal.
    small = "reasoning-gym:chain_sum?size=300&seed=0&max_terms=2&max_digits=1"
    pattern = r"questions word for word .* and so do the sets of the next 8 seeds tried .* few distinct questions"
    with pytest.warns(UserWarning, match=pattern):
        check_held_out(small, small.replace("size=300&seed=0", "size=20&seed=300"))
    # Seeds apart with a free seed further on: refused, naming it.
    with pytest.raises(
        ValueError, match=r"word for word .*: give the held-out set another seed \(seed=\d+ shares none\)$"
    ):
        check_held_out(small.replace("size=300", "size=40"), small.replace("size=300&seed=0", "size=5&seed=40"))
    # Other tasks, and sources that are not specs, are not compared.
    check_held_out(train, "reasoning-gym:basic_arithmetic?size=50&seed=0")
    check_held_out(train, "arithmetic-eval")


# --------------------------------------------------------------------------------- the scoring


def test_the_reward_scores_with_the_tasks_own_scorer():
    records = load_prompt_records(SPEC)
    prompts, fields = prompt_columns(records)
    reward = load_reward("reasoning-gym")
    right = [f"Thinking... <answer>{r['answer']}</answer>" for r in records]
    assert score_responses(reward, prompts, right, where="t", fields=fields) == [1.0] * 6
    wrong = [f"<answer>{int(r['answer']) + 1}</answer>" for r in records]
    assert all(s < 1.0 for s in score_responses(reward, prompts, wrong, where="t", fields=fields))
    # No tags: no answer. Several: the last one counts.
    assert score_responses(reward, prompts[:1], [records[0]["answer"]], where="t", fields=_first(fields)) == [0.0]
    last = [f"<answer>0</answer> no, <answer>{records[0]['answer']}</answer>"]
    assert score_responses(reward, prompts[:1], last, where="t", fields=_first(fields)) == [1.0]
    # Without the task field, the metadata's source_dataset names the task (its default options).
    no_task = {k: v for k, v in _first(fields).items() if k != "task"}
    assert score_responses(reward, prompts[:1], right[:1], where="t", fields=no_task) == [1.0]
    # --reward math reads the same answer field.
    assert score_responses(load_reward("math"), prompts, right, where="t", fields=fields) == [1.0] * 6


def _first(fields):
    return {k: v[:1] for k, v in fields.items()}


def test_the_scorer_is_built_with_the_records_options():
    from pyppo.tasks import reasoning_gym as rg

    records = task_records("reasoning-gym:decimal_arithmetic?size=1&min_num_decimal_places=2&max_num_decimal_places=2")
    scorer = rg._scorer(records[0]["task"])
    assert scorer.__self__.config.max_num_decimal_places == 2  # not the task's default, 3
    with pytest.raises(ValueError, match=r"reasoning_gym_reward: prompt 0 has no task field and its metadata no"):
        reasoning_gym_reward(["p"], ["<answer>1</answer>"], answer=["1"], metadata=[{}])


def test_a_scorer_that_raises_scores_zero_with_one_warning(monkeypatch):
    from pyppo.tasks import reasoning_gym as rg

    def broken(answer, entry):
        raise SyntaxError("cannot parse")

    monkeypatch.setattr(rg, "_scorer", lambda task: broken)
    monkeypatch.setattr(rg, "_warned", set())
    meta = [{"source_dataset": "n_queens"}] * 2
    with pytest.warns(UserWarning, match=r"task 'n_queens': score_answer raised SyntaxError: cannot parse") as seen:
        assert reasoning_gym_reward(["p"] * 2, ["<answer>(</answer>"] * 2, ["x"] * 2, meta) == [0.0, 0.0]
    assert len(seen) == 1


# ------------------------------------------------------------------------------------ the CLI


def test_a_tiny_run_with_a_held_out_set_then_resumed(tmp_path, capsys):
    import tomllib

    model = save_tiny_causal_lm(tmp_path / "model")
    out = tmp_path / "run"
    train = "reasoning-gym:chain_sum?size=4&seed=0"
    held_out = "reasoning-gym:chain_sum?seed=100&size=2"
    argv = ["train", "--model", str(model), "--prompts", train, "--reward", "reasoning-gym", "--output", str(out)]
    argv += ["--eval-prompts", held_out, "--eval-every", "1", "--steps", "1", "--batch-size", "2"]
    argv += ["--mini-batch-size", "1", "--ppo-epochs", "1", "--max-new-tokens", "4", "--seed", "3"]
    assert cli.main(argv) == 0, capsys.readouterr().err
    config = tomllib.loads((out / "config.toml").read_text())
    assert config["prompts"] == "reasoning-gym:chain_sum?seed=0&size=4"
    assert config["eval_prompts"] == "reasoning-gym:chain_sum?seed=100&size=2"
    evaluated = [json.loads(line) for line in (out / "eval_samples.jsonl").read_text().splitlines()]
    assert [r["prompt"] for r in evaluated] == [r["prompt"] for r in task_records(held_out)]
    # The same set spelled otherwise resumes; another set is refused in one line.
    resume = ["train", "--resume", str(out), "--steps", "2"]
    assert cli.main([*resume, "--prompts", "reasoning-gym:chain_sum?size=4"]) == 0, capsys.readouterr().err
    assert len((out / "metrics.jsonl").read_text().splitlines()) == 2
    # An option written at its default (chain_sum's min_terms=2) is the same set too.
    default_written = "reasoning-gym:chain_sum?seed=0&size=4&min_terms=2"
    assert cli.main([*resume[:-1], "3", "--prompts", default_written]) == 0, capsys.readouterr().err
    assert len((out / "metrics.jsonl").read_text().splitlines()) == 3
    capsys.readouterr()
    assert cli.main([*resume[:-1], "4", "--prompts", "reasoning-gym:chain_sum?size=5"]) == 2
    assert "--prompts 'reasoning-gym:chain_sum?size=5' differs from the resumed run's" in _error_line(capsys)


def test_an_overlapping_held_out_set_and_an_unknown_task_are_refused_before_loading(tmp_path, capsys):
    out = tmp_path / "run"
    model = save_tiny_causal_lm(tmp_path / "model")  # never loaded: the checks come first
    capsys.readouterr()
    argv = ["train", "--model", str(model), "--prompts", "reasoning-gym:chain_sum?size=4", "--reward", "reasoning-gym"]
    argv += ["--output", str(out)]
    assert cli.main([*argv, "--eval-prompts", "reasoning-gym:chain_sum?seed=2", "--eval-every", "1"]) == 2
    assert "shares" in _error_line(capsys) and not out.exists()
    # An option written at its default, on either side, is still the same problems.
    train = ["--prompts", "reasoning-gym:chain_sum?size=4&min_terms=2"]
    assert cli.main([*argv, *train, "--eval-prompts", "reasoning-gym:chain_sum?seed=2", "--eval-every", "1"]) == 2
    assert "shares 2 of its 500 problems" in _error_line(capsys) and not out.exists()
    # Other options: the questions are compared.
    held_out = ["--eval-prompts", "reasoning-gym:chain_sum?size=50&seed=0&max_terms=3", "--eval-every", "1"]
    assert cli.main([*argv[:3], "--prompts", "reasoning-gym:chain_sum?size=50&seed=0", *argv[5:], *held_out]) == 2
    assert "shares 10 of its 50 questions word for word" in _error_line(capsys) and not out.exists()
    assert cli.main([*argv[:3], "--prompts", "reasoning-gym:no_such_task", "--output", str(out)]) == 2
    assert "reasoning-gym has no task 'no_such_task'" in _error_line(capsys) and not out.exists()
    # A reward that needs the reasoning-gym fields, on prompts without them.
    assert cli.main([*argv[:3], "--prompts", "arithmetic", "--reward", "reasoning-gym", "--output", str(out)]) == 2
    assert "reward 'reasoning-gym' needs the prompt field 'metadata'" in _error_line(capsys)


def test_pyppo_info_lists_the_tasks(capsys):
    assert cli.main(["info"]) == 0
    out = capsys.readouterr().out
    assert "reasoning-gym tasks" in out and "basic_arithmetic" in out and "chain_sum" in out
    assert cli.main(["info", "--json"]) == 0
    sources = json.loads(capsys.readouterr().out)["prompt_sources"]
    assert sources["builtin"] == ["arithmetic", "arithmetic-eval"] and ".parquet" in sources["file_suffixes"]
    assert sources["reasoning_gym"]["tasks"] == task_names() and "basic_arithmetic" in task_names()
