"""Hooks see the model at their record's step, and write images, histograms and text to TensorBoard,
read back by TensorBoard's own reader."""

import io

import numpy as np
import pytest
from models import blobs, estimator

import estimax as ex


def _events(model_dir):
    """The run's TensorBoard run: the event files in the model_dir itself."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    events = EventAccumulator(model_dir, size_guidance={"images": 0, "tensors": 0, "histograms": 0})
    events.Reload()
    return events


class KernelPictures(ex.Hook):
    """After each evaluation: the first layer's kernel as an image and a histogram, and a line of text."""

    def __init__(self):
        self.kernels = {}

    def after_eval(self, evaluation):
        kernel = np.asarray(evaluation.model().l1.kernel[...])  # (6, 32): the model at this step
        self.kernels[evaluation.step] = kernel
        scaled = (kernel - kernel.min()) / (kernel.max() - kernel.min())
        evaluation.summaries.image("l1_kernel", scaled)
        evaluation.summaries.histogram("l1_kernel", kernel, bins=8)
        evaluation.summaries.text("note", f"accuracy **{evaluation.metrics['accuracy']:.3f}**")


def test_a_hook_logs_the_model_s_kernel_as_an_image_histogram_and_text_after_each_evaluation(model_dir):
    from PIL import Image

    est = estimator(model_dir, tensorboard=True, checkpoint=ex.CheckpointPolicy(every_steps=8, keep=10))
    hook = KernelPictures()
    est.train_and_evaluate(
        ex.data.from_arrays(*blobs(256)), ex.data.from_arrays(*blobs(64, seed=1)), max_steps=16, eval_every=8,
        hooks=[hook],
    )  # fmt: skip
    assert sorted(hook.kernels) == [8, 16]
    for step, kernel in hook.kernels.items():  # the model of the step evaluated: as its checkpoint holds it
        np.testing.assert_array_equal(kernel, np.asarray(est.model(checkpoint=step).l1.kernel[...]))
    assert not np.array_equal(hook.kernels[8], hook.kernels[16])

    events = _events(model_dir)
    images = events.Images("eval/l1_kernel")  # the hook's tag under the evaluation's split
    assert [i.step for i in images] == [8, 16] and (images[0].width, images[0].height) == (32, 6)
    for image in images:
        kernel = hook.kernels[image.step]
        expected = np.round((kernel - kernel.min()) / (kernel.max() - kernel.min()) * 255).astype(np.uint8)
        decoded = np.asarray(Image.open(io.BytesIO(image.encoded_image_string)))
        np.testing.assert_array_equal(decoded, expected)
    histograms = events.Histograms("eval/l1_kernel")
    assert [h.step for h in histograms] == [8, 16]
    for histogram in histograms:
        kernel, h = hook.kernels[histogram.step].astype(np.float64), histogram.histogram_value
        counts, edges = np.histogram(kernel, bins=8)
        assert (h.min, h.max, h.num) == (kernel.min(), kernel.max(), kernel.size)
        assert h.sum == pytest.approx(kernel.sum()) and h.sum_squares == pytest.approx(np.square(kernel).sum())
        np.testing.assert_array_equal(h.bucket, counts)
        np.testing.assert_allclose(h.bucket_limit, edges[1:])
    texts = events.Tensors("eval/note")
    assert [t.step for t in texts] == [8, 16]
    assert texts[0].tensor_proto.string_val[0].decode().startswith("accuracy **")
    assert events.PluginTagToContent("text") == {"eval/note": b""}
    assert "eval/accuracy" in events.Tags()["scalars"]  # beside the evaluation's scalars


def test_a_matplotlib_figure_is_an_image_in_tensorboard(model_dir):
    import matplotlib

    matplotlib.use("Agg")
    from matplotlib import pyplot as plt

    class Figure(ex.Hook):
        def after_eval(self, evaluation):
            figure, axes = plt.subplots(figsize=(2, 1), dpi=50)
            axes.plot([0, 1], [evaluation.metrics["loss"]] * 2)
            evaluation.summaries.figure("loss_plot", figure)
            plt.close(figure)

    est = estimator(model_dir, tensorboard=True)
    est.train_and_evaluate(
        ex.data.from_arrays(*blobs(128)),
        ex.data.from_arrays(*blobs(32)),
        max_steps=4,
        eval_every=4,
        hooks=[Figure()],
    )
    (image,) = _events(model_dir).Images("eval/loss_plot")
    assert (image.step, image.width, image.height) == (4, 100, 50)
    assert image.encoded_image_string.startswith(b"\x89PNG")


