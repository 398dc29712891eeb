"""Seeing training: hooks, writers, train_and_evaluate, non-finite values, profiling, the summary."""

import contextlib
import glob
import json
import os

import jax
import numpy as np
import optax
import pytest
from models import blobs, estimator

import estimax as ex
from estimax.hooks import Hook

DATA = ex.data.from_arrays(*blobs(256))


def _records(model_dir, split=None):
    with open(os.path.join(model_dir, "metrics.jsonl")) as f:
        records = [json.loads(line) for line in f]
    return [r for r in records if split is None or r["split"] == split]


class Recorder(Hook):
    def __init__(self):
        self.events = []

    def begin(self, run):
        self.events.append(("begin", run.start_step, run.target_step))

    def after_loop(self, loop):
        self.events.append(("loop", loop.step_before, loop.step_after, loop.crossed(10), loop.outputs["loss"].shape))

    def after_eval(self, evaluation):
        self.events.append(("eval", evaluation.step, evaluation.metrics["num_examples"]))

    def end(self, summary):
        self.events.append(("end", summary.step))


def test_hooks_see_every_loop_and_crossed_multiples():
    recorder = Recorder()
    estimator(steps_per_loop=4).train(DATA, max_steps=22, hooks=[recorder])
    loops = [e for e in recorder.events if e[0] == "loop"]
    assert recorder.events[0] == ("begin", 0, 22) and recorder.events[-1] == ("end", 22)
    assert [(b, a) for _, b, a, _, _ in loops] == [(0, 4), (4, 8), (8, 12), (12, 16), (16, 20), (20, 22)]
    assert [a for _, _, a, crossed, _ in loops if crossed] == [12, 20]  # 10 and 20 crossed, never hit
    assert [shape for *_, shape in loops] == [(4,)] * 5 + [(2,)]


def test_writers_metrics_file_and_tensorboard_read_back(model_dir):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    est = estimator(
        model_dir,
        steps_per_loop=4,
        log_every_steps=8,
        tensorboard=True,
        optimizer=optax.inject_hyperparams(optax.sgd)(learning_rate=optax.linear_schedule(0.1, 0.0, 24)),
    )
    est.train(DATA, max_steps=24)
    est.evaluate(DATA)
    train = _records(model_dir, "train")
    assert [r["step"] for r in train] == [8, 16, 24]
    for key in ("loss", "accuracy", "grad_norm", "learning_rate", "steps_per_sec", "examples_per_sec"):
        assert key in train[1], key
    np.testing.assert_allclose(train[0]["learning_rate"], 0.1 * (1 - 3.5 / 24), rtol=1e-5)  # mean of steps 0-7
    events = EventAccumulator(model_dir)  # the run's one TensorBoard run: every split's tags
    events.Reload()
    assert {"train/loss", "train/grad_norm", "train/learning_rate", "train/steps_per_sec"} <= set(
        events.Tags()["scalars"]
    )
    # Every step's scalars at that step; throughput at the log points.
    assert [e.step for e in events.Scalars("train/loss")] == list(range(1, 25))
    assert [e.step for e in events.Scalars("train/learning_rate")] == list(range(1, 25))
    assert events.Scalars("train/learning_rate")[0].value == pytest.approx(0.1, rel=1e-6)
    window = np.mean([e.value for e in events.Scalars("train/loss")[16:]])
    assert window == pytest.approx(train[2]["loss"], rel=1e-5)  # the log line is the mean of its steps
    assert [e.step for e in events.Scalars("train/steps_per_sec")] == [8, 16, 24]
    assert events.Scalars("eval/accuracy")[0].step == 24


def test_train_and_evaluate_alternates_without_recompiling(model_dir):
    recorder = Recorder()
    est = estimator(model_dir, steps_per_loop=4, eval_batch_size=64, loop="scan")
    final = est.train_and_evaluate(DATA, DATA, max_steps=24, eval_every=8, hooks=[recorder])
    assert [e[1] for e in recorder.events if e[0] == "eval"] == [8, 16, 24]
    assert final["num_examples"] == 256 and final == est.evaluate(DATA)
    assert est.train_and_evaluate(DATA, DATA, max_steps=24, eval_every=8) == final  # nothing left to train
    assert est.compiled() == ex.Compiled("scan", train_scan=1, eval_step=1)
    summary = _records(model_dir, "summary")[-1]
    assert summary["step"] == 24 and summary["accuracy"] == final["accuracy"]
    for part in ("compile", "device", "input_wait", "checkpoint", "evaluation", "total"):
        assert summary[f"{part}_seconds"] >= 0
    assert summary["evaluation_seconds"] > 0 and summary["total_seconds"] >= summary["device_seconds"]


