"""Keeps the libraries' routine chatter off the console, never estimax's own messages.

Orbax logs warnings through absl for things that are expected here (a
read-only view of a checkpoint directory, metadata that a damaged checkpoint
lacks: estimax says what matters itself), and its background event loop can
report "Event loop is closed" from a destructor at exit. Errors of Orbax and
everything of other libraries still pass.
"""

from __future__ import annotations

import logging
import sys

_installed = False


class _OrbaxChatter(logging.Filter):
    def filter(self, record: logging.LogRecord) -> bool:
        return record.levelno >= logging.ERROR or "orbax" not in record.pathname


def _unraisable(previous):
    def hook(unraisable) -> None:
        value = unraisable.exc_value
        if isinstance(value, RuntimeError) and str(value) == "Event loop is closed":
            return  # a callback of Orbax's finished event loop, after the work completed
        previous(unraisable)

    return hook


def quiet_libraries() -> None:
    """Installs the filters once per process."""
    global _installed
    if _installed:
        return
    _installed = True
    logging.getLogger("absl").addFilter(_OrbaxChatter())
    sys.unraisablehook = _unraisable(sys.unraisablehook)
