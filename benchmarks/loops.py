"""Steady-state training throughput: estimax against hand-written JAX loops.

Trains five models by default (a tiny host-bound MLP, a small LSTM, the LM
example's transformer, the TF official MNIST CNN and the digits example's CNN)
on synthetic data, and GPT-2 small in bfloat16 when asked (``--workloads
gpt2``, for accelerators), in one process, with three contenders that share
the model definition, the optimizer, the compute dtype and the input (host
numpy arrays, a fresh permutation per epoch, rows gathered per batch):

- ``jit_step``: one ``jax.jit`` call per step (state donated), at most ~10 in flight;
- ``jit_scan``: one ``jax.jit`` of ``lax.scan`` over K stacked batches per call;
- ``estimax``:  ``Estimator.train`` with ``loop="auto"`` and the same K, fed two ways:
  ``from_arrays`` (estimax gathers the rows) and a plain Python iterable of host
  batches (the references' own generator: estimax checks and stacks them); each
  with ``model_dir=None`` and with a model_dir (``_model_dir``: ``RunConfig``'s
  defaults: metrics.jsonl, TensorBoard with every step's points, the default log
  interval, checkpoints every 1,000 steps within ``max_overhead``, and the one
  each ``train`` call ends with).
  ``--estimax arrays,arrays_model_dir`` times only some of the four.

Each contender is warmed up first (compilation excluded), then timed windows
alternate between contenders for a few rounds (each round starting with the next one); the best steps/s of each is
kept (every round's are in ``steps_per_sec_rounds``). One JSON line per workload goes to stdout, with
``ratio_<input> = estimax / max(jit_step, jit_scan)`` for each input (target
>= 0.95), the same ratio paired within each round (``ratio_<input>_rounds``: min,
median, max over rounds), a model_dir against none paired within each round
(``model_dir_vs_none_<input>_rounds``), the loop ``auto`` chose, and per contender the achieved TFLOP/s by
the compiler's count of the hand-written step, the MFU where the device's
peak is known (``estimax/records/flops.py``) and tokens/s for the token models.

Expected on XLA:CPU: the scan wins on the host-bound MLP and LSTM, while the
MNIST CNN's convolution gradients run ~10x slower inside a rolled ``lax.scan``
than as one call per step, so ``auto`` should pick ``step`` there; the digits
CNN computes its convolutions as matrix products (``windowed_conv``), which
``auto`` scans. On a GPU ``auto`` picks the scan.

Run: ``python benchmarks/loops.py`` (about 15 minutes on 2 cores);
``--workloads mlp,lstm`` picks workloads, ``--quick`` is a < 1 minute smoke run
whose numbers are not meaningful. On a GPU: ``python benchmarks/loops.py
--workloads gpt2,lm,cnn,digits --estimax arrays,arrays_model_dir --window-seconds 5``
(windows sized to about 5 s each at the faster hand-written loop's rate);
``--references jit_scan`` times one hand-written loop (GPT-2 small compiles
for 20 s or more per program on an H200). Each warm-up and round is printed
to stderr as it ends.
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import itertools
import json
import logging
import os
import sys
import tempfile
import time
from collections.abc import Callable

import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import nnx

import estimax as ex
from estimax.examples import digits, lm
from estimax.records import flops

IN_FLIGHT = 10  # the jit_step reference waits on the step this many calls back


# -- models ---------------------------------------------------------------------


class MLP(nnx.Module):
    def __init__(self, rngs: nnx.Rngs):
        self.hidden = nnx.Linear(784, 64, rngs=rngs)
        self.out = nnx.Linear(64, 10, rngs=rngs)

    def __call__(self, x):
        return self.out(nnx.relu(self.hidden(x)))


class LSTM(nnx.Module):
    def __init__(self, rngs: nnx.Rngs, units: int = 10, features: int = 10):
        self.units = units
        self.rnn = nnx.RNN(nnx.OptimizedLSTMCell(features, units, rngs=rngs))
        self.head = nnx.Linear(units, 10, rngs=rngs)

    def __call__(self, x):
        zeros = jnp.zeros((x.shape[0], self.units), x.dtype)  # explicit carry: no RNG use at call time
        (_, hidden), _ = self.rnn(x, initial_carry=(zeros, zeros), return_carry=True)
        return self.head(hidden)


class CNN(nnx.Module):
    def __init__(self, rngs: nnx.Rngs):
        self.conv1 = nnx.Conv(1, 32, (5, 5), padding="SAME", rngs=rngs)
        self.conv2 = nnx.Conv(32, 64, (5, 5), padding="SAME", rngs=rngs)
        self.dense = nnx.Linear(7 * 7 * 64, 1024, rngs=rngs)
        self.dropout = nnx.Dropout(0.4, rngs=rngs)
        self.out = nnx.Linear(1024, 10, rngs=rngs)

    def __call__(self, x):
        x = nnx.max_pool(nnx.relu(self.conv1(x)), (2, 2), (2, 2))
        x = nnx.max_pool(nnx.relu(self.conv2(x)), (2, 2), (2, 2))
        return self.out(self.dropout(nnx.relu(self.dense(x.reshape(x.shape[0], -1)))))


def language_model(rngs: nnx.Rngs) -> nnx.Module:
    """The LM example's transformer (``estimax/examples/lm.py``): 2 blocks of width 128 over 64 bytes."""
    return lm.Transformer(seq_len=64, dim=128, num_heads=4, num_layers=2, mlp_ratio=4, rngs=rngs)


