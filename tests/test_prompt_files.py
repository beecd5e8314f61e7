"""Prompt data in the formats people have (pyppo.data): JSON, Parquet, CSV, saved datasets and
datasets.Dataset objects; chat-message prompts, rendered as the chat template renders them; veRL's
data layout; one-line errors for bad files; a tiny run of each format family."""

from __future__ import annotations

import json
import sys

import pytest

from pyppo import cli
from pyppo.data import check_renderable, classifier_text, prompt_list
from pyppo.prompts import PromptSampler, load_prompt_records, load_prompts, prompt_columns, resolve_prompt_source
from pyppo.rollout.tokens import check_prompt_lengths, encode_prompts
from support.run_fixture import error_line as _error_line
from support.run_fixture import no_loading, tiny_dir  # noqa: F401  (fixtures)
from support.tiny_models import CHAT_TEMPLATE, save_tiny_classifier, tiny_tokenizer

RECORDS = [{"prompt": "Say hi.", "answer": "1"}, {"prompt": "Describe rain.", "answer": "2"}]
MESSAGES = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Say hi."}]
TINY_FLAGS = ["--steps", "1", "--batch-size", "2", "--mini-batch-size", "1", "--ppo-epochs", "1"]
TINY_FLAGS += ["--max-new-tokens", "4", "--seed", "3"]


# ------------------------------------------------------------------------------------ the formats


def _pandas_json(orient):
    import pandas as pd

    return pd.DataFrame(RECORDS).to_json(orient=orient)


@pytest.mark.parametrize(
    "text",
    [
        pytest.param(lambda: json.dumps(RECORDS, indent=2), id="records-list"),
        pytest.param(lambda: "".join(json.dumps(r) + "\n" for r in RECORDS), id="json-lines"),
        pytest.param(lambda: json.dumps({"prompt": ["Say hi.", "Describe rain."], "answer": ["1", "2"]}), id="columns"),
        pytest.param(lambda: _pandas_json("columns"), id="pandas-columns"),
        pytest.param(lambda: _pandas_json("records"), id="pandas-records"),
        pytest.param(lambda: _pandas_json("split"), id="pandas-split"),
        pytest.param(lambda: _pandas_json("index"), id="pandas-index"),
    ],
)
def test_a_json_file_in_each_common_shape(tmp_path, text):
    path = tmp_path / "p.json"
    path.write_text(text())
    assert load_prompt_records(path) == RECORDS
    assert load_prompts(path) == ["Say hi.", "Describe rain."]


def test_a_json_file_of_one_record_and_of_message_prompts(tmp_path):
    one = tmp_path / "one.json"
    one.write_text(json.dumps({"prompt": MESSAGES, "answer": "1"}))  # one object: one record, not columns
    assert load_prompt_records(one) == [{"prompt": MESSAGES, "answer": "1"}]
    columns = tmp_path / "columns.json"
    columns.write_text(json.dumps({"prompt": [MESSAGES, "Say hi."]}))
    assert load_prompts(columns) == [MESSAGES, "Say hi."]


