"""``python -m tracking.reports --sweep-id ID ...``: the same as the ``grkv-report`` command."""

import sys

from tracking.cli import main

sys.exit(main())
