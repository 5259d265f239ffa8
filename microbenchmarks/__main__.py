"""``python -m microbenchmarks``: the same CLI as ``beam-shared-prefix-bench``."""

import sys

from .cli import main

sys.exit(main())
