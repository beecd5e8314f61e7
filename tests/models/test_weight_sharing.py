"""A classifier reward model built on the reference's checkpoint shares its frozen weights with the
reference: one copy in memory, the same scores, and nothing shared that differs or trains."""

from __future__ import annotations

import copy

import pytest
import torch

from pyppo import PPOTrainer
from pyppo.config import PPOConfig
from pyppo.models import share_frozen_weights
from pyppo.rewards import load_reward
from support.tiny_models import save_tiny_causal_lm, tiny_causal_lm, tiny_llama_config, tiny_tokenizer


def classifier_on(causal):
    from transformers import LlamaForSequenceClassification

    torch.manual_seed(1)
    clf = LlamaForSequenceClassification(tiny_llama_config(num_labels=1))
    clf.model.load_state_dict(causal.model.state_dict())
    return clf


def frozen(model):
    return model.requires_grad_(False).eval()


def backbone_bytes(model):
    return sum(p.numel() * p.element_size() for p in model.model.parameters())


def test_equal_frozen_parameters_are_shared_and_outputs_do_not_change():
    ref = frozen(tiny_causal_lm(seed=0))
    clf = frozen(classifier_on(ref))
    with torch.no_grad():
        clf.model.layers[1].mlp.up_proj.weight.add_(1e-3)  # differs: stays its own
    ids = torch.randint(3, 100, (3, 9))
    before = clf(input_ids=ids).logits
    saved = share_frozen_weights(ref, clf)
    up = clf.model.layers[1].mlp.up_proj.weight
    assert saved == backbone_bytes(clf) - up.numel() * up.element_size()
    assert clf.model.embed_tokens.weight.data_ptr() == ref.model.embed_tokens.weight.data_ptr()
    assert (
        clf.model.layers[0].self_attn.q_proj.weight.data_ptr() == ref.model.layers[0].self_attn.q_proj.weight.data_ptr()
    )
    assert up.data_ptr() != ref.model.layers[1].mlp.up_proj.weight.data_ptr()
    assert clf.score.weight.data_ptr() not in {p.data_ptr() for p in ref.parameters()}
    assert torch.equal(clf(input_ids=ids).logits, before)
    assert share_frozen_weights(ref, clf) == 0  # already shared


def test_trainable_or_differently_typed_parameters_are_not_shared():
    ref = frozen(tiny_causal_lm(seed=0))
    trainable = classifier_on(ref)  # requires_grad left on
    assert share_frozen_weights(ref, trainable) == 0
    assert share_frozen_weights(frozen(classifier_on(ref)), ref.requires_grad_(True)) == 0
    half = frozen(classifier_on(ref)).to(torch.bfloat16)
    assert share_frozen_weights(frozen(ref), half) == 0
    # Another checkpoint: only what happens to be equal (the norms' initial ones) is shared.
    other = frozen(classifier_on(tiny_causal_lm(seed=5)))
    kept = dict(ref.named_parameters())
    equal = [p for n, p in other.named_parameters() if n in kept and torch.equal(p, kept[n])]
    assert equal and all(p.ndim == 1 for p in equal)
    assert share_frozen_weights(ref, other) == sum(p.numel() * p.element_size() for p in equal)


def _classifier_reward_on_a_saved_base(tmp_path):
    """(the base causal LM's directory, ``load_reward`` of a one-label classifier saved from it)."""
    from transformers import LlamaForSequenceClassification

    base = save_tiny_causal_lm(tmp_path / "base")
    torch.manual_seed(2)
    LlamaForSequenceClassification.from_pretrained(base, num_labels=1).save_pretrained(tmp_path / "rm")
    tiny_tokenizer().save_pretrained(tmp_path / "rm")
    return base, load_reward(str(tmp_path / "rm"))


def test_trainer_shares_the_reward_models_backbone_with_the_reference_and_it_stays_frozen(tmp_path):
    base, reward = _classifier_reward_on_a_saved_base(tmp_path)
    classifier = reward.__wrapped__.model
    initial = {k: v.clone() for k, v in classifier.state_dict().items()}
    prompts = ["hello there", "a b c", "tell me", "what now"]
    scores_before = reward(prompts, ["nice", "bad", "ok", "fine"])

    policy = tiny_causal_lm(seed=0)
    policy.load_state_dict(type(policy).from_pretrained(base).state_dict())
    config = PPOConfig(
        steps=1, batch_size=4, mini_batch_size=4, ppo_epochs=1, max_new_tokens=6, lr=1e-2, seed=0, dtype="float32"
    )
    trainer = PPOTrainer(config, policy, None, None, tiny_tokenizer(), reward, prompts)
    assert trainer.shared_weight_bytes == backbone_bytes(classifier)
    assert classifier.model.norm.weight.data_ptr() == trainer.models.reference.model.norm.weight.data_ptr()
    trainer.step()
    # The policy trained; the reference, and with it the reward model, did not move.
    assert not torch.equal(
        trainer.policy.model.layers[0].mlp.up_proj.weight, trainer.models.reference.model.layers[0].mlp.up_proj.weight
    )
    assert all(torch.equal(v, initial[k]) for k, v in classifier.state_dict().items())
    assert reward(prompts, ["nice", "bad", "ok", "fine"]) == scores_before


def test_a_function_reward_shares_nothing():
    config = PPOConfig(steps=1, batch_size=2, mini_batch_size=2, max_new_tokens=4, seed=0)
    trainer = PPOTrainer(
        config, tiny_causal_lm(), None, None, tiny_tokenizer(), lambda p, r: [0.0] * len(r), ["a", "b"]
    )
    assert trainer.shared_weight_bytes == 0


def test_in_a_bf16_run_the_reward_model_scores_under_its_autocast_and_shares_the_bf16_weights(tmp_path):
    base, reward = _classifier_reward_on_a_saved_base(tmp_path)
    clf = reward.__wrapped__
    prompts, responses = ["hello there", "a b c", "tell me", "what now"], ["nice", "bad", "ok", "fine"]
    float32_scores = reward(prompts, responses)
    alone = copy.deepcopy(clf)
    alone.dtype = torch.bfloat16  # float32 weights that autocast casts: what autocast alone computes
    autocast_scores = alone(prompts, responses)
    assert autocast_scores != float32_scores
    fp32_bytes = sum(p.numel() * p.element_size() for p in clf.model.parameters())

    policy = tiny_causal_lm(seed=0)
    policy.load_state_dict(type(policy).from_pretrained(base).state_dict())
    config = PPOConfig(
        steps=1, batch_size=4, mini_batch_size=4, ppo_epochs=1, max_new_tokens=6, seed=0, dtype="bfloat16"
    )
    trainer = PPOTrainer(config, policy, None, None, tiny_tokenizer(), reward, prompts)
    assert clf.dtype == torch.bfloat16
    assert reward(prompts, responses) == autocast_scores
    ref = trainer.models.reference
    q = "model.layers.0.self_attn.q_proj.weight"
    assert dict(clf.model.named_parameters())[q].dtype == torch.bfloat16
    assert dict(clf.model.named_parameters())[q].data_ptr() == dict(ref.named_parameters())[q].data_ptr()
    assert clf.model.model.embed_tokens.weight.data_ptr() == ref.model.embed_tokens.weight.data_ptr()
    # Held in bf16, then the backbone shared: only the score head is the classifier's own.
    assert trainer.shared_weight_bytes == fp32_bytes - 2 * clf.model.score.weight.numel()
    with pytest.raises(ValueError, match="already computes in torch.bfloat16"):
        clf.compute_in(torch.float32)