def test_parquet_csv_and_datasets_directories(tmp_path):
    import datasets
    import pandas as pd

    pd.DataFrame(RECORDS).to_parquet(tmp_path / "p.parquet")
    assert load_prompt_records(tmp_path / "p.parquet") == RECORDS
    # CSV: the header names the columns; every value stays the string the file has ("007", not 7).
    (tmp_path / "p.csv").write_text('prompt,answer\n"Say, hi.",007\n\n"Two\nlines",2\n')
    assert load_prompt_records(tmp_path / "p.csv") == [
        {"prompt": "Say, hi.", "answer": "007"},
        {"prompt": "Two\nlines", "answer": "2"},
    ]
    dataset = datasets.Dataset.from_list(RECORDS)
    dataset.save_to_disk(tmp_path / "saved")
    datasets.DatasetDict({"train": dataset, "test": dataset.select([0])}).save_to_disk(tmp_path / "dict")
    assert load_prompt_records(tmp_path / "saved") == RECORDS
    assert load_prompt_records(tmp_path / "dict") == RECORDS  # the "train" split
    datasets.DatasetDict({"validation": dataset}).save_to_disk(tmp_path / "nosplit")
    split = r"nosplit: a DatasetDict without a 'train' split \(splits: 'validation'\); give the split's directory "
    with pytest.raises(ValueError, match=split + r"instead, as in --prompts '.*nosplit/validation'$"):
        load_prompt_records(tmp_path / "nosplit")
    assert load_prompt_records(tmp_path / "nosplit" / "validation") == RECORDS  # what the message says works
    # Given to the trainer, the message says how to pass the split.
    with pytest.raises(
        ValueError, match=r"^prompts: a DatasetDict .*; pass the split to use \(prompts=prompts\['validation'\]\)$"
    ):
        prompt_list(datasets.DatasetDict({"validation": dataset}))
    # A run records a directory as its absolute path, as it does a file.
    assert resolve_prompt_source(str(tmp_path / "saved")) == str((tmp_path / "saved").resolve())


def test_arrow_messages_lose_the_keys_arrow_added(tmp_path):
    import pyarrow as pa
    import pyarrow.parquet as pq

    # Arrow stores the messages as structs of every key any message has: "name" becomes None in
    # the messages without one, and must not reach the chat template.
    with_name = [{"role": "system", "content": "Be brief.", "name": "rules"}, {"role": "user", "content": "Hi."}]
    pq.write_table(pa.Table.from_pylist([{"prompt": with_name}]), tmp_path / "m.parquet")
    assert load_prompts(tmp_path / "m.parquet") == [with_name]


# --------------------------------------------------------------------------------- bad files


def _bad_files(tmp_path):
    """(path, the message's pattern) for each way a prompt file can be wrong."""
    import pandas as pd

    p = tmp_path
    pd.DataFrame({"question": ["a"]}).to_parquet(p / "noprompt.parquet")
    pd.DataFrame({"prompt": ["a", None]}).to_parquet(p / "null.parquet")
    (p / "broken.parquet").write_bytes(b"PAR1 not really")
    (p / "p.txt").write_text(json.dumps({"prompt": "a"}))
    (p / "list.json").write_text(json.dumps([{"prompt": "a", "answer": "1"}, {"prompt": "b"}]))
    (p / "number.json").write_text(json.dumps([{"prompt": "a"}, {"prompt": 7}]))
    (p / "dup.json").write_text('[{"prompt": "a"},\n {"prompt": "b", "answer": 1, "answer": 2}]')
    (p / "columns.json").write_text(json.dumps({"prompt": ["a", "b"], "answer": ["1"]}))
    (p / "invalid.json").write_text('[{"prompt": "a"},]')
    (p / "empty.csv").write_text('prompt,answer\n"",1\n')
    (p / "cells.csv").write_text("prompt,answer\na,1\nb,2,3\n")
    (p / "header.csv").write_text("prompt,prompt\na,b\n")
    (p / "messages.jsonl").write_text(json.dumps({"prompt": [{"role": "robot", "content": "x"}]}) + "\n")
    (p / "notadataset").mkdir()
    import pyarrow as pa
    import pyarrow.parquet as pq

    pq.write_table(pa.table([pa.array(["a"]), pa.array(["b"])], names=["prompt", "prompt"]), p / "twice.parquet")
    return [
        (p / "twice.parquet", r"twice\.parquet: column 'prompt' appears more than once; each column must appear once"),
        (p / "noprompt.parquet", r"noprompt\.parquet: row 0: missing key \"prompt\" \(keys: \['question'\]\)"),
        (p / "null.parquet", r"null\.parquet: row 1: \"prompt\" must be a non-empty string, got None"),
        (p / "broken.parquet", r"broken\.parquet: not a readable Parquet file"),
        (p / "p.txt", r"p\.txt: unknown prompt file suffix '\.txt'; expected one of \.jsonl, \.ndjson, \.json"),
        (p / "list.json", r"list\.json: record 1 \(line 1\): its fields besides \"prompt\" are none, but .*record 0"),
        (p / "number.json", r"number\.json: record 1 \(line 1\): \"prompt\" must be a non-empty string, got 7"),
        (p / "dup.json", r"dup\.json: record 1 \(line 2\): key 'answer' appears more than once"),
        (p / "columns.json", r"columns\.json: column 'answer' has 1 values, column 'prompt' 2"),
        (p / "invalid.json", r"invalid\.json: not valid JSON \(.* at line 1, column"),
        (p / "empty.csv", r"empty\.csv:2: \"prompt\" must be a non-empty string, got ''"),
        (p / "cells.csv", r"cells\.csv:3: 3 values for the 2 columns of the header row \('prompt', 'answer'\)"),
        (p / "header.csv", r"header\.csv:1: column 'prompt' appears more than once in the header row"),
        (p / "messages.jsonl", r"messages\.jsonl:1: \"prompt\" message 0: \"role\" must be one of 'system', 'user'"),
        (p / "notadataset", r"notadataset: a directory, but not one written by datasets' save_to_disk"),
    ]


