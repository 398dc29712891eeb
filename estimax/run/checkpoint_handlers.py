"""Orbax's handlers of a checkpoint's items: the state written replica-parallel only where that pays.

Orbax writes a replicated array replica-parallel by default: each device that
holds a replica writes a slice of it, through a slicing program compiled for
each array shape and device at a process's first save (24 programs for the
tests' small MLP on 8 CPU devices; a quarter of all the programs the test
suite compiled, and a compile each on an accelerator too). A slice repays its
program only when it is large: here an array is written replica-parallel when
each replica's slice has at least ``MIN_SLICE_BYTES``, otherwise whole by its
first replica, as Orbax does on GPUs. The arrays written are the same either
way, and either restores. Owns the handlers (``registry``); when and what is
saved is ``checkpoint.py``'s.
"""

from __future__ import annotations

import copy
import logging

import jax
import orbax.checkpoint as ocp

logger = logging.getLogger("estimax")

MIN_SLICE_BYTES = 4 * 2**20  # writing 4 MiB takes milliseconds; a slicing program takes tens to compile
_MIN_SLICE_OPTION = "_min_slice_bytes_for_replica_parallel"  # ArrayHandler's, set at construction only


def registry() -> ocp.handlers.DefaultCheckpointHandlerRegistry:
    """The handlers of a checkpoint's items: its ``state`` saved (``ocp.args.PyTreeSave``) as Orbax's standard
    handler saves, with the array handler above, and restored by that handler (``StandardRestore``); its
    ``meta`` as JSON. Each item and kind of arguments is named: Orbax finds an unnamed one only once."""
    handlers = ocp.handlers.DefaultCheckpointHandlerRegistry()
    writer = ocp.PyTreeCheckpointHandler(save_concurrent_gb=96, type_handler_registry=_types())  # the standard's
    handlers.add("state", ocp.args.PyTreeSave, writer)
    handlers.add("state", ocp.args.StandardRestore, ocp.StandardCheckpointHandler())
    meta = ocp.JsonCheckpointHandler()
    handlers.add("meta", ocp.args.JsonSave, meta)
    handlers.add("meta", ocp.args.JsonRestore, meta)
    return handlers


def _types():
    """Orbax's type handlers, with a copy of its array handler that slices only large replicas."""
    arrays = copy.copy(ocp.type_handlers.get_type_handler(jax.Array))  # its options and its metadata store
    if hasattr(arrays, _MIN_SLICE_OPTION):
        setattr(arrays, _MIN_SLICE_OPTION, MIN_SLICE_BYTES)
    else:  # another Orbax: its defaults (tests/test_checkpoint.py counts the programs a save compiles)
        logger.debug("Orbax's ArrayHandler has no %s: arrays are written as Orbax writes them", _MIN_SLICE_OPTION)
    kinds = ocp.type_handlers.supported_types()
    return ocp.type_handlers.create_type_handler_registry(
        *[(kind, arrays if kind is jax.Array else ocp.type_handlers.get_type_handler(kind)) for kind in kinds]
    )
