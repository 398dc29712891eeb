"""Hugging Face datasets as inputs, on Parquet and JSON Lines files the tests write (no network): a
map-style Dataset is random access (epochs, shards, resume from the step), a streaming IterableDataset
is split per process and per Grain worker, and a resumed run continues the stream where it stopped."""

import itertools
import json
import os

import jax
import numpy as np
import pytest
from models import blobs, estimator

os.environ.setdefault("HF_HUB_OFFLINE", "1")  # local files only: no Hub look-ups
datasets = pytest.importorskip("datasets", reason="from_hf needs the Hugging Face datasets library (estimax[hf])")
pa = pytest.importorskip("pyarrow")

import pyarrow.parquet as pq  # noqa: E402

import estimax as ex  # noqa: E402
from estimax.data import feed  # noqa: E402
from estimax.errors import ConfigError  # noqa: E402
from estimax.loop import DeviceLoop  # noqa: E402

datasets.disable_progress_bars()


def _rows(n):
    features, labels = blobs(n)
    return {"id": np.arange(n), "x": features["x"], "y": labels}


def _parquet(directory, n, num_files):
    rows, paths = _rows(n), []
    for k, part in enumerate(np.array_split(np.arange(n), num_files)):
        paths.append(str(directory / f"part-{k}.parquet"))
        table = {"id": rows["id"][part], "x": list(rows["x"][part]), "y": rows["y"][part], "text": ["a"] * len(part)}
        pq.write_table(pa.table(table), paths[-1], row_group_size=16)
    return paths


def _json_lines(directory, n, num_files):
    rows, paths = _rows(n), []
    for k, part in enumerate(np.array_split(np.arange(n), num_files)):
        paths.append(str(directory / f"part-{k}.jsonl"))
        with open(paths[-1], "w") as f:
            for i in part:
                f.write(json.dumps({"id": int(i), "x": rows["x"][i].tolist(), "y": int(rows["y"][i])}) + "\n")
    return paths


def _map_style(tmp_path, n, num_files=3):
    paths = _parquet(tmp_path, n, num_files)
    return datasets.load_dataset("parquet", data_files=paths, split="train", cache_dir=str(tmp_path / "cache"))


def _stream(tmp_path, n, num_files=4):
    paths = _json_lines(tmp_path, n, num_files)
    return datasets.load_dataset("json", data_files=paths, split="train", streaming=True)


def _ids(stacks):
    return np.concatenate([s[0]["id"].reshape(-1) for s in stacks])


def test_a_map_style_dataset_trains_in_epochs_and_evaluates_exactly(tmp_path):
    source = ex.data.from_hf(_map_style(tmp_path, 1000), features=["x", "id"], label="y")
    ((features, labels),) = list(itertools.islice(feed.eval_batches(source, 1000), 1))
    rows = _rows(1000)
    np.testing.assert_array_equal(features["id"], rows["id"])
    np.testing.assert_array_equal(features["x"], rows["x"])  # float32 in Parquet: float32 here
    np.testing.assert_array_equal(labels, rows["y"])
    assert features["x"].dtype == np.float32 and set(features) == {"x", "id"}
    # Three epochs: each a new permutation, every example at most once per epoch.
    steps = source.steps_per_epoch(64)
    epochs = _ids(feed.train_stacks(source, 64, [steps] * 3, seed=2, start_step=0)).reshape(3, -1)
    assert steps == 15 and all(len(np.unique(e)) == 960 for e in epochs)
    assert not np.array_equal(epochs[0], epochs[1])
    # Resume from a step in the second epoch: the same batches as the uninterrupted order.
    resumed = _ids(feed.train_stacks(source, 64, [steps], seed=2, start_step=20))
    np.testing.assert_array_equal(resumed, epochs.reshape(-1)[20 * 64 : (20 + steps) * 64])
    # Through the Estimator: evaluation and prediction equal those of the same rows as arrays.
    est = estimator(eval_batch_size=64).train(source, epochs=1)
    assert est.step == 1000 // 32
    reference = ex.data.from_arrays({"x": rows["x"], "id": rows["id"]}, rows["y"])
    results, expected = est.evaluate(source), est.evaluate(reference)
    assert results["num_examples"] == 1000
    np.testing.assert_allclose(results["loss"], expected["loss"], rtol=1e-5)


def test_a_map_style_dataset_is_sharded_over_processes(tmp_path):
    source = ex.data.from_hf(_map_style(tmp_path, 301), label="y", features=["id", "x"])
    per_epoch = source.steps_per_epoch(16, 3)
    train = [
        set(_ids(feed.train_stacks(source, 16, [per_epoch], seed=0, start_step=0, shard=feed.Shard(p, 3))))
        for p in range(3)
    ]
    assert all(len(t) == per_epoch * 16 for t in train)
    assert all(not (a & b) for a, b in itertools.combinations(train, 2))
    shards = [list(feed.eval_batches(source, 32, shard=feed.Shard(p, 3))) for p in range(3)]
    assert len({len(s) for s in shards}) == 1
    assert sorted(np.concatenate([b[0]["id"] for s in shards for b in s]).tolist()) == list(range(301))