def gpt2_small(rngs: nnx.Rngs) -> nnx.Module:
    """The LM example at GPT-2 small's shape (``--set preset=gpt2-small``): 12 blocks of width 768 over 1,024 bytes."""
    return lm.Transformer(**lm.PRESETS["gpt2-small"], rngs=rngs)


def digits_cnn(rngs: nnx.Rngs) -> nnx.Module:
    """The digits example's CNN (``estimax/examples/digits.py``): the TF official MNIST CNN on 8x8 images."""
    return digits.CNN(rngs=rngs)


def token_cross_entropy(logits, labels):
    return optax.softmax_cross_entropy_with_integer_labels(logits, labels).mean(axis=-1)


def cross_entropy(logits, labels):
    return optax.softmax_cross_entropy_with_integer_labels(logits, labels)


def squared_error(predictions, labels):
    return jnp.mean((predictions - labels) ** 2, axis=-1)


@dataclasses.dataclass(frozen=True)
class Workload:
    name: str
    build: Callable[[nnx.Rngs], nnx.Module]
    loss: Callable  # (outputs, labels) -> per-example loss (batch,)
    x_shape: tuple[int, ...]  # per example
    y_shape: tuple[int, ...] | None  # per example float targets; None: int class labels
    batch: int
    lr: float
    k: int  # steps per loop
    steps: int  # per timed window of jit_step and estimax (a multiple of k)
    scan_steps: int | None = None  # per timed window of jit_scan (a multiple of k); default: steps
    examples: int = 8192
    tokens: bool = False  # integer bytes in and out (the LM)
    compute_dtype: str | None = None  # mixed precision: RunConfig(compute_dtype=...), the same casts by hand

    def data(self, seed: int = 0) -> tuple[np.ndarray, np.ndarray]:
        rng = np.random.default_rng(seed)
        if self.tokens:
            windows = rng.integers(0, 256, (self.examples, self.x_shape[0] + 1)).astype(np.int32)
            return windows[:, :-1], windows[:, 1:]
        x = rng.standard_normal((self.examples, *self.x_shape), dtype=np.float32)
        if self.y_shape is None:
            return x, rng.integers(0, 10, self.examples).astype(np.int32)
        return x, rng.standard_normal((self.examples, *self.y_shape), dtype=np.float32)


WORKLOADS = {
    "mlp": Workload("mlp", MLP, cross_entropy, (784,), None, batch=32, lr=0.01, k=50, steps=30000),
    "lstm": Workload("lstm", LSTM, squared_error, (10, 10), (10,), batch=128, lr=0.001, k=50, steps=9000),
    "lm": Workload(
        "lm", language_model, token_cross_entropy, (64,), (64,), batch=16, lr=0.05, k=20, steps=400, tokens=True
    ),
    "cnn": Workload("cnn", CNN, cross_entropy, (28, 28, 1), None, batch=128, lr=0.05, k=14, steps=42, scan_steps=14),
    "digits": Workload("digits", digits_cnn, cross_entropy, (8, 8), None, batch=128, lr=0.05, k=50, steps=200),
    # For accelerators: ~2e13 FLOPs per step (32 x 1,024 tokens), hours per window on a CPU.
    "gpt2": Workload(
        "gpt2",
        gpt2_small,
        token_cross_entropy,
        (1024,),
        (1024,),
        batch=32,
        lr=0.05,
        k=20,
        steps=200,
        examples=2048,
        tokens=True,
        compute_dtype="bfloat16",
    ),
}
DEFAULT_WORKLOADS = ("mlp", "lstm", "lm", "cnn", "digits")  # gpt2 only when asked for


