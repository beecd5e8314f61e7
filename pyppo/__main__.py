"""``python -m pyppo``: the same as the ``pyppo`` command."""

import sys

from pyppo.cli.main import main

sys.exit(main())
