"""The errors guide's list of mistakes holds: each row's mistake, made for real, raises the error class the
row shows, and that error is an ``ex.EstimaxError`` (a row that shows a warning: that warning). A row
without its mistake here fails, so a new row comes with its check. Every kind is a top-level name."""

import builtins
import gzip
import inspect
import os
import re
import warnings
from pathlib import Path

import grain
import jax
import numpy as np
import pytest
from helpers import mean_loss_fn, no_predict_branch_fn, read_only, sgd_estimator, write_idx
from models import MLP, blobs, estimator

import estimax as ex
from estimax.errors import one_line
from estimax.examples import mnist

GUIDE = Path(__file__).resolve().parent.parent / "docs" / "guides" / "errors.md"
FEATURES, LABELS = blobs(256)
DATA = ex.data.from_arrays(FEATURES, LABELS)


def guide_rows() -> dict[str, str]:
    """``{mistake: what estimax says}``: the rows of the guide's table "Mistake | What estimax says"."""
    text = GUIDE.read_text()
    table = text[text.index("| Mistake | What estimax says |") :].split("\n\n")[0].splitlines()[2:]
    return dict(re.fullmatch(r"\| (.+?) \| (.+) \|", row).groups() for row in table)


def shown_error(said: str) -> tuple[str, str]:
    """``(class, message)`` of the error a row shows: its first code span, ``Class: message``."""
    shown, _, message = re.search(r"(`+) ?(.*?) ?\1", said)[2].partition(": ")
    return shown, message


def first_words(message: str, count: int = 6) -> list[str]:
    """The first words of ``message`` that do not vary with the run: no paths, numbers or elisions."""
    words = (w.strip(",.:;()'\"") for w in message.split())
    return [w for w in words if w and not re.search(r"[/\d]|\.\.\.", w)][:count]


# -- each row's mistake, made for real: (tmp_path, request) -> None -------------------------------------------


def _batch_size_that_does_not_divide(tmp_path, request):
    estimator(str(tmp_path / "run"), eval_batch_size=12).train_and_evaluate(DATA, DATA, max_steps=8, eval_every=4)


def _best_of_a_metric_not_evaluated(tmp_path, request):
    estimator(str(tmp_path / "run")).train_and_evaluate(DATA, DATA, max_steps=8, eval_every=4, best=ex.Best("acc"))


def _a_function_as_a_hook(tmp_path, request):
    estimator().train(DATA, max_steps=4, hooks=[print])


def _a_read_only_model_dir(tmp_path, request):
    with read_only(tmp_path / "run"):
        estimator(str(tmp_path / "run")).train(DATA, max_steps=4)


def _no_labels(tmp_path, request):
    estimator().train(ex.data.from_arrays(FEATURES), max_steps=4)


def _float_labels(tmp_path, request):
    estimator().train(ex.data.from_arrays(FEATURES, LABELS.astype(np.float32)), max_steps=4)


def _a_feature_the_input_lacks(tmp_path, request):
    estimator().train(ex.data.from_arrays({"pixels": FEATURES["x"]}, LABELS), max_steps=4)


def _text_features(tmp_path, request):
    estimator().train([({"x": FEATURES["x"].astype(str)[:32]}, LABELS[:32])], max_steps=4)


def _a_mean_loss_where_evaluation_pads(tmp_path, request):
    padded = ex.data.from_arrays(*blobs(100))
    sgd_estimator(mean_loss_fn, model_dir=str(tmp_path / "run")).train_and_evaluate(
        DATA, padded, max_steps=8, eval_every=4
    )


def _predict_without_a_predict_branch(tmp_path, request):
    sgd_estimator(no_predict_branch_fn).predict(ex.data.from_arrays(FEATURES))


def _images_of_another_size(tmp_path, request):
    rng = np.random.default_rng(0)
    write_idx(tmp_path, "train", rng.integers(0, 255, (64, 14, 14)), rng.integers(0, 10, 64))
    sgd_estimator(mnist.model_fn, mnist.model).train(ex.data.idx.mnist(tmp_path), max_steps=1)


def _a_module_class_as_the_model(tmp_path, request):
    sgd_estimator(model=MLP)


def _a_grain_dataset_of_examples(tmp_path, request):
    examples = grain.MapDataset.range(64).map(lambda i: ({"x": FEATURES["x"][i]}, LABELS[i]))
    estimator().train(examples, max_steps=4)


