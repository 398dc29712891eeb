"""``python -m estimax.cli``: the ``estimax`` command (as ``python -m estimax``)."""

import sys

from estimax.cli.entry import main

if __name__ == "__main__":
    sys.exit(main())
