"""Grain datasets, TFRecord and idx files as inputs: coverage per epoch, per-process shards,
exact evaluation on every process, resume positions and errors that name the culprit."""

import itertools
import json
import os
import re
import time

import grain
import numpy as np
import pytest
from models import blobs, estimator

import estimax as ex
from estimax.data import feed, tfrecord
from estimax.loop import DeviceLoop


def _grain_examples(n):
    features, labels = blobs(n)
    ids = np.arange(n)
    return grain.MapDataset.range(n).map(lambda i: ({"x": features["x"][i], "id": ids[i]}, labels[i]))


def _write_tfrecords(directory, n, num_files, fs_prefix=""):
    features, labels = blobs(n)
    parts = np.array_split(np.arange(n), num_files)
    for k, rows in enumerate(parts):
        tfrecord.write(
            f"{fs_prefix}{directory}/part-{k:02d}.tfrecord",
            ({"x": features["x"][i], "id": i, "label": labels[i]} for i in rows),
        )
    return f"{fs_prefix}{directory}/part-*.tfrecord"


SPEC = {"x": tfrecord.Feature(np.float32, (6,)), "id": tfrecord.Feature(np.int64), "label": tfrecord.Feature(np.int32)}


def _source(kind, n, tmp_path, num_files=4):
    if kind == "arrays":
        features, labels = blobs(n)
        return ex.data.from_arrays({"x": features["x"], "id": np.arange(n)}, labels)
    if kind == "grain":
        return ex.data.from_grain(_grain_examples(n))
    return tfrecord.tfrecord(_write_tfrecords(tmp_path, n, num_files), SPEC, label="label")


@pytest.mark.parametrize("kind", ["arrays", "grain", "tfrecord"])
def test_three_epochs_see_every_example_once_per_epoch(kind, tmp_path, monkeypatch, estimax_log):
    """What the device loop consumed, over 3 epochs of 1,000 examples, batch 64, 8 devices."""
    consumed = []
    run = DeviceLoop.run

    def recording_run(self, state, chunk):
        consumed.append(np.asarray(chunk.stack[0]["id"]).reshape(-1, 64))
        return run(self, state, chunk)

    monkeypatch.setattr(DeviceLoop, "run", recording_run)
    est = estimator(train_batch_size=64, steps_per_loop=7, loop="scan")
    est.train(_source(kind, 1000, tmp_path), epochs=3)
    announced = re.search(r"epoch is (\d+) steps .*; (\d+) examples per epoch are dropped", estimax_log.text)
    steps, dropped = map(int, announced.groups())
    assert est.step == 3 * steps and steps * 64 + dropped == 1000
    batches = np.concatenate(consumed)
    assert len(batches) == 3 * steps
    seen = []
    for epoch in range(3):
        ids = batches[epoch * steps : (epoch + 1) * steps].ravel()
        assert len(np.unique(ids)) == len(ids) == 1000 - dropped  # none repeated within an epoch
        seen.append(ids)
    counts = np.bincount(np.concatenate(seen), minlength=1000)
    assert counts.sum() == 3 * 1000 - 3 * dropped and counts.max() <= 3
    assert not np.array_equal(seen[0], seen[1])  # reshuffled each epoch


@pytest.mark.parametrize("kind, num_files", [("arrays", 1), ("grain", 1), ("tfrecord", 4), ("tfrecord", 2)])
def test_process_shards_are_disjoint_and_eval_counts_each_example_once(kind, num_files, tmp_path):
    n, count = 1001, 3
    source = _source(kind, n, tmp_path, num_files)
    # Training: one epoch on each process; disjoint shards, the same number of steps everywhere.
    per_epoch = source.steps_per_epoch(16, count)
    train = []
    for p in range(count):
        stacks = feed.train_stacks(source, 16, [per_epoch], seed=0, start_step=0, shard=feed.Shard(p, count))
        ids = np.concatenate([s[0]["id"].ravel() for s in stacks])
        assert len(ids) == per_epoch * 16 and len(np.unique(ids)) == len(ids)
        train.append(set(ids.tolist()))
    assert all(not (a & b) for a, b in itertools.combinations(train, 2))
    # Evaluation: the same number of batches on every process; valid rows cover the set once.
    num_batches, evaluated = set(), []
    for p in range(count):
        batches = list(feed.eval_batches(source, 64, shard=feed.Shard(p, count)))
        num_batches.add(len(batches))
        evaluated.extend(b[0]["id"] for b in batches)
    assert len(num_batches) == 1 and all(len(ids) <= 64 for ids in evaluated)
    assert sorted(np.concatenate(evaluated).tolist()) == list(range(n))