def test_each_bad_file_is_refused_in_one_line_naming_the_file_the_record_and_the_column(tmp_path, tiny_dir, capsys):
    for path, pattern in _bad_files(tmp_path):
        with pytest.raises(ValueError, match=pattern):
            load_prompt_records(path)
        # pyppo train says the same in one line, before the model loads or anything is written.
        out = tmp_path / "run"
        argv = ["train", "--model", str(tiny_dir), "--reward", "math", "--prompts", str(path), "--output", str(out)]
        assert cli.main(argv) == 2, path
        line = _error_line(capsys)
        assert str(path) in line, line
        assert not out.exists()


def test_a_missing_format_package_is_one_line_naming_the_flag_the_file_and_the_extra(
    tmp_path, tiny_dir, monkeypatch, capsys
):
    import datasets
    import pandas as pd

    pd.DataFrame(RECORDS).to_parquet(tmp_path / "p.parquet")
    datasets.Dataset.from_list(RECORDS).save_to_disk(tmp_path / "saved")
    for module in ("pyarrow", "pyarrow.parquet", "datasets"):
        monkeypatch.setitem(sys.modules, module, None)  # importing it now raises ImportError
    parquet, saved = str(tmp_path / "p.parquet"), str(tmp_path / "saved")
    with pytest.raises(ModuleNotFoundError) as info:
        load_prompt_records(parquet, flag="--eval-prompts")
    assert (
        str(info.value)
        == f"--eval-prompts {parquet!r}: reading Parquet needs the pyarrow package (pip install 'pyppo[data]')"
    )
    with pytest.raises(
        ModuleNotFoundError,
        match=r"reading a dataset saved by save_to_disk needs the datasets package \(pip install 'pyppo\[data\]'\)$",
    ):
        load_prompts(saved)
    out = tmp_path / "run"
    capsys.readouterr()  # datasets' progress bars
    assert cli.main(["train", "--model", str(tiny_dir), "--prompts", parquet, "--output", str(out)]) == 2
    assert (
        _error_line(capsys)
        == f"pyppo: error: --prompts {parquet!r}: reading Parquet needs the pyarrow package (pip install 'pyppo[data]')"
    )
    assert not out.exists()


# ------------------------------------------------------------------------------- message prompts


