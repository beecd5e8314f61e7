"""A local ``transformers`` sequence-classification model as a reward (``--reward DIR``):
:class:`SequenceClassifierReward`, which :func:`pyppo.rewards.load_reward` builds for a directory."""

from __future__ import annotations

import json
import os
from pathlib import Path

import torch

from .data.messages import classifier_text
from .precision import autocast

__all__ = ["SequenceClassifierReward"]


class SequenceClassifierReward:
    """A local ``transformers`` sequence-classification model used as a reward.

    Each pair is scored as the text ``prompt + response`` (truncated from the left so the response
    is kept); a chat-message prompt as the conversation with the response as the assistant's turn
    (:func:`pyppo.data.messages.classifier_text`). The score is the single logit of a one-label
    reward model, else the logit of the positive class: ``label`` if given, else the label whose
    name starts with "pos" in ``config.id2label``, else class 1 of a two-class model.

    Args:
        path: directory with ``config.json``, weights and tokenizer files.
        label: name or index of the class to score (multi-class models only).
        device: where the classifier runs.
        batch_size: pairs scored per forward pass.
        max_length: token limit; default the tokenizer's limit, capped at 2048.

    Raises:
        FileNotFoundError: ``path`` is not a directory with a ``config.json``.
        ValueError: the positive class cannot be determined, or ``label`` is unknown; the
            directory holds a causal LM, or a checkpoint without weights the classifier needs
            (its score head): they would be initialised at random.
    """

    def __init__(
        self,
        path: str | os.PathLike,
        *,
        label: str | int | None = None,
        device: str | torch.device = "cpu",
        batch_size: int = 16,
        max_length: int | None = None,
    ):
        from transformers import AutoModelForSequenceClassification, AutoTokenizer

        path = Path(path).expanduser()
        if not (path / "config.json").is_file():
            raise FileNotFoundError(f"reward model {str(path)!r}: not a directory with a config.json")
        # A causal LM loads as a classifier with a freshly initialised score head: random scores.
        architectures = json.loads((path / "config.json").read_text()).get("architectures") or []
        if architectures and not any(a.endswith("ForSequenceClassification") for a in architectures):
            raise ValueError(
                f"reward model {str(path)!r} is not a sequence-classification model "
                f"(architectures: {', '.join(architectures)}); its score head would be random"
            )
        self.name = str(path)
        self.tokenizer = AutoTokenizer.from_pretrained(path, local_files_only=True)
        self.model, info = AutoModelForSequenceClassification.from_pretrained(
            path, local_files_only=True, output_loading_info=True
        )
        if info.get("missing_keys"):
            # A checkpoint without a classifier head (a causal LM whose config names no
            # architecture, say) would get a freshly initialised one: random scores.
            missing = sorted(info["missing_keys"])
            raise ValueError(
                f"reward model {str(path)!r}: its checkpoint has no weights for "
                f"{', '.join(missing[:4])}{' ...' if len(missing) > 4 else ''}; "
                "they would be initialised at random, and so would the scores"
            )
        self.model.to(device).eval().requires_grad_(False)
        self.device = torch.device(device)
        self.dtype = torch.float32
        self.batch_size = batch_size
        self.tokenizer.truncation_side = "left"
        if self.tokenizer.pad_token is None:
            # Some reward models (GPT-2 based) have no pad token; EOS is only padding here, and the
            # attention mask hides it.
            self.tokenizer.pad_token = self.tokenizer.eos_token or self.tokenizer.unk_token
        if self.tokenizer.pad_token is not None and self.model.config.pad_token_id is None:
            # Decoder classifiers pool the last non-pad token and need pad_token_id for that.
            self.model.config.pad_token_id = self.tokenizer.pad_token_id
        limit = self.tokenizer.model_max_length
        self.max_length = max_length or (limit if isinstance(limit, int) and limit <= 2048 else 2048)
        self.index = self._score_index(label)

    def _score_index(self, label) -> int:
        num_labels = self.model.config.num_labels
        id2label = {int(k): str(v) for k, v in (self.model.config.id2label or {}).items()}
        if label is not None:
            if isinstance(label, int) and 0 <= label < num_labels:
                return label
            for i, name in id2label.items():
                if name == str(label):
                    return i
            raise ValueError(f"reward model {self.name!r}: unknown label {label!r}; labels are {id2label}")
        if num_labels == 1:
            return 0
        positive = [i for i, name in id2label.items() if name.lower().startswith("pos")]
        if len(positive) == 1:
            return positive[0]
        if num_labels == 2:
            return 1
        raise ValueError(
            f"reward model {self.name!r} has {num_labels} classes {id2label} and none is named "
            "positive; use SequenceClassifierReward(path, label=...) to choose the class to score"
        )

    def compute_in(self, dtype: torch.dtype) -> int:
        """Score under ``torch.autocast(dtype)`` from now on, as every forward of a run with that
        compute dtype does, with the classifier's linear weights held in ``dtype``
        (:func:`pyppo.models.hold_linear_weights`: the operands autocast would cast them to, at
        half the bytes). The trainer calls it with the run's dtype; float32 changes nothing.

        Returns:
            the bytes no longer held.

        Raises:
            ValueError: ``dtype`` is float32 after the classifier was set to another dtype (its
                float32 weights are gone), or not float32, bfloat16 or float16.
        """
        from .models.frozen import hold_linear_weights

        if dtype == self.dtype:
            return 0
        if self.dtype != torch.float32:
            raise ValueError(
                f"reward model {self.name!r} already computes in {self.dtype} (its float32 weights are not "
                f"kept); load it again to score in {dtype}"
            )
        saved = hold_linear_weights(self.model, dtype)
        self.dtype = dtype
        return saved

    @torch.no_grad()
    def __call__(self, prompts: list[str], responses: list[str]) -> list[float]:
        texts = [classifier_text(self.tokenizer, p, r) for p, r in zip(prompts, responses)]
        scores: list[float] = []
        for start in range(0, len(texts), self.batch_size):
            enc = self.tokenizer(
                texts[start : start + self.batch_size],
                return_tensors="pt",
                padding=True,
                truncation=True,
                max_length=self.max_length,
            ).to(self.device)
            with autocast(self.device, self.dtype):
                logits = self.model(**enc).logits
            scores.extend(logits[:, self.index].float().cpu().tolist())
        return scores
