"""One module per op family, named as its ``pyppo/ops`` module: each builds the
:class:`~pyppo.bench.case.Case` rows of its ops (inputs, the pyppo call, the eager call of the
peers, the floor) and names its targets (``bt`` is the ``[B, T]`` case shape they share).
Which cases run at which sizes is :mod:`pyppo.bench.suites`."""
