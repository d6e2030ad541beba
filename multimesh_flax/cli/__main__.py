"""``python -m multimesh_flax.cli``: the ``mmflax`` command line."""

import sys

from multimesh_flax.cli import main

sys.exit(main())
