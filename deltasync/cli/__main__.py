"""``python -m deltasync.cli``: the ``deltasync`` command."""

import sys

from . import main

sys.exit(main())
