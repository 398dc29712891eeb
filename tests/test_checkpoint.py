"""Checkpoint policy, corruption fallback, choosing a checkpoint and warm start."""

import glob
import json
import os
import sys
import time

import helpers
import jax
import numpy as np
import optax
import pytest
import warm
from flax import nnx
from models import blobs, estimator

import estimax as ex
from estimax.run import pruning
from estimax.run.checkpoint import Checkpointer, locate
from estimax.run.checkpoint_meta import CheckpointMeta

DATA = ex.data.from_arrays(*blobs(256))


def _steps(model_dir):
    return sorted(int(d) for d in os.listdir(os.path.join(model_dir, "checkpoints")) if d.isdigit())


def _params(est, **kw):
    flat = nnx.to_flat_state(nnx.state(est.model(**kw), nnx.Param))
    return {"/".join(map(str, k)): np.asarray(v) for k, v in flat}


def _data_files(model_dir, step):
    """The array data files of a checkpoint (tensorstore OCDBT ``d/`` directories)."""
    root = os.path.join(model_dir, "checkpoints", str(step), "state")
    return [os.path.join(r, f) for r, _, fs in os.walk(root) for f in fs if os.path.basename(r) == "d"]


@pytest.mark.quick
def test_policy_saves_on_crossed_steps_and_keeps_the_last(model_dir):
    estimator(model_dir, steps_per_loop=3, checkpoint=ex.CheckpointPolicy(every_steps=5, keep=2)).train(
        DATA, max_steps=20
    )
    assert _steps(model_dir) == [15, 20]  # saved at 6, 12, 15, 18 (crossings) and 20 (end); the last 2 kept


def test_a_replicated_array_is_sliced_across_its_replicas_only_when_a_slice_is_large(tmp_path, caplog):
    """Orbax writes a replicated array replica-parallel through a slicing program per shape and device; the
    state's writer (``checkpoint_handlers.py``) does so only for slices of at least MIN_SLICE_BYTES. Shapes no
    other test uses: a program already compiled in this process would not be logged."""
    import orbax.checkpoint as ocp
    from jax.sharding import NamedSharding, PartitionSpec

    from estimax.run import checkpoint_handlers

    replicated = NamedSharding(jax.make_mesh((2,), ("data",), devices=jax.devices()[:2]), PartitionSpec())
    rows = 2 * checkpoint_handlers.MIN_SLICE_BYTES // (4 * 1031) + 2  # float32: each replica's half is larger
    state = {
        "small": jax.device_put(np.arange(4 * 1033, dtype=np.float32).reshape(4, 1033), replicated),
        "large": jax.device_put(np.ones((rows, 1031), np.float32), replicated),
    }
    writer = checkpoint_handlers.registry().get("state", ocp.args.PyTreeSave)
    with jax.log_compiles(True), caplog.at_level("WARNING"):
        ocp.Checkpointer(writer).save(tmp_path / "state", args=ocp.args.PyTreeSave(state))
    sliced = [r.getMessage() for r in caplog.records if r.getMessage().startswith("Compiling jit(slice)")]
    assert len(sliced) == 2 and all(f"[{rows},1031]" in m for m in sliced), sliced  # the large one, per replica
    restored = ocp.StandardCheckpointer().restore(tmp_path / "state", state)
    for name, value in state.items():
        np.testing.assert_array_equal(np.asarray(restored[name]), np.asarray(value))


def test_policy_saves_by_time(model_dir):
    policy = ex.CheckpointPolicy(every_steps=None, every_seconds=1e-3, keep=100)
    estimator(model_dir, steps_per_loop=4, checkpoint=policy).train(DATA, max_steps=16)
    assert _steps(model_dir) == [4, 8, 12, 16]


