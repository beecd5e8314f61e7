"""What ``pyppo bench`` (:mod:`pyppo.cli.bench`, the command) times pyppo's ops with: the cases of
each op (:mod:`.cases`), the suites that group them by size (:mod:`.suites`), the eager code
users write today (:mod:`.eager`), the interleaved timing (:mod:`.timing`, :mod:`.harness`), the
peak-memory measures (:mod:`.memory`), the peer libraries' own functions (:mod:`.peers`,
:mod:`.peer_cases`) and the JSON, table and PNG outputs (:mod:`.output`, :mod:`.table`,
:mod:`.plot`).
"""

from __future__ import annotations

from .memory import quiet_stderr

__all__ = ["quiet_stderr"]