def _a_model_dir_below_a_file(tmp_path, request):
    (tmp_path / "notes.txt").write_text("kept")
    estimator(str(tmp_path / "notes.txt" / "run"))


def _an_unset_variable_in_the_model_dir(tmp_path, request):
    request.getfixturevalue("monkeypatch").delenv("UNSET", raising=False)
    estimator("$UNSET/run")


def _a_directory_where_the_lock_goes(tmp_path, request):
    os.makedirs(tmp_path / "run" / "estimax.lock")
    estimator(str(tmp_path / "run")).train(DATA, max_steps=4)


def _a_later_attempt_holds_the_model_dir(tmp_path, request):
    import json
    import socket
    import time

    request.getfixturevalue("monkeypatch").setenv("ESTIMAX_RUN_ID", "job-7")
    os.makedirs(tmp_path / "run")
    later = {"host": socket.gethostname(), "pid": 1, "run": "job-7", "attempt_started": time.time() + 3600}
    (tmp_path / "run" / "estimax.lock").write_text(json.dumps(later))
    estimator(str(tmp_path / "run")).train(DATA, max_steps=4)


def _best_with_mode(tmp_path, request):
    ex.Best("accuracy", mode="max")


def _an_export_to_an_absent_bucket(tmp_path, request):
    request.getfixturevalue("s3")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", ex.UntrainedWarning)
        estimator().export("s3://absent-bucket/model", example_features={"x": FEATURES["x"][:1]})


def _a_text_feature_written(tmp_path, request):
    ex.data.array_record.write(str(tmp_path / "names.array_record"), [{"name": np.array("abc")}])


def _a_pytorch_data_loader(tmp_path, request):
    class DataLoader:  # what torch.utils.data.DataLoader is, as far as the check sees
        __module__ = "torch.utils.data.dataloader"

        def __iter__(self):
            return iter([])

    estimator().train(DataLoader(), max_steps=4)


def _a_truncated_gzip_file(tmp_path, request):
    images = tmp_path / "train-images-idx3-ubyte.gz"
    with gzip.open(images, "wb") as f:
        f.write(np.zeros(16 + 5 * 28 * 28, np.uint8).tobytes())
    images.write_bytes(images.read_bytes()[:-20])
    ex.data.idx.read_idx(images, ex.data.idx.IMAGES_MAGIC)


def _a_state_donated_outside_estimax(tmp_path, request):
    est = estimator()
    jax.jit(lambda state: state, donate_argnums=0)(est.state())
    est.train(DATA, max_steps=4)


def _an_evaluation_before_training(tmp_path, request):
    estimator(str(tmp_path / "run")).evaluate(DATA)


def _a_batch_size_of_zero(tmp_path, request):
    ex.RunConfig(train_batch_size=0)


def _a_patience_of_zero(tmp_path, request):
    ex.Best("accuracy", patience=0)


def _train_and_evaluate_without_eval_every(tmp_path, request):
    estimator().train_and_evaluate(DATA, DATA, max_steps=8)


def _input_files_that_do_not_exist(tmp_path, request):
    ex.data.array_record(str(tmp_path / "train-*.array_record"), {"x": ex.data.array_record.Feature(np.float32, (6,))})


def _records_without_a_feature_of_the_spec(tmp_path, request):
    path = str(tmp_path / "train.array_record")
    ex.data.array_record.write(path, ({"x": FEATURES["x"][i]} for i in range(64)))
    spec = {"x": ex.data.array_record.Feature(np.float32, (6,)), "label": ex.data.array_record.Feature(np.int32)}
    estimator().train(ex.data.array_record(path, spec, label="label"), max_steps=4)


def _a_name_estimax_does_not_have(tmp_path, request):
    ex.Estimater  # noqa: B018


def _a_metric_without_compute(tmp_path, request):
    class Hits(ex.metrics.Metric):
        pass

    Hits().compute()