def test_save_every_steps_is_a_shorthand():
    config = ex.RunConfig(save_every_steps=7, keep_checkpoints=1)
    assert config.checkpoint == ex.CheckpointPolicy(every_steps=7, keep=1)  # kept exactly: max_overhead=None
    assert ex.RunConfig().checkpoint == ex.CheckpointPolicy(every_steps=1000, max_overhead=0.02)
    with pytest.raises(ex.errors.ConfigError, match=r"max_overhead=2\) is not a fraction .* Fix: max_overhead=0.02"):
        ex.CheckpointPolicy(max_overhead=2)


def test_saves_due_by_steps_are_put_off_while_they_would_cost_more_than_max_overhead(model_dir, estimax_log):
    # A loop of this model takes about a millisecond, a save tens: saving every 2 steps would be most
    # of the time. Put off, the saves by steps take at most 2% of it; the end is always saved.
    bounded = ex.CheckpointPolicy(every_steps=2, keep=1000, max_overhead=0.02)
    estimator(model_dir, steps_per_loop=2, checkpoint=bounded).train(DATA, max_steps=120)
    saved = _steps(model_dir)
    assert saved[-1] == 120 and all(step % 2 == 0 for step in saved) and len(saved) <= 10, saved
    put_off = [r.getMessage() for r in estimax_log.records if "is put off" in r.getMessage()]
    assert len(put_off) == 1 and "CheckpointPolicy(max_overhead=None) saves at every multiple" in put_off[0]
    exact = ex.CheckpointPolicy(every_steps=2, keep=1000)  # max_overhead=None
    estimator(model_dir + "-exact", steps_per_loop=2, checkpoint=exact).train(DATA, max_steps=20)
    assert _steps(model_dir + "-exact") == list(range(2, 21, 2))


def test_calls_without_the_save_at_their_end_continue_in_memory_and_a_preemption_still_saves(model_dir, estimax_log):
    from helpers import SigtermAfter

    policy = ex.CheckpointPolicy(every_steps=8, keep=100, at_end=False)
    est = estimator(model_dir, steps_per_loop=2, checkpoint=policy)
    for end in (5, 10, 15, 20):  # short calls of 2-step loops: saved only where a multiple of 8 is crossed
        est.train(DATA, max_steps=end)
        assert est.step == end
    assert _steps(model_dir) == [9, 17]
    assert "step 5 not saved (CheckpointPolicy(at_end=False)), no checkpoint yet" in estimax_log.text
    assert "step 20 not saved (CheckpointPolicy(at_end=False)), the last checkpoint is step 17" in estimax_log.text
    est.train(DATA, max_steps=20)  # nothing to train: nothing to say
    assert estimax_log.text.count("not saved (CheckpointPolicy(at_end=False))") == 4
    one_call = estimator(model_dir + "-one-call", steps_per_loop=2)
    one_call.train(DATA, max_steps=20)
    assert all(np.array_equal(a, b) for a, b in zip(_params(est).values(), _params(one_call).values(), strict=True))
    assert estimator(model_dir).step == 17  # another Estimator reads what was saved
    with pytest.raises(ex.Preempted):
        est.train(DATA, max_steps=30, hooks=[SigtermAfter(22)])
    assert _steps(model_dir) == [9, 17, 22]  # saved where it stopped


