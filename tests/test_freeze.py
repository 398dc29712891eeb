"""Freezing parameters by rules: frozen bytes never move, no optimizer state for them, schedules
unfreeze at their step and resume exactly."""

import os
import sys

import jax
import numpy as np
import optax
import pytest
import warm
from helpers import user_env
from models import blobs, estimator

import estimax as ex
from estimax.loop import count_primitives
from estimax.state import leaf_names

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _data():
    return ex.data.from_arrays(*blobs(256))


def _params(est) -> dict[str, np.ndarray]:
    params = jax.device_get(est.state().params)
    return dict(zip(leaf_names(params), map(np.asarray, jax.tree.leaves(params)), strict=True))


def _array_bytes(tree) -> int:
    """Bytes of the non-scalar leaves (Adam's moments; its step counts are scalars)."""
    return sum(np.asarray(x).nbytes for x in jax.tree.leaves(jax.device_get(tree)) if np.ndim(x))


def test_frozen_parameters_keep_their_bits_and_have_no_optimizer_state():
    est = estimator(None, optimizer=optax.adam(1e-2), freeze=[r"l1/.*"], quiet=True)
    before = _params(est)
    est.train(_data(), max_steps=8)
    after = _params(est)
    for name in ("l1/kernel", "l1/bias"):
        np.testing.assert_array_equal(after[name], before[name])
    assert not np.array_equal(after["l2/kernel"], before["l2/kernel"])
    trained_bytes = after["l2/kernel"].nbytes + after["l2/bias"].nbytes
    assert _array_bytes(est.state().opt_state) == 2 * trained_bytes  # Adam's mu and nu, of l2 only
    full = estimator(None, optimizer=optax.adam(1e-2), quiet=True)
    assert _array_bytes(full.state().opt_state) == 2 * sum(x.nbytes for x in before.values())
    plan = est.freeze_plan()
    assert (plan.phases[0].trained, plan.phases[0].trained_bytes) == (2, trained_bytes)
    assert plan.phases[0].frozen_bytes == before["l1/kernel"].nbytes + before["l1/bias"].nbytes
    assert plan.frozen_paths == (("l1/bias", "l1/kernel"),) and "frozen  l1/kernel" in str(plan)
    assert full.freeze_plan() is None


def test_the_frozen_layers_weight_gradients_are_not_in_the_step():
    """Forward 2 matmuls; backward: dW2, and for an unfrozen l1 also dh1 and dW1."""
    counts = {}
    for name, freeze in {"all": [], "l1 frozen": [r"l1/.*"]}.items():
        est = estimator(None, freeze=freeze, quiet=True)
        batch = ({"x": jax.ShapeDtypeStruct((32, 6), np.float32)}, jax.ShapeDtypeStruct((32,), np.int32))
        jaxpr = jax.make_jaxpr(lambda s, b, est=est: est.core.train_step(s, b, True))(est.state_shapes(), batch)
        counts[name] = count_primitives(jaxpr.jaxpr, ("dot_general",))
    assert counts == {"all": 5, "l1 frozen": 3}


def test_a_rule_that_matches_nothing_is_one_line_before_training():
    with pytest.raises(ex.ConfigError, match=r"freeze=...\) rule 'encoder/.\*' matches no parameter") as error:
        estimator(None, freeze=[r"l1/.*", r"encoder/.*"])
    assert "\n" not in str(error.value) and "l1/bias" in str(error.value)
    with pytest.raises(ex.ConfigError, match=r"freeze\[500\]"):
        estimator(None, freeze={0: [r"l1/.*"], 500: [r"l3/.*"]})


@pytest.mark.parametrize(
    "freeze, error",
    [("l1/.*", ex.ConfigTypeError), ({-1: ["l1/.*"]}, ex.ConfigError), ([r"l1/("], ex.ConfigError), ([3], TypeError)],
)
def test_bad_freeze_settings_are_named(freeze, error):
    with pytest.raises(error, match="freeze"):
        ex.RunConfig(freeze=freeze)


