"""What the per-step gradient checks cost: candidates side by side in one process.

Each candidate is a ``jax.jit`` of ``lax.scan`` over K stacked batches of the
hand-written train step of ``loops.py`` (same model, optimizer and batches),
differing only in what it computes from the gradients:

- ``none``: the loss only (the reference);
- ``every_step``: the global norm and a finite flag per parameter on every step
  (``estimax.step.grad_checks`` with ``measure=True``; estimax before 0.2);
- ``norm_only``: ``optax.global_norm`` on every step, no flags;
- ``carry``: the norm on every step and the flags of the first non-finite step
  carried through the loop (no per-step flag output);
- ``cond``: the checks under ``lax.cond``, run on the loop's last step and
  on any step whose loss is not finite (what estimax does);
- ``select``: the checks on every step, ``jnp.where`` keeping them on those
  same steps only (no conditional: on a GPU a conditional copies its
  predicate to the host and waits for it);
- ``outputs_only``: no checks, but the outputs ``cond`` writes every step
  (a NaN norm and flags that are all True): what the outputs alone cost;
- ``last_only``: the first K-1 steps in the scan with the loss only, the last
  step after it with the checks: the checks once a loop, with neither a
  conditional nor per-step outputs (a non-finite loss then does not measure
  its step).

Timed windows alternate between candidates; the best of each is kept and
reported as steps/s and as a fraction of ``none``. Run:
``python benchmarks/step_extras.py [--workloads mlp,lstm] [--rounds 5]
[--candidates cond,select] [--loops N]`` (``none`` is always timed; ``--loops``
sizes the windows, e.g. 100 loops on a GPU).
"""

from __future__ import annotations

import argparse
import json
import time

import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import nnx
from loops import WORKLOADS, Workload, shuffled_batches

from estimax.step import grad_checks


def candidates(w: Workload, names):
    graphdef, params, rest = nnx.split(w.build(nnx.Rngs(0)), nnx.Param, ...)
    optimizer = optax.sgd(w.lr)

    def step(state, batch):
        params, opt_state, rest = state
        model = nnx.merge(graphdef, params, rest)
        loss, grads = nnx.value_and_grad(lambda m: jnp.mean(w.loss(m(batch[0]), batch[1])))(model)
        updates, opt_state = optimizer.update(grads, opt_state, params)
        state = (optax.apply_updates(params, updates), opt_state, nnx.split(model, nnx.Param, ...)[2])
        return state, loss, grads

    def per_step(extras):
        def body(state, batch):
            state, loss, grads = step(state, batch)
            return state, {"loss": loss, **extras(grads)}

        return lambda state, stack: jax.lax.scan(body, state, stack)

    def carry(state, stack):
        def body(carry, batch):
            state, flags = carry
            state, loss, grads = step(state, batch)
            checks = grad_checks(grads, True)
            flags = jnp.where(flags.all(), checks["finite_grads"], flags)  # the first non-finite step's
            return (state, flags), {"loss": loss, "grad_norm": checks["grad_norm"]}

        num_params = len(jax.tree.leaves(params))
        (state, flags), outputs = jax.lax.scan(body, (state, jnp.ones(num_params, bool)), stack)
        return state, (outputs, flags)

    def selected(grads, measure):
        checks = grad_checks(grads, True)
        skipped = {"grad_norm": jnp.float32(jnp.nan), "finite_grads": jnp.ones_like(checks["finite_grads"])}
        return {name: jnp.where(measure, checks[name], skipped[name]) for name in checks}

    def measured_on(checks):
        def loop(state, stack):
            def body(state, xs):
                batch, last = xs
                state, loss, grads = step(state, batch)
                return state, {"loss": loss, **checks(grads, last | ~jnp.isfinite(loss))}

            num_steps = jax.tree.leaves(stack)[0].shape[0]
            return jax.lax.scan(body, state, (stack, jnp.arange(num_steps) == num_steps - 1))

        return loop

    def unmeasured(grads):
        return {"grad_norm": jnp.float32(jnp.nan), "finite_grads": jnp.ones(len(jax.tree.leaves(grads)), bool)}

    def last_only(state, stack):
        state, outputs = per_step(lambda grads: {})(state, jax.tree.map(lambda x: x[:-1], stack))
        state, loss, grads = step(state, jax.tree.map(lambda x: x[-1], stack))
        return state, (outputs, loss, grad_checks(grads, True))

    loops = {
        "none": per_step(lambda grads: {}),
        "every_step": per_step(lambda grads: grad_checks(grads, True)),
        "norm_only": per_step(lambda grads: {"grad_norm": optax.global_norm(grads)}),
        "carry": carry,
        "cond": measured_on(grad_checks),
        "select": measured_on(selected),
        "outputs_only": per_step(unmeasured),
        "last_only": last_only,
    }
    state = (params, optimizer.init(params), rest)
    return state, {name: jax.jit(loop, donate_argnums=0) for name, loop in loops.items() if name in names}


CANDIDATES = ("none", "every_step", "norm_only", "carry", "cond", "select", "outputs_only", "last_only")


def benchmark(w: Workload, rounds: int, names=CANDIDATES, num_loops: int | None = None) -> dict:
    x, y = w.data()
    initial, loops = candidates(w, names)
    states = {name: jax.tree.map(jnp.copy, initial) for name in loops}
    batches = shuffled_batches(x, y, w.batch)
    stacks = [
        jax.device_put(jax.tree.map(lambda *b: np.stack(b), *(next(batches) for _ in range(w.k)))) for _ in range(4)
    ]
    num_loops = num_loops or max((w.scan_steps or w.steps) // w.k, 1)

    def run(name):
        state = states[name]
        for i in range(num_loops):
            state, outputs = loops[name](state, stacks[i % len(stacks)])
        jax.block_until_ready((state, outputs))
        states[name] = state

    for name in loops:
        run(name)  # compiles
    best = dict.fromkeys(loops, float("inf"))
    for _ in range(rounds):
        for name in loops:
            start = time.perf_counter()
            run(name)
            best[name] = min(best[name], time.perf_counter() - start)
    steps = num_loops * w.k
    return {
        "workload": w.name,
        **{f"{name}_steps_per_sec": round(steps / t) for name, t in best.items()},
        **{f"{name}_vs_none": round(best["none"] / t, 3) for name, t in best.items() if name != "none"},
    }


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--workloads", default="mlp,lstm", help="comma-separated subset of " + ", ".join(WORKLOADS))
    parser.add_argument("--rounds", type=int, default=5, help="timed windows per candidate (best is kept)")
    parser.add_argument(
        "--candidates", default=",".join(CANDIDATES), help="comma-separated subset of " + ", ".join(CANDIDATES)
    )
    parser.add_argument("--loops", type=int, help="loops per timed window (default: the workload's window)")
    args = parser.parse_args(argv)
    names = ["none", *(n for n in args.candidates.split(",") if n and n != "none")]
    if not set(names) <= set(CANDIDATES):
        parser.error(f"unknown candidates {sorted(set(names) - set(CANDIDATES))}; expected some of {CANDIDATES}")
    for name in args.workloads.split(","):
        print(json.dumps(benchmark(WORKLOADS[name], args.rounds, names, args.loops)), flush=True)


if __name__ == "__main__":
    main()
