"""Where arrays live: sharding rules, FSDP and tensor parallel on 8 simulated devices.

References are always the pure data-parallel run of the same model, seed and
data (`mesh=None`), or a checkpoint's own arrays; never numbers the layout printed.
"""

import os
import shutil
import subprocess
import sys
import time

import jax
import jax.numpy as jnp
import numpy as np
import optax
import orbax.checkpoint as ocp
import pytest
import warm
from flax import nnx
from jax.sharding import PartitionSpec as P
from models import blobs
from models import estimator as mlp_estimator

import estimax as ex
from estimax import cli
from estimax import layout as layout_lib
from estimax.cli import flags
from estimax.state import leaf_names

TESTS = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(TESTS)

TP_RULES = [
    (r"attn/(query|key|value)/kernel", (None, "model")),  # column parallel: heads split over "model"
    (r"attn/(query|key|value)/bias", ("model",)),
    (r"attn/out/kernel", ("model", None)),  # row parallel
    (r"mlp/up/kernel", (None, "model")),
    (r"mlp/up/bias", ("model",)),
    (r"mlp/down/kernel", ("model", None)),
]


class Attention(nnx.Module):
    def __init__(self, d: int, heads: int, rngs: nnx.Rngs):
        self.heads = heads
        self.query, self.key, self.value = (nnx.Linear(d, d, rngs=rngs) for _ in range(3))
        self.out = nnx.Linear(d, d, rngs=rngs)

    def __call__(self, x):
        b, t, d = x.shape
        split = lambda y: y.reshape(b, t, self.heads, d // self.heads)  # noqa: E731
        q, k, v = split(self.query(x)), split(self.key(x)), split(self.value(x))
        weights = jax.nn.softmax(jnp.einsum("bthd,bshd->bhts", q, k) / np.sqrt(d // self.heads), axis=-1)
        return self.out(jnp.einsum("bhts,bshd->bthd", weights, v).reshape(b, t, d))


class MLPBlock(nnx.Module):
    def __init__(self, d: int, hidden: int, rngs: nnx.Rngs):
        self.up, self.down = nnx.Linear(d, hidden, rngs=rngs), nnx.Linear(hidden, d, rngs=rngs)

    def __call__(self, x):
        return self.down(nnx.gelu(self.up(x)))


class Tiny(nnx.Module):
    """One pre-norm transformer block over 4 positions of 6 features, then a 3-way classifier."""

    def __init__(self, rngs: nnx.Rngs, d: int = 32, hidden: int = 64, heads: int = 4):
        self.embed = nnx.Linear(6, d, rngs=rngs)
        self.norm1, self.norm2 = nnx.LayerNorm(d, rngs=rngs), nnx.LayerNorm(d, rngs=rngs)
        self.attn, self.mlp = Attention(d, heads, rngs), MLPBlock(d, hidden, rngs)
        self.head = nnx.Linear(d, 3, rngs=rngs)

    def __call__(self, x):
        h = self.embed(x)
        h = h + self.attn(self.norm1(h))
        h = h + self.mlp(self.norm2(h))
        return self.head(h.mean(axis=1))


def tiny_model_fn(model, features, labels, mode, params):
    logits = model(features["x"])
    if mode == ex.PREDICT:
        return ex.Spec(predictions={"logits": logits})
    return ex.Spec(loss=optax.softmax_cross_entropy_with_integer_labels(logits, labels))


def sequences(n: int = 256, seed: int = 0):
    features, labels = blobs(n, seed)
    noise = np.random.default_rng(seed + 1).normal(size=(n, 4, 6)).astype(np.float32)
    return {"x": features["x"][:, None, :] + 0.5 * noise}, labels


def tiny(model_dir=None, optimizer=None, **config):
    config.setdefault("train_batch_size", 32)
    config.setdefault("steps_per_loop", 25)
    config.setdefault("loop", "scan")
    config.setdefault("quiet", True)
    return ex.Estimator(
        model=lambda rngs, params: Tiny(rngs),
        model_fn=tiny_model_fn,
        optimizer=optimizer or optax.sgd(0.1),
        config=ex.RunConfig(model_dir=model_dir, **config),
    )


MLP_LAYOUT = dict(  # tests/models.py's MLP: l1 column parallel, l2 row parallel, and FSDP
    mesh={"data": 2, "fsdp": 2, "model": 2},
    sharding_rules=[(r"l1/kernel", (None, "model")), (r"l1/bias", ("model",)), (r"l2/kernel", ("model", None))],
    fsdp_min_bytes=0,
)

LAYOUTS = {
    "fsdp=8": dict(mesh={"fsdp": 8}, fsdp_min_bytes=0),
    "data=4,model=2": dict(mesh={"data": 4, "model": 2}, sharding_rules=TP_RULES),
    "data=2,fsdp=2,model=2": dict(mesh={"data": 2, "fsdp": 2, "model": 2}, sharding_rules=TP_RULES, fsdp_min_bytes=0),
}


def host_params(est) -> dict[str, np.ndarray]:
    state = est.state()
    return dict(zip(leaf_names(state.params), map(np.asarray, jax.tree.leaves(state.params)), strict=True))


def relative_difference(a: dict, b: dict) -> float:
    """``|a - b| / |b|`` over all parameters together (a leaf whose gradient is 0, like attention's
    key bias, holds only rounding noise that a per-leaf ratio would blow up)."""
    assert a.keys() == b.keys()
    flat = lambda t: np.concatenate([t[k].ravel() for k in sorted(t)])  # noqa: E731
    return float(np.linalg.norm(flat(a) - flat(b)) / np.linalg.norm(flat(b)))


def per_device_bytes(tree) -> int:
    """The most bytes any one device holds of ``tree``, from the arrays' own shards."""
    held: dict = {}
    for leaf in jax.tree.leaves(tree):
        for shard in leaf.addressable_shards:
            held[shard.device] = held.get(shard.device, 0) + shard.data.nbytes
    return max(held.values())


@pytest.fixture(scope="module")
def data_parallel():
    est = tiny()
    est.train(ex.data.from_arrays(*sequences()), max_steps=50)
    return host_params(est)


@pytest.mark.parametrize("name", list(LAYOUTS))
def test_sharded_layouts_end_within_1e_5_of_data_parallel_after_50_sgd_steps(data_parallel, name):
    est = tiny(**LAYOUTS[name])
    est.train(ex.data.from_arrays(*sequences()), max_steps=50)
    plan = {row.path: row.spec for row in est.sharding_plan()}
    state = est.state()
    for path, leaf in zip(leaf_names(state.params), jax.tree.leaves(state.params), strict=True):
        assert leaf.sharding.spec == plan[path], path  # the arrays live where the plan says
    if "model" in name:
        assert plan["attn/query/kernel"][1] == "model" and plan["mlp/down/kernel"][0] == "model"
    if "fsdp" in name:
        assert any("fsdp" in str(spec) for spec in plan.values())
    assert relative_difference(host_params(est), data_parallel) < 1e-5


def test_mesh_none_is_the_1d_data_mesh_bit_for_bit():
    a, b = mlp_estimator(), mlp_estimator(mesh={"data": -1})
    assert a.mesh.shape == b.mesh.shape == {"data": 8}
    for est in (a, b):
        est.train(ex.data.from_arrays(*blobs(256)), max_steps=8)
    assert all(row.spec == P() for row in a.sharding_plan())
    pa, pb = host_params(a), host_params(b)
    for k in pa:
        np.testing.assert_array_equal(pa[k], pb[k])


def test_minus_one_takes_the_rest_and_axes_are_laid_out_data_fsdp_then_model():
    est = tiny(mesh={"model": 2, "data": -1}, sharding_rules=TP_RULES)
    assert dict(est.mesh.shape) == {"data": 4, "model": 2}
    est = tiny(mesh={"fsdp": -1})
    assert dict(est.mesh.shape) == {"data": 1, "fsdp": 8}
    assert flags.mesh_axes("data=4,model=-1") == {"data": 4, "model": -1}  # estimax train --mesh data=4,model=-1
    assert flags.with_fsdp(None, 8) == {"data": -1, "fsdp": 8}  # --fsdp 8
    assert flags.with_fsdp({"data": 2, "model": 2}, 2) == {"data": 2, "model": 2, "fsdp": 2}
    assert flags.with_fsdp({"model": 2}, 2) == {"data": -1, "model": 2, "fsdp": 2}


@pytest.mark.parametrize(
    "optimizer",
    [
        optax.adam(1e-3),
        optax.chain(optax.clip_by_global_norm(1.0), optax.inject_hyperparams(optax.adamw)(learning_rate=1e-3)),
    ],
    ids=["adam", "inject_hyperparams"],
)
def test_optimizer_state_has_exactly_its_parameters_sharding(optimizer):
    est = tiny(optimizer=optimizer, skip_nonfinite=True, **LAYOUTS["data=2,fsdp=2,model=2"])
    state = est.state()
    specs = dict(zip(leaf_names(state.params), (x.sharding.spec for x in jax.tree.leaves(state.params)), strict=True))
    assert any(spec != P() for spec in specs.values())
    mirrored = 0
    for path, leaf in jax.tree_util.tree_leaves_with_path(state.opt_state):
        name = jax.tree_util.keystr(path, simple=True, separator="/").removesuffix("/value")
        owner = [p for p in specs if name.endswith("/" + p)]
        if owner:  # mu/nu of a parameter
            assert leaf.sharding.spec == specs[owner[0]], name
            mirrored += 1
        else:  # counts, hyper-parameters, apply_if_finite's counters
            assert leaf.ndim == 0 and leaf.sharding.spec == P(), name
    assert mirrored == 2 * len(specs)


def test_fsdp_8_holds_an_eighth_of_the_state_per_device():
    def wide(rngs, params):
        return nnx.Sequential(nnx.Linear(64, 2048, rngs=rngs), nnx.relu, nnx.Linear(2048, 64, rngs=rngs))

    def run(**config):
        est = ex.Estimator(
            model=wide,
            model_fn=lambda m, f, y, mode, p: ex.Spec(loss=jnp.mean((m(f["x"]) - y) ** 2, axis=-1)),
            optimizer=optax.adam(1e-3),
            config=ex.RunConfig(train_batch_size=16, steps_per_loop=2, quiet=True, **config),
        )
        x = np.random.default_rng(0).normal(size=(64, 64)).astype(np.float32)
        est.train(ex.data.from_arrays({"x": x}, x), max_steps=2)
        return est, per_device_bytes(est.state())

    replicated, replicated_bytes = run()
    sharded, sharded_bytes = run(mesh={"fsdp": 8})
    assert sharded_bytes <= 1.05 * replicated_bytes / 8
    assert sharded.sharding_plan().totals["total"] == sharded_bytes
    assert replicated.sharding_plan().totals["total"] == replicated_bytes == sharded.sharding_plan().replicated_total


def test_the_plan_lists_every_parameter_and_the_first_log_line_states_bytes_per_device(estimax_log):
    est = tiny(**LAYOUTS["data=2,fsdp=2,model=2"])
    plan = est.sharding_plan()
    assert [r.path for r in plan if r.kind == "params"] == leaf_names(est.state_shapes().params)
    row = next(r for r in plan if r.path == "attn/query/kernel")
    assert (row.shape, row.dtype, row.spec) == ((32, 32), "float32", P("fsdp", "model"))
    assert row.bytes_per_device == 32 * 32 * 4 // 4 and row.placed_by == "rule 0 + fsdp"
    assert next(r for r in plan if r.path == "norm1/scale").placed_by == "fsdp"
    assert next(r for r in plan if r.path == "head/bias").placed_by == "replicated"  # 3 does not divide by fsdp=2
    assert plan.totals["params"] == sum(r.bytes_per_device for r in plan if r.kind == "params")
    assert plan.totals["total"] == sum(plan.totals[k] for k in ("params", "opt_state", "model_state", "other"))
    text = str(plan)
    assert "attn/query/kernel" in text and "P('fsdp', 'model')" in text and "per device: params" in text
    est = mlp_estimator(**MLP_LAYOUT)
    est.train(ex.data.from_arrays(*blobs(64)), max_steps=1)
    first = next(line for line in estimax_log.messages if line.startswith("Training steps"))
    assert f"state {layout_lib.format_bytes(est.sharding_plan().totals['total'])} per device" in first
    assert "mesh data=2 x fsdp=2 x model=2" in first


def test_nnx_declared_shardings_are_followed_and_rules_override_them():
    def annotated(rngs, params):
        kernel = nnx.with_partitioning(nnx.initializers.lecun_normal(), (None, "model"))
        return nnx.Sequential(nnx.Linear(6, 16, kernel_init=kernel, rngs=rngs), nnx.relu, nnx.Linear(16, 3, rngs=rngs))

    def make(**config):
        return ex.Estimator(
            model=annotated,
            model_fn=lambda m, f, y, mode, p: ex.Spec(
                loss=optax.softmax_cross_entropy_with_integer_labels(m(f["x"]), y)
            ),
            optimizer=optax.sgd(0.1),
            config=ex.RunConfig(
                train_batch_size=32, steps_per_loop=5, quiet=True, mesh={"data": 4, "model": 2}, **config
            ),
        )

    est = make()
    row = next(r for r in est.sharding_plan() if r.path == "layers/0/kernel")
    assert (row.spec, row.placed_by) == (P(None, "model"), "nnx out_sharding")
    est.train(ex.data.from_arrays(*blobs(64)), max_steps=5)
    assert est.state().params["layers"][0]["kernel"].get_value().sharding.spec == P(None, "model")
    est = make(sharding_rules=[(r"layers/0/kernel", (None, None))])
    assert next(r for r in est.sharding_plan() if r.path == "layers/0/kernel").spec == P()


@pytest.mark.parametrize(
    ("config", "message"),
    [
        (
            dict(mesh={"data": 4, "model": 2}, sharding_rules=[(r"attn/qkv/kernel", (None, "model"))]),
            r"sharding_rules 0: \('attn/qkv/kernel'.*match no parameter.*attn/query/kernel.*Fix: correct the regex",
        ),
        (
            dict(mesh={"data": 4, "model": 2}, sharding_rules=[(r"attn/query/kernel", ("model",))]),
            r"parameter attn/query/kernel of shape \(32, 32\).*sharding_rules\[0\].*1 entries for 2 dimensions"
            r".*Fix: e.g. \('model', None\)",
        ),
        (
            dict(mesh={"data": 4, "model": 2}, sharding_rules=[(r"head/kernel", (None, "model"))]),
            r"parameter head/kernel of shape \(32, 3\).*dimension 1 has size 3, which does not divide over "
            r"'model' \(2 devices\)",
        ),
        (
            dict(mesh={"data": 8}, sharding_rules=[(r"mlp/up/kernel", (None, "tensor"))]),
            r"parameter mlp/up/kernel of shape \(32, 64\).*the mesh has no axis 'tensor'.*Fix: add 'tensor'",
        ),
        (dict(mesh={"data": 3, "model": 2}), r"takes 6 devices but there are 8.*Fix: give one axis -1"),
        (dict(mesh={"data": -1, "model": 3}), r"fixed axes take 3 devices, which does not divide the 8 devices"),
    ],
    ids=["matches-nothing", "rank", "indivisible", "unknown-axis", "mesh-size", "minus-one"],
)
def test_a_layout_that_cannot_be_made_is_an_error_before_compiling(config, message):
    with pytest.raises(ValueError, match=message):
        tiny(**config)


def test_settings_are_checked_when_the_config_is_made():
    with pytest.raises(ValueError, match=r"several -1 axes"):
        ex.RunConfig(mesh={"data": -1, "fsdp": -1})
    with pytest.raises(ValueError, match=r"axis 'model' size 0; expected a positive integer or -1"):
        ex.RunConfig(mesh={"data": 4, "model": 0})
    with pytest.raises(TypeError, match=r"has spec 'model'; expected a tuple"):
        ex.RunConfig(sharding_rules=[(r".*kernel", "model")])
    with pytest.raises(ValueError, match=r"'\(unclosed' is not a regex"):
        ex.RunConfig(sharding_rules=[(r"(unclosed", (None,))])
    est = tiny(mesh={"data": 2, "fsdp": 2, "model": 2}, train_batch_size=10)
    with pytest.raises(
        ValueError,
        match=r"train_batch_size=10\) does not divide the 4 devices of the batch axes data=2 x fsdp=2.*use 8 or 12",
    ):
        est.train(ex.data.from_arrays(*sequences(64)), max_steps=1)


def test_eval_predict_and_model_on_a_tensor_parallel_state_match_data_parallel():
    features, labels = blobs(101)  # not a multiple of the batch: padding is masked
    data = ex.data.from_arrays(features, labels)
    results, predictions, outputs = [], [], []
    for config in ({}, MLP_LAYOUT):
        est = mlp_estimator(eval_batch_size=16, **config)
        est.train(data, max_steps=4)
        results.append(est.evaluate(data))
        predictions.append(np.stack([p["logits"] for p in est.predict(data)]))
        model = est.model()
        assert all(x.sharding.is_fully_replicated for x in jax.tree.leaves(nnx.state(model)))  # gathered
        outputs.append(np.asarray(model(jnp.asarray(features["x"][:5]))))
    assert results[0]["num_examples"] == results[1]["num_examples"] == 101
    np.testing.assert_allclose(results[1]["loss"], results[0]["loss"], rtol=1e-5)
    assert predictions[0].shape == predictions[1].shape == (101, 3)
    np.testing.assert_allclose(predictions[1], predictions[0], rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(outputs[1], outputs[0], rtol=1e-5, atol=1e-6)


def test_nonfinite_detection_names_sharded_parameters_and_skipping_keeps_the_layout():
    features, labels = blobs(64)
    features["x"][3, 0] = np.nan  # in one of the two batches of the first two steps
    data = ex.data.from_arrays(features, labels)
    with pytest.raises(ex.NonFiniteError, match=r"l1/kernel"):
        mlp_estimator(steps_per_loop=2, **MLP_LAYOUT).train(data, max_steps=2)
    est = mlp_estimator(steps_per_loop=2, skip_nonfinite=True, **MLP_LAYOUT)
    est.train(data, max_steps=2)
    state = est.state()
    assert state.params["l1"]["kernel"].get_value().sharding.spec == P("fsdp", "model")
    assert int(state.step) == 2 and np.isfinite(host_params(est)["l1/kernel"]).all()
    assert int(state.opt_state.total_notfinite) == 1


def test_a_fsdp_checkpoint_restores_bitwise_in_other_layouts_and_training_continues(tmp_path):
    data = ex.data.from_arrays(*blobs(256))
    saved_dir = str(tmp_path / "fsdp")
    adam = dict(optimizer=optax.adam(1e-2), dropout=0.0, save_every_steps=4)
    saved = mlp_estimator(saved_dir, mesh={"fsdp": 8}, fsdp_min_bytes=0, **adam)
    saved.train(data, max_steps=4)
    saved_state = jax.device_get(saved.state())
    saved.train(data, max_steps=8)
    continued = host_params(saved)
    tensor_parallel = {k: v for k, v in MLP_LAYOUT.items() if k != "mesh"} | {"mesh": {"data": 4, "model": 2}}
    for name, config in (("data=8", {}), ("data=4,model=2", tensor_parallel), ("1 device", dict(num_devices=1))):
        model_dir = str(tmp_path / name)
        shutil.copytree(os.path.join(saved_dir, "checkpoints", "4"), os.path.join(model_dir, "checkpoints", "4"))
        est = mlp_estimator(model_dir, **adam, **config)
        restored = jax.device_get(est.state())
        for a, b in zip(jax.tree.leaves(restored), jax.tree.leaves(saved_state), strict=True):
            np.testing.assert_array_equal(a, b)  # bitwise, optimizer state and key included
        est.train(data, max_steps=8)
        assert relative_difference(host_params(est), continued) < 1e-5, name


def test_warm_start_loads_into_the_sharded_layout(tmp_path):
    source = mlp_estimator(str(tmp_path / "source"))
    source.train(ex.data.from_arrays(*blobs(256)), max_steps=4)
    est = mlp_estimator(warm_start=ex.WarmStart(str(tmp_path / "source")), **MLP_LAYOUT)
    state = est.state()
    assert state.params["l1"]["kernel"].get_value().sharding.spec == P("fsdp", "model")
    expected, loaded = host_params(source), host_params(est)
    for k in expected:
        np.testing.assert_array_equal(loaded[k], expected[k])


def test_a_sharded_run_killed_and_resumed_is_bitwise_identical(tmp_path):
    job = os.path.join(TESTS, "resumable_job.py")
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([ROOT, TESTS])}

    def start(model_dir, steps):
        return warm.Popen(
            [sys.executable, job, model_dir, str(steps), "fsdp"],
            env=env,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
        )

    def final(model_dir):
        manager = ocp.CheckpointManager(os.path.join(model_dir, "checkpoints"))
        state = manager.restore(20, args=ocp.args.Composite(state=ocp.args.StandardRestore())).state
        return {jax.tree_util.keystr(p): np.asarray(x) for p, x in jax.tree_util.tree_leaves_with_path(state["params"])}

    reference = str(tmp_path / "reference")
    process = start(reference, 20)
    out, _ = process.communicate(timeout=120)
    assert process.returncode == 0, out
    killed = str(tmp_path / "killed")
    process = start(killed, 20)
    checkpoints = os.path.join(killed, "checkpoints")
    while not (os.path.isdir(checkpoints) and any(n.isdigit() and int(n) >= 8 for n in os.listdir(checkpoints))):
        assert process.poll() is None, process.stdout.read()
        time.sleep(0.002)  # as helpers.wait_for: a look every 2 ms leaves the cores to the run it waits for
    process.kill()
    process.wait()
    process = start(killed, 20)
    out, _ = process.communicate(timeout=120)
    assert process.returncode == 0 and "Restored checkpoint step" in out, out
    a, b = final(reference), final(killed)
    for k in a:
        np.testing.assert_array_equal(b[k], a[k])


def test_an_optimizer_whose_init_needs_real_parameters_is_matched_by_path_and_shape():
    def init(params):  # indexes the parameters: cannot run on optax's placeholders
        return {"trace": jax.tree.map(jnp.zeros_like, params), "first_kernel": jnp.zeros_like(params["l1"]["kernel"])}

    def update(grads, state, params=None):
        trace = jax.tree.map(lambda t, g: 0.9 * t + g, state["trace"], grads)
        return jax.tree.map(lambda t: -0.1 * t, trace), {**state, "trace": trace}

    est = mlp_estimator(optimizer=optax.GradientTransformation(init, update), **MLP_LAYOUT)
    est.train(ex.data.from_arrays(*blobs(64)), max_steps=2)
    state = est.state()
    kernel = state.params["l1"]["kernel"].get_value().sharding.spec
    assert kernel == P("fsdp", "model")
    assert state.opt_state["trace"]["l1"]["kernel"].get_value().sharding.spec == kernel
    assert state.opt_state["first_kernel"].sharding.spec == P()  # not a parameter's path: replicated


def test_a_bad_mesh_on_the_command_line_is_a_usage_error(capsys):
    with pytest.raises(SystemExit) as exit_info:
        cli.main(["train", "--example", "digits", "--mesh", "data4"])
    assert exit_info.value.code == 2
    assert "received 'data4'; expected name=size pairs, e.g. data=4,model=2" in capsys.readouterr().err


def test_random_draws_compile_as_kernels_only_while_a_replicated_state_is_initialised_on_a_gpu(monkeypatch):
    """GPT-2 small's initial state compiled for 3 min 5 s on an H200 with threefry written out; the
    kernel lowering is JAX-global, so it must not outlive the initialisation (a user's dropout keeps
    XLA's fusable draws) nor apply to a sharded state (one opaque kernel cannot be split)."""
    from estimax import assembly

    def kernels():
        return jax.config.jax_threefry_gpu_kernel_lowering

    with assembly._random_draws_as_kernels(replicated=True):
        assert not kernels()  # a CPU: nothing changes
    monkeypatch.setattr(jax, "default_backend", lambda: "gpu")
    with assembly._random_draws_as_kernels(replicated=False):
        assert not kernels()
    with pytest.raises(ZeroDivisionError), assembly._random_draws_as_kernels(replicated=True):
        assert kernels()
        1 / 0  # noqa: B018  an initialisation that fails still gives the setting back
    assert not kernels()
