"""``python -m parlay``: the ``parlay`` command (:func:`parlay.cli.main`)."""
import sys

from parlay.cli import main

sys.exit(main())
