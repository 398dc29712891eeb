"""RunConfig, CheckpointPolicy and Best: where a run writes, how big its
batches are, how it loops, when it saves, and which evaluation is the best.

Validated, immutable dataclasses. They own settings and the checks of each
setting on its own (names, ranges, the form of mesh axes and sharding rules);
nothing here touches devices or files, and nothing imports JAX: a check that
needs the devices (a batch that splits over them) is ``data/plan.py``'s, made
when a call starts.
"""

from __future__ import annotations

import contextlib
import dataclasses
import numbers
import operator
import os
import re
import sys
import warnings
from collections.abc import Mapping, Sequence

from estimax import counting, eval_sets
from estimax.errors import ConfigError, ConfigTypeError
from estimax.fine_tuning import LoRA, check_freeze
from estimax.records.tracker_kinds import resolve as resolve_trackers

LOOP_KINDS = ("auto", "scan", "step")
"""The device loops ``RunConfig(loop=...)`` and ``--loop`` take."""
COMPUTE_DTYPES = ("bfloat16", "float16", "float32")
"""The dtypes ``RunConfig(compute_dtype=...)`` may run the model in (``precision.py``)."""
DEFAULT_FSDP_MIN_BYTES = 1 << 12  # 4 KiB: smaller leaves (LayerNorm scales, small biases) stay whole on every device
DIRECTIONS = ("max", "min")
EMA_WARMUPS = ("ramp", "debias", "none")
"""The warm-ups of the parameter average ``RunConfig(ema_warmup=...)`` takes (``averaging.py``)."""
EVAL_WEIGHTS = ("average", "raw")
"""The weights ``RunConfig(eval_weights=...)`` may choose for evaluation, prediction and export."""
# Metric names whose better direction goes without saying (as in Keras' "auto" mode, stricter).
_LOWER_IS_BETTER = ("loss", "error", "mse", "mae", "perplexity")
_HIGHER_IS_BETTER = ("acc", "auc", "precision", "recall", "f1", "r2")
_UNSET = object()


def _integer(owner: str, name: str, value) -> int:
    """``value`` as a plain ``int`` (numpy's integers too); a ``ConfigTypeError`` for another type."""
    if not isinstance(value, bool):
        with contextlib.suppress(TypeError):
            return operator.index(value)
    raise ConfigTypeError(
        f"{owner}({name}={value!r}) is of type {type(value).__name__}; expected an integer. Fix: pass {name}=<int>."
    )


def _check_positive(owner: str, name: str, value) -> int:
    """``value`` as a plain ``int``: a ``ConfigTypeError`` for another type, a ``ConfigError`` below 1."""
    value = _integer(owner, name, value)
    if value < 1:
        raise ConfigError(f"{owner}({name}={value!r}) must be a positive integer; expected 1 or more.")
    return value


def _check_number(owner: str, name: str, value, minimum: float = 0.0) -> float:
    """``value`` as a ``float`` above ``minimum`` (numpy's numbers too)."""
    if isinstance(value, bool) or not isinstance(value, numbers.Real):
        raise ConfigTypeError(f"{owner}({name}={value!r}) is of type {type(value).__name__}; expected a number.")
    if not value > minimum or value != value:  # NaN compares false
        raise ConfigError(f"{owner}({name}={value!r}) must be a number above {minimum:g}.")
    return float(value)


def _check_flag(owner: str, name: str, value) -> bool:
    """``value`` as a ``bool`` (numpy's too); ``"yes"`` or ``1`` are not read as one."""
    if type(value).__name__ not in ("bool", "bool_"):
        raise ConfigTypeError(f"{owner}({name}={value!r}) is of type {type(value).__name__}; expected True or False.")
    return bool(value)


def _set(config, name: str, value) -> None:
    object.__setattr__(config, name, value)  # the checked form of a frozen dataclass's field