def test_a_schedule_is_normalised_and_a_list_is_one_phase():
    assert ex.RunConfig(freeze=["a"]).freeze == ((0, ("a",)),)
    assert ex.RunConfig(freeze={500: [], 0: ["a", "b"]}).freeze == ((0, ("a", "b")), (500, ()))
    assert ex.RunConfig(freeze={10: ["a"]}).freeze == ((0, ()), (10, ("a",)))


def test_a_schedule_unfreezes_at_its_step_inside_a_device_loop():
    """l1 is frozen for updates 0-2 and trains from update 3 (the step 3 -> 4), here in the middle of
    a loop of 2 steps; l2 trains throughout."""
    schedule = {0: [r"l1/.*"], 3: []}
    est = estimator(None, optimizer=optax.adam(1e-2), freeze=schedule, steps_per_loop=2, quiet=True)
    initial = _params(est)
    est.train(_data(), max_steps=3)
    at_3 = _params(est)
    np.testing.assert_array_equal(at_3["l1/kernel"], initial["l1/kernel"])
    assert not np.array_equal(at_3["l2/kernel"], initial["l2/kernel"])
    est.train(_data(), max_steps=4)
    assert not np.array_equal(_params(est)["l1/kernel"], initial["l1/kernel"])
    # Both groups keep state from the start: Adam's moments for every parameter.
    assert _array_bytes(est.state().opt_state) == 2 * sum(x.nbytes for x in initial.values())
    assert [(p.start, p.trained) for p in est.freeze_plan().phases] == [(0, 2), (3, 4)]
    # Inside a scan of 4 steps that crosses the boundary: the same bits as loops of 2 and 1.
    scanned = estimator(None, optimizer=optax.adam(1e-2), freeze=schedule, steps_per_loop=4, quiet=True)
    scanned.train(_data(), max_steps=4)
    for name, value in _params(scanned).items():
        np.testing.assert_allclose(value, _params(est)[name], rtol=1e-6, atol=1e-7)


def test_a_resumed_schedule_ends_with_the_bits_of_an_uninterrupted_one(tmp_path):
    def run(model_dir):
        return estimator(
            str(model_dir), optimizer=optax.adam(1e-2), freeze={0: [r"l1/.*"], 3: [r"l2/.*"]},
            steps_per_loop=1, quiet=True,
        )  # fmt: skip

    whole = run(tmp_path / "whole")
    whole.train(_data(), max_steps=6)
    run(tmp_path / "parts").train(_data(), max_steps=2)
    resumed = run(tmp_path / "parts")  # a new Estimator: restored from the checkpoint of step 2
    assert resumed.step == 2
    resumed.train(_data(), max_steps=6)
    expected, got = jax.device_get(whole.state()), jax.device_get(resumed.state())
    for a, b in zip(jax.tree.leaves(expected), jax.tree.leaves(got), strict=True):
        np.testing.assert_array_equal(a, b)


def test_the_command_line_freezes_by_repeated_flags(tmp_path):
    env = user_env()
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [ROOT, env.get("PYTHONPATH")]))
    args = ["train", "--max-steps", "1", "--model-dir", str(tmp_path / "run"), "--freeze", "conv1/.*", "--freeze", "x"]
    result = warm.run(
        [sys.executable, "-m", "estimax.cli", *args], capture_output=True, text=True, env=env, timeout=300
    )
    assert result.returncode != 0
    assert result.stderr.strip().splitlines() == [
        "estimax: error: RunConfig(freeze=...) rule 'x' matches no parameter; expected a regex that fully matches "
        "paths such as conv1/bias, conv1/kernel, conv2/bias, conv2/kernel, dense/bias, dense/kernel .... Fix: "
        "correct the regex or remove it. (--debug shows the traceback)"
    ]
