"""``python -m pyppo.config > table``: prints the key table of ``docs/trainer.md``
(:func:`~.docs_table.config_markdown`)."""

import sys

from .docs_table import config_markdown

sys.stdout.write(config_markdown())