def test_message_prompts_are_rendered_exactly_as_the_chat_template_renders_them():
    tok = tiny_tokenizer()
    tok.padding_side = "left"
    # A SmolLM2-like template: a default system message only when the conversation has none.
    tok.chat_template = (
        "{% if messages[0]['role'] != 'system' %}<|im_start|>system\nDEFAULT<|im_end|>\n{% endif %}" + CHAT_TEMPLATE
    )
    prompts = [MESSAGES, "Say hi.", [{"role": "user", "content": "A"}, {"role": "assistant", "content": "B"}]]
    ids, mask = encode_prompts(tok, prompts, use_chat_template=True, max_prompt_length=None, device="cpu")
    expected = [
        tok.apply_chat_template(MESSAGES, tokenize=True, add_generation_prompt=True),
        tok.apply_chat_template([{"role": "user", "content": "Say hi."}], tokenize=True, add_generation_prompt=True),
        tok.apply_chat_template(prompts[2], tokenize=True, add_generation_prompt=True),
    ]
    expected = [list(e["input_ids"]) if isinstance(e, dict) or hasattr(e, "keys") else list(e) for e in expected]
    assert [row[m].tolist() for row, m in zip(ids, mask)] == expected
    texts = tok.batch_decode([row[m] for row, m in zip(ids, mask)])
    assert "Be brief." in texts[0] and "DEFAULT" not in texts[0]  # the given system message, kept
    assert "DEFAULT" in texts[1]


def test_a_message_prompt_without_a_chat_template_is_refused_naming_it():
    tok = tiny_tokenizer()
    tok.padding_side = "left"
    prompts = ["Say hi.", MESSAGES, MESSAGES]
    with pytest.raises(ValueError, match=r"^eval_prompts\[1\] \(and 1 more\) is a list of chat messages, but prompts"):
        check_prompt_lengths(
            tok,
            prompts,
            use_chat_template=False,
            room=None,
            max_new_tokens=4,
            max_prompt_length=None,
            truncate=True,
            what="eval_prompts",
        )
    with pytest.raises(ValueError, match=r"prompts\[1\] \(and 1 more\) is a list of chat messages"):
        encode_prompts(tok, prompts, use_chat_template=False, max_prompt_length=None, device="cpu")
    tok.chat_template = None
    with pytest.raises(ValueError, match=r"the tokenizer has none, or use_chat_template = false"):
        encode_prompts(tok, prompts, use_chat_template=True, max_prompt_length=None, device="cpu")
    check_renderable(["a", "b"], uses_template=False)  # strings need no template


def test_a_message_prompt_without_a_chat_template_can_be_named_by_its_source():
    with pytest.raises(
        ValueError, match=r"^--prompts 'm\.jsonl': prompt 1 \(and 1 more\) is a list of chat messages, but"
    ):
        check_renderable(["Say hi.", MESSAGES, MESSAGES], uses_template=False, source="--prompts 'm.jsonl'")
    check_renderable([MESSAGES], uses_template=True, source="--prompts 'm.jsonl'")


def test_a_long_message_prompt_is_measured_through_the_template():
    tok = tiny_tokenizer()
    long = [{"role": "system", "content": "x" * 40}, {"role": "user", "content": "Hi."}]
    kwargs = dict(use_chat_template=True, room=30, max_new_tokens=4, max_prompt_length=None, truncate=False)
    with pytest.raises(ValueError, match=r"prompts: prompt 1 \(\d+ tokens\) longer than the 30 tokens"):
        check_prompt_lengths(tok, ["Hi.", long], **kwargs)


def test_the_sampler_and_the_columns_take_message_prompts():
    records = [{"prompt": MESSAGES, "answer": "1"}, {"prompt": "Say hi.", "answer": "2"}]
    assert prompt_columns(records) == ([MESSAGES, "Say hi."], {"answer": ["1", "2"]})
    assert prompt_columns([MESSAGES]) == ([MESSAGES], None)
    assert sorted(map(str, PromptSampler(records, seed=0).sample(2))) == sorted(map(str, records))
    with pytest.raises(ValueError, match=r"prompts\[0\]: \"prompt\" message 1 \(user\): \"content\" must be a str"):
        PromptSampler([[MESSAGES[0], {"role": "user", "content": None}]], seed=0)


