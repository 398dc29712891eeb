"""The quickstart main job and the CLI, as a user runs them (real subprocesses)."""

import json
import os
import re
import subprocess
import sys

import pytest
import warm
from helpers import run_estimax, user_env

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def test_main_job_reaches_97_percent_held_out(tmp_path):
    out = run_estimax("train", cwd=tmp_path)
    accuracy, examples = re.search(r"held-out accuracy (\S+) on (\d+) examples", out).groups()
    assert float(accuracy) >= 0.97 and int(examples) == 360
    assert os.path.isdir(tmp_path / "runs" / "digits" / "checkpoints")


def test_train_then_evaluate_and_predict_in_new_processes(tmp_path):
    model_dir = str(tmp_path / "run")
    run_estimax("train", "--model-dir", model_dir, "--max-steps", "20", "--steps-per-loop", "10", "--loop", "step")
    results = json.loads(run_estimax("evaluate", "--model-dir", model_dir).strip().splitlines()[-1])
    assert results["num_examples"] == 360
    output = tmp_path / "predictions.jsonl"
    assert "360 predictions" in run_estimax("predict", "--model-dir", model_dir, "--output", str(output))
    assert len(output.read_text().splitlines()) == 360
    records = [json.loads(line) for line in open(os.path.join(model_dir, "metrics.jsonl"))]
    assert {r["split"] for r in records} == {"train", "eval", "summary"}


def _run(*args, cwd=None):
    env = user_env()
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [ROOT, env.get("PYTHONPATH")]))
    return warm.run(
        [sys.executable, "-m", "estimax.cli", *args], capture_output=True, text=True, env=env, cwd=cwd, timeout=300
    )


def test_help_version_and_argument_errors_do_not_import_jax():
    # Each in a fresh interpreter: which modules `estimax --help` and a mistake load, not how long they take.
    probe = (
        "import sys\nfrom estimax import cli\ntry:\n    cli.main(sys.argv[1:])\nexcept SystemExit as e:\n"
        "    code = e.code\nprint('CODE', code, 'JAX', 'jax' in sys.modules, 'NUMPY', 'numpy' in sys.modules)"
    )
    mistakes = {  # --set mistakes too: read from the task's source, before its imports
        ("train", "--seed", "x"): "argument --seed: received 'x'",
        ("train", "--set", "hiden=64"): "--set hiden=64: 'hiden' is not in params; known names: image_size, lea",
        ("evaluate", "--set", "learning_rate=fast"): "--set learning_rate=fast: not a float like its default 0.001",
        ("predict", "--input", "new.txt"): "--input new.txt: no reader for '.txt'; expected one of .npz, .npy",
    }
    for args, code in [(["--help"], 0), (["train", "--help"], 0), (["--version"], 0), *((a, 2) for a in mistakes)]:
        result = subprocess.run(
            [sys.executable, "-c", probe, *args], capture_output=True, text=True, env={**os.environ, "PYTHONPATH": ROOT}
        )
        assert f"CODE {code} JAX False NUMPY False" in result.stdout, (args, result.stdout, result.stderr)
        assert mistakes.get(tuple(args), "") in (result.stderr.splitlines() or [""])[-1], result.stderr
        assert (
            code or "pip install '.[docs]' && mkdocs serve" in " ".join(result.stdout.split()) or args == ["--version"]
        )
    version = _run("--version").stdout
    assert re.fullmatch(r"estimax \d+\.\d+\.\d+\S* \(Python 3\.\d+\.\d+, jax \S+, flax \S+\)\n", version), version


def test_values_and_combinations_are_checked_before_anything_starts():
    cases = {
        ("train", "--seed", "-1"): r"argument --seed: received '-1'; expected an integer >= 0",
        ("train", "--batch-size", "0"): r"argument --train-batch-size/--batch-size: received '0'; expected a positive",
        ("train", "--train-batch-size", "0"): r"argument --train-batch-size/--batch-size: received '0'; expected a",
        ("train", "--profile-steps", "10"): r"argument --profile-steps: received '10'; expected A:B with 0 <= A < B",
        ("train", "--profile-steps", "9:3"): r"received '9:3'; expected A:B with 0 <= A < B",
        ("train", "--tracker", "neptune"): r"argument --trackers/--tracker: received 'neptune'; expected one of mlflow",
        ("train", "--set", "lr"): r"argument --set: received 'lr'; expected NAME=VALUE",
        ("train", "--set", "a=1", "--set", "a=2"): r"--set a given more than once",
        ("train", "my.task", "--example", "lstm"): r"received the task 'my.task' and --example/--data",
        ("train", "--example", "lstm", "--data", "mnist"): r"received --example lstm and --data mnist",
        (
            "train",
            "--num-processes",
            "2",
            "--process-id",
            "2",
        ): r"--process-id 2 with --num-processes 2; expected 0 to 1",
        ("predict", "--max-steps=3"): r"unrecognized arguments: --max-steps=3",
    }
    for args, message in cases.items():
        result = _run(*args)
        assert result.returncode == 2 and re.search(message, result.stderr), (args, result.stderr)
        assert "Traceback" not in result.stderr


