"""``python -m esper``: the same commands as the ``esper`` console script."""

from esper.cli import main

raise SystemExit(main())
