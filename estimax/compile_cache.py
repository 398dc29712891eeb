"""JAX's persistent compilation cache: a second process does not compile again.

Owns where compiled programs are kept between processes (a user cache
directory, never a model_dir, which several users or jobs may share) and the
JAX settings that make every program cacheable, the small ones included. Does
not own what is compiled or when (``loop.py``).

The setting is process-wide (JAX has one cache per process): the first
directory enabled in a process is the one used.
"""

from __future__ import annotations

import logging
import os

import jax

logger = logging.getLogger("estimax")

# ``estimax`` commands read this: a directory, or "off" to compile everything afresh.
ENV = "ESTIMAX_COMPILATION_CACHE"


def default_directory() -> str | None:
    """``$ESTIMAX_COMPILATION_CACHE``, else ``$XDG_CACHE_HOME/estimax/jax`` (``~/.cache/estimax/jax``);
    ``None`` when the variable says ``off``."""
    chosen = os.environ.get(ENV)
    if chosen is not None:
        return None if chosen.strip().lower() in ("", "0", "off", "false", "no") else os.path.expanduser(chosen)
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return os.path.join(base, "estimax", "jax")


def enable(directory: str | os.PathLike | None) -> str | None:
    """Keeps compiled programs in ``directory`` for later processes; ``None`` does nothing.

    Returns the directory in use. Programs are cached whatever their compile
    time or size: the device loop of a small model compiles in well under JAX's
    default threshold of one second, and a restart pays it again otherwise.
    """
    if directory is None:
        return None
    directory = os.path.abspath(os.path.expandvars(os.path.expanduser(os.fspath(directory))))
    current = jax.config.jax_compilation_cache_dir
    if current is not None and os.path.abspath(current) != directory:
        logger.warning("The compilation cache is already %s in this process; %s is not used.", current, directory)
        return current
    os.makedirs(directory, exist_ok=True)
    jax.config.update("jax_compilation_cache_dir", directory)
    # JAX decides once per process whether a cache is in use, at the first compilation:
    # a program compiled before this call must not have decided "none" for good.
    from jax.experimental.compilation_cache import compilation_cache

    compilation_cache.reset_cache()
    jax.config.update("jax_persistent_cache_min_compile_time_secs", 0.0)
    jax.config.update("jax_persistent_cache_min_entry_size_bytes", -1)  # -1: no size threshold at all
    return directory