def test_errors_are_one_line_and_debug_shows_the_traceback(tmp_path):
    # Case 8 of the reliability issue: --data-dir without a task that reads files is never ignored.
    result = _run("train", "--data-dir", str(tmp_path), cwd=tmp_path)
    expected = rf"^estimax: error: --data-dir {tmp_path}: task 'digits' reads no data directory .* --data mnist"
    assert result.returncode == 2 and re.search(expected, result.stderr, re.M), result.stderr
    assert "Traceback" not in result.stderr and not os.path.exists(tmp_path / "runs")
    # Predicting an untrained model refuses, like evaluate.
    for command in ("predict", "evaluate"):
        result = _run(command, "--model-dir", str(tmp_path / "empty"), cwd=tmp_path)
        assert result.returncode == 2 and "Traceback" not in result.stderr, result.stderr
        assert re.search(rf"estimax: error: No checkpoint in {tmp_path}/empty: nothing trained", result.stderr)
        assert "predictions" not in result.stdout
    result = _run("train", "--data-dir", str(tmp_path), "--debug", cwd=tmp_path)
    assert (
        result.returncode == 1
        and "Traceback" in result.stderr
        and "estimax.errors.ConfigError: --data-dir" in result.stderr
    )


def test_a_task_with_a_syntax_error_names_the_file_and_line(tmp_path):
    task = tmp_path / "broken_task.py"
    task.write_text("import estimax as ex\n\n\ndef model(rngs, params:\n    pass\n")
    result = _run("train", str(task), cwd=tmp_path)
    assert result.returncode == 2 and "Traceback" not in result.stderr, result.stderr
    assert re.search(
        rf"Task '{task}' does not compile: {task}, line 4: .* in `def model\(rngs, params:`", result.stderr
    )
    assert "Fix:" in result.stderr and len(result.stderr.splitlines()) == 1


def test_a_set_value_that_breaks_the_model_names_it(tmp_path):
    result = _run("train", "--set", "num_classes=0", "--max-steps", "1", cwd=tmp_path)
    # Flax 0.10 refuses to build the empty layer; Flax 0.12 builds it and the first step fails.
    last = result.stderr.splitlines()[-1]
    assert result.returncode == 2 and "Traceback" not in result.stderr, result.stderr
    assert last.startswith("estimax: error: With --set num_classes=0, the model") and "Fix: a value the model" in last
    checkpoints = tmp_path / "runs" / "digits" / "checkpoints"
    assert not (checkpoints.exists() and any(n.isdigit() for n in os.listdir(checkpoints)))  # nothing saved
    result = _run("train", "--set", "image_size=4", "--max-steps", "1", cwd=tmp_path)  # fails in the first step
    assert result.returncode == 2 and "Traceback" not in result.stderr, result.stderr
    assert result.stderr.splitlines()[-1].startswith("estimax: error: With --set image_size=4, the model_fn fails:")


def test_set_names_are_read_from_the_source_only_where_it_declares_them(tmp_path):
    from estimax.cli import task as task_lib

    sources = {  # the task's source -> whether `--set extra=1` is refused before the module is imported
        'params = {"hidden": 16}\n': True,
        'params: dict = dict(hidden=16)\nrate = params["hidden"] * 2\n': True,
        'params = {"hidden": 16}\nparams["extra"] = 0\n': False,  # known once the module has run
        'params = {"hidden": 16}\nparams.update(extra=0)\n': False,
        'params = {"hidden": 16}\nparams |= {"extra": 0}\n': False,
        'params = {**BASE, "hidden": 16}\n': False,
        "params = make_params()\n": False,
    }
    for number, (source, refused) in enumerate(sources.items()):
        path = tmp_path / f"task_{number}.py"
        path.write_text(source)
        try:
            task_lib.check_sets(str(path), [("extra", "1")])
        except ValueError as error:
            assert refused and "'extra' is not in params; known names: hidden" in str(error), source
        else:
            assert not refused, source
    (tmp_path / "computed.py").write_text('SIZE = 4\nparams = {"hidden": SIZE, "rate": 0.1}\n')
    task_lib.check_sets(str(tmp_path / "computed.py"), [("hidden", "not checked: not a literal")])
    with pytest.raises(ValueError, match=r"--set rate=fast: not a float like its default 0.1"):
        task_lib.check_sets(str(tmp_path / "computed.py"), [("rate", "fast")])
