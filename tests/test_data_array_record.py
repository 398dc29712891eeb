"""ArrayRecord files as inputs: written and read back exactly, every example once per epoch, disjoint
per-process shards, resume from the step, Grain worker processes, gs:// through the format's own
reader (the GCS emulator), other stores through fsspec, and errors that name the file and the record."""

import itertools
import os

import jax
import numpy as np
import pytest
from models import blobs, estimator

import estimax as ex
from estimax.data import arrayrecord, feed, files
from estimax.errors import ConfigError, InputError, StorageError
from estimax.loop import DeviceLoop

Feature = ex.data.array_record.Feature
SPEC = {"x": Feature(np.float32, (6,)), "id": Feature(np.int64), "label": Feature(np.int32)}


def _write(directory, n, num_files):
    features, labels = blobs(n)
    for k, rows in enumerate(np.array_split(np.arange(n), num_files)):
        ex.data.array_record.write(
            f"{directory}/part-{k:02d}.array_record",
            ({"x": features["x"][i], "id": i, "label": labels[i]} for i in rows),
        )
    return f"{directory}/part-*.array_record"


def _source(tmp_path, n, num_files=4, **kwargs):
    return ex.data.array_record(_write(tmp_path, n, num_files), SPEC, label="label", **kwargs)


def _ids(stacks):
    return np.concatenate([s[0]["id"].reshape(-1) for s in stacks])


def test_every_feature_kind_reads_back_as_written(tmp_path):
    image = np.arange(12, dtype=np.uint8).reshape(3, 4)
    for name, ks in (("b", range(3, 5)), ("a", range(3))):  # a list keeps its order, a glob sorts
        ex.data.array_record.write(
            tmp_path / f"{name}.array_record",
            [{"image": (image + k).tobytes(), "tokens": np.arange(k), "w": [0.5, k], "y": k} for k in ks],
        )
    spec = {
        "image": Feature(np.uint8, (3, 4)),
        "tokens": Feature(np.int32, (), max_length=6),
        "w": Feature(np.float32, (2,)),
        "y": Feature(np.int32),
    }
    by_list = ex.data.array_record([tmp_path / "b.array_record", str(tmp_path / "a.array_record")], spec, label="y")
    ((features, labels),) = list(feed.eval_batches(by_list, 8))
    order = [3, 4, 0, 1, 2]
    np.testing.assert_array_equal(labels, order)
    np.testing.assert_array_equal(features["image"], np.stack([image + k for k in order]))
    np.testing.assert_array_equal(features["tokens_length"], order)
    np.testing.assert_array_equal(features["tokens"][0], [0, 1, 2, 0, 0, 0])
    np.testing.assert_array_equal(features["w"], [[0.5, k] for k in order])
    assert features["tokens"].dtype == np.int32 and features["w"].dtype == np.float32
    by_glob = ex.data.array_record(tmp_path / "*.array_record", spec, label="y")
    assert np.concatenate([b[1] for b in feed.eval_batches(by_glob, 2)]).tolist() == [0, 1, 2, 3, 4]
    # What the format's own reader sees: one tf.train.Example per record, written with group_size:1.
    reader = arrayrecord.open_reader("a", str(tmp_path / "a.array_record"))
    assert reader.num_records() == 3 and "group_size:1," in reader.writer_options_string()
    example = ex.data.tfrecord.Example.FromString(reader.read([2])[0])
    assert list(example.features.feature["y"].int64_list.value) == [2]


def test_three_epochs_in_the_device_loop_see_each_example_once_per_epoch(tmp_path, monkeypatch):
    consumed = []
    run = DeviceLoop.run

    def recording_run(self, state, chunk):
        consumed.append(np.asarray(chunk.stack[0]["id"]).reshape(-1, 64))
        return run(self, state, chunk)

    monkeypatch.setattr(DeviceLoop, "run", recording_run)
    source = _source(tmp_path, 1000)
    est = estimator(train_batch_size=64, steps_per_loop=7, loop="scan").train(source, epochs=3)
    steps = 1000 // 64
    batches = np.concatenate(consumed)
    assert est.step == len(batches) == 3 * steps
    epochs = [batches[e * steps : (e + 1) * steps].ravel() for e in range(3)]
    for ids in epochs:
        assert len(np.unique(ids)) == len(ids) == steps * 64  # none repeated; 1000 - 960 dropped
    assert not np.array_equal(epochs[0], epochs[1])  # reshuffled each epoch
    # Evaluation and prediction of the files equal those of the same examples as arrays.
    features, labels = blobs(1000)
    reference = ex.data.from_arrays(features, labels)
    results, expected = est.evaluate(source), est.evaluate(reference)
    assert results["num_examples"] == 1000
    np.testing.assert_allclose(results["loss"], expected["loss"], rtol=1e-5)
    np.testing.assert_allclose(
        np.stack([r["logits"] for r in est.predict(source)]),
        np.stack([r["logits"] for r in est.predict(reference)]),
        rtol=1e-5,
    )


