"""Sampling is from softmax(logits / temperature) and nothing else, whatever the model's own
generation_config carries; prompts are encoded as the trainer expects."""

from __future__ import annotations

import pytest
import torch

from pyppo.config import PPOConfig
from pyppo.rollout.hf_generate import generate, generation_config
from pyppo.rollout.tokens import encode_prompts
from support.tiny_models import tiny_causal_lm, tiny_tokenizer

# Every filter a checkpoint's generation_config.json might carry, at values that change sampling.
FILTERS = dict(
    do_sample=True,
    temperature=0.3,
    top_k=3,
    top_p=0.5,
    min_p=0.2,
    typical_p=0.5,
    epsilon_cutoff=0.01,
    eta_cutoff=0.01,
    repetition_penalty=3.0,
    no_repeat_ngram_size=1,
    suppress_tokens=[10, 11],
    begin_suppress_tokens=[12],
    bad_words_ids=[[13]],
    min_new_tokens=4,
    renormalize_logits=True,
)


def _model_with_filters():
    from transformers import GenerationConfig

    model = tiny_causal_lm()
    model.generation_config = GenerationConfig(**FILTERS, eos_token_id=2, pad_token_id=2)
    return model


@pytest.mark.parametrize("temperature", [1.0, 0.7])
def test_sampling_distribution_ignores_the_models_generation_config(temperature):
    model, tok = _model_with_filters(), tiny_tokenizer()
    saved = model.generation_config
    cfg = PPOConfig(temperature=temperature, max_new_tokens=6)
    gen = generation_config(cfg, eos_token_id=2, pad_token_id=2)
    ids, mask = encode_prompts(
        tok, ["hello there", "a b"], use_chat_template=True, max_prompt_length=None, device="cpu"
    )
    torch.manual_seed(0)
    out = generate(model, ids, mask, gen, output_scores=True, output_logits=True, return_dict_in_generate=True)
    assert model.generation_config is saved  # restored afterwards
    # What the sampler drew from (scores, after every processor) is the raw logits / temperature.
    for raw, processed in zip(out.logits, out.scores):
        torch.testing.assert_close(
            torch.log_softmax(processed.double(), -1),
            torch.log_softmax(raw.double() / temperature, -1),
            rtol=0,
            atol=1e-6,
        )


def test_a_filter_would_have_shown():
    # The check above can fail: with the model's own config in charge, the scores are filtered.
    model, tok = _model_with_filters(), tiny_tokenizer()
    ids, mask = encode_prompts(tok, ["hello there"], use_chat_template=False, max_prompt_length=None, device="cpu")
    out = model.generate(
        input_ids=ids,
        attention_mask=mask.long(),
        max_new_tokens=6,
        output_scores=True,
        output_logits=True,
        return_dict_in_generate=True,
    )
    assert torch.isinf(out.scores[0]).any() and not torch.isinf(out.logits[0]).any()


def test_generation_config_pins_the_knobs():
    gen = generation_config(
        PPOConfig(temperature=0.9, top_k=4, top_p=0.8, max_new_tokens=7), eos_token_id=2, pad_token_id=5
    )
    assert (gen.temperature, gen.top_k, gen.top_p, gen.max_new_tokens) == (0.9, 4, 0.8, 7)
    assert (gen.eos_token_id, gen.pad_token_id, gen.do_sample, gen.num_beams) == (2, 5, True, 1)
    assert (gen.repetition_penalty, gen.no_repeat_ngram_size, gen.typical_p) == (1.0, 0, 1.0)


def test_encode_prompts_left_pads_and_cuts_from_the_left():
    tok = tiny_tokenizer()
    tok.padding_side = "left"
    ids, mask = encode_prompts(tok, ["abcdefgh", "xy"], use_chat_template=False, max_prompt_length=4, device="cpu")
    assert ids.shape == (2, 4) and mask.tolist() == [[True] * 4, [False, False, True, True]]
    assert tok.decode(ids[0]) == "efgh"  # the end of the prompt, next to the response, is kept
    with pytest.raises(ValueError, match="zero tokens"):
        encode_prompts(tok, [""], use_chat_template=False, max_prompt_length=None, device="cpu")


def _linears(model):
    return [m for m in model.modules() if isinstance(m, torch.nn.Linear)]


def test_packed_linear_weights_match_f_linear_and_are_removed_on_exit():
    from pyppo.rollout.hf_generate import packed_linear_weights

    model = tiny_causal_lm()
    x = torch.randn(3, 5, model.config.hidden_size)
    layers = _linears(model)
    before = [
        layer(x if layer.in_features == x.shape[-1] else torch.randn(3, 5, layer.in_features)) for layer in layers[:1]
    ]
    with torch.no_grad(), packed_linear_weights(model, 3) as n:
        assert n == len(layers) > 0
        for layer in layers:
            inp = torch.randn(3, 5, layer.in_features)
            torch.testing.assert_close(
                layer(inp), torch.nn.functional.linear(inp, layer.weight, layer.bias), rtol=1e-5, atol=1e-5
            )
            assert "forward" in layer.__dict__
    assert all("forward" not in layer.__dict__ for layer in layers)
    assert torch.equal(layers[0](x), before[0])  # the original forward is back


