"""The digits CNN's convolutions: XLA's own against ``windowed_conv`` (matrix products of shifted windows).

``estimax/examples/digits.py`` gives its two ``nnx.Conv`` layers ``windowed_conv`` as their
``conv_general_dilated``. This times, in one process, the digits CNN's whole training step (forward,
backward, AdamW; batch 128 of 8x8 images, dropout on) built both ways, and the second layer's
convolution alone (forward, and forward with both gradients), the candidates' timed windows
alternating for a few rounds. One JSON line per measurement: the best ms per call of each, every
round's, and ``speedup`` = XLA's convolution / windowed (best against best; ``speedup_rounds``:
min and max of the ratios paired within each round).
Run: ``python benchmarks/digits_conv.py`` (about a minute on 2 cores); ``--rounds``, ``--calls``.
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

from estimax.examples import digits


def cnn(windowed: bool) -> digits.CNN:
    model = digits.CNN(rngs=nnx.Rngs(0, dropout=1))
    if not windowed:
        for layer in (model.conv1, model.conv2):
            layer.conv_general_dilated = jax.lax.conv_general_dilated
    return model


def train_step(windowed: bool):
    """A jitted AdamW step of the digits CNN, and its arguments."""
    model = cnn(windowed)
    optimizer = nnx.Optimizer(model, optax.adamw(1e-3, weight_decay=1e-4), wrt=nnx.Param)

    @nnx.jit
    def step(model, optimizer, images, labels):
        def loss(model):
            return optax.softmax_cross_entropy_with_integer_labels(model(images), labels).mean()

        value, grads = nnx.value_and_grad(loss)(model)
        optimizer.update(model, grads)
        return value

    rng = np.random.default_rng(0)
    images = jnp.asarray(rng.random((128, 8, 8), np.float32))
    labels = jnp.asarray(rng.integers(0, 10, 128, np.int32))
    return step, (model, optimizer, images, labels)


def conv2(windowed: bool, gradients: bool):
    """The second layer's convolution (4x4x32 -> 4x4x64, a 5x5 kernel) on a batch of 128."""
    conv = digits.windowed_conv if windowed else jax.lax.conv_general_dilated
    options = {name: value for name, value in digits.WINDOWED.items() if name not in ("window_strides", "padding")}

    def forward(x, kernel):
        return conv(x, kernel, (1, 1), "SAME", **options)

    function = jax.grad(lambda x, k: (forward(x, k) ** 2).sum(), argnums=(0, 1)) if gradients else forward
    rng = np.random.default_rng(0)
    x = jnp.asarray(rng.standard_normal((128, 4, 4, 32), np.float32))
    kernel = jnp.asarray(rng.standard_normal((5, 5, 32, 64), np.float32))
    return jax.jit(function), (x, kernel)


def timed(function, args, calls: int) -> float:
    """Milliseconds per call over ``calls`` calls."""
    began = time.perf_counter()
    for _ in range(calls):
        out = function(*args)
    jax.block_until_ready(out)
    return (time.perf_counter() - began) / calls * 1e3


def compare(name: str, build, rounds: int, calls: int) -> dict:
    candidates = {"xla_conv": build(False), "windowed": build(True)}
    for function, args in candidates.values():
        timed(function, args, 2)  # compiled before timing
    times = {label: [] for label in candidates}
    for round_ in range(rounds):
        order = list(candidates)[round_ % 2 :] + list(candidates)[: round_ % 2]  # each round starts with the next
        for label in order:
            times[label].append(timed(*candidates[label], calls))
    paired = [xla / windowed for xla, windowed in zip(times["xla_conv"], times["windowed"], strict=True)]
    return {
        "measure": name,
        **{f"{label}_ms": round(min(ms), 2) for label, ms in times.items()},
        **{f"{label}_ms_rounds": [round(ms, 2) for ms in values] for label, values in times.items()},
        "speedup": round(min(times["xla_conv"]) / min(times["windowed"]), 2),
        "speedup_rounds": [round(min(paired), 2), round(max(paired), 2)],
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=4)
    parser.add_argument("--calls", type=int, default=40)
    args = parser.parse_args()
    builds = {
        "train_step": train_step,
        "conv2_forward": lambda windowed: conv2(windowed, gradients=False),
        "conv2_forward_and_gradients": lambda windowed: conv2(windowed, gradients=True),
    }
    for name, build in builds.items():
        print(json.dumps(compare(name, build, args.rounds, args.calls)), flush=True)


if __name__ == "__main__":
    main()
