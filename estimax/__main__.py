"""``python -m estimax``: the ``estimax`` command, for an environment whose scripts are not on PATH.

Owns nothing but the entry point: the arguments, exit codes and messages are
``estimax.cli``'s.
"""

import sys

from estimax.cli import main

if __name__ == "__main__":
    sys.exit(main())