def test_a_hook_that_may_stop_still_gets_the_final_evaluation():
    recorder = Recorder()  # overrides after_loop: each loop is read before the next is dispatched
    estimator(steps_per_loop=4, eval_batch_size=64).train_and_evaluate(
        DATA, DATA, max_steps=22, eval_every=8, hooks=[recorder]
    )
    assert [e[1] for e in recorder.events if e[0] == "eval"] == [8, 16, 22]


def test_eval_every_counts_epochs_of_the_training_input():
    recorder = Recorder()  # 256 examples in batches of 32: 8 steps an epoch
    estimator(steps_per_loop=4, eval_batch_size=64).train_and_evaluate(
        DATA, DATA, epochs=3, eval_every=ex.Epochs(2), hooks=[recorder]
    )
    assert [e[1] for e in recorder.events if e[0] == "eval"] == [16, 24]
    for wrong, error in ((0, ex.errors.ConfigError), ("1 epoch", TypeError), (ex.Epochs, TypeError), (1.5, TypeError)):
        with pytest.raises(error, match=r"eval_every=.*(positive integer|a number of steps or ex\.Epochs\(n\))"):
            estimator().train_and_evaluate(DATA, DATA, max_steps=4, eval_every=wrong)
    with pytest.raises(ex.errors.ConfigError, match=r"Epochs\(count=0\) must be a positive integer"):
        ex.Epochs(0)


def test_the_old_cadence_arguments_still_work_with_a_warning():
    recorder = Recorder()
    with pytest.warns(DeprecationWarning, match=r"train_and_evaluate\(eval_every_epochs=1\) is deprecated; "
                      r"pass eval_every=Epochs\(count=1\)") as warned:  # fmt: skip
        estimator(steps_per_loop=4).train_and_evaluate(DATA, DATA, epochs=2, eval_every_epochs=1, hooks=[recorder])
    assert warned[0].filename == __file__  # the warning points at the call
    assert [e[1] for e in recorder.events if e[0] == "eval"] == [8, 16]
    with pytest.warns(DeprecationWarning, match=r"\(eval_every_steps=4\) is deprecated; pass eval_every=4\."):
        estimator(steps_per_loop=4).train_and_evaluate(DATA, DATA, max_steps=8, eval_every_steps=4)
    with pytest.raises(ex.errors.ConfigError, match=r"received \{'eval_every': 4, 'eval_every_steps': 4\}; expected"):
        estimator().train_and_evaluate(DATA, DATA, max_steps=8, eval_every=4, eval_every_steps=4)


def test_the_best_checkpoint_is_the_best(model_dir):
    est = estimator(model_dir, steps_per_loop=2, eval_batch_size=64, lr=0.5)
    est.train_and_evaluate(DATA, DATA, max_steps=20, eval_every=2, best=ex.Best("loss"))
    evaluations = {r["step"]: r["loss"] for r in _records(model_dir, "eval")}
    (best_step,) = [int(d) for d in os.listdir(os.path.join(model_dir, "best")) if d.isdigit()]
    assert evaluations[best_step] == min(evaluations.values())
    best = est.evaluate(DATA, checkpoint=os.path.join(model_dir, "best"))
    assert best["loss"] == pytest.approx(evaluations[best_step], rel=1e-6)


def test_early_stopping_stops_when_the_metric_stalls():
    est = estimator(steps_per_loop=2, eval_batch_size=64, lr=0.0)  # nothing is learned: the loss stalls
    est.train_and_evaluate(DATA, DATA, max_steps=100, eval_every=4, best=ex.Best(patience=2))
    assert est.step == 12  # evaluations at 4 (best), 8 and 12 (no improvement twice): stop


def _with_nan_at(step, rows=32):
    features, labels = blobs(320)
    batches = [({"x": features["x"][i : i + rows].copy()}, labels[i : i + rows]) for i in range(0, 320, rows)]
    batches[step - 1][0]["x"][3, 0] = np.nan  # the batch of that step (steps count from 1)
    return batches