def test_a_classifier_reward_scores_a_message_prompt_as_the_conversation(tmp_path):
    from tokenizers.processors import TemplateProcessing

    from pyppo.rewards import SequenceClassifierReward

    tok = tiny_tokenizer()
    # A tokenizer that adds BOS itself, and a template that writes it too: it must appear once.
    tok.backend_tokenizer.post_processor = TemplateProcessing(single="<s> $A", special_tokens=[("<s>", 1)])
    tok.chat_template = "{{ bos_token }}" + CHAT_TEMPLATE
    text = classifier_text(tok, MESSAGES, "Hello.")
    assert text == "<|im_start|>system\nBe brief.<|im_end|>\n<|im_start|>user\nSay hi.<|im_end|>\n" + (
        "<|im_start|>assistant\nHello.<|im_end|>\n"
    )
    assert tok(text)["input_ids"].count(1) == 1
    assert classifier_text(tok, "Say hi. ", "Hello.") == "Say hi. Hello."  # a string prompt, as before
    tok.chat_template = None
    assert classifier_text(tok, MESSAGES, "Hello.") == "Be brief.\n\nSay hi.\n\nHello."

    reward = SequenceClassifierReward(save_tiny_classifier(tmp_path / "rm"))
    rendered = classifier_text(reward.tokenizer, MESSAGES, "Hello.")
    assert reward([MESSAGES], ["Hello."]) == reward([rendered], [""])


def test_a_reward_error_shows_a_message_prompt_clipped():
    from pyppo.rewards import RewardError, score_responses

    long = [{"role": "user", "content": "x" * 200}]
    clipped = r"prompt 0: \"\[\{'role': 'user', 'content': 'x+\.\.\.\", response: 'r'"
    with pytest.raises(RewardError, match=clipped) as info:
        score_responses(lambda prompts, responses: [float("nan")], [long], ["r"], where="step 1")
    assert len(str(info.value)) < 300


def test_a_message_prompt_starts_an_episode():
    from pyppo.agents.render import ChatRenderer

    tok = tiny_tokenizer()
    renderer = ChatRenderer(tok, use_chat_template=True, tools=None)
    leading = renderer.messages(MESSAGES, " Go.")
    assert leading == [MESSAGES[0], {"role": "user", "content": "Say hi. Go."}] and MESSAGES[1]["content"] == "Say hi."
    assert (
        renderer.prompt_ids(leading)
        == encode_prompts(tok, [leading], use_chat_template=True, max_prompt_length=None, device="cpu")[0][0].tolist()
    )
    # The tools' text joins the prompt's own system message.
    with pytest.warns(UserWarning, match="ignores tools="):
        with_tools = ChatRenderer(
            tok, use_chat_template=True, tools=[{"type": "function"}], tools_system_prompt=lambda schemas: "TOOLS"
        )
    assert with_tools.messages(MESSAGES, None)[0] == {"role": "system", "content": "Be brief.\n\nTOOLS"}
    with pytest.raises(ValueError, match="no user message to add the environment's reset"):
        renderer.messages([{"role": "system", "content": "s"}], "text")
    with pytest.raises(ValueError, match="is a list of chat messages, but prompts are not rendered"):
        ChatRenderer(tok, use_chat_template=False, tools=None).messages(MESSAGES, None)


# ---------------------------------------------------------------------------------- veRL's layout


def _verl_parquet(path):
    """A tiny veRL data file, made the way veRL's examples/data_preprocess/gsm8k.py makes one: a
    datasets map from the raw rows to veRL's columns, then to_parquet."""
    import datasets

    raw = datasets.Dataset.from_dict(
        {"question": ["What is 2 + 3?", "What is 4 + 4?"], "answer": ["2 + 3 = 5\n#### 5", "4 + 4 = 8\n#### 8"]}
    )

    def to_verl(example, index):
        question, solution = example.pop("question"), example.pop("answer")
        return {
            "data_source": "openai/gsm8k",
            "prompt": [{"role": "user", "content": question + " Give the number after ####."}],
            "ability": "math",
            "reward_model": {"style": "rule", "ground_truth": solution.split("#### ")[1]},
            "extra_info": {"split": "train", "index": index, "answer": solution, "question": question},
        }

    raw.map(to_verl, with_indices=True).to_parquet(str(path))
    return path


