"""The pure compiled core: one training step, the device loop, eval and predict.

Every function here is a pure function of pytrees, traced once and compiled
with explicit shardings by ``loop.py``. The checks of what a model_fn returns
(``checks/spec.py``) run while tracing, so a wrong Spec fails before anything is compiled.
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import optax

from estimax import accumulation, precision
from estimax import metrics as metrics_lib
from estimax.checks import diagnose
from estimax.checks.spec import check_spec
from estimax.fine_tuning import averaging
from estimax.spec import EVAL, PREDICT, TRAIN, Mode, Spec
from estimax.state import TrainState

Batch = tuple[Any, Any]  # (features, labels); labels may be None in PREDICT


@dataclasses.dataclass(frozen=True)
class StepOptions:
    """How a training step computes beyond the model and its optimizer (``Core(options=...)``).

    Attributes:
      grad_accum_steps: micro-batches per optimizer step (``accumulation.py``).
      measure_every_step: run ``grad_checks`` on every step of a device loop, not only
        on its last one and on non-finite losses (exact skipped-update counts).
      last_step_apart: run a loop's last step after its scan instead of a conditional in
        every step (``train_loop``); for GPUs, where a conditional waits for its predicate.
      average: the rule of a moving average of the parameters kept in the state, or None.
    """

    grad_accum_steps: int = 1
    measure_every_step: bool = False
    last_step_apart: bool = False
    average: averaging.Averaging | None = None


class Core:
    """The pure functions of one model: what runs on the device per step.

    Args:
      adapter: the model adapter (``models.Adapter``).
      model_fn: ``model_fn(model, features, labels, mode, params) -> Spec``.
      optimizer: an optax ``GradientTransformation``.
      hparams: the user's params; ``batch_size`` is set per mode by the caller.
      seed: the base key of initialisation and per-step randomness.
      compute_dtype: the dtype the model runs in (mixed precision), or None.
      options: accumulation, gradient checks, the loop's last step, the parameter average
        (``StepOptions``).
    """

    def __init__(
        self,
        adapter,
        model_fn: Callable,
        optimizer: optax.GradientTransformation,
        hparams: dict,
        seed: int,
        compute_dtype: str | None = None,
        options: StepOptions = StepOptions(),
    ):
        self.adapter = adapter
        self.model_fn = model_fn
        self.optimizer = optimizer
        self.hparams = hparams
        self.seed = seed
        self.compute_dtype = None if compute_dtype is None else jnp.dtype(compute_dtype)
        self.grad_accum_steps = options.grad_accum_steps
        self.measure_every_step = options.measure_every_step
        self.last_step_apart = options.last_step_apart and not options.measure_every_step
        self.average = options.average

    # -- state ---------------------------------------------------------------
    def init_state(self) -> TrainState:
        params, model_state = self.adapter.init()
        state = TrainState(
            step=jnp.zeros((), jnp.int32),
            params=params,
            opt_state=self.optimizer.init(params),
            model_state=model_state,
            rng=jax.random.key_data(jax.random.key(self.seed)),
            average=None if self.average is None else params,
        )
        return averaging.restarted(state)

    def _key(self, state: TrainState) -> jax.Array:
        return jax.random.fold_in(jax.random.wrap_key_data(state.rng), state.step)

    def call(self, params, state: TrainState, batch: Batch, mode: Mode, batch_size: int):
        """``(Spec, bound model)`` of the model_fn on ``batch`` with ``params`` and the per-step key of ``state``."""
        return self._apply(params, state.model_state, batch, mode, batch_size, self._key(state))

    def _apply(self, params, model_state, batch: Batch, mode: Mode, batch_size, key):
        """model_fn on these arrays; ``key=None``: no randomness (PREDICT)."""
        features, labels = batch
        if self.compute_dtype is not None:
            params, features = precision.cast_floating((params, features), self.compute_dtype)
        module = self.adapter.bind(params, model_state, mode, key)
        hparams = {**self.hparams, "batch_size": batch_size}
        try:
            spec = self.model_fn(module, features, labels, mode, hparams)
        except Exception as error:  # traced before compiling: said in terms of the input

            def without_labels():
                return self.model_fn(
                    self.adapter.bind(params, model_state, PREDICT, None), features, None, PREDICT, hparams
                )

            explained = diagnose.model_fn_error(error, features, labels, mode, without_labels)
            if explained is None:
                raise
            raise explained from error
        spec = check_spec(spec, mode, batch_size)
        if self.compute_dtype is not None:  # outputs leave in float32, whatever the compute dtype
            spec = Spec(*precision.cast_floating(tuple(spec), jnp.float32))
        return spec, module

    # -- training ------------------------------------------------------------
    def train_step(self, state: TrainState, batch: Batch, measure: bool | jax.Array = True) -> tuple[TrainState, dict]:
        """One optimizer step on the global batch; returns the per-step outputs.

        ``measure``: whether this step reads every gradient for ``grad_checks``: ``True``,
        ``False``, or a device flag (then also when the loss is not finite, under a conditional);
        the device loop measures its last step only.
        """
        batch_size = _batch_size(batch)

        def loss_fn(params):
            spec, module = self.call(params, state, batch, TRAIN, batch_size)
            # The carry of the device loop keeps its dtypes, whatever the compute dtype.
            return jnp.mean(spec.loss), (spec, precision.like(self.adapter.model_state(module), state.model_state))

        loss_labels = None
        if self.grad_accum_steps == 1:
            (loss, (spec, model_state)), grads = jax.value_and_grad(loss_fn, has_aux=True)(state.params)
            # Which labels a non-finite loss came from: named if training stops on it.
            loss_labels = functools.partial(metrics_lib.loss_labels, spec.loss, batch[1])
        else:
            loss, spec, model_state, grads = self._accumulated_grads(state, batch)
        updates, opt_state = self.optimizer.update(grads, state.opt_state, state.params)
        params = optax.apply_updates(state.params, updates)
        if self.measure_every_step:
            measure = True
        elif not isinstance(measure, bool):  # a device flag: a non-finite loss measures its step too
            measure = measure | ~jnp.isfinite(loss)
        outputs = {"loss": loss, **grad_checks(grads, measure, loss_labels)}
        learning_rate = _learning_rate(opt_state)  # the rate this update used
        if learning_rate is not None:
            outputs["learning_rate"] = jnp.asarray(learning_rate, jnp.float32)
        outputs.update(metrics_lib.train_outputs(spec.metrics, batch_size))  # metric inputs: per-step states
        average = None if self.average is None else self.average.update(state.average, params, state.step + 1)
        return TrainState(state.step + 1, params, opt_state, model_state, state.rng, average), outputs

    def _accumulated_grads(self, state: TrainState, batch: Batch):
        """What ``train_step`` needs of the batch (its loss, a Spec of its metric means, the next
        model state, the gradient), summed over ``grad_accum_steps`` strided micro-batches.

        Micro-batch ``i`` draws its randomness from ``fold_in(step key, i)`` and starts
        from the model state the previous one left (batch statistics update once per
        micro-batch).
        """
        micro_batch_size = _batch_size(batch) // self.grad_accum_steps

        def loss_fn(params, model_state, micro_batch, index):
            key = jax.random.fold_in(self._key(state), index)
            spec, module = self._apply(params, model_state, micro_batch, TRAIN, micro_batch_size, key)
            return spec.loss, (spec.metrics or {}, precision.like(self.adapter.model_state(module), model_state))

        loss, metrics, model_state, grads = accumulation.accumulate(
            loss_fn, state.params, state.model_state, batch, self.grad_accum_steps
        )
        return loss, Spec(loss=loss, metrics=metrics), model_state, grads

    def train_loop(self, state: TrainState, stack: Batch) -> tuple[TrainState, dict]:
        """``steps_per_loop`` steps as one ``lax.scan`` over a stack of batches.

        Each step measures its gradients under a conditional, true on the last step and on a
        non-finite loss. XLA:GPU copies a conditional's predicate to the host and waits for it,
        every step (~10% of a 0.3 ms step), so with ``last_step_apart`` the scan runs all steps
        but the last with no conditional and no checks, then runs the last one, measured. A
        non-finite loss in the scan freezes the state from its step on, and the step after the
        scan is that one again, measured, its outputs in its row: the same as with the
        conditional up to that step (training stops there), at the cost of a second copy
        of the step in the compiled program.
        """
        num_steps = jax.tree.leaves(stack)[0].shape[0]
        if not self.last_step_apart:
            last = jnp.arange(num_steps) == num_steps - 1
            return jax.lax.scan(lambda s, xs: self.train_step(s, *xs), state, (stack, last))
        if num_steps == 1:
            state, row = self.train_step(state, jax.tree.map(lambda x: x[0], stack), measure=True)
            return state, jax.tree.map(lambda x: x[None], row)

        def unmeasured(carry, batch):
            state, finite = carry
            new, outputs = self.train_step(state, batch, measure=False)
            finite = finite & jnp.isfinite(outputs["loss"])
            kept = jax.tree.map(lambda a, b: jnp.where(finite, a, b), new, state)  # frozen from a NaN on
            return (kept, finite), outputs

        head = jax.tree.map(lambda x: x[:-1], stack)
        (state, finite), rows = jax.lax.scan(unmeasured, (state, jnp.bool_(True)), head)
        # The last step, or the first non-finite one again from the state before it.
        index = jnp.where(finite, num_steps - 1, jnp.argmin(jnp.isfinite(rows["loss"])))
        batch = jax.tree.map(lambda x: jax.lax.dynamic_index_in_dim(x, index, keepdims=False), stack)
        state, row = self.train_step(state, batch, measure=True)
        return state, jax.tree.map(lambda rows, x: jnp.concatenate([rows, x[None]]).at[index].set(x), rows, row)

    # -- evaluation and prediction -------------------------------------------
    def eval_values(self, state: TrainState, batch: Batch) -> tuple[dict, dict]:
        """The loss and metrics of one batch (per-example values, scalars or metric inputs) by
        name, and the per-example ``eval_outputs``."""
        spec, _ = self.call(state.params, state, batch, EVAL, _batch_size(batch))
        values = {"loss": spec.loss} if spec.loss is not None else {}
        values.update(spec.metrics or {})
        return values, dict(spec.eval_outputs or {})

    def eval_states(self, state: TrainState, batch: Batch, mask: jax.Array) -> tuple[dict, dict]:
        """The metric states of one padded batch (and ``num_examples``), and its ``eval_outputs``.

        Sums over the sharded global batch: XLA merges every device and host.
        """
        values, outputs = self.eval_values(state, batch)
        return eval_states_of(values, mask), outputs

    def eval_step(self, state: TrainState, totals: dict, batch: Batch, mask: jax.Array) -> tuple[dict, dict]:
        """Merges the states of one padded batch into ``totals``; also returns its ``eval_outputs``."""
        states, outputs = self.eval_states(state, batch, mask)
        return {k: totals[k].merge(states[k]) for k in totals}, outputs

    def predict_step(self, state: TrainState, batch: Batch):
        return self.predictions(state.params, state.model_state, batch)

    def predictions(self, params, model_state, batch: Batch):
        """PREDICT-mode outputs: what ``predict()`` runs and what ``export()`` serializes.

        No key: prediction is deterministic, and an exported program carries no randomness.
        """
        spec, _ = self._apply(params, model_state, batch, PREDICT, _batch_size(batch), None)
        return spec.predictions


def grad_checks(grads, measure: bool | jax.Array, loss_labels: Callable | None = None) -> dict[str, jax.Array]:
    """The global gradient norm and a finite flag per parameter, where ``measure`` holds; and with
    ``loss_labels`` (``metrics.loss_labels`` of the step's loss and labels, not yet called) which
    labels a non-finite per-example loss came from.

    One pass over every gradient costs a host-bound model a fifth of its step on
    XLA:CPU, so with a device flag it runs under ``lax.cond`` (free when skipped), and
    ``measure=False`` leaves it out of the program (``train_loop``): an unmeasured step
    reports ``grad_norm`` NaN (not measured; the logs average measured steps only),
    every flag True and no label (the labels cost ~0.5% of a CPU step each time they are
    read). A NaN/Inf is reported with the parameters and labels it hit because a
    non-finite loss always measures its step.
    """
    leaves = jax.tree.leaves(grads)
    labels_of = loss_labels or (lambda: None)
    # What an unmeasured step reports instead: zeros of the labels' shape (None: no labels of that form).
    no_labels = jax.tree.map(lambda s: jnp.zeros(s.shape, s.dtype), jax.eval_shape(labels_of))

    def measured(leaves):
        squares = jnp.stack([jnp.sum(jnp.square(g.astype(jnp.float32))) for g in leaves])
        return jnp.sqrt(jnp.sum(squares)), jnp.isfinite(squares), labels_of()

    def skipped(leaves):
        return jnp.float32(jnp.nan), jnp.ones(len(leaves), bool), no_labels

    if isinstance(measure, bool):
        norm, finite, labels = (measured if measure else skipped)(leaves)
    else:
        norm, finite, labels = jax.lax.cond(measure, measured, skipped, leaves)
    checks = {"grad_norm": norm, "finite_grads": finite}
    if labels is not None:
        checks[metrics_lib.LOSS_LABELS] = labels
    return checks


def eval_states_of(values: dict, mask: jax.Array) -> dict:
    """The states of one batch's ``eval_values``, and ``num_examples`` (the count of valid rows)."""
    states = metrics_lib.batch_states(values, mask)
    states[metrics_lib.NUM_EXAMPLES] = metrics_lib.SumState.from_batch(mask, mask=mask)
    return states


def _learning_rate(opt_state):
    """The learning rate of this step, where the optimizer exposes it (``optax.inject_hyperparams``)."""
    for node in jax.tree.leaves(opt_state, is_leaf=lambda x: hasattr(x, "hyperparams")):
        if "learning_rate" in getattr(node, "hyperparams", {}):
            return node.hyperparams["learning_rate"]
    return None


def _batch_size(batch: Batch) -> int:
    return jax.tree.leaves(batch[0])[0].shape[0]