def test_a_process_with_fewer_examples_pads_with_masked_batches():
    source = ex.data.from_grain(grain.MapDataset.range(10).map(lambda i: ({"id": np.int64(i)}, None)))
    shards = [list(feed.eval_batches(source, 2, shard=feed.Shard(p, 4))) for p in range(4)]
    assert [len(s) for s in shards] == [2, 2, 2, 2]  # 3, 3, 2, 2 examples
    assert [b[0]["id"].shape[0] for b in shards[3]] == [2, 0]
    # On the device side, an empty batch becomes a fully masked one.
    (device_batch,) = list(estimator(eval_batch_size=8).plan.eval_batches([shards[3][1]]))
    assert device_batch.num_valid == 0 and not np.asarray(device_batch.mask).any()


@pytest.mark.parametrize("kind", ["grain", "tfrecord"])
def test_evaluate_and_predict_are_exact_on_any_source(kind, tmp_path):
    source = _source(kind, 1001, tmp_path)
    est = estimator(eval_batch_size=64, predict_batch_size=64).train(source, max_steps=8)
    features, labels = blobs(1001)
    reference = ex.data.from_arrays(features, labels)
    expected = est.evaluate(reference)
    results = est.evaluate(source)
    assert results["num_examples"] == 1001
    np.testing.assert_allclose(results["accuracy"], expected["accuracy"], rtol=1e-6)
    np.testing.assert_allclose(results["loss"], expected["loss"], rtol=1e-5)
    rows = list(est.predict(source))
    np.testing.assert_allclose(
        np.stack([r["logits"] for r in rows]), np.stack([r["logits"] for r in est.predict(reference)]), rtol=1e-5
    )


def test_grain_map_dataset_resumes_from_the_step():
    source = ex.data.from_grain(_grain_examples(300))
    full = np.concatenate([s[0]["id"] for s in feed.train_stacks(source, 16, [9, 9, 9], seed=5, start_step=0)])
    resumed = np.concatenate([s[0]["id"] for s in feed.train_stacks(source, 16, [9, 9], seed=5, start_step=9)])
    np.testing.assert_array_equal(resumed, full[9:])


def _iter_dataset():
    examples = _grain_examples(500)
    return examples.shuffle(3).to_iter_dataset().filter(lambda e: e[0]["id"] % 7 != 0)


def test_streaming_input_state_is_taken_after_each_chunk_and_restores_the_rest():
    source = ex.data.from_grain(_iter_dataset())
    full, states = [], []
    # Through the background stage, two chunks ahead: each chunk carries the state after its own batches.
    plan = estimator(train_batch_size=8, steps_per_loop=5).plan
    with feed.Prefetch(plan.train_chunks(source, 0, 40)) as chunks:
        for chunk in chunks:
            full.append(np.asarray(chunk.stack[0]["id"]))
            states.append(chunk.input_state)
    assert len(full) == 8 and all(s is not None for s in states)
    for k in (0, 3, 6):
        rest = feed.train_stacks(source, 8, [5] * (7 - k), seed=0, start_step=0, input_state=states[k])
        np.testing.assert_array_equal(np.concatenate([r[0]["id"] for r in rest]), np.concatenate(full[k + 1 :]))


