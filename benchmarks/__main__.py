"""``python -m benchmarks [--quick] [--out DIR] [--sections B0,B1,...]``: the whole suite.

See ``benchmarks/__init__.py`` for what each section measures.
"""

import sys

from benchmarks import main

if __name__ == "__main__":
    sys.exit(main())
