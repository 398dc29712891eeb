"""RunConfig: where a run writes, how big its batches are, how it loops and what it keeps.

A validated, immutable dataclass. It owns the run's settings and the check of each setting
(names, ranges, the form of mesh axes and sharding rules); nothing here touches devices or
files, and nothing imports JAX: a check that needs the devices (a batch that splits over them)
is ``data/plan.py``'s, made when a call starts. The checks of one value are
``checks/values.py``'s; ``CheckpointPolicy``, ``Best`` and ``Epochs`` are ``policies.py``'s (named here
too, where they have always been imported from).
"""

from __future__ import annotations

import dataclasses
import numbers
import os
import re
import sys
from collections.abc import Mapping, Sequence

from estimax import counting
from estimax.checks import values
from estimax.errors import ConfigError, ConfigTypeError
from estimax.fine_tuning import LoRA, check_freeze
from estimax.policies import DEFAULT_CHECKPOINT_POLICY, Best, CheckpointPolicy, Epochs
from estimax.records.tracker_kinds import resolve as resolve_trackers

__all__ = ["Best", "CheckpointPolicy", "Epochs", "RunConfig"]

LOOP_KINDS = ("auto", "scan", "step")
"""The device loops ``RunConfig(loop=...)`` and ``--loop`` take."""
COMPUTE_DTYPES = ("bfloat16", "float16", "float32")
"""The dtypes ``RunConfig(compute_dtype=...)`` may run the model in (``precision.py``)."""
DEFAULT_FSDP_MIN_BYTES = 1 << 12  # 4 KiB: smaller leaves (LayerNorm scales, small biases) stay whole on every device
EMA_WARMUPS = ("ramp", "debias", "none")
"""The warm-ups of the parameter average ``RunConfig(ema_warmup=...)`` takes (``averaging.py``)."""
EVAL_WEIGHTS = ("average", "raw")
"""The weights ``RunConfig(eval_weights=...)`` may choose for evaluation, prediction and export."""
_UNSET = object()


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
            values.set_checked(self, name, values.positive("RunConfig", name, getattr(self, name)))
        if self.train_batch_size % self.grad_accum_steps:  # over the devices too: InputPlan.check, when training starts
            raise ConfigError(
                f"RunConfig(train_batch_size={self.train_batch_size}) does not split into "
                f"grad_accum_steps={self.grad_accum_steps} equal micro-batches; expected a multiple of "
                f"{self.grad_accum_steps}. Fix: use train_batch_size "
                f"{counting.nearest_multiples(self.train_batch_size, self.grad_accum_steps)}."
            )
        values.set_checked(
            self, "sync_timeout_seconds", values.number("RunConfig", "sync_timeout_seconds", self.sync_timeout_seconds)
        )
        for name in ("eval_batch_size", "predict_batch_size", "num_devices", "tokens_per_example"):
            if getattr(self, name) is not None:
                values.set_checked(self, name, values.positive("RunConfig", name, getattr(self, name)))
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
        values.set_checked(self, "fsdp_min_bytes", values.integer("RunConfig", "fsdp_min_bytes", self.fsdp_min_bytes))
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
            values.set_checked(self, name, values.flag("RunConfig", name, getattr(self, name)))
        for name in ("loop", "compute_dtype"):
            value = getattr(self, name)
            if value is not None and not isinstance(value, str):
                kind = type(value).__name__
                raise ConfigTypeError(f"RunConfig({name}={value!r}) is of type {kind}; expected a string.")
        seed = values.integer("RunConfig", "seed", self.seed)
        if not 0 <= seed < 2**63:
            raise ConfigError(
                f"RunConfig(seed={seed}) is out of range; expected an integer from 0 to 2**63 - 1 (it seeds JAX's "
                "keys and the input's shuffling). Fix: a seed in that range, e.g. seed=0."
            )
        values.set_checked(self, "seed", seed)

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
            values.set_checked(self, "ema_decay", decay)
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