def test_the_old_best_metric_mode_and_patience_arguments_still_work_with_a_warning(model_dir):
    est = estimator(model_dir, steps_per_loop=2, eval_batch_size=64, lr=0.0)
    with pytest.warns(DeprecationWarning, match=r"pass best=Best\(metric='loss', direction='min'.*patience=2"):
        est.train_and_evaluate(DATA, DATA, max_steps=100, eval_every=4, best_metric="loss", mode="min", patience=2)
    assert est.step == 12 and os.listdir(os.path.join(model_dir, "best"))  # stopped early, the best kept
    with pytest.warns(DeprecationWarning, match=r"EarlyStopping\(mode='max'\) is deprecated; pass direction='max'"):
        assert ex.EarlyStopping("accuracy", mode="max").direction == "max"
    with pytest.raises(ex.errors.ConfigError, match=r"received best= and \['patience'\]; expected one of them"):
        est.train_and_evaluate(DATA, DATA, max_steps=4, eval_every=4, best=ex.Best(), patience=2)
    with pytest.raises(TypeError, match=r"unexpected keyword arguments \['best_metrics'\]"):
        est.train_and_evaluate(DATA, DATA, max_steps=4, eval_every=4, best_metrics="loss")


@pytest.mark.parametrize("last_step_apart", [False, True], ids=["conditional", "last_step_apart"])
def test_a_nan_stops_training_with_the_window_and_parameters(model_dir, last_step_apart):
    est = estimator(model_dir, steps_per_loop=4, save_every_steps=4)
    est.core.last_step_apart = last_step_apart  # what GPUs run, here on the CPU
    # ReLU's gradient at NaN is 0, so l1/bias stays finite: only the parameters actually hit are named.
    with pytest.raises(
        ex.NonFiniteError,
        match=r"at step 7 \(in the loop of steps 5-8\): loss nan; non-finite "
        r"gradients of \['l1/kernel', 'l2/bias', 'l2/kernel'\]"
        r".*last checkpoint \(step 4\) is kept",
    ):
        est.train(_with_nan_at(7), max_steps=10)
    assert estimator(model_dir).step == 4  # no checkpoint came out of the NaN


class Outputs(Hook):
    def __init__(self):
        self.loops = []

    def after_loop(self, loop):
        self.loops.append({k: np.asarray(v) for k, v in loop.outputs.items()})


