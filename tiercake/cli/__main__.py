"""``python -m tiercake.cli``: what the ``tiercake`` script runs."""

import sys

from . import run

sys.exit(run())