@dataclasses.dataclass(frozen=True)
class CheckpointPolicy:
    """When training saves checkpoints and which ones are kept.

    Saves happen at loop boundaries: when a multiple of ``every_steps`` was
    crossed, when ``every_seconds`` have passed since the last save, at the end
    of training and on preemption (SIGTERM/SIGINT).

    Attributes:
      every_steps: save when a multiple is crossed; ``None``: not by steps.
      every_seconds: save when this long has passed since the last save.
      keep: how many of the most recent checkpoints are kept.
      keep_every_hours: also keep one checkpoint per this many hours, forever.
      async_save: write in the background; training waits only while the
        state is copied off the devices.
      at_end: save when a ``train`` call ends, and return once that save is
        committed. ``False``: a call ends without it (a preemption still
        saves), for many short calls in one process, each of which would
        pay the save (0.05-0.2 s for a small state): what it trained since
        the last save lives only in memory until the next save.
      max_overhead: the largest fraction of training time saves due by
        ``every_steps`` may take: such a save is put off (with one log line)
        while the last save, from its start to its commit, took more than this
        fraction of the time since it started (``save_schedule.py``). ``None``:
        every multiple is saved. ``RunConfig``'s default policy has ``0.02``.
    """

    every_steps: int | None = 1000
    every_seconds: float | None = None
    keep: int = 3
    keep_every_hours: float | None = None
    async_save: bool = True
    max_overhead: float | None = None
    at_end: bool = True

    def __post_init__(self):
        _set(self, "keep", _check_positive("CheckpointPolicy", "keep", self.keep))
        if self.every_steps is not None:
            _set(self, "every_steps", _check_positive("CheckpointPolicy", "every_steps", self.every_steps))
        for name in ("every_seconds", "keep_every_hours"):
            if getattr(self, name) is not None:
                _set(self, name, _check_number("CheckpointPolicy", name, getattr(self, name)))
        for name in ("async_save", "at_end"):
            _set(self, name, _check_flag("CheckpointPolicy", name, getattr(self, name)))
        if self.max_overhead is not None and not (
            _check_number("CheckpointPolicy", "max_overhead", self.max_overhead) < 1
        ):
            raise ConfigError(
                f"CheckpointPolicy(max_overhead={self.max_overhead!r}) is not a fraction of the training time; "
                "expected a number between 0 and 1, e.g. 0.02, or None. Fix: max_overhead=0.02 (saves take at most "
                "2% of the time), or None (every multiple of every_steps is saved)."
            )


DEFAULT_CHECKPOINT_POLICY = CheckpointPolicy(max_overhead=0.02)
"""``RunConfig``'s policy when none is given: a save every 1,000 steps, put off while saves would
take more than 2% of the time (a model that runs 1,000 steps in a fraction of a second)."""


@dataclasses.dataclass(frozen=True)
class Best:
    """Which evaluation of ``train_and_evaluate`` is the best, whether its checkpoint is
    kept, and when training gives up on improving.

    Attributes:
      metric: the evaluation metric that decides: ``"loss"`` or a name of
        ``Spec(metrics=...)``.
      direction: ``"max"`` or ``"min"``: whether a higher or a lower value is
        better. ``None``: ``"min"`` for names with loss, error, mse, mae or
        perplexity in them, ``"max"`` for acc(uracy), auc, precision, recall, f1
        or r2; any other name must say.
      keep_checkpoint: keep the best state in ``<model_dir>/best`` (one checkpoint).
      patience: stop training when the metric has not improved for this many
        evaluations; ``None``: never stop early.
      min_delta: a change smaller than this is not an improvement (for ``patience``).
      set: the evaluation set whose ``metric`` decides, where ``eval_input`` is a mapping of
        named sets (keyword only); ``None``: the only set (several sets must name one).

    ``mode=`` still works for one release (a ``DeprecationWarning``): it is ``direction=``.
    """

    metric: str = "loss"
    direction: str | None = None
    keep_checkpoint: bool = True
    patience: int | None = None
    min_delta: float = 0.0
    _: dataclasses.KW_ONLY
    set: str | None = None
    mode: dataclasses.InitVar[str | None] = None  # the name of ``direction`` in train_and_evaluate(mode=...)

    def __post_init__(self, mode: str | None):
        if mode is not None:
            if self.direction is not None:
                raise ConfigError(
                    f"Best(direction={self.direction!r}, mode={mode!r}); expected one of them. Fix: keep direction=."
                )
            warnings.warn(
                f"Best(mode={mode!r}) is deprecated; pass Best(direction={mode!r}).", DeprecationWarning, stacklevel=3
            )
            object.__setattr__(self, "direction", mode)
        if not isinstance(self.metric, str) or not self.metric:
            raise ConfigError(f"Best(metric={self.metric!r}); expected the name of an evaluation metric.")
        if self.direction is None:
            object.__setattr__(self, "direction", _direction_of(self.metric))
        if self.direction not in DIRECTIONS:
            raise ConfigError(f"Best(direction={self.direction!r}); expected 'max' or 'min'.")
        if self.patience is not None:
            _check_positive("Best", "patience", self.patience)
        if self.set is not None:
            eval_sets.check_name(self.set, "Best(set=...)")


