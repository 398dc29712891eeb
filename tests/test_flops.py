"""FLOP counts against the analytic formulas, FLOP/s and MFU in the records, the LM's fused
attention against the attention written out, and the GPT-2 small preset's shape."""

import json
import os

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx

import estimax as ex
from estimax.examples import lm
from estimax.records import flops


class Seen(ex.Hook):
    """What a user's hook receives: the compiler's FLOPs of one training step."""

    flops_per_step = None

    def after_loop(self, loop):
        self.flops_per_step = loop.flops_per_step


class Dense(nnx.Module):
    """Three wide layers behind a narrow input, so that the first layer (no input gradient) is negligible."""

    def __init__(self, rngs):
        self.layers = nnx.List(
            [nnx.Linear(a, b, use_bias=False, rngs=rngs) for a, b in ((4, 512), (512, 512), (512, 512), (512, 512))]
        )

    def __call__(self, x):
        for layer in self.layers:
            x = layer(x)
        return x


def squared_error(model, features, labels, mode, params):
    outputs = model(features["x"])
    return ex.Spec(loss=jnp.mean((outputs - labels) ** 2, axis=-1), predictions=outputs)


def test_a_dense_step_costs_six_flops_per_parameter_and_example():
    batch, seen = 64, Seen()
    est = ex.Estimator(
        lambda rngs, params: Dense(rngs),
        squared_error,
        optax.sgd(1e-3),
        ex.RunConfig(train_batch_size=batch, steps_per_loop=2, quiet=True),
    )
    x = np.zeros((256, 4), np.float32)
    est.train(ex.data.from_arrays({"x": x}, np.zeros((256, 512), np.float32)), max_steps=4, hooks=[seen])
    parameters = 4 * 512 + 3 * 512 * 512
    assert seen.flops_per_step == pytest.approx(6 * parameters * batch, rel=0.1)


@pytest.mark.parametrize("grad_accum_steps", [1, 4])
def test_the_rolled_loop_is_counted_as_one_step_like_the_step_loop(grad_accum_steps):
    # The rolled loop's count is of its own lowering (XLA counts a loop's body once), the step loop's of the step's;
    # with its last step apart (GPUs' loop, here on the CPU) the rolled loop holds two steps: the step is counted.
    counts = {}
    for loop, apart in (("scan", False), ("scan", True), ("step", False)):
        seen = Seen()
        config = ex.RunConfig(
            train_batch_size=64, steps_per_loop=3, loop=loop, grad_accum_steps=grad_accum_steps, quiet=True
        )
        est = ex.Estimator(lambda rngs, params: Dense(rngs), squared_error, optax.sgd(1e-3), config)
        est.core.last_step_apart = apart
        x = np.zeros((256, 4), np.float32)
        est.train(ex.data.from_arrays({"x": x}, np.zeros((256, 512), np.float32)), max_steps=3, hooks=[seen])
        counts[loop, apart] = seen.flops_per_step
    parameters = 4 * 512 + 3 * 512 * 512
    step = counts["step", False]
    assert counts["scan", False] == pytest.approx(step, rel=1e-4), counts  # the loop's counter: a few FLOPs
    assert counts["scan", True] == step and step == pytest.approx(6 * parameters * 64, rel=0.1), counts


def test_the_lm_step_costs_what_the_transformer_formula_says():
    sizes = {"seq_len": 64, "dim": 128, "num_heads": 4, "num_layers": 2, "mlp_ratio": 4}
    batch, seen = 8, Seen()
    est = lm.estimator(ex.RunConfig(train_batch_size=batch, steps_per_loop=2, loop="step", quiet=True), **sizes)
    windows = np.arange(16 * 65, dtype=np.int32).reshape(16, 65) % 256
    data = ex.data.from_arrays({"bytes": windows[:, :-1]}, windows[:, 1:])
    est.train(data, max_steps=2, hooks=[seen])
    d, layers, length = sizes["dim"], sizes["num_layers"], sizes["seq_len"]
    matmul_parameters = layers * (4 * d * d + 2 * sizes["mlp_ratio"] * d * d) + d * lm.VOCAB_SIZE
    # Per token: 6 per matmul parameter, and 12 * layers * context * width for the attention scores
    # and their weighted sum, forward and backward (the causal mask saves nothing in a dense kernel).
    per_token = 6 * matmul_parameters + 12 * layers * length * d
    assert seen.flops_per_step == pytest.approx(per_token * batch * length, rel=0.1)


def test_records_carry_tflops_per_device_and_no_mfu_without_a_known_peak(tmp_path, estimax_log):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    est = lm.estimator(
        ex.RunConfig(
            model_dir=str(tmp_path), train_batch_size=8, steps_per_loop=2, log_every_steps=2, tensorboard=True
        ),
        seq_len=32,
        dim=32,
        num_heads=2,
        num_layers=1,
    )
    windows = np.arange(16 * 33, dtype=np.int32).reshape(16, 33) % 256
    est.train(ex.data.from_arrays({"bytes": windows[:, :-1]}, windows[:, 1:]), max_steps=8)
    with open(os.path.join(tmp_path, "metrics.jsonl")) as f:
        timed = [r for r in map(json.loads, f) if r["split"] == "train" and "steps_per_sec" in r]
    assert timed and all(r["tflops_per_device"] > 0 and "mfu" not in r for r in timed)
    # The LM declares its tokens per example (its sequence length): tokens/s = examples/s x 32.
    assert all(r["tokens_per_sec"] == pytest.approx(r["examples_per_sec"] * 32) for r in timed)
    # The same values in TensorBoard, at the log points, and in the train lines.
    events = EventAccumulator(str(tmp_path))
    events.Reload()
    assert "train/mfu" not in events.Tags()["scalars"]
    by_step = {e.step: e.value for e in events.Scalars("train/tflops_per_device")}
    for record in timed:
        assert by_step[record["step"]] == pytest.approx(record["tflops_per_device"], rel=1e-6)  # float32 in events
    timed_lines = [line for line in estimax_log.messages if line.startswith("train step") and "steps/s" in line]
    assert len(timed_lines) == len(timed)
    assert all("tflops_per_device" in line and "tokens/s" in line and "mfu" not in line for line in timed_lines)


