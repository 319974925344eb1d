"""``python -m esper.cli``: the ``esper`` command."""

import sys

from esper.cli import main

sys.exit(main())
