"""``python -m deltasync.demo``: the same as ``deltasync demo``."""

import sys

from .runner import main

sys.exit(main())