def _direction_of(metric: str) -> str:
    name = metric.lower()
    if any(word in name for word in _LOWER_IS_BETTER):
        return "min"
    if any(word in name for word in _HIGHER_IS_BETTER):
        return "max"
    raise ConfigError(
        f"Best(metric={metric!r}) does not say whether higher or lower is better; expected "
        f"direction='max' or 'min'. Fix: Best({metric!r}, direction='max') (or 'min')."
    )


@dataclasses.dataclass(frozen=True)
class RunConfig:
    """Settings of a run.

    Attributes:
      model_dir: directory for checkpoints and ``metrics.jsonl``; ``None`` keeps
        everything in memory (nothing is saved or restored).
      train_batch_size: global batch of one training step, over all devices.
      eval_batch_size: global batch of evaluation; defaults to the train batch.
      predict_batch_size: global batch of prediction; defaults to the eval batch.
      steps_per_loop: training steps run per host round trip (the device loop).
      loop: how the steps of one loop are run on the device: ``"scan"`` (one
        compiled ``lax.scan`` of ``steps_per_loop`` steps), ``"step"`` (one
        compiled call per step, dispatched without waiting) or ``"auto"``
        (``scan``, except ``step`` for models with convolutions on CPU, decided
        from the traced step without running it; a resumed run keeps the loop
        its checkpoint was trained with).
      seed: seeds parameter initialisation, dropout and shuffling.
      log_every_steps: a train log line is written when a multiple is crossed.
      checkpoint: when checkpoints are saved and kept (``CheckpointPolicy``).
      tensorboard: write TensorBoard event files into ``<model_dir>``, one TensorBoard run
        (every step's scalars; no extra library: TensorBoard itself only views them).
      quiet: no progress bar and no train log lines (warnings, evaluations and
        files still appear).
      profile_steps: ``(A, B)``: write a ``jax.profiler`` trace of the loops
        that run steps A to B to ``<model_dir>/profile``.
      skip_nonfinite: skip updates whose gradients are NaN/Inf on the device and
        count them (``skipped_update_fraction``) instead of stopping.
      num_devices: use the first N devices (default: all devices of all processes).
      mesh: ``{axis: size}`` of the device mesh, e.g. ``{"data": 4, "model": 2}``;
        one size may be ``-1`` (the rest of the devices). The batch is split
        over ``data`` and ``fsdp``; other axes are model axes. ``fsdp`` > 1
        also shards parameters and optimizer state (see ``layout.py``).
        ``None``: a 1-D ``data`` mesh, everything replicated.
      sharding_rules: ``[(regex, spec), ...]``: a parameter (or model state
        leaf) whose ``/``-joined path fully matches ``regex`` is sharded by
        ``spec``, one entry per dimension (an axis name, a tuple of names,
        or ``None``); the first match wins, and a rule that matches nothing
        is an error.
      fsdp_min_bytes: with an ``fsdp`` axis, parameters of at least this size
        are sharded over it (smaller ones stay on every device).
      compute_dtype: ``"bfloat16"`` (or ``"float16"``) runs the model in that dtype
        while parameters and optimizer state stay float32 (see ``precision.py``);
        ``None``: compute in the parameters' dtype.
      grad_accum_steps: split each training batch into this many micro-batches,
        run one after the other, and make one optimizer update from their summed
        gradients (``accumulation.py``): ``train_batch_size`` stays the batch of
        one step and activation memory falls to that of a micro-batch.
      save_every_steps: shorthand for ``checkpoint.every_steps`` (``None``: only
        at the end and on preemption).
      keep_checkpoints: shorthand for ``checkpoint.keep``.
      trackers: also log the records of ``metrics.jsonl`` to experiment trackers:
        ``"mlflow"``, ``"mlflow=URI"`` (a server or a local directory), or
        ``estimax.trackers.MLflow(...)`` (see ``trackers.py``).
      compilation_cache: a directory where compiled programs are kept for later
        processes (JAX's persistent compilation cache, process-wide; see
        ``estimax.compile_cache``); ``None`` (default): not kept. The ``estimax``
        command uses ``~/.cache/estimax/jax``.
      tokens_per_example: the tokens in one example of a sequence model (its
        sequence length): train lines then carry ``tokens_per_sec``.
      sync_timeout_seconds: with several processes, how long the barriers before
        the first loop and at checkpoints wait for every process before raising
        an error that names the late ones (``estimax.distributed.Sync``).
      freeze: parameters that do not train: ``[regex, ...]`` over ``/``-joined paths
        (full match, as ``sharding_rules``), or a schedule ``{step: [regex, ...]}``
        whose entry applies from that step until the next one (``{0: ["embed/.*"],
        500: []}`` unfreezes the embedding at step 500). Frozen parameters keep their
        values bit for bit and have no optimizer state (``estimax/fine_tuning/freezing.py``); a
        rule that matches nothing is an error.
      lora: ``LoRA(layers=[regex, ...], rank=8, alpha=16)``: low-rank adapters on
        those linear layers of an NNX model; only the adapters train.
      ema_decay: keep an exponential moving average of the parameters with this
        decay in (0, 1), e.g. 0.999, updated in every step and saved with the
        checkpoints (``averaging.py``); ``None`` (default): none is kept.
      ema_warmup: how the average starts: ``"ramp"`` (decay ``min(ema_decay,
        (1+n)/(10+n))`` at step ``n``, TF's), ``"debias"`` (optax's bias
        correction) or ``"none"`` (the constant decay from the initial parameters).
      eval_weights: ``"average"`` or ``"raw"``: the weights that evaluation, the best
        checkpoint's choice, prediction, ``model()`` and export use; ``None``
        (default): the average where one is kept.
    """

    model_dir: str | os.PathLike | None = None
    train_batch_size: int = 32
    eval_batch_size: int | None = None
    predict_batch_size: int | None = None
    steps_per_loop: int = 50
    loop: str = "auto"
    seed: int = 0
    log_every_steps: int = 100
    checkpoint: CheckpointPolicy = DEFAULT_CHECKPOINT_POLICY
    tensorboard: bool = True
    quiet: bool = False
    profile_steps: tuple[int, int] | None = None
    skip_nonfinite: bool = False
    num_devices: int | None = None
    compute_dtype: str | None = None
    mesh: dict[str, int] | None = None
    sharding_rules: tuple = ()
    fsdp_min_bytes: int = DEFAULT_FSDP_MIN_BYTES
    sync_timeout_seconds: float = 300.0
    grad_accum_steps: int = 1
    trackers: tuple = ()
    compilation_cache: str | os.PathLike | None = None
    tokens_per_example: int | None = None
    freeze: tuple = ()
    lora: LoRA | None = None
    ema_decay: float | None = None
    ema_warmup: str = "ramp"
    eval_weights: str | None = None
    save_every_steps: dataclasses.InitVar[int | None] = _UNSET
    keep_checkpoints: dataclasses.InitVar[int] = _UNSET

    def __post_init__(self, save_every_steps, keep_checkpoints):
        self._check_types()
        shorthands = {"every_steps": save_every_steps, "keep": keep_checkpoints}
        shorthands = {k: v for k, v in shorthands.items() if v is not _UNSET}
        for field, value in shorthands.items():
            chosen = getattr(self.checkpoint, field)
            if chosen != getattr(CheckpointPolicy(), field) and chosen != value:  # both given, and they differ
                shorthand = "save_every_steps" if field == "every_steps" else "keep_checkpoints"
                raise ConfigError(
                    f"RunConfig({shorthand}={value!r}) and checkpoint=CheckpointPolicy({field}={chosen!r}) "
                    f"disagree; {shorthand} is a shorthand for CheckpointPolicy({field}=...). "
                    f"Fix: give only one of them."
                )
        if "every_steps" in shorthands and self.checkpoint == DEFAULT_CHECKPOINT_POLICY:
            shorthands["max_overhead"] = None  # a cadence asked for is kept, as CheckpointPolicy(every_steps=...) is
        if shorthands:
            object.__setattr__(self, "checkpoint", dataclasses.replace(self.checkpoint, **shorthands))
        for name in ("train_batch_size", "steps_per_loop", "log_every_steps", "grad_accum_steps"):
            _set(self, name, _check_positive("RunConfig", name, getattr(self, name)))
        if self.train_batch_size % self.grad_accum_steps:  # over the devices too: InputPlan.check, when training starts
            raise ConfigError(
                f"RunConfig(train_batch_size={self.train_batch_size}) does not split into "
                f"grad_accum_steps={self.grad_accum_steps} equal micro-batches; expected a multiple of "
                f"{self.grad_accum_steps}. Fix: use train_batch_size "
                f"{counting.nearest_multiples(self.train_batch_size, self.grad_accum_steps)}."
            )
        _set(
            self, "sync_timeout_seconds", _check_number("RunConfig", "sync_timeout_seconds", self.sync_timeout_seconds)
        )
        for name in ("eval_batch_size", "predict_batch_size", "num_devices", "tokens_per_example"):
            if getattr(self, name) is not None:
                _set(self, name, _check_positive("RunConfig", name, getattr(self, name)))
        if self.profile_steps is not None:
            start, stop = self.profile_steps
            if not (isinstance(start, int) and isinstance(stop, int) and 0 <= start < stop):
                raise ConfigError(
                    f"RunConfig(profile_steps={self.profile_steps!r}); expected (A, B) with 0 <= A < B, "
                    "e.g. (100, 110)."
                )
        if self.loop not in LOOP_KINDS:
            raise ConfigError(f"RunConfig(loop={self.loop!r}) is not a device loop; expected one of {LOOP_KINDS}.")
        check_compute_dtype(self.compute_dtype)
        self._check_average()
        object.__setattr__(self, "mesh", check_mesh_axes(self.mesh))
        object.__setattr__(self, "sharding_rules", check_rules(self.sharding_rules))
        _set(self, "fsdp_min_bytes", _integer("RunConfig", "fsdp_min_bytes", self.fsdp_min_bytes))
        if self.fsdp_min_bytes < 0:
            raise ConfigError(f"RunConfig(fsdp_min_bytes={self.fsdp_min_bytes!r}) must be a non-negative integer.")
        object.__setattr__(self, "trackers", resolve_trackers(self.trackers))
        object.__setattr__(self, "freeze", check_freeze(self.freeze))
        if self.lora is not None and not isinstance(self.lora, LoRA):
            raise ConfigTypeError(
                f"RunConfig(lora={self.lora!r}) is of type {type(self.lora).__name__}; expected "
                r"ex.LoRA(layers=[r'blocks/\d+/attn/(query|value)'], rank=8) or None."
            )
        for name in ("model_dir", "compilation_cache"):
            if getattr(self, name) is not None:
                object.__setattr__(self, name, os.fspath(getattr(self, name)))

    def _check_types(self) -> None:
        """The kinds of the settings checked on their own (each setting's range is checked where it is used)."""
        for name in ("model_dir", "compilation_cache"):
            value = getattr(self, name)
            if value is not None and not isinstance(value, str | os.PathLike):
                raise ConfigTypeError(
                    f"RunConfig({name}={value!r}) is of type {type(value).__name__}; expected a path (str or "
                    "os.PathLike) or None."
                )
        if not isinstance(self.checkpoint, CheckpointPolicy):
            raise ConfigTypeError(
                f"RunConfig(checkpoint={self.checkpoint!r}) is of type {type(self.checkpoint).__name__}; expected a "
                "CheckpointPolicy. Fix: checkpoint=ex.CheckpointPolicy(every_steps=...), or save_every_steps=..."
            )
        for name in ("tensorboard", "quiet", "skip_nonfinite"):
            _set(self, name, _check_flag("RunConfig", name, getattr(self, name)))
        for name in ("loop", "compute_dtype"):
            value = getattr(self, name)
            if value is not None and not isinstance(value, str):
                kind = type(value).__name__
                raise ConfigTypeError(f"RunConfig({name}={value!r}) is of type {kind}; expected a string.")
        seed = _integer("RunConfig", "seed", self.seed)
        if not 0 <= seed < 2**63:
            raise ConfigError(
                f"RunConfig(seed={seed}) is out of range; expected an integer from 0 to 2**63 - 1 (it seeds JAX's "
                "keys and the input's shuffling). Fix: a seed in that range, e.g. seed=0."
            )
        _set(self, "seed", seed)

    def _check_average(self) -> None:
        """``ema_decay`` in (0, 1) or None, a known warm-up, and weights to evaluate that exist."""
        if self.ema_decay is not None:
            if isinstance(self.ema_decay, bool) or not isinstance(self.ema_decay, numbers.Real):
                kind = type(self.ema_decay).__name__
                raise ConfigTypeError(f"RunConfig(ema_decay={self.ema_decay!r}) is of type {kind}; expected a number.")
            decay = float(self.ema_decay)
            if not 0 < decay < 1:  # NaN too
                raise ConfigError(
                    f"RunConfig(ema_decay={self.ema_decay!r}) is outside (0, 1); expected the decay of the parameter "
                    "average, e.g. 0.999 (an average over about 1000 steps), or None to keep none."
                )
            _set(self, "ema_decay", decay)
        for name, allowed in (("ema_warmup", EMA_WARMUPS), ("eval_weights", EVAL_WEIGHTS)):
            value = getattr(self, name)
            if value not in allowed and not (name == "eval_weights" and value is None):
                raise ConfigError(f"RunConfig({name}={value!r}); expected one of {allowed}.")
        if self.eval_weights == "average" and self.ema_decay is None:
            raise ConfigError(
                "RunConfig(eval_weights='average') but ema_decay=None: no parameter average is kept. Fix: set "
                "ema_decay (e.g. 0.999), or leave eval_weights out to evaluate the raw weights."
            )

    @property
    def global_eval_batch_size(self) -> int:
        return self.eval_batch_size or self.train_batch_size

    @property
    def global_predict_batch_size(self) -> int:
        return self.predict_batch_size or self.global_eval_batch_size