def test_verl_layout_reaches_the_reward_by_name(tmp_path, tiny_dir, capsys):
    data = _verl_parquet(tmp_path / "train.parquet")
    records = load_prompt_records(data)
    assert set(records[0]) == {
        "prompt",
        "data_source",
        "ability",
        "reward_model",
        "extra_info",
        "ground_truth",
        "answer",
    }
    assert [r["ground_truth"] for r in records] == ["5", "8"] == [r["answer"] for r in records]
    # A record's own answer is never replaced.
    own = dict(records[0], answer="own")
    (tmp_path / "own.jsonl").write_text(json.dumps(own) + "\n")
    assert load_prompt_records(tmp_path / "own.jsonl")[0]["answer"] == "own"

    # A tiny run on it: the reward gets each field by name, and samples.jsonl logs the messages.
    seen = tmp_path / "seen.jsonl"
    (tmp_path / "verl_reward.py").write_text(
        "import json\n"
        "def score(prompts, responses, ground_truth, data_source, extra_info, answer):\n"
        f"    with open({str(seen)!r}, 'a') as f:\n"
        "        f.write(json.dumps([prompts, ground_truth, data_source, extra_info, answer]) + '\\n')\n"
        "    return [0.5] * len(responses)\n"
    )
    out = tmp_path / "run"
    argv = ["train", "--model", str(tiny_dir), "--prompts", str(data), "--output", str(out), *TINY_FLAGS]
    argv += ["--reward", f"{tmp_path / 'verl_reward.py'}:score"]
    assert cli.main(argv) == 0, capsys.readouterr().err
    prompts, truths, sources, extra, answers = json.loads(seen.read_text().splitlines()[0])
    by_truth = {r["ground_truth"]: r for r in records}
    assert sorted(truths) == ["5", "8"] and truths == answers and sources == ["openai/gsm8k"] * 2
    for prompt, truth, info in zip(prompts, truths, extra):
        assert prompt == by_truth[truth]["prompt"] and info == by_truth[truth]["extra_info"]
    samples = [json.loads(line) for line in (out / "samples.jsonl").read_text().splitlines()]
    assert sorted(s["prompt"][0]["content"] for s in samples) == sorted(r["prompt"][0]["content"] for r in records)


# ------------------------------------------------------------------------------ runs of each family


@pytest.mark.parametrize("kind", ["json", "csv", "saved"])
def test_a_tiny_run_on_each_format_then_resumed(kind, tmp_path, tiny_dir, capsys):
    import datasets
    import tomllib

    if kind == "json":
        source = tmp_path / "p.json"
        source.write_text(json.dumps(RECORDS))
    elif kind == "csv":
        source = tmp_path / "p.csv"
        source.write_text("prompt,answer\nSay hi.,1\nDescribe rain.,2\n")
    else:
        source = tmp_path / "saved"
        datasets.Dataset.from_list(RECORDS).save_to_disk(source)
    out = tmp_path / "run"
    argv = ["train", "--model", str(tiny_dir), "--reward", "math", "--prompts", str(source), "--output", str(out)]
    assert cli.main([*argv, *TINY_FLAGS]) == 0, capsys.readouterr().err
    assert tomllib.loads((out / "config.toml").read_text())["prompts"] == str(source.resolve())
    samples = [json.loads(line) for line in (out / "samples.jsonl").read_text().splitlines()]
    assert {s["prompt"] for s in samples} <= {"Say hi.", "Describe rain."}
    assert cli.main(["train", "--resume", str(out), "--steps", "2"]) == 0, capsys.readouterr().err
    assert len((out / "metrics.jsonl").read_text().splitlines()) == 2


