"""A run is the computation that made it: the fingerprint of a training step, the record a run
keeps of it, the one line when an Estimator continues a run with another computation, and an
evaluation by another computation kept out of the run's history."""

import json
import os
import subprocess
import sys

import jax
import numpy as np
import optax
import pytest
from flax import nnx
from models import blobs, model_fn

import estimax as ex
from estimax import fingerprint

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


class MLP(nnx.Module):
    def __init__(self, activation, rngs):
        self.activation = activation
        self.l1 = nnx.Linear(6, 16, rngs=rngs)
        self.l2 = nnx.Linear(16, 3, rngs=rngs)

    def __call__(self, x):
        return self.l2(getattr(nnx, self.activation)(self.l1(x)))


def _estimator(model_dir=None, activation="relu", lr=0.1, **config):
    return ex.Estimator(
        model=lambda rngs, params: MLP(activation, rngs),
        model_fn=model_fn,
        optimizer=optax.sgd(lr),
        config=ex.RunConfig(model_dir=model_dir, **{"train_batch_size": 32, "steps_per_loop": 2, **config}),
    )


DATA = ex.data.from_arrays(*blobs(256))

DIGEST_PROGRAM = f"""
import os, sys
os.environ["XLA_FLAGS"] = "--xla_force_host_platform_device_count=2"
sys.path.insert(0, {os.path.join(ROOT, "tests")!r})
from test_fingerprint import DATA, _estimator
print(_estimator().computation(DATA).digest)
"""


def test_the_fingerprint_is_what_the_step_computes_not_the_process_nor_the_devices():
    relu = _estimator().computation(DATA)
    assert relu == _estimator(num_devices=1).computation(DATA)  # 8 devices or 1: the same computation
    env = {**os.environ, "PYTHONPATH": ROOT}
    other_process = subprocess.run([sys.executable, "-c", DIGEST_PROGRAM], capture_output=True, text=True, env=env)
    assert other_process.stdout.strip() == relu.digest, other_process.stderr  # another process, 2 devices
    gelu, faster = _estimator(activation="gelu").computation(DATA), _estimator(lr=0.2).computation(DATA)
    assert len({relu.digest, gelu.digest, faster.digest}) == 3 and relu.arrays == gelu.arrays == faster.arrays
    assert fingerprint.differences(relu, gelu).startswith("code: the training step computes otherwise")
    # The batch it was traced on is recorded: the same step traced again on the decoded batch agrees.
    batch = fingerprint.decode_batch(relu.batch)
    assert batch[0]["x"].shape == (32, 6) and batch[1] == jax.ShapeDtypeStruct((32,), np.int32)
    wider = _estimator(train_batch_size=64).computation(DATA)
    assert fingerprint.differences(relu, wider).startswith(
        "shapes: the batch (features['x'] float32 (32, 6), labels int32 (32,) -> features['x'] float32 (64, 6)"
    )


def test_continuing_a_run_with_another_computation_says_so_and_its_evaluations_stay_out(tmp_path, estimax_log):
    model_dir = str(tmp_path / "run")
    _estimator(model_dir).train(DATA, max_steps=4)
    assert not [r for r in estimax_log.records if "another computation" in r.getMessage()]

    # A new learning rate for the rest of the run: allowed, in one line naming what differs.
    _estimator(model_dir, lr=0.05).train(DATA, max_steps=8)
    said = [r.getMessage() for r in estimax_log.records if "another computation" in r.getMessage()]
    assert len(said) == 1 and said[0].startswith(f"Continuing step 4 of {model_dir} with another computation (code:")
    history = json.loads((tmp_path / "run" / "computation.json").read_text())
    assert [entry["from_step"] for entry in history] == [0, 4] and history[0]["digest"] != history[1]["digest"]

    # The gelu code evaluates the run's step-8 weights: the results come back, the run's history keeps none.
    estimax_log.clear()
    results = _estimator(model_dir, activation="gelu").evaluate(DATA)
    assert results["num_examples"] == 256
    said = [r.getMessage() for r in estimax_log.records if "not written into" in r.getMessage()]
    assert len(said) == 1 and said[0].startswith(f"The evaluation of step 8 is not written into {model_dir}'s")
    assert "(code: the model_fn computes otherwise in eval mode" in said[0]
    assert not (tmp_path / "run" / "metrics.jsonl").exists() or not [
        line for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines() if '"eval"' in line
    ]
    # The model that made step 8 evaluates it as the run's own, whatever its optimizer.
    own = _estimator(model_dir, lr=0.1).evaluate(DATA)
    evals = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    evals = [record for record in evals if record["split"] == "eval"]
    assert len(evals) == 1 and evals[0]["step"] == 8 and evals[0]["loss"] == pytest.approx(own["loss"])


def test_an_eval_mode_mean_loss_is_refused_by_check_before_anything_trains(tmp_path):
    def mean_loss(model, features, labels, mode, params):
        spec = model_fn(model, features, labels, mode, params)
        return spec if mode == ex.PREDICT else spec._replace(loss=spec.loss.mean())

    estimator = ex.Estimator(
        model=lambda rngs, params: MLP("relu", rngs),
        model_fn=mean_loss,
        optimizer=optax.sgd(0.1),
        config=ex.RunConfig(model_dir=str(tmp_path / "run"), train_batch_size=32, eval_batch_size=48),
    )
    estimator.check(ex.TRAIN, DATA)  # a scalar loss trains
    with pytest.raises(ex.errors.SpecError, match=r"model_fn returned scalar \['loss'\] in eval mode"):
        estimator.check(ex.EVAL, DATA)  # 256 examples in batches of 48: the last one is padded
    assert estimator.step == 0 and not (tmp_path / "run" / "checkpoints").exists()