def check_compute_dtype(name: str | None) -> None:
    if name is not None and name not in COMPUTE_DTYPES:
        raise ConfigError(
            f"RunConfig(compute_dtype={name!r}) is not a supported compute dtype; expected one of "
            f"{COMPUTE_DTYPES} or None (compute in the parameters' dtype)."
        )


def check_mesh_axes(axes) -> dict[str, int] | None:
    """``RunConfig(mesh=...)`` as a dict, or a ValueError/TypeError naming what is wrong."""
    if axes is None:
        return None
    if not isinstance(axes, Mapping) or not axes:
        raise ConfigTypeError(
            f"RunConfig(mesh={axes!r}); expected a dict axis name -> size, e.g. {{'data': 4, 'model': 2}}."
        )
    for name, size in axes.items():
        if not isinstance(name, str) or not name:
            raise ConfigTypeError(f"RunConfig(mesh=...) has axis name {name!r}; expected a non-empty string.")
        if isinstance(size, bool) or not isinstance(size, int) or (size < 1 and size != -1):
            raise ConfigError(
                f"RunConfig(mesh=...) gives axis {name!r} size {size!r}; expected a positive integer or -1 (the rest)."
            )
    if sum(size == -1 for size in axes.values()) > 1:
        raise ConfigError(f"RunConfig(mesh={dict(axes)}) has several -1 axes; expected at most one (the rest).")
    return dict(axes)


