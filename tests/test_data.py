"""Array inputs and the feed: coverage, resume position, and clear errors on bad batches."""

import itertools

import numpy as np
import pytest
from models import blobs, estimator

import estimax as ex
from estimax.data import feed
from estimax.data.source import ChunkSizes, total_steps

pytestmark = pytest.mark.quick  # the quick tier: pytest -m quick


def test_each_epoch_visits_every_example_at_most_once_and_reshuffles():
    ids = np.arange(1000)
    data = ex.data.from_arrays({"id": ids}, ids)
    per_epoch = data.steps_per_epoch(64)
    assert per_epoch == 15
    batches = [f["id"] for f, _ in itertools.islice(data.train_batches(64, seed=3), 3 * per_epoch)]
    epochs = [np.concatenate(batches[e * per_epoch : (e + 1) * per_epoch]) for e in range(3)]
    for seen in epochs:
        assert len(seen) == 960 and len(np.unique(seen)) == 960
    assert not np.array_equal(epochs[0], epochs[1])


def test_train_batches_resume_from_any_step():
    data = ex.data.from_arrays(*blobs(200))
    full = list(itertools.islice(data.train_batches(16, seed=1), 40))
    resumed = list(itertools.islice(data.train_batches(16, seed=1, start_step=27), 13))
    for (a, la), (b, lb) in zip(full[27:], resumed, strict=True):
        np.testing.assert_array_equal(a["x"], b["x"])
        np.testing.assert_array_equal(la, lb)


def test_stacks_hold_the_same_batches_as_single_steps():
    data = ex.data.from_arrays(*blobs(200))
    batches = list(itertools.islice(data.train_batches(16, seed=4, start_step=5), 17))
    stacks = list(data.train_stacks(16, [7, 7, 3], seed=4, start_step=5))
    assert [s[0]["x"].shape for s in stacks] == [(7, 16, 6), (7, 16, 6), (3, 16, 6)]
    np.testing.assert_array_equal(np.concatenate([s[0]["x"] for s in stacks]), np.stack([b[0]["x"] for b in batches]))
    np.testing.assert_array_equal(np.concatenate([s[1] for s in stacks]), np.stack([b[1] for b in batches]))


@pytest.mark.parametrize(("start", "target", "per_loop"), [(0, 22, 4), (5, 22, 4), (0, 8, 4), (3, 3, 4), (7, 9, 1)])
def test_the_loops_of_a_call_are_its_steps_cut_into_steps_per_loop(start, target, per_loop):
    sizes = ChunkSizes(start, target, per_loop)
    expected = [min(per_loop, target - s) for s in range(start, target, per_loop)]
    assert list(sizes) == expected and len(sizes) == len(expected) and sizes[1:] == expected[1:]
    assert sizes.steps == total_steps(sizes) == total_steps(expected) == sum(expected)


def test_a_distant_max_steps_holds_no_list_of_its_loops():
    # A run that trains until it is stopped (max_steps=10**15) asked for a list of 10**15 loop sizes.
    sizes = ChunkSizes(10, 10**15, 1)
    assert len(sizes) == 10**15 - 10 and sizes[-1] == 1 and sizes.steps == 10**15 - 10

    class StopAfterThreeLoops(ex.hooks.Hook):
        def after_loop(self, loop):
            return loop.step_after >= 12

    est = estimator(steps_per_loop=4)
    assert est.train(ex.data.from_arrays(*blobs(256)), max_steps=10**15, hooks=[StopAfterThreeLoops()]).step == 12


def test_process_shards_are_disjoint_and_cover_the_data():
    ids = np.arange(1001)
    data = ex.data.from_arrays({"id": ids})
    shards = [
        np.concatenate([f["id"] for f, _ in data.eval_batches(64, process_index=i, process_count=3)]) for i in range(3)
    ]
    assert sorted(np.concatenate(shards).tolist()) == ids.tolist()
    train = [
        np.concatenate(
            [f["id"] for f, _ in itertools.islice(data.train_batches(16, seed=0, process_index=i, process_count=3), 20)]
        )
        for i in range(3)
    ]
    assert not set(train[0]) & set(train[1]) and not set(train[1]) & set(train[2])


