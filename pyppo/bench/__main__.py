"""``python -m pyppo.bench``: the same as ``pyppo bench`` (usable where the ``pyppo`` script is not
on PATH, as in benchmarks/gpu_check.sh)."""

import sys

from pyppo.cli import main

sys.exit(main(["bench", *sys.argv[1:]]))
