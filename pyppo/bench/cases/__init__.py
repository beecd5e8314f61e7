"""One benchmark per op: each module builds that op's :class:`~pyppo.bench.case.Case` rows
(inputs, the pyppo call, the eager call of the peers, the floor) and names its targets.
Which cases run at which sizes is :mod:`pyppo.bench.suites`."""
