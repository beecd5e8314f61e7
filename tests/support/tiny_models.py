"""Tiny random models and a character tokenizer for fast tests (no downloads).

The tokenizer maps printable ASCII one character per token, so any generated id decodes to text and
vocab stays under the tiny model's 128 entries. EOS = pad = "<|im_end|>" (id 2), as in SmolLM2, so
the tests exercise the pad == EOS case the trainer must handle.
"""

from __future__ import annotations

from pathlib import Path

import torch

TINY_CONFIG = dict(
    vocab_size=128,
    hidden_size=32,
    intermediate_size=64,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
)

SPECIALS = ["<unk>", "<s>", "<|im_end|>", "<|im_start|>"]
# A minimal ChatML template, so code that formats prompts with apply_chat_template works.
CHAT_TEMPLATE = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)


def tiny_llama_config(**overrides):
    from transformers import LlamaConfig

    cfg = dict(TINY_CONFIG, bos_token_id=1, eos_token_id=2, pad_token_id=2)
    cfg.update(overrides)
    return LlamaConfig(**cfg)


def tiny_causal_lm(seed: int = 0):
    from transformers import LlamaForCausalLM

    torch.manual_seed(seed)
    return LlamaForCausalLM(tiny_llama_config()).eval()


def tiny_tokenizer():
    """Character-level fast tokenizer: ids 0-3 special, then printable ASCII (vocab 99 <= 128)."""
    from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {tok: i for i, tok in enumerate(SPECIALS)}
    for c in map(chr, range(32, 127)):
        vocab[c] = len(vocab)
    backend = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    backend.pre_tokenizer = pre_tokenizers.Split(Regex("."), behavior="isolated")
    backend.decoder = decoders.Fuse()
    tok = PreTrainedTokenizerFast(
        tokenizer_object=backend,
        unk_token="<unk>",
        bos_token="<s>",
        eos_token="<|im_end|>",
        pad_token="<|im_end|>",
        additional_special_tokens=["<|im_start|>"],
    )
    tok.chat_template = CHAT_TEMPLATE
    return tok


def save_tiny_causal_lm(path: Path, seed: int = 0) -> Path:
    """Save a tiny random Llama causal LM and its tokenizer as an HF directory at ``path``."""
    path = Path(path)
    tiny_causal_lm(seed).save_pretrained(path)
    tiny_tokenizer().save_pretrained(path)
    return path


def save_tiny_classifier(path: Path, num_labels: int = 1, id2label=None, seed: int = 0) -> Path:
    """Save a tiny random Llama sequence classifier (a reward model) and its tokenizer."""
    from transformers import LlamaForSequenceClassification

    torch.manual_seed(seed)
    kwargs = dict(num_labels=num_labels)
    if id2label is not None:
        kwargs["id2label"] = id2label
        kwargs["label2id"] = {v: k for k, v in id2label.items()}
    LlamaForSequenceClassification(tiny_llama_config(**kwargs)).save_pretrained(path)
    tiny_tokenizer().save_pretrained(path)
    return Path(path)


# ---------------------------------------------------------------------------------------------
# other architectures, for the trainer's head check and its wiring tests

#: Tiny random configs of several causal-LM families, with the head transform (if any) made large
#: enough to show on a probe of small logits. ``uses_hidden``: whether the trainer may compute
#: log-probs from the hidden states (the head is a plain linear map of them).
ARCHITECTURES = {
    "llama": (dict(), True),
    "qwen2": (dict(), True),
    "gpt2": (dict(n_embd=32, n_layer=2, n_head=4, n_positions=128, bos_token_id=1, eos_token_id=2), True),
    "gemma2": (dict(head_dim=8, final_logit_softcapping=0.5), False),
    "granite": (dict(logits_scaling=4.0), False),
    "cohere": (dict(logit_scale=0.25, bos_token_id=1, eos_token_id=2), False),
}


def tiny_arch(name: str, seed: int = 0, **overrides):
    """A tiny random causal LM of the family ``name`` (a key of :data:`ARCHITECTURES`)."""
    from transformers import AutoConfig, AutoModelForCausalLM

    extra, _ = ARCHITECTURES[name]
    cfg = AutoConfig.for_model(name, **TINY_CONFIG, **{"pad_token_id": 2, **extra, **overrides})
    torch.manual_seed(seed)
    return AutoModelForCausalLM.from_config(cfg).eval()


def tiny_dropout_lm(p: float = 0.3, seed: int = 0):
    """A tiny GPT-2 with ``nn.Dropout`` of probability ``p`` on embeddings, attention and MLP."""
    return tiny_arch("gpt2", seed=seed, resid_pdrop=p, embd_pdrop=p, attn_pdrop=p)


class BatchMixingEmbedding(torch.nn.Module):
    """An embedding whose output depends slightly on the other rows of the batch (their mean), so
    a model built on it is not batch-invariant: a row's log-probs change with its batch-mates."""

    def __init__(self, embedding: torch.nn.Embedding, eps: float = 1e-2):
        super().__init__()
        self.embedding = embedding
        self.eps = eps

    def forward(self, ids):
        x = self.embedding(ids)
        return x + self.eps * x.mean(dim=0, keepdim=True)


def tiny_batch_mixing_lm(seed: int = 0):
    model = tiny_causal_lm(seed)
    model.model.embed_tokens = BatchMixingEmbedding(model.model.embed_tokens)
    return model