@pytest.mark.quick
@pytest.mark.parametrize("damage", ["truncate", "alter"])
def test_a_damaged_latest_checkpoint_falls_back_to_the_previous(model_dir, damage, estimax_log):
    est = estimator(model_dir, save_every_steps=4)
    est.train(DATA, max_steps=8)
    at_8 = _params(est)
    est.train(DATA, max_steps=12)
    for path in _data_files(model_dir, 12):
        with open(path, "r+b") as f:
            if damage == "truncate":
                f.truncate(os.path.getsize(path) // 2)
            else:
                f.seek(os.path.getsize(path) // 2)
                byte = f.read(1)
                f.seek(-1, os.SEEK_CUR)
                f.write(bytes([byte[0] ^ 0xFF]))
    resumed = estimator(model_dir, save_every_steps=4)
    assert resumed.step == 8
    assert "checkpoints/12 cannot be used" in estimax_log.text and "Restored step 8" in estimax_log.text
    for name, value in _params(resumed).items():
        np.testing.assert_array_equal(value, at_8[name])


def test_a_save_stopped_before_it_finished_is_removed_with_a_warning_and_saved_again(model_dir, estimax_log):
    uninterrupted = estimator(model_dir, save_every_steps=4).train(DATA, max_steps=12)
    at_12 = _params(uninterrupted)
    root = os.path.join(model_dir, "checkpoints")
    # What a save killed before its last rename leaves: the step under Orbax's temporary name.
    os.rename(os.path.join(root, "12"), os.path.join(root, "12.orbax-checkpoint-tmp-1764000000"))
    resumed = estimator(model_dir, save_every_steps=4)
    assert resumed.step == 8
    resumed.train(DATA, max_steps=12)
    assert f"The save of step 12 in {root} never finished" in estimax_log.text
    assert sorted(os.listdir(root)) == ["12", "4", "8"]
    for name, value in _params(resumed).items():
        np.testing.assert_array_equal(value, at_12[name])


def test_what_another_estimator_wrote_between_two_train_calls_is_seen(model_dir, estimax_log):
    # The first Estimator keeps its writer between calls; the steps another one saved meanwhile, and a
    # save of it that was killed before it finished, are seen when the first trains again.
    first = estimator(model_dir, save_every_steps=4)
    first.train(DATA, max_steps=8)
    estimator(model_dir, save_every_steps=4).train(DATA, max_steps=16)
    root = os.path.join(model_dir, "checkpoints")
    os.rename(os.path.join(root, "16"), os.path.join(root, "16.orbax-checkpoint-tmp-1764000000"))
    assert first.step == 12  # the newest finished checkpoint, not the first's own step 8
    first.train(DATA, max_steps=20)
    assert f"The save of step 16 in {root} never finished" in estimax_log.text
    assert "Training steps 12 -> 20" in estimax_log.text
    assert sorted(os.listdir(root)) == ["12", "16", "20"]
    reader = estimator(model_dir, save_every_steps=4)
    first.train(DATA, max_steps=24)
    assert reader.step == 24 and _steps(model_dir) == [16, 20, 24]


def test_altered_checksums_are_detected(model_dir):
    import json

    estimator(model_dir, save_every_steps=4).train(DATA, max_steps=8)
    meta = os.path.join(model_dir, "checkpoints", "8", "meta", "metadata")
    record = json.load(open(meta))
    name = sorted(record["checksums"])[0]
    record["checksums"][name] = (record["checksums"][name] + 1) % 2**32
    json.dump(record, open(meta, "w"))
    assert estimator(model_dir).step == 4


def test_a_meta_of_an_earlier_release_restores_and_the_meta_written_is_what_earlier_releases_wrote(model_dir):
    trained = estimator(model_dir, save_every_steps=4).train(DATA, max_steps=8)
    path = os.path.join(model_dir, "checkpoints", "8", "meta", "metadata")
    written = json.load(open(path))
    assert list(written) == ["step", "input_state", "checksums", "saved_at", "run", "loop"]  # the keys, in order
    assert list(written["run"]) == ["train_batch_size", "seed", "optimizer", "shape"]
    assert list(written["run"]["shape"]) == ["processes", "devices", "mesh"]
    meta = CheckpointMeta.from_json(written)
    assert meta.to_json() == written and (meta.step, meta.run.train_batch_size, meta.run.shape.devices) == (8, 32, 8)
    # The oldest record: no save time, run setup nor loop mode; what it lacks reads as None, and it restores.
    json.dump({key: written[key] for key in ("step", "input_state", "checksums")}, open(path, "w"))
    assert CheckpointMeta.from_json(json.load(open(path))).run is None
    resumed = estimator(model_dir)
    assert resumed.step == 8 and _params(resumed).keys() == _params(trained).keys()
    for name, value in _params(trained).items():
        np.testing.assert_array_equal(_params(resumed)[name], value)


@pytest.mark.quick
def test_no_usable_checkpoint_is_an_error(model_dir):
    estimator(model_dir, save_every_steps=None).train(DATA, max_steps=4)
    for path in _data_files(model_dir, 4):
        open(path, "wb").close()
    with pytest.raises(ex.CheckpointError, match=r"No usable checkpoint in .*step 4: .*Fix:"):
        _ = estimator(model_dir).step


@pytest.mark.quick
def test_evaluate_predict_and_model_take_a_checkpoint(model_dir):
    est = estimator(model_dir, save_every_steps=4, keep_checkpoints=5).train(DATA, max_steps=12)
    at_4 = estimator(steps_per_loop=4).train(DATA, max_steps=4)  # the same first 4 steps, in memory
    by_step, by_path = _params(est, checkpoint=4), _params(est, checkpoint=os.path.join(model_dir, "checkpoints", "4"))
    for name, value in _params(at_4).items():
        np.testing.assert_array_equal(by_step[name], value)
        np.testing.assert_array_equal(by_path[name], value)
    assert est.evaluate(DATA, checkpoint=4) == at_4.evaluate(DATA)
    first = next(iter(est.predict(DATA, checkpoint=4)))
    np.testing.assert_array_equal(first["logits"], next(iter(at_4.predict(DATA)))["logits"])
    assert est.step == 12  # choosing a checkpoint does not change the estimator's state
    with pytest.raises(ex.CheckpointError, match="does not exist"):
        est.model(checkpoint=os.path.join(model_dir, "nowhere"))


def test_warm_start_loads_selected_parameters_and_reports_the_plan(tmp_path):
    source = str(tmp_path / "source")
    trained = estimator(source, optimizer=optax.adam(1e-2)).train(DATA, max_steps=8)
    warm = ex.WarmStart(source, exclude=["l2/.*"])
    fresh = estimator(classes=5)
    plan = warm.plan(fresh.state_shapes().params)
    assert plan.loaded == [("l1/bias", "l1/bias"), ("l1/kernel", "l1/kernel")]
    assert plan.skipped == ["l2/bias", "l2/kernel"] and plan.initialised == ["l2/bias", "l2/kernel"]
    assert "2 loaded, 2 skipped, 2 left at initialisation" in str(plan)

    tuned = estimator(str(tmp_path / "tuned"), classes=5, optimizer=optax.adam(1e-2), warm_start=warm)
    source_params, tuned_params, init_params = _params(trained), _params(tuned), _params(fresh)
    np.testing.assert_array_equal(tuned_params["l1/kernel"], source_params["l1/kernel"])
    np.testing.assert_array_equal(tuned_params["l2/kernel"], init_params["l2/kernel"])
    opt_leaves = jax.tree.leaves(tuned.state().opt_state)
    assert all(not np.any(np.asarray(x)) for x in opt_leaves if np.ndim(x))  # a fresh optimizer state
    tuned.train(DATA, max_steps=4)
    again = estimator(str(tmp_path / "tuned"), classes=5, optimizer=optax.adam(1e-2), warm_start=warm)
    assert again.step == 4  # its own checkpoint wins over the warm start
    with pytest.raises(ex.CheckpointError, match=r"another model or optimizer; arrays removed: opt_state/0/count"):
        _ = estimator(str(tmp_path / "tuned"), classes=5).step  # another optimizer state


def test_warm_start_errors_and_array_sources(tmp_path):
    source = str(tmp_path / "source")
    trained = estimator(source).train(DATA, max_steps=4)
    with pytest.raises(ValueError, match=r"parameter l2/bias has shape \(5,\) but l2/bias .* has shape \(3,\)"):
        _ = estimator(classes=5, warm_start=ex.WarmStart(source)).step
    arrays = str(tmp_path / "params.npz")
    np.savez(arrays, **{"first/kernel": _params(trained)["l1/kernel"]})
    renamed = estimator(warm_start=ex.WarmStart(arrays, include=["l1/kernel"], rename={"l1/": "first/"}))
    np.testing.assert_array_equal(_params(renamed)["l1/kernel"], _params(trained)["l1/kernel"])
    with_optimizer = estimator(warm_start=ex.WarmStart(source, optimizer_state=True))
    assert with_optimizer.step == 0


def test_readme_fine_tuning_example(tmp_path):
    """The README's example: the digits CNN fine-tuned with a new 5-class head."""
    from estimax.examples import digits

    train, _ = digits.load()
    config = ex.RunConfig(model_dir=str(tmp_path / "digits"), train_batch_size=16, steps_per_loop=5, loop="step")
    digits.estimator(config).train(train, max_steps=5)  # the guide's 128 examples a step only cost time here

    first_five = train.labels < 5
    subset = ex.data.from_arrays({"image": train.features["image"][first_five]}, train.labels[first_five])
    tuned = ex.Estimator(
        model=digits.build_model,
        model_fn=digits.model_fn,
        optimizer=digits.optimizer(),
        config=ex.RunConfig(model_dir=str(tmp_path / "digits-0to4"), train_batch_size=16, steps_per_loop=5),
        params={"num_classes": 5},
        warm_start=ex.WarmStart(str(tmp_path / "digits"), exclude=["head/.*"]),
    )
    plan = ex.WarmStart(str(tmp_path / "digits"), exclude=["head/.*"]).plan(tuned.state_shapes().params)
    assert [t for t, _ in plan.loaded] == [
        "conv1/bias",
        "conv1/kernel",
        "conv2/bias",
        "conv2/kernel",
        "dense/bias",
        "dense/kernel",
    ]
    assert plan.initialised == ["head/bias", "head/kernel"]
    tuned.train(subset, max_steps=5)
    assert tuned.evaluate(subset)["num_examples"] == first_five.sum()


def test_a_streaming_input_resumes_from_the_position_saved_with_the_checkpoint(tmp_path):
    """A Grain IterDataset cannot seek by step: its iterator state travels in the checkpoint."""
    import grain

    features, labels = blobs(2000, seed=5)

    def stream():
        return ex.data.from_grain(
            grain.MapDataset.range(2000)
            .shuffle(seed=1)
            .map(lambda i: ({"x": features["x"][i]}, labels[i]))
            .to_iter_dataset()
        )

    uninterrupted = estimator(str(tmp_path / "a"), steps_per_loop=4).train(stream(), max_steps=16)
    interrupted = str(tmp_path / "b")
    estimator(interrupted, steps_per_loop=4, save_every_steps=4).train(stream(), max_steps=8)
    resumed = estimator(interrupted, steps_per_loop=4).train(stream(), max_steps=16)  # a new process would do this
    for name, value in _params(uninterrupted).items():
        np.testing.assert_array_equal(_params(resumed)[name], value)
    estimator(str(tmp_path / "c"), steps_per_loop=4, save_every_steps=4).train(stream(), max_steps=8)
    _forget_the_input_position(tmp_path / "c", step=8)  # a resume without it starts the stream over
    restarted = estimator(str(tmp_path / "c"), steps_per_loop=4).train(stream(), max_steps=16)
    assert any(not np.array_equal(_params(restarted)[n], v) for n, v in _params(uninterrupted).items())


def _forget_the_input_position(model_dir, step: int) -> None:
    """Rewrites the checkpoint's JSON record without the input position (as one of a plain iterable has)."""
    records = [p for p in glob.glob(f"{model_dir}/**/{step}/meta/*", recursive=True) if p.endswith("metadata")]
    (record,) = records
    with open(record) as f:
        meta = json.load(f)
    assert meta["input_state"] is not None
    with open(record, "w") as f:
        json.dump({**meta, "input_state": None}, f)


TRAINER = """
import sys
from models import blobs, estimator
import estimax as ex
policy = ex.CheckpointPolicy(every_steps=1, keep=1, max_overhead=None, async_save=False)
estimator(sys.argv[1], steps_per_loop=1, checkpoint=policy).train(ex.data.from_arrays(*blobs(64)), max_steps=150)
"""


def test_a_reader_lists_and_evaluates_the_checkpoints_while_the_writer_deletes_them(model_dir):
    # Orbax lists the step folders, then reads each one: a step the trainer deletes in between failed
    # about 1 listing in 20 and 1 evaluation in 3 (as damage: "No usable checkpoint") while the trainer
    # saved and pruned every step.
    with open(f"{model_dir}.log", "w") as log:  # a file: a pipe nobody reads would stop the trainer once full
        trainer = warm.Popen([sys.executable, "-c", TRAINER, model_dir], env=helpers.job_env(), stderr=log)
    listings, evaluated = 0, []
    while trainer.poll() is None:
        if os.path.isdir(os.path.join(model_dir, "checkpoints")) and _steps(model_dir):  # one is saved
            reader, _ = locate(model_dir)  # opening lists them
            for _ in range(10):
                assert len(reader.steps()) <= 2  # listed again (a reader's steps() reads the folder)
                listings += 1
            reader.close()
            evaluated.append(estimator(model_dir).evaluate(DATA, steps=1)["loss"])
        else:  # nothing to race yet: the trainer gets the cores while it compiles
            time.sleep(0.01)
    assert trainer.wait() == 0, open(f"{model_dir}.log").read()[-2000:]
    assert listings > 100 and len(evaluated) > 5, f"{listings} listings, {len(evaluated)} evaluations: too few"
    assert _steps(model_dir) == [150]


@pytest.mark.parametrize("races", [3, pruning.LISTINGS])
def test_a_reader_that_the_writers_pruning_outpaces_is_told_so_and_nothing_is_called_damaged(
    model_dir, monkeypatch, estimax_log, races
):
    # Between a listing and its read the writer commits the next step and deletes the listed one (keep=1), as
    # a trainer saving every step does to a reader slower than a step; each race lost is listed again. Losing
    # every listing ended with "No usable checkpoint ... step N: FileNotFoundError", as if the step were damaged.
    policy = ex.CheckpointPolicy(every_steps=1, keep=1, max_overhead=None, async_save=False)
    writer = estimator(model_dir, steps_per_loop=1, checkpoint=policy)
    writer.train(DATA, max_steps=1)
    restore, raced = Checkpointer._restore_verified, []

    def read_once_the_writer_moved_on(self, target, step):
        if self.read_only and len(raced) < races:
            raced.append(step)
            writer.train(DATA, max_steps=step + 1)
        return restore(self, target, step)

    monkeypatch.setattr(Checkpointer, "_restore_verified", read_once_the_writer_moved_on)
    reader = estimator(model_dir)
    if races < pruning.LISTINGS:  # a race lost fewer times than the reader lists: the newest step is read
        reader.evaluate(DATA, steps=1)
        assert f"Restored checkpoint step {races + 1} from" in estimax_log.text
    else:
        with pytest.raises(ex.CheckpointError) as caught:
            reader.evaluate(DATA, steps=1)
        message = str(caught.value)
        assert f"its writer deleted the newest step of each of {races} listings before it was read" in message
        assert f"step {races}: " in message and "Nothing is damaged" in message and "Estimator.follow" in message
    assert raced == list(range(1, races + 1)) and _steps(model_dir) == [races + 1]
    assert "cannot be used" not in estimax_log.text and "No usable checkpoint" not in estimax_log.text