def check_rules(rules) -> tuple[tuple[str, tuple], ...]:
    """``RunConfig(sharding_rules=...)`` as a tuple of ``(regex, spec)``, or an error naming the bad entry."""
    example = "e.g. [(r'.*mlp/up/kernel', ('fsdp', 'model'))]"
    if isinstance(rules, str | bytes) or not isinstance(rules, Sequence):
        raise ConfigTypeError(
            f"RunConfig(sharding_rules={rules!r}); expected a list of (regex, spec) pairs, {example}."
        )
    # A PartitionSpec exists only once jax.sharding is imported: it is recognised without importing JAX here.
    partition_spec = getattr(sys.modules.get("jax.sharding"), "PartitionSpec", tuple)
    checked = []
    for i, rule in enumerate(rules):
        if not (isinstance(rule, tuple | list) and len(rule) == 2 and isinstance(rule[0], str)):
            raise ConfigTypeError(
                f"RunConfig(sharding_rules=...)[{i}] is {rule!r}; expected a (regex, spec) pair, {example}."
            )
        pattern, spec = rule
        try:
            re.compile(pattern)
        except re.error as error:
            raise ConfigError(f"RunConfig(sharding_rules=...)[{i}]: {pattern!r} is not a regex ({error}).") from None
        spec = tuple(spec) if isinstance(spec, tuple | list | partition_spec) else spec
        if not isinstance(spec, tuple) or not all(_is_spec_entry(e) for e in spec):
            raise ConfigTypeError(
                f"RunConfig(sharding_rules=...)[{i}] ({pattern!r}) has spec {spec!r}; expected a tuple with one "
                "entry per dimension: a mesh axis name, a tuple of names, or None (not sharded)."
            )
        checked.append((pattern, spec))
    return tuple(checked)


