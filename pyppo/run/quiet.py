"""What other libraries would print in the middle of the run's progress bar, held back while the
loop draws it.

* DeepSpeed's ``Setting accelerator to CPU. If you have GPU or other accelerator, we were unable
  to detect it.`` (a warning of its logger ``"DeepSpeed"``, printed once, when ``deepspeed`` is
  imported on a machine without CUDA). pyppo never uses DeepSpeed, but where it is installed (the
  OpenRLHF integration's peers bring it) ``transformers``' ``save_pretrained`` imports it: its
  ``unwrap_model`` calls ``accelerate``'s ``extract_model_from_parallel``, which imports
  ``deepspeed`` to recognise a ``DeepSpeedEngine``. The first ``policy/`` export of a run is
  therefore where it came out, inside the bar. DeepSpeed creates that logger (with its own handler)
  only when it is imported, so the record is dropped by a filter on the logger, which
  ``logging.getLogger`` keeps across DeepSpeed's own set-up; every other DeepSpeed message passes.
* ``transformers``' ``Writing model shards`` bar, drawn by every ``save_pretrained`` (each
  ``policy/`` export), which would stack under the run's bar; it is turned off for the loop and
  put back as it was.
"""

from __future__ import annotations

import contextlib
import logging
from typing import Iterator

__all__ = ["quiet_libraries"]

#: The start of DeepSpeed's accelerator warning (deepspeed/accelerator/real_accelerator.py).
DEEPSPEED_CPU_WARNING = "Setting accelerator to CPU"


class _DropMessage(logging.Filter):
    def __init__(self, start: str):
        super().__init__()
        self.start = start

    def filter(self, record: logging.LogRecord) -> bool:
        return not str(record.msg).startswith(self.start)


@contextlib.contextmanager
def quiet_libraries() -> Iterator[None]:
    """While in it: DeepSpeed's CPU-accelerator warning is dropped and ``transformers``' progress
    bars are off (both put back on exit, also after an error)."""
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
        yield
    finally:
        deepspeed_logger.removeFilter(drop)
        if bars_were_on:
            hf_logging.enable_progress_bar()
