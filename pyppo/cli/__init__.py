"""The ``pyppo`` command line (``pyppo ...`` or ``python -m pyppo ...``): :mod:`.main` (the parser
and the entry point), one module per command (:mod:`.train`, :mod:`.info`, :mod:`.profile`,
:mod:`.export`, :mod:`.bench`), ``pyppo train --nproc``'s launcher (:mod:`.nproc`; the parser
resolves a run's settings, then hands them to it or to :mod:`.train`), the shared flags
(:mod:`.flags`) and how a run's trainer is built from its sources (:mod:`.build`)."""

from .main import build_parser, main
from .train import TRAIN_DEFAULTS, resolve_train_config, write_resolved_config

__all__ = ["TRAIN_DEFAULTS", "build_parser", "main", "resolve_train_config", "write_resolved_config"]