def quick(w: Workload) -> Workload:
    """A smoke run: 14 steps per loop, batches of at most 32, short windows."""
    steps = 14 * (3 if w.name == "cnn" else 12)
    return dataclasses.replace(w, batch=min(w.batch, 32), k=14, steps=steps, scan_steps=14, examples=2048)


# -- hand-written references ----------------------------------------------------


def shuffled_batches(x: np.ndarray, y: np.ndarray, batch: int, seed: int = 0):
    """Endless batches: a fresh permutation per epoch, rows gathered per batch."""
    for epoch in itertools.count():
        order = np.random.default_rng([seed, epoch]).permutation(len(x))
        for i in range(len(x) // batch):
            rows = order[i * batch : (i + 1) * batch]
            yield x[rows], y[rows]


def reference_step(w: Workload):
    """(initial state, pure train step): NNX split into params and the rest (RNG state), threaded through.

    With a ``compute_dtype``, floating parameters and features are cast down inside the
    differentiated function (float32 masters, as estimax's ``RunConfig(compute_dtype=...)``)."""
    graphdef, params, rest = nnx.split(w.build(nnx.Rngs(0)), nnx.Param, ...)
    optimizer = optax.sgd(w.lr)
    low = (lambda tree: tree) if w.compute_dtype is None else functools.partial(cast_floating, dtype=w.compute_dtype)

    def loss_fn(params, rest, x, y):
        model = nnx.merge(graphdef, low(params), rest, copy=True)  # new variables, of this trace
        loss = jnp.mean(w.loss(model(low(x)), y).astype(jnp.float32))
        return loss, nnx.split(model, nnx.Param, ...)[2]

    def step(state, batch):
        params, opt_state, rest = state
        (loss, rest), grads = jax.value_and_grad(loss_fn, has_aux=True)(params, rest, *batch)
        updates, opt_state = optimizer.update(grads, opt_state, params)
        return (optax.apply_updates(params, updates), opt_state, rest), loss

    return (params, optimizer.init(params), rest), step


def cast_floating(tree, dtype: str):
    return jax.tree.map(lambda x: x.astype(dtype) if jnp.issubdtype(x.dtype, jnp.floating) else x, tree)


def jit_step_runner(w: Workload, x, y) -> Callable[[int], None]:
    state, step = reference_step(w)
    step = jax.jit(step, donate_argnums=0)
    batches = shuffled_batches(x, y, w.batch)

    def run(steps: int):
        nonlocal state
        losses = []
        for _ in range(steps):
            state, loss = step(state, next(batches))
            losses.append(loss)
            if len(losses) > IN_FLIGHT:
                losses.pop(0).block_until_ready()
        jax.block_until_ready(state)

    return run


def jit_scan_runner(w: Workload, x, y) -> Callable[[int], None]:
    state, step = reference_step(w)
    loop = jax.jit(lambda state, stack: jax.lax.scan(step, state, stack), donate_argnums=0)
    batches = shuffled_batches(x, y, w.batch)

    def run(steps: int):
        nonlocal state
        previous = None
        for _ in range(steps // w.k):
            stack = jax.tree.map(lambda *b: np.stack(b), *(next(batches) for _ in range(w.k)))
            state, losses = loop(state, stack)
            if previous is not None:
                previous.block_until_ready()  # at most two loops in flight
            previous = losses
        jax.block_until_ready(state)

    return run


# -- estimax ----------------------------------------------------------------------


def estimax_runner(
    w: Workload, x, y, input: str, model_dir: str | None, compilation_cache: str, **settings
) -> tuple[Callable[[int], None], ex.Estimator]:
    """``input``: "arrays" (``from_arrays``) or "iterable" (a generator of host batches). With a
    ``model_dir``: ``RunConfig``'s defaults (metrics.jsonl, TensorBoard with every step's points, a
    log line every ``log_every_steps``, checkpoints by its default policy), less what ``settings``
    (more ``RunConfig`` fields) change."""

    def model_fn(model, features, labels, mode, params):
        outputs = model(features["x"])
        if mode == ex.PREDICT:
            return ex.Spec(predictions={"y": outputs})
        return ex.Spec(loss=w.loss(outputs, labels))

    logging_settings = dict(log_every_steps=10**9) if model_dir is None else {}  # a model_dir: the defaults
    config = ex.RunConfig(
        model_dir=model_dir,
        train_batch_size=w.batch,
        steps_per_loop=w.k,
        loop="auto",
        compute_dtype=w.compute_dtype,
        compilation_cache=compilation_cache,  # the second Estimator of a workload reads the first's programs
        **logging_settings,
        **settings,
    )
    est = ex.Estimator(
        model=lambda rngs, params: w.build(rngs), model_fn=model_fn, optimizer=optax.sgd(w.lr), config=config
    )
    logging.getLogger("estimax").setLevel(logging.WARNING)
    if input == "arrays":
        data = ex.data.from_arrays({"x": x}, y)
    else:
        data = (({"x": xb}, yb) for xb, yb in shuffled_batches(x, y, w.batch))

    def run(steps: int):
        est.train(data, steps=steps)
        jax.block_until_ready(est.state())

    return run, est


# -- measurement ------------------------------------------------------------------


def steps_per_sec(run: Callable[[int], None], steps: int) -> float:
    start = time.perf_counter()
    run(steps)
    return steps / (time.perf_counter() - start)


ESTIMAX_VARIANTS = ("arrays", "arrays_model_dir", "iterable", "iterable_model_dir")


REFERENCES = ("jit_step", "jit_scan")


def benchmark(
    w: Workload,
    rounds: int,
    model_dirs: str,
    variants=ESTIMAX_VARIANTS,
    window_seconds: float | None = None,
    references=REFERENCES,
) -> dict:
    x, y = w.data()
    estimators = {
        f"{input}{suffix}": estimax_runner(w, x, y, input, model_dir, os.path.join(model_dirs, "compiled"))
        for input in ("arrays", "iterable")
        for suffix, model_dir in (("", None), ("_model_dir", os.path.join(model_dirs, f"{w.name}-{input}")))
        if f"{input}{suffix}" in variants
    }
    hand_written = {"jit_step": (jit_step_runner, 2 * w.k, w.steps), "jit_scan": (jit_scan_runner, w.k, w.scan_steps)}
    contenders = {  # name: (run, warm-up steps, timed steps); only the references asked for are built
        name: (runner(w, x, y), warmup, steps or w.steps)
        for name, (runner, warmup, steps) in hand_written.items()
        if name in references
    }
    # estimax warms up on >= 2 loops: compilation and the auto choice
    contenders |= {f"estimax_{input}": (run, 2 * w.k, w.steps) for input, (run, _) in estimators.items()}
    for name, (run, warmup, _) in contenders.items():
        start = time.perf_counter()
        run(warmup)  # compiling included
        print(f"{w.name} {name} warm-up: {time.perf_counter() - start:.1f} s", file=sys.stderr, flush=True)
    if window_seconds:  # every contender's window sized to about this long at the faster reference's rate
        rate = max(steps_per_sec(contenders[name][0], 2 * w.k) for name in references)
        steps = w.k * max(1, round(window_seconds * rate / w.k))
        contenders = {name: (run, warmup, steps) for name, (run, warmup, _) in contenders.items()}
    rates = {name: [] for name in contenders}
    names = list(contenders)
    for r in range(rounds):
        for name in names[r % len(names) :] + names[: r % len(names)]:  # each round starts one later: no fixed order
            run, _, steps = contenders[name]
            rates[name].append(steps_per_sec(run, steps))
        progress = {name: round(values[-1], 2) for name, values in rates.items()}
        print(f"{w.name} round {r + 1} steps/s: {json.dumps(progress)}", file=sys.stderr, flush=True)
    best = {name: max(values) for name, values in rates.items()}
    reference = max(best[name] for name in references)
    # Paired within each round (the same minutes of the machine): estimax against the faster reference, and
    # a model_dir against none on the same input.
    round_reference = [max(pair) for pair in zip(*(rates[name] for name in references), strict=True)]
    paired = {
        f"ratio_{input}_rounds": spread(
            [a / b for a, b in zip(rates[f"estimax_{input}"], round_reference, strict=True)]
        )
        for input in estimators
    }
    paired |= {
        f"model_dir_vs_none_{input}_rounds": spread(
            [a / b for a, b in zip(rates[f"estimax_{input}_model_dir"], rates[f"estimax_{input}"], strict=True)]
        )
        for input in ("arrays", "iterable")
        if f"{input}_model_dir" in estimators and input in estimators
    }
    return {
        "workload": w.name,
        "device": jax.devices()[0].device_kind,
        "batch": w.batch,
        "steps_per_loop": w.k,
        "compute_dtype": w.compute_dtype,
        "window_steps": {name: steps for name, (_, _, steps) in contenders.items()},
        **{f"{name}_steps_per_sec": round(value, 2) for name, value in best.items()},
        "steps_per_sec_rounds": {name: [round(v, 1) for v in values] for name, values in rates.items()},
        "estimax_loop": {input: est.compiled().loop for input, (_, est) in estimators.items()},
        **{f"ratio_{input}": round(best[f"estimax_{input}"] / reference, 3) for input in estimators},
        **paired,
        **model_rates(w, x, y, best),
    }


def spread(values: list[float]) -> dict[str, float]:
    """min, median and max of per-round ratios."""
    ordered = sorted(values)
    return {"min": round(ordered[0], 3), "median": round(float(np.median(ordered)), 3), "max": round(ordered[-1], 3)}


def model_rates(w: Workload, x, y, best: dict[str, float]) -> dict:
    """Tokens/s (token workloads), achieved TFLOP/s and, where the device's peak is known, MFU of
    each contender, from the compiler's FLOP count of the hand-written step (the same model)."""
    state, step = reference_step(w)
    flops_per_step = flops.step_flops(jax.jit(step), state, next(shuffled_batches(x, y, w.batch)))
    rates = {}
    if w.tokens:
        rates["tokens_per_sec"] = {name: round(value * w.batch * w.x_shape[0]) for name, value in best.items()}
    if flops_per_step is not None:
        peak = flops.device_peak(w.compute_dtype)
        achieved = {name: flops.achieved(flops_per_step, value, 1, peak) for name, value in best.items()}
        rates["tflops_per_sec"] = {name: float(f"{a['tflops_per_device']:.3g}") for name, a in achieved.items()}
        if peak is not None:
            rates["mfu"] = {name: round(a["mfu"], 3) for name, a in achieved.items()}
    return rates


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="a smoke run: tiny windows, one round")
    parser.add_argument(
        "--workloads",
        default=",".join(DEFAULT_WORKLOADS),
        help=f"comma-separated subset of {', '.join(WORKLOADS)} (default: {', '.join(DEFAULT_WORKLOADS)})",
    )
    parser.add_argument(
        "--estimax",
        default=",".join(ESTIMAX_VARIANTS),
        help="the estimax runs to time: comma-separated subset of " + ", ".join(ESTIMAX_VARIANTS),
    )
    parser.add_argument(
        "--references",
        default=",".join(REFERENCES),
        help="the hand-written loops to time: comma-separated subset of " + ", ".join(REFERENCES),
    )
    parser.add_argument("--rounds", type=int, default=3, help="timed windows per contender (best is kept)")
    parser.add_argument(
        "--window-seconds",
        type=float,
        help="size every timed window to about this many seconds (for accelerators, where the CPU-sized "
        "windows last milliseconds); default: each workload's fixed steps",
    )
    args = parser.parse_args(argv)
    names = [n for n in args.workloads.split(",") if n]
    unknown = sorted(set(names) - WORKLOADS.keys())
    if unknown:
        parser.error(f"unknown workloads {unknown}; expected some of {sorted(WORKLOADS)}")
    variants = [v for v in args.estimax.split(",") if v]
    if not set(variants) <= set(ESTIMAX_VARIANTS):
        parser.error(
            f"unknown estimax runs {sorted(set(variants) - set(ESTIMAX_VARIANTS))}; expected some of {ESTIMAX_VARIANTS}"
        )
    references = [r for r in args.references.split(",") if r]
    if not references or not set(references) <= set(REFERENCES):
        parser.error(f"--references {args.references!r}: expected some of {REFERENCES}")
    start = time.perf_counter()
    with tempfile.TemporaryDirectory() as model_dirs:
        for name in names:
            w = quick(WORKLOADS[name]) if args.quick else WORKLOADS[name]
            print(
                json.dumps(
                    benchmark(
                        w, 1 if args.quick else args.rounds, model_dirs, variants, args.window_seconds, references
                    )
                ),
                flush=True,
            )
    print(f"total {time.perf_counter() - start:.1f} s", file=sys.stderr)


if __name__ == "__main__":
    main()