def test_from_arrays_checks_sizes():
    with pytest.raises(ValueError, match=r"differ in their number of examples"):
        ex.data.from_arrays({"x": np.zeros((10, 2))}, np.zeros(9))
    with pytest.raises(ValueError, match=r"fewer than one batch of 32"):
        next(ex.data.from_arrays({"x": np.zeros((10, 2))}).train_batches(32, seed=0))


def _batches(*shapes_and_dtypes):
    return [({"x": np.zeros(s, d)}, np.zeros(s[0], np.int32)) for s, d in shapes_and_dtypes]


@pytest.mark.parametrize(
    "batches, message",
    [
        (
            _batches(((32, 6), np.float32), ((32, 5), np.float32)),
            r"Input batch 1: features\['x'\] has per-example shape \(5,\) and dtype float32; expected \(6,\) float32",
        ),
        (_batches(((32, 6), np.float32), ((32, 6), np.float64)), r"dtype float64; expected \(6,\) float32"),
        (
            [
                ({"x": np.zeros((32, 6), np.float32)}, np.zeros(32, np.int32)),
                ({"y": np.zeros((32, 6), np.float32)}, np.zeros(32, np.int32)),
            ],
            r"missing: \[\"features\['x'\]\"\], unexpected: \[\"features\['y'\]\"\]",
        ),
        ([({"x": np.array([["a"] * 6] * 32)}, np.zeros(32))], r"features\['x'\] has dtype <U1; expected numbers"),
        ([({"x": np.zeros((32, 6), np.float32)}, np.zeros(31))], r"labels has 31 rows; expected 32"),
        (
            _batches(((32, 6), np.float32), ((16, 6), np.float32), ((32, 6), np.float32)),
            r"Training input batch 1 has 16 rows; expected the host batch size 32",
        ),
    ],
)
def test_bad_batches_are_named(batches, message):
    with pytest.raises((ValueError, TypeError), match=message):
        estimator(steps_per_loop=4).train(batches, max_steps=10)


def test_inputs_must_yield_pairs():
    with pytest.raises(TypeError, match=r"expected a \(features, labels\) tuple"):
        estimator().train([np.zeros((32, 6))], max_steps=1)
    with pytest.raises(TypeError, match=r"Input int is not supported"):
        estimator().train(3, max_steps=1)


def test_a_failed_input_leaves_checkpoints_intact(model_dir):
    data = ex.data.from_arrays(*blobs(256))
    estimator(model_dir).train(data, max_steps=8)
    bad = _batches(((32, 6), np.float32), ((32, 7), np.float32))
    with pytest.raises(ValueError):
        estimator(model_dir).train(bad, steps=10)
    assert estimator(model_dir).step == 8


def test_prefetch_forwards_errors_and_stops():
    def source():
        yield 1
        raise RuntimeError("broken source")

    with feed.Prefetch(source()) as items:
        assert next(items) == 1
        with pytest.raises(RuntimeError, match="broken source"):
            next(items)
        with pytest.raises(StopIteration):
            next(items)
    with feed.Prefetch(itertools.count()) as endless:  # closing an unfinished producer returns
        assert next(endless) == 0


def test_from_arrays_global_batches_do_not_depend_on_the_process_count():
    data = ex.data.from_arrays({"id": np.arange(1001)})
    one = [f["id"] for f, _ in itertools.islice(data.train_batches(48, seed=3, start_step=15), 30)]
    parts = [
        [
            f["id"]
            for f, _ in itertools.islice(
                data.train_batches(16, seed=3, start_step=15, process_index=p, process_count=3), 30
            )
        ]
        for p in range(3)
    ]
    for step, batch in enumerate(one):  # across an epoch boundary (20 steps per epoch)
        np.testing.assert_array_equal(np.concatenate([part[step] for part in parts]), batch)
    assert data.steps_per_epoch(16, 3) == data.steps_per_epoch(48, 1) == 20