@pytest.mark.parametrize("nan_step, accumulated", [(None, 1), (None, 2), (5, 1), (6, 1), (8, 1), (10, 2)])
def test_the_loop_with_its_last_step_apart_trains_and_reports_as_the_conditional_one(nan_step, accumulated):
    """GPUs run a loop's last step after the scan (no conditional per step): same steps, same outputs."""
    data = _with_nan_at(nan_step) if nan_step else DATA
    runs = []
    for apart in (False, True):
        est, seen = estimator(steps_per_loop=4, dropout=0.3, grad_accum_steps=accumulated), Outputs()
        est.core.last_step_apart = apart
        with contextlib.nullcontext() if nan_step is None else pytest.raises(ex.NonFiniteError) as stopped:
            est.train(data, max_steps=10, hooks=[seen])  # loops of 4, 4 and 2 steps
        runs.append((seen.loops, jax.device_get(est.state()), None if nan_step is None else str(stopped.value)))
    (loops, state, error), (apart_loops, apart_state, apart_error) = runs
    assert error == apart_error
    assert len(loops) == len(apart_loops) == (3 if nan_step is None else (nan_step - 1) // 4)
    for outputs, apart_outputs in zip(loops, apart_loops, strict=True):
        assert outputs.keys() == apart_outputs.keys()
        for name in outputs:
            np.testing.assert_allclose(apart_outputs[name], outputs[name], rtol=1e-6, err_msg=name)
    if nan_step is None:
        jax.tree.map(lambda a, b: np.testing.assert_allclose(a, b, rtol=1e-6), apart_state, state)


def test_skip_nonfinite_skips_and_counts(model_dir):
    est = estimator(model_dir, steps_per_loop=4, log_every_steps=8, skip_nonfinite=True)
    est.train(_with_nan_at(7), max_steps=10)
    assert est.step == 10
    assert all(np.isfinite(np.asarray(v)).all() for v in est.model().l1.kernel[...].ravel()[None])
    skipped = [r["skipped_update_fraction"] for r in _records(model_dir, "train")]
    assert skipped[0] == pytest.approx(1 / 8)  # one of steps 1-8


def test_profile_steps_write_a_trace(model_dir):
    estimator(model_dir, steps_per_loop=2, profile_steps=(2, 4)).train(DATA, max_steps=6)
    assert glob.glob(os.path.join(model_dir, "profile", "**", "*.xplane.pb"), recursive=True)


def test_progress_bar_shows_step_loss_and_throughput(capsys):
    from estimax.hooks import LoopRecord, RunInfo, Summary
    from estimax.hooks.progress import ProgressBar

    bar = ProgressBar(global_batch_size=32)
    bar.begin(RunInfo(0, 20, 32, 5, None))
    bar.after_loop(LoopRecord(0, 10, {"loss": np.full(10, 0.5)}, 0.5, 0.1))
    bar.after_loop(LoopRecord(10, 20, {"loss": np.full(10, 0.25)}, 0.5, 0.0))
    bar.end(Summary(20, {}, {}))
    shown = capsys.readouterr().err
    assert "20/20" in shown and "epoch=4.00" in shown and "steps_s=20.0" in shown and "input_wait=0%" in shown
    smoothed = float(shown.split("loss=")[1].split(",")[0])
    assert 0.25 < smoothed < 0.5  # an exponential moving average of 0.5 then 0.25


def test_quiet_hides_train_lines(estimax_log):
    estimator(quiet=True, log_every_steps=4).train(DATA, max_steps=8)
    assert "train step" not in estimax_log.text and "Done at step 8" in estimax_log.text


class Losses(Hook):
    def __init__(self):
        self.losses = []

    def after_loop(self, loop):
        self.losses.extend(float(x) for x in loop.outputs["loss"])


def test_tensorboard_has_every_step_of_a_200_step_run(model_dir):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    losses = Losses()
    estimator(model_dir, steps_per_loop=50, log_every_steps=100, tensorboard=True).train(
        DATA, max_steps=200, hooks=[losses]
    )
    events = EventAccumulator(model_dir, size_guidance={"scalars": 0})
    events.Reload()
    loss = events.Scalars("train/loss")
    assert [e.step for e in loss] == list(range(1, 201))
    np.testing.assert_allclose([e.value for e in loss], losses.losses, rtol=1e-6)  # each step's own loss
    # The gradient norm is measured on each loop's last step under a scan (every step when stepping).
    norms = events.Scalars("train/grad_norm")
    assert {50, 100, 150, 200} <= {e.step for e in norms} and all(np.isfinite(e.value) for e in norms)
    assert [r["step"] for r in _records(model_dir, "train")] == [100, 200]  # the file keeps its cadence


def test_the_count_of_compiled_programs_reads_a_private_jax_name_that_still_exists():
    """``Estimator.compiled()`` counts compiled programs through ``_cache_size()`` of JAX's jitted
    functions, which JAX does not make public; training never reads it. If this fails, JAX moved
    it: ``estimax.loop._count`` then reports -1, and ``compiled()``'s counts need another source."""
    f = jax.jit(lambda x: x + 1)
    f(1.0), f(np.ones(2, np.float32))
    assert callable(getattr(f, "_cache_size", None)) and f._cache_size() == 2


def test_evaluations_finer_than_a_loop_say_at_which_steps_they_run(estimax_log):
    class Steps(Hook):
        def __init__(self):
            self.steps = []

        def after_eval(self, evaluation):
            self.steps.append(evaluation.step)

    hook = Steps()
    est = estimator(None, steps_per_loop=8)
    est.train_and_evaluate(
        ex.data.from_arrays(*blobs(256)), ex.data.from_arrays(*blobs(64)), max_steps=48, eval_every=20,
        hooks=[hook],
    )  # fmt: skip
    (line,) = [m for m in estimax_log.messages if m.startswith("Evaluating every 20 steps")]
    assert "with 8 steps per loop" in line and "steps 24, 40, 64, ..." in line
    assert hook.steps == [24, 40, 48]  # as the line says, then the end