@pytest.mark.parametrize("num_files", [4, 2])  # files i::n; fewer files than processes: records i::n
def test_process_shards_are_disjoint_and_evaluation_counts_each_example_once(tmp_path, num_files):
    n, count = 1001, 3
    source = _source(tmp_path, n, num_files)
    per_epoch = source.steps_per_epoch(16, count)
    train = []
    for p in range(count):
        ids = _ids(feed.train_stacks(source, 16, [per_epoch], seed=0, start_step=0, shard=feed.Shard(p, count)))
        assert len(ids) == per_epoch * 16 and len(np.unique(ids)) == len(ids)
        train.append(set(ids.tolist()))
    assert all(not (a & b) for a, b in itertools.combinations(train, 2))
    shards = [list(feed.eval_batches(source, 64, shard=feed.Shard(p, count))) for p in range(count)]
    assert len({len(s) for s in shards}) == 1  # the same number of evaluation steps on every process
    assert sorted(np.concatenate([b[0]["id"] for s in shards for b in s]).tolist()) == list(range(n))


def test_training_resumes_from_the_step_and_the_seed_sets_the_order(tmp_path, model_dir):
    source = _source(tmp_path, 300)  # 18 steps of 16 per epoch: the resumed part crosses an epoch
    full = _ids(feed.train_stacks(source, 16, [10, 10, 10], seed=5, start_step=0))
    np.testing.assert_array_equal(_ids(feed.train_stacks(source, 16, [10, 10], seed=5, start_step=10)), full[160:])
    assert not np.array_equal(_ids(feed.train_stacks(source, 16, [10], seed=6, start_step=0)), full[:160])
    # A run stopped at step 8 and resumed by a new Estimator ends where an uninterrupted run does.
    estimator(model_dir, steps_per_loop=4, seed=5).train(source, max_steps=8)
    resumed = estimator(model_dir, steps_per_loop=4, seed=5).train(source, max_steps=24)
    straight = estimator(f"{model_dir}-straight", steps_per_loop=4, seed=5).train(source, max_steps=24)
    assert resumed.step == straight.step == 24
    for a, b in zip(jax.tree.leaves(resumed.state().params), jax.tree.leaves(straight.state().params), strict=True):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))


def test_grain_worker_processes_read_the_same_batches(tmp_path):
    pattern = _write(tmp_path, 200, 2)
    in_process = ex.data.array_record(pattern, SPEC, label="label")
    workers = ex.data.array_record(pattern, SPEC, label="label", num_workers=2)
    expected = list(feed.train_stacks(in_process, 16, [4, 4], seed=1, start_step=3))
    for got, want in zip(feed.train_stacks(workers, 16, [4, 4], seed=1, start_step=3), expected, strict=True):
        np.testing.assert_array_equal(got[0]["id"], want[0]["id"])
        np.testing.assert_array_equal(got[0]["x"], want[0]["x"])


def test_gs_files_are_read_by_the_format_reader(gcs):
    for k in range(2):
        ex.data.array_record.write(f"gs://bkt/ar/part-{k}.array_record", [{"id": 10 * k + i} for i in range(3)])
    pattern = "gs://bkt/ar/part-*.array_record"
    catalog = arrayrecord.Catalog(files.expand(pattern))
    assert catalog.paths == {f"gs://bkt/ar/part-{k}.array_record": f"gs://bkt/ar/part-{k}.array_record" for k in (0, 1)}
    source = ex.data.array_record(pattern, {"id": Feature(np.int64)})
    assert np.concatenate([b[0]["id"] for b in feed.eval_batches(source, 4)]).tolist() == [0, 1, 2, 10, 11, 12]


def test_other_stores_are_copied_locally_through_fsspec():
    ex.data.array_record.write("memory://ar-test/a.array_record", [{"id": i} for i in range(5)])
    catalog = arrayrecord.Catalog(files.expand("memory://ar-test/*.array_record"))
    (local,) = catalog.paths.values()
    assert os.path.isfile(local) and catalog.counts == {"memory:///ar-test/a.array_record": 5}
    source = ex.data.array_record("memory://ar-test/a.array_record", {"id": Feature(np.int64)})
    assert np.concatenate([b[0]["id"] for b in feed.eval_batches(source, 4)]).tolist() == list(range(5))
    directory = os.path.dirname(local)
    del catalog
    assert not os.path.exists(directory)  # the copies go with the catalog