def _is_spec_entry(entry) -> bool:
    return (
        entry is None or isinstance(entry, str) or (isinstance(entry, tuple) and all(isinstance(a, str) for a in entry))
    )


def best_from(best: Best | None, deprecated: dict) -> Best | None:
    """``best``, or the ``Best`` that ``train_and_evaluate``'s old ``best_metric``/``mode``/``patience``
    arguments meant (deprecated: one release with a warning)."""
    unknown = sorted(set(deprecated) - {"best_metric", "mode", "patience"})
    if unknown:
        raise ConfigTypeError(f"train_and_evaluate() got unexpected keyword arguments {unknown}.")
    if not deprecated:
        return best
    if best is not None:
        raise ConfigError(
            f"train_and_evaluate() received best= and {sorted(deprecated)}; expected one of them. "
            "Fix: put everything in best=ex.Best(...)."
        )
    metric, mode, patience = deprecated.get("best_metric"), deprecated.get("mode", "max"), deprecated.get("patience")
    replacement = (
        Best(metric, mode, patience=patience)
        if metric is not None
        else Best("loss", "min", keep_checkpoint=False, patience=patience)
    )
    warnings.warn(
        f"train_and_evaluate({', '.join(f'{k}={v!r}' for k, v in deprecated.items())}) is deprecated; "
        f"pass best={replacement!r}.",
        DeprecationWarning,
        stacklevel=4,  # best_from, train_and_evaluate, its one-thread wrapper, the caller
    )
    return replacement if (metric is not None or patience is not None) else None
