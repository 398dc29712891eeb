"""What an Estimator is made of, built once from its arguments.

Owns the wiring of an Estimator's parts, each built from the ones before it:
the mesh, the model's pure functions (``step.Core``) and the state's abstract
shapes, where every array lives (``layout.py``), the run directory, the
current state, the input plan, the checks of each mode, the evaluator, the
writers, the evaluations and the trainer. Each part makes its own decisions; the one made here
is how the initial state is compiled (``_initialise``). The verbs that use the parts are ``estimator.py``'s.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
from collections.abc import Callable

import jax
import optax

from estimax import accumulation, compile_cache
from estimax import layout as layout_lib
from estimax import mesh as mesh_lib
from estimax.checks import validation
from estimax.data.plan import InputPlan
from estimax.distributed import Sync
from estimax.evaluations import Evaluations
from estimax.evaluator import Evaluator
from estimax.fine_tuning import averaging, freezing, lora
from estimax.hooks.call_writers import CallWriters
from estimax.models import resolve as resolve_model
from estimax.records.writers import ensure_console
from estimax.run import checkpoint as checkpoint_lib
from estimax.run import resize, run_setup
from estimax.run.current_state import CurrentState
from estimax.run.run_dir import open_run_dir
from estimax.step import Core, StepOptions
from estimax.train_call import ModelOnMesh, TrainCall


@dataclasses.dataclass(frozen=True)
class Parts:
    """An Estimator's parts (see the module's docstring)."""

    mesh: jax.sharding.Mesh
    core: Core
    layout: layout_lib.Layout
    run_dir: object  # a RunDir, or a NoRunDir without model_dir
    current: CurrentState
    plan: InputPlan
    checks: validation.ModeChecks
    evaluator: Evaluator
    evaluations: Evaluations
    writers: CallWriters
    train_call: TrainCall
    state_shapes: Callable  # () -> the TrainState as ShapeDtypeStructs with their shardings: nothing allocated
    trainable: freezing.FreezePlan | None = None  # what trains at each phase of RunConfig(freeze=...)
    merged: Callable | None = None  # under LoRA: state -> (the base model's Core, state with adapters merged)

    def exportable(self, state) -> tuple:
        """``(core, state)`` an artifact is written from: under LoRA, the base with the adapters merged
        into it (one artifact, no adapters)."""
        return (self.core, state) if self.merged is None else self.merged(state)


def assemble(model, model_fn, optimizer, config, params: dict, warm_start, host_metrics) -> Parts:
    """The parts of ``Estimator(model, model_fn, optimizer, config, params, warm_start, host_metrics)``;
    the arguments are checked already."""
    compile_cache.enable(config.compilation_cache)
    mesh = mesh_lib.make_mesh(mesh_lib.devices(config.num_devices), config.mesh)
    with jax.set_mesh(mesh):  # modules that declare shardings (nnx.with_partitioning) need a mesh to trace
        adapter = resolve_model(lora.wrap(model, config.lora), params, config.seed)
        # Frozen parameters: a zero update, no optimizer state, no weight gradient (freezing.py); under
        # LoRA, every parameter but the adapters.
        base = (lambda name: not lora.is_adapter(name)) if config.lora else None
        adapter, optimizer, trainable = freezing.apply(config.freeze, adapter, optimizer, base, "LoRA (the base)")
    if config.skip_nonfinite:  # the update of a NaN/Inf gradient is skipped on the device
        optimizer = optax.apply_if_finite(optimizer, max_consecutive_errors=10**9)
    setup = run_setup.record(config.train_batch_size, config.seed, optimizer, resize.shape(mesh))
    with jax.set_mesh(mesh):
        core = Core(
            adapter,
            model_fn,
            optimizer,
            params,
            config.seed,
            config.compute_dtype,
            StepOptions(
                config.grad_accum_steps,
                measure_every_step=config.skip_nonfinite,  # every skipped update is counted
                last_step_apart=mesh.devices.flat[0].platform == "gpu",  # no conditional in XLA:GPU's loops
                average=averaging.of(config),
            ),
        )
        abstract_state = jax.eval_shape(core.init_state)  # shapes only: traced once
    layout = layout_lib.build(mesh, abstract_state, optimizer, config.sharding_rules, config.fsdp_min_bytes)
    sync = Sync(config.sync_timeout_seconds)
    run_dir = open_run_dir(config.model_dir, config.checkpoint, setup)
    shapes = functools.partial(_state_shapes, abstract_state, layout)  # the target of every restore
    adapters = config.lora.adapters if config.lora else None  # an adapter file to start from
    current = CurrentState(run_dir, shapes, functools.partial(_initialise, core, layout, adapters), warm_start, setup)
    plan = InputPlan(config, layout, sync)
    accumulation.warn_if_multisteps(abstract_state.opt_state)
    writers = CallWriters(config, run_dir, params, mesh.size)
    evaluator = Evaluator(core, layout, plan, config.quiet)
    checks = validation.ModeChecks(core, abstract_state, plan)
    parts = Parts(
        mesh=mesh,
        core=core,
        layout=layout,
        run_dir=run_dir,
        current=current,
        plan=plan,
        checks=checks,
        evaluator=evaluator,
        evaluations=Evaluations(evaluator, config, writers, host_metrics, checks, run_dir, current),
        writers=writers,
        train_call=TrainCall(config, ModelOnMesh(core, layout), plan, run_dir, current, sync, writers),
        state_shapes=shapes,
        trainable=trainable,
        merged=functools.partial(_merged_core, model, params, config, core, mesh) if config.lora else None,
    )
    ensure_console()
    freezing.report(trainable)
    return parts


def _merged_core(model, hparams: dict, config, core: Core, mesh, state, *, merge: bool = True):
    """``(Core of the model without adapters, state with the adapters merged)``: what export writes;
    ``merge=False``: the state of the base alone, the adapters left out (an adapters-only export's base)."""
    with jax.set_mesh(mesh):  # modules that declare shardings need a mesh to trace
        base_adapter = resolve_model(model, hparams, config.seed)
    base = Core(base_adapter, core.model_fn, core.optimizer, core.hparams, core.seed, core.compute_dtype)
    return base, lora.merged(base_adapter, state, config.lora, merge)


def _state_shapes(abstract_state, layout):
    return checkpoint_lib.abstract_like(abstract_state, layout.state)


def _initialise(core: Core, layout: layout_lib.Layout, adapters: str | None = None):
    replicated = all(sharding.is_fully_replicated for sharding in jax.tree.leaves(layout.state))
    with jax.set_mesh(layout.mesh), _random_draws_as_kernels(replicated):  # arrays created in their shards
        state = jax.jit(core.init_state, out_shardings=layout.state)()
    return state if adapters is None else lora.load(state, adapters)


@contextlib.contextmanager
def _random_draws_as_kernels(replicated: bool):
    """On a GPU, the initial state's random draws each as one CUDA kernel (the same bits).

    JAX writes each threefry draw out as 20 unrolled rounds on a GPU (on a CPU as a
    loop), so the initialisation of GPT-2 small's 75 weight matrices compiled for 3 min 5 s on
    an H200 (jax 0.11.2), against 21 s for a whole hand-written training scan. JAX's
    kernel lowering compiles in no time but is one opaque call, which XLA cannot split
    into shards: it is used only where the state is replicated, and only here.
    """
    if not replicated or jax.default_backend() != "gpu":
        yield
        return
    before = jax.config.jax_threefry_gpu_kernel_lowering
    jax.config.update("jax_threefry_gpu_kernel_lowering", True)
    try:
        yield
    finally:
        jax.config.update("jax_threefry_gpu_kernel_lowering", before)
