"""The adapter protocol, and how the model a user passes becomes an adapter.

An adapter turns one user model (a Flax NNX factory, a Linen module, a Keras
3 model, a pair of plain functions) into the pieces the pure compiled core
needs. Owns the protocol and ``WrappedModel``; each kind of model lives in its
own module, and ``resolve.py`` picks one. Does not own training: ``step.py``.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any, Protocol

from estimax.spec import Mode

Params = Any  # a pytree of trained arrays
ModelState = Any  # a pytree of non-trained arrays carried from step to step (batch statistics, ...)


class Adapter(Protocol):
    """What the core asks of a model.

    ``params`` are differentiated and updated by the optimizer; ``model_state``
    is carried from one step to the next unchanged by the optimizer. Both are
    pytrees of arrays; nothing else crosses into compiled code.
    """

    def init(self) -> tuple[Params, ModelState]:
        """``(params, model_state)`` of a fresh model (traceable: runs inside ``jit``)."""

    def bind(self, params: Params, model_state: ModelState, mode: Mode, key) -> Any:
        """The callable handed to ``model_fn`` as ``model``, over these arrays (traceable).

        ``mode`` selects train or eval behaviour (dropout, batch statistics);
        ``key`` is the step's key, the only source of randomness; ``None`` in
        PREDICT, where nothing may be random (an exported program has no key).
        """

    def model_state(self, model: Any) -> ModelState:
        """The model state after ``model_fn`` called ``model`` (updated batch statistics)."""

    def live(self, params: Params, model_state: ModelState) -> Any:
        """The model in its own framework's form, in eval behaviour, for interactive use."""


@dataclasses.dataclass(frozen=True)
class WrappedModel:
    """A user model wrapped by ``ex.models.*``; ``build(hparams, seed)`` makes its adapter.

    Building is deferred to the Estimator, which knows the hyper-parameters
    and the seed.
    """

    kind: str
    build: Callable[[dict, int], Adapter]