def test_the_host_counts_a_lowered_program_as_its_own_backend_does():
    """GPUs and TPUs (PJRT plugins) cannot analyse a lowered program; the host's client counts it for
    them (a private JAX function, named here so that a JAX that renames it fails this test)."""
    step = jax.jit(lambda w, x: jax.grad(lambda w: jnp.sum(jnp.tanh(x @ w) ** 2))(w))
    lowered = step.lower(jnp.ones((64, 32)), jnp.ones((16, 64)))
    on_host = flops.host_cost_analysis(lowered)
    own = lowered.cost_analysis()
    own = own[0] if isinstance(own, (list, tuple)) else own
    assert on_host["flops"] == own["flops"] >= 2 * (2 * 16 * 64 * 32)  # the forward and the kernel-gradient matmuls


class OnAPlugin:
    """A jitted step whose lowered program gives no cost analysis, as on CUDA and TPU (PJRT plugins:
    ``Lowered.cost_analysis()`` is None there; seen on an H200 with jax 0.11.2)."""

    def __init__(self, jitted):
        self.jitted = jitted

    def lower(self, *args):
        lowered = self.jitted.lower(*args)
        return type("PluginLowered", (), {"cost_analysis": lambda self: None, "compiler_ir": lowered.compiler_ir})()


def test_a_step_on_a_backend_without_cost_analysis_is_counted_by_the_host():
    step = jax.jit(lambda w, x: jax.grad(lambda w: jnp.sum(jnp.tanh(x @ w) ** 2))(w))
    args = jnp.ones((64, 32)), jnp.ones((16, 64))
    assert flops.step_flops(OnAPlugin(step), *args, micro_batches=2) == flops.step_flops(step, *args, micro_batches=2)


def test_peaks_are_dense_and_mfu_divides_by_them():
    assert flops.peak_tflops("NVIDIA H100 80GB HBM3", "bfloat16") == 989.0  # not the 1,979 with sparsity
    assert flops.peak_tflops("NVIDIA H100 PCIe", "bfloat16") == 756.0
    assert flops.peak_tflops("NVIDIA H100 80GB HBM3", None) == 494.5  # float32 matmuls run as TF32
    assert flops.peak_tflops("TPU v5 lite", "bfloat16") == 197.0
    assert flops.peak_tflops("TPU v5p", None) == 459.0
    assert flops.peak_tflops("cpu", None) is None
    assert flops.achieved(4e12, 100.0, 4, 989.0) == pytest.approx({"tflops_per_device": 100.0, "mfu": 100 / 989})
    assert flops.achieved(4e12, 100.0, 4, None) == {"tflops_per_device": 100.0}


@pytest.mark.parametrize("dtype, tolerance", [(jnp.float32, 1e-5), (jnp.bfloat16, 2e-2)])
def test_fused_attention_equals_attention_written_out(dtype, tolerance):
    attention = lm.Attention(64, 4, rngs=nnx.Rngs(0))
    x = jax.random.normal(jax.random.key(1), (2, 16, 64)).astype(dtype)
    got = attention(x)

    def heads(y):
        return y.reshape(2, 16, 4, 16)

    q, k, v = (heads(layer(x)) for layer in (attention.query, attention.key, attention.value))
    scores = jnp.einsum("bqhd,bkhd->bhqk", q, k).astype(jnp.float32) / np.sqrt(16)
    causal = jnp.tril(jnp.ones((16, 16), bool))
    weights = jax.nn.softmax(jnp.where(causal, scores, -jnp.inf), axis=-1).astype(dtype)
    expected = attention.out(jnp.einsum("bhqk,bkhd->bqhd", weights, v).reshape(2, 16, 64))
    np.testing.assert_allclose(np.asarray(got, np.float32), np.asarray(expected, np.float32), atol=tolerance)


def test_gpt2_small_preset_has_its_shape():
    params = {**lm.params, "preset": "gpt2-small"}
    shapes = nnx.eval_shape(lambda: lm.model(nnx.Rngs(0), params))
    count = sum(x.size for x in jax.tree.leaves(nnx.state(shapes, nnx.Param)))
    d, layers, vocab, context = 768, 12, lm.VOCAB_SIZE, 1024
    # Per block: q, k, v, out (4d^2), the MLP (8d^2), two LayerNorms (4d); embeddings, a final LayerNorm, the head.
    assert count == layers * (12 * d * d + 4 * d) + vocab * d + context * d + 2 * d + d * vocab
    config = lm.run_config(ex.RunConfig(), params)
    assert (config.tokens_per_example, config.compute_dtype) == (1024, "bfloat16")
    with pytest.raises(ValueError, match="preset='gpt3'"):
        lm.sizes({**lm.params, "preset": "gpt3"})
