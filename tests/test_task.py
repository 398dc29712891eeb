"""Task modules: a user's own program run by the CLI (real subprocesses), and the convention's checks."""

import importlib.util
import json
import os
import sys

import pytest
import warm
from helpers import user_env

from estimax.cli import task as task_lib

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _readme_task() -> str:
    """The complete task module of the task-modules guide: the test runs the manual's file."""
    with open(os.path.join(ROOT, "docs", "guides", "task-modules.md")) as f:
        return f.read().split("```python\n", 1)[1].split("```", 1)[0]


def _estimax(*args, cwd, check=True):
    env = user_env()  # the user's machine: real devices
    env["PYTHONPATH"] = ROOT  # this checkout's estimax; the task is found from the working directory
    result = warm.run(
        [sys.executable, "-m", "estimax.cli", *args], capture_output=True, text=True, env=env, cwd=cwd, timeout=600
    )
    if check:
        assert result.returncode == 0, result.stdout + result.stderr
    return result


@pytest.fixture
def project(tmp_path):
    """A user's project directory: ``my_project/task.py``."""
    (tmp_path / "my_project").mkdir()
    (tmp_path / "my_project" / "__init__.py").write_text("")
    (tmp_path / "my_project" / "task.py").write_text(_readme_task())
    return tmp_path


def test_a_user_task_is_trained_evaluated_and_predicted_by_module_path_and_file(project):
    common = ["--model-dir", "run", "--set", "hidden=8", "--set", "learning_rate=0.1"]
    tracking = ["--tracker", f"mlflow={project / 'mlruns'}"] if importlib.util.find_spec("mlflow") else []
    out = _estimax("train", "my_project.task", *common, *tracking, "--max-steps", "16", cwd=project).stdout
    assert "held-out accuracy" in out and "after 16 steps" in out
    assert float(out.split("held-out accuracy ")[1].split()[0]) >= 0.9  # three well-separated clusters
    # The same task as a .py file; hidden=8 must be given again, or the checkpoint's shapes differ.
    evaluation = _estimax("evaluate", "my_project/task.py", *common, cwd=project).stdout
    assert json.loads(evaluation.strip().splitlines()[-1])["num_examples"] == 192
    output = project / "predictions.jsonl"
    predicted = _estimax("predict", "my_project.task", *common, "--output", str(output), cwd=project).stdout
    assert "192 predictions" in predicted
    records = [json.loads(line) for line in output.read_text().splitlines()]
    assert [r["index"] for r in records] == list(range(192)) and {r["class"] for r in records} <= {0, 1, 2}
    logged = [json.loads(line) for line in open(project / "run" / "metrics.jsonl")]
    assert {r["split"] for r in logged} == {"train", "eval", "summary"}
    assert max(r["step"] for r in logged if r["split"] == "train") == 16
    if tracking:  # --tracker: the same run in MLflow, with the overridden params
        from mlflow.tracking import MlflowClient

        client = MlflowClient(f"sqlite:///{project}/mlruns/mlflow.db")
        (run,) = client.search_runs([client.get_experiment_by_name("estimax").experiment_id])
        assert run.data.params["params.hidden"] == "8" and run.data.params["train_batch_size"] == "32"
        last_train = [r for r in logged if r["split"] == "train"][-1]
        assert run.data.metrics["train/loss"] == pytest.approx(last_train["loss"])
    # The run remembers its --set values: another one is refused in one line (the checkpoint would not fit).
    mismatch = _estimax(
        "evaluate", "my_project.task", "--model-dir", "run", "--set", "hidden=16", cwd=project, check=False
    )
    assert mismatch.returncode == 2 and "was trained with --set hidden=8 --set learning_rate=0.1" in mismatch.stderr


def test_launch_runs_a_user_task_as_two_processes(project):
    command = [sys.executable, "-m", "estimax.cli", "train", "my_project.task", "--model-dir", "run2"]
    out = _estimax("launch", "--num-processes", "2", "--devices-per-process", "2", "--", *command, cwd=project).stdout
    assert "[0] held-out accuracy" in out and "after 12 steps" in out
    assert "[1] held-out" not in out  # process 0 speaks for the group
    assert os.path.isdir(project / "run2" / "checkpoints")


def test_set_values_are_typed_from_the_defaults():
    defaults = {"n": 3, "rate": 0.1, "flag": False, "name": "a", "sizes": (64, 32), "tags": ["x"], "extra": None}
    overrides = {"n": "5", "rate": "1e-3", "flag": "true", "name": "b", "sizes": "128,64,32", "tags": "y,z"}
    params = task_lib.override(defaults, {**overrides, "extra": "[1, 2]"})
    assert params == {
        "n": 5,
        "rate": 1e-3,
        "flag": True,
        "name": "b",
        "sizes": (128, 64, 32),
        "tags": ["y", "z"],
        "extra": [1, 2],
    }
    assert task_lib.override(defaults, {"sizes": "(8,)", "rate": "2", "flag": "0"})["sizes"] == (8,)
    assert task_lib.override(defaults, {"rate": "2"})["rate"] == 2.0
    with pytest.raises(ValueError, match=r"--set n=5.5: not a int like its default 3; expected e.g. --set n=3"):
        task_lib.override(defaults, {"n": "5.5"})
    with pytest.raises(ValueError, match=r"--set flag=maybe: not a bool .* expected e.g. --set flag=true"):
        task_lib.override(defaults, {"flag": "maybe"})
    with pytest.raises(ValueError, match=r"--set sizes=64,x: not a tuple like its default \(64, 32\)"):
        task_lib.override(defaults, {"sizes": "64,x"})
    with pytest.raises(
        ValueError, match=r"--set hiden=8: 'hiden' is not in params; known names: extra, flag, n, name, rate"
    ):
        task_lib.override(defaults, {"hiden": "8"})


def test_a_task_missing_names_is_told_the_convention(tmp_path):
    path = tmp_path / "half_task.py"
    path.write_text("params = {}\n\ndef model(rngs, params):\n    pass\n")
    with pytest.raises(
        ValueError,
        match=r"half_task.py' does not define model_fn, optimizer, train_input, eval_input; "
        r"expected a task module defines model \(the factory",
    ):
        task_lib.load(str(path))
    with pytest.raises(ValueError, match=r"No task module 'no_such_project.task' \(no module named 'no_such_project'"):
        task_lib.load("no_such_project.task")
    with pytest.raises(FileNotFoundError, match=r"Task file 'missing.py' does not exist"):
        task_lib.load("missing.py")


def test_bundled_examples_follow_the_convention():
    import estimax.cli

    for name in estimax.cli.EXAMPLES:
        task = task_lib.load(f"estimax.examples.{name}")
        assert task.name == name and {"batch_size", "max_steps"} <= set(task.defaults)