def test_grain_checks_its_own_pipeline_state():
    batched = _iter_dataset().batch(8, drop_remainder=True)
    grain.experimental.assert_equal_output_after_checkpoint(batched)


def test_streaming_input_trains_and_refuses_epochs_and_many_processes():
    est = estimator(steps_per_loop=4).train(ex.data.from_grain(_iter_dataset()), max_steps=8)
    assert est.step == 8
    with pytest.raises(TypeError, match=r"Counting in epochs needs an input of known size"):
        estimator().train(ex.data.from_grain(_iter_dataset()), epochs=1)
    with pytest.raises(ValueError, match=r"IterDataset and there are 2 processes"):
        next(
            feed.train_stacks(ex.data.from_grain(_iter_dataset()), 8, [1], seed=0, start_step=0, shard=feed.Shard(0, 2))
        )


def test_bad_examples_are_named():
    def bad(i):
        return ({"x": np.zeros(5 if i == 3 else 6, np.float32)}, np.int32(0))

    message = r"Example \d+ of a batch: features\['x'\] has per-example shape \(5,\) and dtype float32; expected \(6,\)"
    with pytest.raises(ValueError, match=message):
        estimator().train(ex.data.from_grain(grain.MapDataset.range(64).map(bad)), max_steps=2)
    with pytest.raises(ValueError, match=message.replace(r"\d+", "3")):
        estimator().evaluate(ex.data.from_grain(grain.MapDataset.range(64).map(bad)))
    text = grain.MapDataset.range(64).map(lambda i: ({"x": np.array("a")}, np.int32(0)))
    with pytest.raises(ValueError, match=r"features\['x'\] has dtype <U1; expected numbers"):
        estimator().evaluate(ex.data.from_grain(text))
    with pytest.raises(TypeError, match=r"expected a \(features, labels\) tuple"):
        estimator().evaluate(ex.data.from_grain(grain.MapDataset.range(64)))


def test_a_grain_dataset_of_examples_passed_as_it_is_says_to_wrap_it(model_dir):
    wrap = r"Fix: ex\.data\.from_grain\(dataset\)"
    with pytest.raises(ex.errors.InputError, match=rf"^Input is a Grain MapMapDataset of single examples.*{wrap}"):
        estimator(model_dir).train(_grain_examples(64), max_steps=2)
    assert not os.path.exists(model_dir)
    streaming = _grain_examples(64).to_iter_dataset()  # read as batches: its first one has scalars
    fix = r"Fix: feed batches, e\.g\. ex\.data\.from_grain\(dataset\) for a Grain dataset of single examples"
    with pytest.raises(ValueError, match=rf"^Input features\['id'\] is a scalar; expected one row per example\. {fix}"):
        estimator().evaluate(streaming)


def test_input_wait_fraction_is_logged_and_large_only_when_input_is_slow(model_dir):
    features, labels = blobs(512)

    def slow(i):
        time.sleep(0.008)  # 256 ms per batch of 32: far slower than a step of this MLP, even on a loaded machine
        return {"x": features["x"][i]}, labels[i]

    options = grain.ReadOptions(num_threads=1, prefetch_buffer_size=32)
    slow_input = ex.data.from_grain(grain.MapDataset.range(512).map(slow), read_options=options)
    for run, data in (("fast", ex.data.from_arrays(features, labels)), ("slow", slow_input)):
        estimator(f"{model_dir}-{run}", steps_per_loop=4, log_every_steps=8, loop="scan").train(data, max_steps=24)
    records = {
        run: [
            r
            for line in open(os.path.join(f"{model_dir}-{run}", "metrics.jsonl"))
            if (r := json.loads(line))["split"] == "train"
        ]
        for run in ("fast", "slow")
    }
    assert all(0 <= r["input_wait_fraction"] <= 1 for rs in records.values() for r in rs)
    assert records["slow"][-1]["input_wait_fraction"] > 0.5  # the device waits for most of the time
    assert records["fast"][-1]["input_wait_fraction"] < records["slow"][-1]["input_wait_fraction"]
