"""A pytest plugin that runs a peer's own test files with pyppo in place of the peer's functions.

Loaded as ``-p support.peer_suite_plugin`` by the child pytest of
tests/integrations/test_peer_suites.py, with ``tests/`` on ``PYTHONPATH``:

* ``PYPPO_PEER_SUITE=verl``: ``pyppo.integrations.verl.patch()`` runs before collection, so the
  peer's test modules, which import veRL's functions by name, import pyppo's adapters.
* ``PYPPO_PEER_SUITE=openrlhf``: OpenRLHF's tests load private copies of its modules (by file path,
  under package names of their own), which ``patch()`` never reaches. After collection, the
  names a test module bound from such a copy (``compute_approx_kl``, ...) are pointed at pyppo's
  adapters instead.

Every test's call runs under a recorder of the pyppo operators it dispatches (forward and
backward); at the end ``PYPPO_PEER_SUITE_REPORT`` receives ``{nodeid: {"outcome": "passed" |
"failed" | "skipped", "ops": ["pyppo::kl_penalty", ...]}}`` as JSON.
"""

from __future__ import annotations

import json
import os

import pytest

from support.peer_support import pyppo_ops_called

_SUITE = os.environ.get("PYPPO_PEER_SUITE", "")
_REPORT = os.environ.get("PYPPO_PEER_SUITE_REPORT")
# OpenRLHF's functions that pyppo.integrations.openrlhf replaces.
_OPENRLHF_NAMES = ("compute_approx_kl", "compute_reward", "log_probs_from_logits", "compute_entropy", "masked_mean")
_results: dict[str, dict] = {}


def pytest_configure(config):
    if _SUITE == "verl":
        import pyppo.integrations.verl as pv

        pv.patch()
    elif _SUITE == "openrlhf":
        from pyppo.integrations.openrlhf import install_flash_attn_stub

        install_flash_attn_stub()
    else:
        raise pytest.UsageError(f"PYPPO_PEER_SUITE must be verl or openrlhf, got {_SUITE!r}")


def pytest_collection_modifyitems(items):
    if _SUITE != "openrlhf":
        return
    import pyppo.integrations.openrlhf as po

    for item in items:
        module = getattr(item, "module", None)
        for name in _OPENRLHF_NAMES:
            if module is not None and callable(getattr(module, name, None)):
                setattr(module, name, getattr(po, name))


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_call(item):
    with pyppo_ops_called() as ops:
        yield
    _results.setdefault(item.nodeid, {})["ops"] = sorted(set(ops))


def pytest_runtest_logreport(report):
    entry = _results.setdefault(report.nodeid, {"ops": []})
    if report.when == "call" or report.outcome != "passed":
        entry["outcome"] = report.outcome


def pytest_sessionfinish(session):
    if _REPORT:
        with open(_REPORT, "w") as f:
            json.dump(_results, f, indent=1, sort_keys=True)