def test_errors_name_the_file_and_the_record(tmp_path):
    path = tmp_path / "c.array_record"
    marks = [{"m": f"MARK-{i:04d}".encode(), "x": np.full(3, i, np.float32)} for i in range(6)]
    ex.data.array_record.write(path, marks, options="group_size:1,uncompressed")  # records findable in the bytes
    data = bytearray(path.read_bytes())
    data[data.index(b"MARK-0003") + 2] ^= 0xFF
    path.write_bytes(bytes(data))
    records = arrayrecord.Records(files.expand(path), arrayrecord.Catalog(files.expand(path)))
    assert records[2][2] and len(records) == 6
    with pytest.raises(ex.InputIndexError, match=r"^Record 6 of an ArrayRecord source of 6 records; expected 0 to 5"):
        records[6]  # an IndexError too, as the sequence protocol asks
    with pytest.raises(InputError, match=rf"^{path}: record 3 cannot be read \(.*[Cc]orrupt.*\)\. Fix: write the file"):
        records[3]
    truncated = tmp_path / "t.array_record"
    truncated.write_bytes(bytes(data[: len(data) // 2]))
    tfrecords = tmp_path / "x.tfrecord"
    ex.data.tfrecord.write(tfrecords, [{"x": [1.0, 2.0, 3.0]}] * 3)
    for wrong in (truncated, tfrecords):
        unreadable = rf"^{wrong}: cannot be opened as an ArrayRecord file \(.+\); expected a complete file written"
        with pytest.raises(InputError, match=unreadable):
            ex.data.array_record(wrong, {"x": Feature(np.float32, (3,))})
    good = tmp_path / "g.array_record"
    ex.data.array_record.write(good, [{"x": [1.0, 2.0, 3.0]}] * 2 + [{"x": [1.0, 2.0]}])
    with pytest.raises(ValueError, match=rf"{good}: record 2: feature 'x' has 2 values; expected 3"):
        list(feed.eval_batches(ex.data.array_record(good, {"x": Feature(np.float32, (3,))}), 8))
    with pytest.raises(
        ValueError, match=rf"{good}: record 0 has no feature 'y'; expected the spec's \['x', 'y'\] \(found \['x'\]\)"
    ):
        list(feed.eval_batches(ex.data.array_record(good, {"x": Feature(np.float32, (3,)), "y": Feature()}), 8))
    with pytest.raises(ConfigError, match=r"array_record\(label='y'\) is not in the feature spec \['x'\]\. Fix"):
        ex.data.array_record(good, {"x": Feature(np.float32, (3,))}, label="y")
    with pytest.raises(ConfigError, match=r"array_record\(features=\['x'\]\); expected a dict of name -> Feature"):
        ex.data.array_record(good, ["x"])
    with pytest.raises(FileNotFoundError, match=r"match no file"):
        ex.data.array_record(tmp_path / "none-*.array_record", {"x": Feature()})
    with pytest.raises(StorageError, match=rf"{tmp_path}/absent/a.array_record: cannot be written \(.+\); expected"):
        ex.data.array_record.write(tmp_path / "absent" / "a.array_record", [{"x": 1}])
    with pytest.raises(ConfigError, match=r"write\(options='group_size:1,bogus'\): Unknown option bogus"):
        ex.data.array_record.write(good, [{"x": 1}], options="group_size:1,bogus")


def test_write_names_a_feature_it_cannot_encode_and_leaves_nothing_half_written(tmp_path):
    path = tmp_path / "w.array_record"
    ex.data.array_record.write(path, [{"id": i} for i in range(3)])
    before = path.read_bytes()
    rule = r"a tf\.train\.Example feature holds floats \(float_list\), integers or booleans \(int64_list\), or one"
    with pytest.raises(InputError, match=rf"^Feature 'name' has dtype <U3; {rule}.*Fix: encode it, e\.g\. "):
        ex.data.array_record.write(path, [{"id": 0, "name": np.array(["abc"])}])

    def raises_half_way():
        yield from ({"id": i} for i in range(5))
        raise OSError("the source went away")

    with pytest.raises(OSError, match="the source went away"):
        ex.data.array_record.write(path, raises_half_way())
    assert path.read_bytes() == before  # the earlier file is kept whole
    with pytest.raises(OSError, match="the source went away"):
        ex.data.array_record.write(tmp_path / "new.array_record", raises_half_way())
    assert sorted(os.listdir(tmp_path)) == ["w.array_record"]  # no partial file, under any name
