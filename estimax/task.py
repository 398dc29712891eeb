"""``estimax.task`` is now ``estimax.cli.task`` (the task-module contract belongs to the
command line). This alias keeps the old path working for one release, with a warning."""

import sys
import warnings

from estimax.cli import task as _task

warnings.warn(
    "estimax.task moved to estimax.cli.task; the old path goes in the next release.", DeprecationWarning, stacklevel=2
)
sys.modules[__name__] = _task
