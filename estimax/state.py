"""TrainState: the one pytree that a training step maps to its successor.

Everything the continuation of a run depends on lives here, so that saving
it is saving the run.
"""

from __future__ import annotations

from typing import Any, NamedTuple


class TrainState(NamedTuple):
    """Attributes:
    step: int32 scalar, the number of training steps taken.
    params: trained parameters (an ``nnx.State`` of ``nnx.Param``).
    opt_state: the optimizer's state.
    model_state: non-trained model variables (batch statistics, ...).
    rng: raw key data of the run's base key; step ``s`` uses ``fold_in(rng, s)``.
    """

    step: Any
    params: Any
    opt_state: Any
    model_state: Any
    rng: Any