def test_the_model_in_after_loop_is_the_step_s_for_a_hook_that_may_stop_and_refused_for_one_that_does_not(
    model_dir,
):
    class Reads(ex.Hook):
        def __init__(self, may_stop):
            self.may_stop, self.kernels, self.errors = may_stop, {}, []

        def after_loop(self, loop):
            try:
                self.kernels[loop.step_after] = np.asarray(loop.model().l1.kernel[...])
            except ex.ModelUnavailableError as error:
                self.errors.append(str(error))

    stopping, observing = Reads(True), Reads(False)
    est = estimator(model_dir, checkpoint=ex.CheckpointPolicy(every_steps=4, keep=10))
    est.train(ex.data.from_arrays(*blobs(256)), max_steps=12, hooks=[stopping, observing])
    assert sorted(stopping.kernels) == [4, 8, 12] and not stopping.errors
    for step, kernel in stopping.kernels.items():
        np.testing.assert_array_equal(kernel, np.asarray(est.model(checkpoint=step).l1.kernel[...]))
    # Both hooks ran in a call that waits between loops (one may stop), so the observer read the live state too.
    assert sorted(observing.kernels) == [4, 8, 12]


def test_a_record_s_model_taken_after_its_state_moved_on_is_one_error(model_dir):
    class Keeps(ex.Hook):
        may_stop = False

        def __init__(self):
            self.records = []

        def after_loop(self, loop):
            self.records.append(loop)

    hook = Keeps()
    estimator(model_dir).train(ex.data.from_arrays(*blobs(256)), max_steps=12, hooks=[hook])
    with pytest.raises(ex.ModelUnavailableError, match="The model of step 4 is no longer on the devices"):
        hook.records[0].model()
    assert np.asarray(hook.records[-1].model().l1.kernel[...]).shape == (6, 32)  # the last state: still live


def test_summaries_name_a_wrong_image_or_histogram_and_write_nothing_without_a_model_dir():
    class Bad(ex.Hook):
        def __init__(self, call):
            self.call = call

        def after_loop(self, loop):
            self.call(loop.summaries)

    with pytest.raises(ex.InputError, match=r"shape \(2, 3, 4, 5\); expected \(height, width\)"):
        estimator(None, tensorboard=True).train(ex.data.from_arrays(*blobs(64)), max_steps=4, hooks=[
            Bad(lambda s: s.image("x", np.zeros((2, 3, 4, 5)))),
        ])  # fmt: skip
    from estimax.records.summaries import Summaries

    assert not Summaries().writes
    with pytest.raises(ex.InputError, match="1 of them NaN or Inf"):
        Summaries([object()]).histogram("h", [1.0, np.nan])


def test_hooks_is_a_submodule_of_the_package():
    assert ex.hooks.Hook is ex.Hook and ex.hooks.EarlyStopping is ex.EarlyStopping


def test_a_run_s_hyper_parameters_are_in_tensorboard_s_hparams_tab_in_the_run_of_its_curves(model_dir):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator
    from tensorboard.plugins.hparams import plugin_data_pb2

    estimator(model_dir, tensorboard=True, lr=0.05, dropout=0.25).train(ex.data.from_arrays(*blobs(128)), max_steps=4)
    events = EventAccumulator(model_dir)
    events.Reload()
    (content,) = events.PluginTagToContent("hparams").values()
    hparams = plugin_data_pb2.HParamsPluginData.FromString(content).session_start_info.hparams
    assert {name: value.WhichOneof("kind") for name, value in hparams.items()} == {
        "train_batch_size": "number_value", "seed": "number_value", "grad_accum_steps": "number_value",
        "dropout": "number_value", "classes": "number_value",
    }  # fmt: skip
    assert (hparams["train_batch_size"].number_value, hparams["dropout"].number_value) == (32, 0.25)
    assert "train/loss" in events.Tags()["scalars"]  # one run: the tab shows its curves against them