def test_packed_copies_are_freed_on_exit_without_the_garbage_collector():
    # A packed copy is as large as the weights; freed only by the cyclic collector it could stay
    # alive through the update that follows the rollout.
    import gc
    import weakref

    from pyppo.rollout.hf_generate import packed_linear_weights

    model = tiny_causal_lm()
    gc.collect()
    gc.disable()
    try:
        with torch.no_grad(), packed_linear_weights(model, 2) as n:
            refs = [weakref.ref(layer.__dict__["forward"]) for layer in _linears(model)]
        assert n == len(refs) > 0
        assert all(r() is None for r in refs)
    finally:
        gc.enable()


def test_packed_linear_weights_are_removed_when_sampling_raises():
    from pyppo.rollout.hf_generate import packed_linear_weights

    model = tiny_causal_lm()
    with pytest.raises(RuntimeError, match="boom"), torch.no_grad(), packed_linear_weights(model, 2):
        raise RuntimeError("boom")
    assert all("forward" not in layer.__dict__ for layer in _linears(model))


def test_packing_is_off_under_autocast_and_for_half_precision_weights():
    from pyppo.rollout.hf_generate import packed_linear_weights

    model = tiny_causal_lm()
    with torch.autocast("cpu", dtype=torch.bfloat16), packed_linear_weights(model, 2) as n:
        assert n == 0
    with packed_linear_weights(model.to(torch.bfloat16), 2) as n:
        assert n == 0


def test_sampling_with_packed_weights_draws_the_same_tokens(monkeypatch):
    # The packed GEMMs differ from MKL's only in float32 rounding: with one seed the draws agree.
    from contextlib import contextmanager

    import pyppo.rollout.hf_generate as rollout

    model, tok = tiny_causal_lm(), tiny_tokenizer()
    tok.padding_side = "left"
    gen = generation_config(PPOConfig(max_new_tokens=12), eos_token_id=2, pad_token_id=2)
    ids, mask = encode_prompts(
        tok, ["hello there", "a b", "the quick brown fox"], use_chat_template=True, max_prompt_length=None, device="cpu"
    )
    packed_layers = []
    real = rollout.packed_linear_weights

    @contextmanager
    def counting(m, b):
        with real(m, b) as n:
            packed_layers.append(n)
            yield n

    monkeypatch.setattr(rollout, "packed_linear_weights", counting)
    torch.manual_seed(0)
    packed = generate(model, ids, mask, gen)

    @contextmanager
    def unpacked(m, b):
        yield 0

    monkeypatch.setattr(rollout, "packed_linear_weights", unpacked)
    torch.manual_seed(0)
    plain = generate(model, ids, mask, gen)
    assert packed_layers == [len(_linears(model))]
    assert torch.equal(packed, plain)


@pytest.mark.parametrize("dtype, atol", [("float32", 1e-5), ("bfloat16", 0.02)])
def test_the_decode_paths_logprobs_of_its_samples_are_the_trainers(monkeypatch, dtype, atol):
    # What the sampler drew each token from (the KV-cached decode forwards, packed weights in
    # float32, the float64 inverse-transform draw) against the trainer's own forward of the
    # finished sequences (old_logprobs, whose first ratio is exactly 1 whatever was sampled).
    # bf16: the decode's logits are rounded to bf16 (an ulp is 2^-8 of them) where the trainer's
    # hidden-state path keeps the head's float32 accumulation, and the two forwards round their
    # bf16 activations in other orders.
    import pyppo.rollout.hf_generate as rollout
    from pyppo.trainer.rollout_forwards import rollout_forwards
    from pyppo.trainer.step_stats import PhaseTimer
    from support.trainer_fixture import make_trainer, small_config

    seen = {}
    real = rollout.generate

    def capturing(model, query_ids, query_mask, gen_config, **kwargs):
        out = real(model, query_ids, query_mask, gen_config, output_logits=True, return_dict_in_generate=True, **kwargs)
        seen["logits"] = torch.stack(out.logits, 1).float() / gen_config.temperature
        return out.sequences

    monkeypatch.setattr(rollout, "generate", capturing)
    tr = make_trainer(small_config(steps=1, dtype=dtype, temperature=0.7, max_new_tokens=10))
    batch = tr.rollout(["say something nice", "why", "the quick brown fox", "a"])
    rollout_forwards(tr.models, batch, torch.arange(len(batch)), 2, PhaseTimer())
    T = batch.response_length
    decode = torch.log_softmax(seen["logits"][:, :T], -1).gather(-1, batch.response_ids.unsqueeze(-1)).squeeze(-1)
    mask = batch.loss_mask
    assert int(mask.sum()) > 8
    err = (decode - batch.old_logprobs)[mask].abs().max()
    assert float(err) <= atol, float(err)