MISTAKES = {
    "`eval_batch_size=12` on 8 devices": _batch_size_that_does_not_divide,
    '`best=ex.Best("acc")`': _best_of_a_metric_not_evaluated,
    "`hooks=[print]`": _a_function_as_a_hook,
    "a read-only model_dir": _a_read_only_model_dir,
    "no labels in the input": _no_labels,
    "float labels for an integer-label loss": _float_labels,
    "the model reads a feature the input lacks": _a_feature_the_input_lacks,
    "text features": _text_features,
    "a mean loss (`....mean()`) in `train_and_evaluate`, or in `evaluate` of an input that pads": (
        _a_mean_loss_where_evaluation_pads
    ),
    "a model_fn without a predict branch, in `predict`": _predict_without_a_predict_branch,
    "features of another shape than the model was built for (MNIST idx files of 14x14 images, a model for 28x28)": (
        _images_of_another_size
    ),
    "`Estimator(model=MLP)`, the class": _a_module_class_as_the_model,
    "a Grain `MapDataset` of examples passed as it is": _a_grain_dataset_of_examples,
    "a model_dir that is a file, or below one": _a_model_dir_below_a_file,
    '`model_dir="$UNSET/run"`': _an_unset_variable_in_the_model_dir,
    "a directory named `estimax.lock` in the model_dir": _a_directory_where_the_lock_goes,
    "training while a later attempt of the same run (`ESTIMAX_RUN_ID`) holds the model_dir": (
        _a_later_attempt_holds_the_model_dir
    ),
    '`ex.Best("accuracy", mode="max")`': _best_with_mode,
    '`export("s3://absent-bucket/model")`': _an_export_to_an_absent_bucket,
    "`array_record.write` (or `tfrecord.write`) of a text feature": _a_text_feature_written,
    "a torch `DataLoader`, `tf.data.Dataset` or Hugging Face dataset passed as it is": _a_pytorch_data_loader,
    "a truncated `.gz` file": _a_truncated_gzip_file,
    "`est.state()` given to the user's own `jax.jit(..., donate_argnums=0)`, then `train`": (
        _a_state_donated_outside_estimax
    ),
    "`evaluate`, `predict` or `model()` before training, with no checkpoint": _an_evaluation_before_training,
    "`RunConfig(train_batch_size=0)`": _a_batch_size_of_zero,
    '`ex.Best("accuracy", patience=0)`': _a_patience_of_zero,
    "`train_and_evaluate` without `eval_every`": _train_and_evaluate_without_eval_every,
    "input files that do not exist": _input_files_that_do_not_exist,
    "records without a feature of the spec (an ArrayRecord or TFRecord file)": _records_without_a_feature_of_the_spec,
    "`ex.Estimater` (a name estimax does not have)": _a_name_estimax_does_not_have,
    "a `Metric` subclass without `compute` (or `from_batch`, `empty`, `merge`)": _a_metric_without_compute,
}


@pytest.mark.parametrize("mistake", list(guide_rows()))
def test_each_mistake_of_the_guide_raises_the_error_it_shows(mistake, tmp_path, request):
    assert mistake in MISTAKES, (
        f"the errors guide lists {mistake!r}, which tests/test_errors.py does not make. Fix: add a function that "
        "makes that mistake to MISTAKES."
    )
    shown, message = shown_error(guide_rows()[mistake])
    kind = getattr(ex, shown, None) or getattr(builtins, shown)
    with warnings.catch_warnings():
        if issubclass(kind, Warning):
            warnings.simplefilter("error", kind)  # raised where it is warned
        with pytest.raises(Exception) as caught:
            MISTAKES[mistake](tmp_path, request)
    raised = caught.value
    assert type(raised).__name__ == shown, f"{mistake}: the guide shows {shown}; raised {one_line(raised)}"
    assert isinstance(raised, ex.EstimaxError | Warning), f"{mistake}: raised {one_line(raised)}"
    missing = [word for word in first_words(message) if word not in str(raised)]
    assert not missing, f"{mistake}: the guide shows {message!r}; raised {one_line(raised)}"


@pytest.mark.quick
def test_every_mistake_here_is_a_row_of_the_guide():
    assert set(MISTAKES) <= set(guide_rows()), sorted(set(MISTAKES) - set(guide_rows()))


@pytest.mark.quick
def test_every_kind_is_a_top_level_name_and_derives_from_a_builtin():
    kinds = {
        name: value
        for name, value in vars(ex.errors).items()
        if inspect.isclass(value) and issubclass(value, ex.EstimaxError)
    }
    assert set(kinds) <= set(ex.errors.__all__) <= set(ex.__all__), sorted(set(kinds) - set(ex.errors.__all__))
    for name, kind in kinds.items():
        assert getattr(ex, name) is kind
        builtin = [base for base in kind.__mro__[:-3] if base.__module__ == "builtins"]  # before Exception
        assert builtin or kind is ex.EstimaxError, f"{name} derives from no built-in class but Exception"
