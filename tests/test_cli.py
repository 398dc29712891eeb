"""The quickstart main job and the CLI, as a user runs them (real subprocesses)."""

import json
import os
import re
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _estimax(*args, cwd=None):
    env = {k: v for k, v in os.environ.items() if k != "XLA_FLAGS"}  # the user's machine: real devices
    # This checkout's package, not whichever estimax is installed in the environment.
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [ROOT, env.get("PYTHONPATH")]))
    result = subprocess.run(
        [sys.executable, "-m", "estimax.cli", *args], capture_output=True, text=True, env=env, cwd=cwd, timeout=300
    )
    assert result.returncode == 0, result.stdout + result.stderr
    return result.stdout


def test_main_job_reaches_97_percent_held_out(tmp_path):
    out = _estimax("train", cwd=tmp_path)
    accuracy, examples = re.search(r"held-out accuracy (\S+) on (\d+) examples", out).groups()
    assert float(accuracy) >= 0.97 and int(examples) == 360
    assert os.path.isdir(tmp_path / "runs" / "digits" / "checkpoints")


def test_train_then_evaluate_and_predict_in_new_processes(tmp_path):
    model_dir = str(tmp_path / "run")
    _estimax("train", "--model-dir", model_dir, "--max-steps", "20", "--steps-per-loop", "10", "--loop", "step")
    results = json.loads(_estimax("evaluate", "--model-dir", model_dir).strip().splitlines()[-1])
    assert results["num_examples"] == 360
    output = tmp_path / "predictions.jsonl"
    assert "360 predictions" in _estimax("predict", "--model-dir", model_dir, "--output", str(output))
    assert len(output.read_text().splitlines()) == 360
    records = [json.loads(line) for line in open(os.path.join(model_dir, "metrics.jsonl"))]
    assert {r["split"] for r in records} == {"train", "eval", "summary"}
