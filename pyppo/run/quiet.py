"""What other libraries would print into a run's output, or send from it, held back.

* DeepSpeed's ``Setting accelerator to CPU. If you have GPU or other accelerator, we were unable
  to detect it.`` (a warning of its logger ``"DeepSpeed"``, printed on stdout when ``deepspeed``
  is imported on a machine without CUDA), and the ``DeprecationWarning`` of ``torch.jit`` that its
  import raises. pyppo never uses DeepSpeed, but where it is installed (the OpenRLHF
  integration's peers bring it) every ``save_pretrained`` of ``transformers`` imported it, for
  nothing: its ``unwrap_model`` calls ``accelerate``'s ``extract_model_from_parallel``, which
  imports ``deepspeed`` whenever it is installed, to recognise a ``DeepSpeedEngine`` (seconds of
  import at the first ``policy/`` export). No object can be a ``DeepSpeedEngine`` while
  ``deepspeed`` is not imported, so inside :func:`quiet_libraries` ``accelerate`` is told it is
  available only once something has imported it: the import, its warning and its cost are gone at
  their cause. Where something else imports DeepSpeed inside, its accelerator warning is dropped by
  a filter on its logger (which ``logging.getLogger`` keeps across DeepSpeed's own set-up); every
  other DeepSpeed message passes.
* ``transformers``' progress bars (``Loading weights``, ``Writing model shards``, drawn by every
  ``from_pretrained`` and ``save_pretrained``), which would stack under the run's own bar: turned
  off inside and put back as they were.
* The Hugging Face Hub's telemetry (a report of the library versions with each Hub request,
  which ``transformers`` sends with its downloads): :func:`no_telemetry`. pyppo itself never
  contacts the Hub (every ``from_pretrained`` it makes is ``local_files_only``); a reward that
  does sends no telemetry either. vLLM's usage statistics are switched off where vLLM is imported
  (:func:`pyppo.rollout.vllm_engine.usage_stats_off`).

A user who turned a library's telemetry on (``HF_HUB_DISABLE_TELEMETRY=0``) keeps it.
"""

from __future__ import annotations

import contextlib
import logging
import os
import sys
from typing import Callable, Iterator, Optional

__all__ = ["DEEPSPEED_CPU_WARNING", "HUB_TELEMETRY_SWITCHES", "no_telemetry", "quiet_libraries"]

#: The start of DeepSpeed's accelerator warning (deepspeed/accelerator/real_accelerator.py).
DEEPSPEED_CPU_WARNING = "Setting accelerator to CPU"

#: The environment variables that switch the Hugging Face Hub's telemetry off
#: (``huggingface_hub.constants``): a user who set any of them has chosen, and
#: :func:`no_telemetry` leaves them as they are.
HUB_TELEMETRY_SWITCHES = ("HF_HUB_DISABLE_TELEMETRY", "DISABLE_TELEMETRY", "DO_NOT_TRACK")


class _DropMessage(logging.Filter):
    def __init__(self, start: str):
        super().__init__()
        self.start = start

    def filter(self, record: logging.LogRecord) -> bool:
        return not str(record.msg).startswith(self.start)


def no_telemetry() -> None:
    """Switch the Hugging Face Hub's telemetry off for this process (``HF_HUB_DISABLE_TELEMETRY=1``,
    and ``huggingface_hub``'s constant where it is imported already: it reads the variable once),
    unless one of :data:`HUB_TELEMETRY_SWITCHES` is set."""
    if any(name in os.environ for name in HUB_TELEMETRY_SWITCHES):
        return
    os.environ["HF_HUB_DISABLE_TELEMETRY"] = "1"
    constants = sys.modules.get("huggingface_hub.constants")
    if constants is not None:
        constants.HF_HUB_DISABLE_TELEMETRY = True


@contextlib.contextmanager
def _deepspeed_only_if_imported() -> Iterator[None]:
    """While in it, ``accelerate``'s ``extract_model_from_parallel`` imports ``deepspeed`` only
    when it is imported already (see the module docstring)."""
    try:
        from accelerate.utils import other
    except ImportError:  # no accelerate: transformers unwraps by itself and never imports deepspeed
        yield
        return
    available: Optional[Callable[[], bool]] = getattr(other, "is_deepspeed_available", None)
    if available is None:  # another accelerate, which does not ask
        yield
        return
    other.is_deepspeed_available = lambda: "deepspeed" in sys.modules and available()
    try:
        yield
    finally:
        other.is_deepspeed_available = available


@contextlib.contextmanager
def quiet_libraries() -> Iterator[None]:
    """While in it: no DeepSpeed import by ``save_pretrained`` and no accelerator warning of
    DeepSpeed's, no ``transformers`` progress bar (each put back on exit, also after an error);
    and, for the rest of the process, no Hub telemetry (:func:`no_telemetry`)."""
    no_telemetry()
    deepspeed_logger = logging.getLogger("DeepSpeed")
    drop = _DropMessage(DEEPSPEED_CPU_WARNING)
    deepspeed_logger.addFilter(drop)
    try:
        from transformers.utils import logging as hf_logging
    except ImportError:  # pragma: no cover - a trainer without transformers
        hf_logging = None
    bars_were_on = hf_logging is not None and hf_logging.is_progress_bar_enabled()
    if bars_were_on:
        hf_logging.disable_progress_bar()
    try:
        with _deepspeed_only_if_imported():
            yield
    finally:
        deepspeed_logger.removeFilter(drop)
        if bars_were_on:
            hf_logging.enable_progress_bar()
