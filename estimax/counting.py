"""What counts of steps and examples imply, each rule stated once.

Owns the nearest valid batch sizes a fix suggests, whether a loop crossed a
multiple of N steps (when logging, evaluating and saving are due: a loop
advances the step by ``steps_per_loop``, so multiples are rarely hit
exactly), and whether a progress bar shows. Imports nothing heavy.
"""

from __future__ import annotations

import sys


def nearest_multiples(size: int, multiple: int) -> str:
    """The positive multiples of ``multiple`` on either side of ``size``, as a fix names them: ``"96 or 128"``."""
    lower = size // multiple * multiple
    return " or ".join(str(b) for b in (lower, lower + multiple) if b > 0)


def crossed(every: int | None, step_before: int, step_after: int) -> bool:
    """Whether the steps ``step_before`` -> ``step_after`` crossed a multiple of ``every`` (``None``: never)."""
    return bool(every) and step_after // every > step_before // every


def in_notebook() -> bool:
    """Whether this runs in a Jupyter kernel (Jupyter, VS Code, Colab): its stderr is not a terminal,
    but a bar redrawn in place shows there."""
    ipython = sys.modules.get("IPython")
    shell = ipython.get_ipython() if ipython is not None and hasattr(ipython, "get_ipython") else None
    return shell is not None and hasattr(shell, "kernel")


def interactive() -> bool:
    """A person watches this console: a terminal or a notebook."""
    return sys.stderr.isatty() or in_notebook()


def progress_bar_shows(quiet: bool) -> bool:
    """A bar shows on a terminal or in a notebook, on process 0, unless ``quiet``; elsewhere plain lines."""
    import jax

    return not quiet and jax.process_index() == 0 and interactive()
