"""Benchmark cases and eager-PyTorch references for ``pyppo bench``.

* :mod:`benchmarks.eager`: one module per op, the eager PyTorch a user writes today (mirroring
  TRL, OpenRLHF and veRL), used as the baseline the compiled ops are measured against.
* :mod:`benchmarks.cases`: the benchmark cases (shapes, dtypes, floors, targets of issue 3).

This package lives at ``benchmarks/`` in the source tree; a wheel may ship it as
``pyppo._benchmarks``. :mod:`pyppo.bench` finds it either way.
"""