def test_the_trainer_takes_a_dataset_of_message_prompts(tmp_path):
    import datasets

    from pyppo import PPOTrainer
    from support.tiny_models import tiny_causal_lm
    from support.trainer_fixture import small_config

    got = []

    def reward(prompts, responses, answer):
        got.append((prompts, answer))
        return [0.0] * len(responses)

    rows = {"prompt": [MESSAGES, [{"role": "user", "content": "Describe rain."}]], "answer": ["1", "2"]}
    train = datasets.Dataset.from_dict(rows)
    held_out = datasets.DatasetDict({"train": datasets.Dataset.from_dict(rows)})
    config = small_config(steps=1, ppo_epochs=1, batch_size=2, mini_batch_size=2, eval_every=1)
    trainer = PPOTrainer(config, tiny_causal_lm(0), None, None, tiny_tokenizer(), reward, train, eval_prompts=held_out)
    assert trainer.sampler.prompts == [{"prompt": p, "answer": a} for p, a in zip(rows["prompt"], rows["answer"])]
    trainer.train(tmp_path / "run", progress=False)
    assert all(isinstance(p, list) for prompts, _ in got for p in prompts)  # the messages as the record has them
    assert {a for _, answers in got for a in answers} == {"1", "2"}
    evaluated = [json.loads(line) for line in (tmp_path / "run" / "eval_samples.jsonl").read_text().splitlines()]
    assert [r["prompt"] for r in evaluated] == rows["prompt"]
    bad = datasets.Dataset.from_dict({"prompt": [MESSAGES, [{"role": "bot", "content": "x"}]]})
    with pytest.raises(ValueError, match=r"^eval_prompts\[1\]: \"prompt\" message 0: \"role\" must be one of"):
        PPOTrainer(config, tiny_causal_lm(0), None, None, tiny_tokenizer(), reward, train, eval_prompts=bad)


def test_a_trainer_without_a_chat_template_refuses_message_prompts_up_front():
    from support.trainer_fixture import make_trainer, small_config

    with pytest.raises(ValueError, match=r"^prompts\[0\] is a list of chat messages, but prompts are not rendered"):
        make_trainer(small_config(use_chat_template=False), prompts=[MESSAGES, "Say hi."])


# ----------------------------------------------------------------------------- before loading


def test_message_prompts_without_the_chat_template_are_refused_before_loading(tmp_path, capsys, no_loading):
    path = tmp_path / "chat.jsonl"
    path.write_text("".join(json.dumps({"prompt": MESSAGES}) + "\n" for _ in range(3)))
    argv = ["train", "--prompts", str(path), "--no-use-chat-template", "--output", str(tmp_path / "run")]
    assert cli.main(argv) == 2
    line = _error_line(capsys)
    assert line.startswith(f"pyppo: error: --prompts {str(path)!r}: prompt 0"), line
    assert "chat" in line and not (tmp_path / "run").exists()


def test_held_out_prompts_that_are_training_prompts_are_said_before_loading(tmp_path, tiny_dir):
    from pyppo.cli.build import check_sources

    train, held_out = tmp_path / "train.jsonl", tmp_path / "eval.jsonl"
    train.write_text("".join(json.dumps({"prompt": f"q{i}"}) + "\n" for i in range(4)))
    held_out.write_text("".join(json.dumps({"prompt": f"q{i}"}) + "\n" for i in (3, 4, 1)))
    with pytest.warns(UserWarning, match=r"--eval-prompts '.*eval\.jsonl': 2 of its 3 prompts are also in --prompts"):
        check_sources(str(tiny_dir), "sentiment", str(train), "cpu", str(held_out))


def test_the_reasoning_gym_reward_on_the_default_prompts_names_the_task_specs(capsys, no_loading, tmp_path):
    argv = ["train", "--reward", "reasoning-gym", "--output", str(tmp_path / "run")]
    assert cli.main(argv) == 2
    line = _error_line(capsys)
    assert "the default prompts (no --prompts)" in line and "--prompts 'reasoning-gym:TASK'" in line, line