@pytest.mark.parametrize("count", [2, 3])  # 4 files: whole files per process; 3 processes: every 3rd row
def test_a_stream_is_split_per_process(tmp_path, count):
    source = ex.data.from_hf(_stream(tmp_path, 400), ["id", "x"], label="y")
    seen = [
        np.concatenate([b[0]["id"] for b in feed.eval_batches(source, 32, shard=feed.Shard(p, count))])
        for p in range(count)
    ]
    assert sorted(np.concatenate(seen).tolist()) == list(range(400))
    if count == 2:  # files 0 and 2, files 1 and 3
        assert sorted(seen[0].tolist()) == list(range(100)) + list(range(200, 300))
    else:
        assert seen[1].tolist() == list(range(1, 400, 3))


@pytest.mark.parametrize("num_workers", [0, 2])
def test_a_stream_resumes_from_its_saved_state(tmp_path, num_workers):
    source = ex.data.from_hf(_stream(tmp_path, 400), ["id", "x"], label="y", num_workers=num_workers)
    stacks = feed.train_stacks(source, 8, [3] * 6, seed=0, start_step=0)
    full, states = [], []
    for stack in stacks:
        full.append(stack[0]["id"].reshape(-1))
        states.append(json.loads(json.dumps(stacks.input_state)))  # as the checkpoint stores it
    assert len(full) == 6 and len(np.unique(np.concatenate(full))) == 6 * 24
    if num_workers:  # each worker reads its own files
        assert {int(i) // 100 for i in full[0]} == {0, 1}
    for k in (0, 3):
        rest = feed.train_stacks(source, 8, [3] * (5 - k), seed=0, start_step=0, input_state=states[k])
        np.testing.assert_array_equal(_ids(rest), np.concatenate(full[k + 1 :]))


def test_a_resumed_run_continues_the_stream_where_it_stopped(tmp_path, model_dir, monkeypatch):
    consumed = []
    run = DeviceLoop.run

    def recording_run(self, state, chunk):
        consumed.append(np.asarray(chunk.stack[0]["id"]).reshape(-1))
        return run(self, state, chunk)

    monkeypatch.setattr(DeviceLoop, "run", recording_run)
    source = ex.data.from_hf(_stream(tmp_path, 600), ["id", "x"], label="y")
    straight = estimator(f"{model_dir}-straight", steps_per_loop=4).train(source, max_steps=16)
    uninterrupted, consumed[:] = np.concatenate(consumed), []
    estimator(model_dir, steps_per_loop=4).train(source, max_steps=8)
    resumed = estimator(model_dir, steps_per_loop=4).train(source, max_steps=16)  # a new Estimator: from disk
    np.testing.assert_array_equal(np.concatenate(consumed), uninterrupted)
    for a, b in zip(jax.tree.leaves(resumed.state().params), jax.tree.leaves(straight.state().params), strict=True):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))


def test_columns_are_checked_and_named(tmp_path):
    dataset = _map_style(tmp_path, 20, 1)
    with pytest.raises(ConfigError, match=r"from_hf\(features=\['x', 'z'\]\): the dataset has no column 'z'; its "):
        ex.data.from_hf(dataset, features=["x", "z"], label="y")
    with pytest.raises(ConfigError, match=r"from_hf\(label='label'\): the dataset has no column 'label'"):
        ex.data.from_hf(dataset, "x", label="label")
    splits = datasets.DatasetDict({"train": dataset, "test": dataset})
    with pytest.raises(
        ConfigError, match=r"DatasetDict of the splits \['train', 'test'\]; .* from_hf\(dataset\['train'\]"
    ):
        ex.data.from_hf(splits)
    with pytest.raises(TypeError, match=r"from_hf received dict; expected a datasets.Dataset"):
        ex.data.from_hf({"x": [1]})
    # Features by default: every column but the labels; text is refused at the first batch, named.
    with pytest.raises(ValueError, match=r"features\['text'\] has dtype <U1; expected numbers"):
        next(feed.train_stacks(ex.data.from_hf(dataset, label="y"), 8, [1], seed=0, start_step=0))
    # Several label columns: a dict of them.
    features, labels = next(iter(feed.eval_batches(ex.data.from_hf(dataset, "x", label=["y", "id"]), 4)))
    assert set(features) == {"x"} and labels["id"].tolist() == [0, 1, 2, 3]
    # A dataset passed as it is points to from_hf.
    with pytest.raises(TypeError, match=r"Input is a Hugging Face Dataset, .* Fix: pass ex.data.from_hf\(dataset"):
        estimator().train(dataset, max_steps=1)
