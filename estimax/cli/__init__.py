"""The command line: ``estimax train|evaluate|predict|export|serve|launch``.

``entry.py`` parses and checks the arguments and prints estimax's errors as
one line; ``flags.py`` is the table of run-setting flags; ``commands.py`` runs
a command on the Estimator; ``runs.py`` chooses its run directory and keeps
what a run remembers; ``predict_file.py`` reads ``predict --input FILE``;
``task.py`` is the task-module contract; ``launch.py`` starts and supervises a group of processes on this machine.
Importing this package imports no JAX (``estimax --help`` answers at once).
"""

from estimax.cli.entry import EXAMPLES, main

__all__ = ["EXAMPLES", "main"]
