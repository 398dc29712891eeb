"""An exponential moving average of the parameters: its rule, its update, and which weights a verb uses.

Owns the average's formula (a decay with a warm-up), its update inside the
compiled step, its value in a fresh or warm-started state, fitting a checkpoint
saved with or without an average to a run that keeps one or not, and choosing
the raw or the averaged parameters for evaluation, prediction and export. Does
not own where the average lives (``layout.py`` gives it its parameters'
shardings), nor saving it (``checkpoint.py`` saves the TrainState whole), nor
the settings (``RunConfig.ema_decay``, ``ema_warmup``, ``eval_weights``).

The rule, for the update that brings the state to step ``n`` (1 for the first)::

    average_n = d_n * average_{n-1} + (1 - d_n) * params_n,   average_0 = params_0

    ema_warmup="ramp":   d_n = min(decay, (1 + n) / (10 + n))     (TF's ExponentialMovingAverage(num_updates))
    ema_warmup="debias": d_n = 1 - (1 - decay) / (1 - decay**n)   (optax.ema(debias=True): params_0 weighs 0)
    ema_warmup="none":   d_n = decay
"""

from __future__ import annotations

import dataclasses
import logging

import jax
import jax.numpy as jnp
import optax

from estimax import precision

logger = logging.getLogger("estimax")
AVERAGE = "average"  # the TrainState field, and the first part of its leaves' names in a checkpoint


@dataclasses.dataclass(frozen=True)
class Averaging:
    """The average's rule: ``decay`` in (0, 1) and a ``warmup`` of ``config.EMA_WARMUPS``."""

    decay: float
    warmup: str = "ramp"

    def rate(self, n: jax.Array) -> jax.Array:
        """``1 - d_n``: the weight of the parameters of step ``n`` (see the module's docstring)."""
        n, decay = jnp.asarray(n, jnp.float32), jnp.float32(self.decay)
        if self.warmup == "ramp":  # 1 - min(d, (1+n)/(10+n)), written so that nothing cancels
            return jnp.maximum(1 - decay, 9.0 / (10.0 + n))
        if self.warmup == "debias":  # exactly 1 at n = 1: the first average is the parameters
            return (1 - decay) / (1 - jnp.power(decay, n))
        return 1 - decay

    def update(self, average, params, step: jax.Array):
        """The average after the update that brought ``params`` to ``step``, in the average's dtypes.

        ``optax.incremental_update`` is the lerp ``rate * new + (1 - rate) * old``; optax's own
        ``ema`` averages updates, not parameters, and would keep a biased copy and a count.
        """
        return precision.like(optax.incremental_update(params, average, self.rate(step)), average)


def of(config) -> Averaging | None:
    """The rule a ``RunConfig`` asks for; ``None``: no average is kept."""
    return None if config.ema_decay is None else Averaging(config.ema_decay, config.ema_warmup)


def evaluates_average(config) -> bool:
    """Whether evaluation, the best checkpoint's choice, prediction and export use the average."""
    return config.ema_decay is not None and config.eval_weights != "raw"


def chosen(state, average: bool):
    """``state`` whose ``params`` are its average where ``average`` (and it keeps one), else ``state``."""
    return state._replace(params=state.average) if average and state.average is not None else state


def restarted(state, keeps: bool | None = None):
    """``state`` with its average equal to its parameters (a fresh or warm-started state) where it
    ``keeps`` one (default: where it holds one); copies, so that donating the state donates distinct
    buffers."""
    keeps = state.average is not None if keeps is None else keeps
    return state._replace(average=jax.tree.map(jnp.copy, state.params)) if keeps else state


def restore_target(abstract_state, saved_names) -> object:
    """The restore target of a checkpoint whose arrays are ``saved_names`` (``None``: unknown): with an
    average where the checkpoint holds one (shaped and sharded like the parameters), else without."""
    if saved_names is None:
        return abstract_state
    saved = any(name.split("/", 1)[0] == AVERAGE for name in saved_names)
    if saved and abstract_state.average is None:
        return abstract_state._replace(average=abstract_state.params)
    if not saved and abstract_state.average is not None:
        return abstract_state._replace(average=None)
    return abstract_state


def as_wanted(state, abstract_state, where: str):
    """A restored ``state`` with an average where the run keeps one: a checkpoint saved without one
    starts it from its parameters, and one saved with one loses it; either is said once."""
    if abstract_state.average is not None and state.average is None:
        logger.warning(
            "%s holds no parameter average (saved by a run without ema_decay): the average starts from its "
            "parameters now.",
            where,
        )
        return restarted(state, keeps=True)
    if abstract_state.average is None and state.average is not None:
        logger.info("%s holds a parameter average; this run keeps none (ema_decay=None): it is not used.", where)
        return state._replace(average=None)
    return state
