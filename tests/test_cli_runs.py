"""The edit-rerun loop on the command line, as a user runs it (real subprocesses): a changed model
under the default directory is a new numbered run, a run remembers its --set values, --epochs,
--warm-start and predict --input."""

import json
import os
import re
import shutil
import subprocess
import sys

import numpy as np
import orbax.checkpoint as ocp
import pytest
import warm
from helpers import user_env

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

TASK = """
import numpy as np
import optax
from flax import nnx

import estimax as ex

params = {"hidden": 16, "learning_rate": 0.05}
DEFAULTS = {"batch_size": 32, "max_steps": 4, "steps_per_loop": 2, "loop": "step"}


class MLP(nnx.Module):
    def __init__(self, hidden, *, rngs):
        self.hidden = nnx.Linear(2, hidden, rngs=rngs)
        self.out = nnx.Linear(hidden, 3, rngs=rngs)

    def __call__(self, x):
        return self.out(nnx.relu(self.hidden(x)))


def model(rngs, params):
    return MLP(params["hidden"], rngs=rngs)


def model_fn(model, features, labels, mode, params):
    logits = model(features["x"])
    if mode == ex.PREDICT:
        return ex.Spec(predictions={"class": logits.argmax(-1)})
    loss = optax.softmax_cross_entropy_with_integer_labels(logits, labels)
    return ex.Spec(loss=loss, metrics={"accuracy": logits.argmax(-1) == labels})


def optimizer(params):
    return optax.sgd(params["learning_rate"], momentum=0.9)


def _blobs(seed):
    rng = np.random.default_rng(seed)
    labels = rng.integers(0, 3, 192).astype(np.int32)
    centres = np.array([[0.0, 3.0], [3.0, -2.0], [-3.0, -2.0]], np.float32)
    return ex.data.from_arrays({"x": centres[labels] + rng.standard_normal((192, 2)).astype(np.float32)}, labels)


def train_input(params):
    return _blobs(0)


def eval_input(params):
    return _blobs(1)
"""


def _run(*args, cwd):
    env = user_env()
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [ROOT, env.get("PYTHONPATH")]))
    command = [sys.executable, "-m", "estimax.cli", *args]
    return warm.run(command, capture_output=True, text=True, env=env, cwd=cwd, timeout=300)


def _ok(*args, cwd) -> str:
    result = _run(*args, cwd=cwd)
    assert result.returncode == 0, result.stdout + result.stderr
    return result.stderr + result.stdout  # the log lines, then what the command printed


def _refused(*args, cwd) -> str:
    result = _run(*args, cwd=cwd)
    assert result.returncode == 2 and "Traceback" not in result.stderr, result.stdout + result.stderr
    return result.stderr.splitlines()[-1]


def _params(model_dir):
    """The parameters of the latest checkpoint of ``model_dir``, read with Orbax: the reference."""
    manager = ocp.CheckpointManager(os.path.join(model_dir, "checkpoints"))
    step = manager.latest_step()
    state = manager.restore(step, args=ocp.args.Composite(state=ocp.args.StandardRestore())).state
    manager.close()
    return step, state["params"]


def test_a_changed_model_is_a_new_run_and_a_run_remembers_its_set_values(tmp_path):
    task = tmp_path / "blobs.py"
    task.write_text(TASK)
    runs = tmp_path / "runs"

    first = _ok("train", "blobs.py", cwd=tmp_path)
    assert f"Run directory {runs}/blobs: a new run (no --set values)" in first
    # A hyper-parameter that changes the shapes: a second run beside the first, trained for 2 epochs of 6 steps.
    second = _ok("train", "blobs.py", "--set", "hidden=8", "--epochs", "2", cwd=tmp_path)
    assert f"Run directory {runs}/blobs-2: a new run (--set hidden=8)" in second
    assert "after 12 steps" in second
    assert json.loads((runs / "blobs-2" / "cli.json").read_text())["sets"] == {"hidden": "8"}

    # evaluate and predict take the latest run with its values, without being told them.
    evaluated = _ok("evaluate", "blobs.py", cwd=tmp_path)
    assert f"Using {runs}/blobs-2, the latest run (--set hidden=8)" in evaluated
    assert json.loads(evaluated.strip().splitlines()[-1])["num_examples"] == 192
    x = np.array([[0.0, 3.0], [3.0, -2.0], [-3.0, -2.0], [0.5, 0.5]], np.float64)  # float64: cast to the task's
    np.savez(tmp_path / "new.npz", x=x)
    assert "4 predictions" in _ok("predict", "blobs.py", "--input", "new.npz", "--output", "p.jsonl", cwd=tmp_path)
    predicted = [json.loads(line)["class"] for line in (tmp_path / "p.jsonl").read_text().splitlines()]
    step, params = _params(runs / "blobs-2")
    hidden = np.maximum(x @ params["hidden"]["kernel"]["value"] + params["hidden"]["bias"]["value"], 0)
    logits = hidden @ params["out"]["kernel"]["value"] + params["out"]["bias"]["value"]
    assert step == 12 and predicted == logits.argmax(-1).tolist()

    # An explicit run directory refuses other values, in one line that names the fix.
    line = _refused("evaluate", "blobs.py", "--model-dir", "runs/blobs-2", "--set", "hidden=4", cwd=tmp_path)
    assert (
        f"--set hidden=4: {runs}/blobs-2 was trained with --set hidden=8" in line and "Fix: leave the --set out" in line
    )
    line = _refused("evaluate", "blobs.py", "--set", "hidden=4", cwd=tmp_path)
    assert f"no run under {runs}/blobs was trained with these values" in line

    # An edit of the model's code: rerunning starts a third run; the first two are kept whole.
    task.write_text(
        TASK.replace("nnx.Linear(hidden, 3, rngs=rngs)", "nnx.Linear(hidden, 3, use_bias=False, rngs=rngs)")
    )
    third = _ok("train", "blobs.py", cwd=tmp_path)
    assert (
        f"Run directory {runs}/blobs-3: a new run (no --set values), as {runs}/blobs was trained by another "
        "computation (shapes: the state's arrays" in third
    )
    assert sorted(os.listdir(runs)) == ["blobs", "blobs-2", "blobs-3"] and _params(runs / "blobs")[0] == 4
    # Under an explicit --model-dir the refusal stays, and its fix names the flags...
    line = _refused("train", "blobs.py", "--model-dir", "runs/blobs", cwd=tmp_path)
    assert f"{runs}/blobs holds a run of another model or optimizer" in line
    assert re.search(rf"another --model-dir, or no --model-dir .* --warm-start {runs}/blobs starts it", line)
    # ... which work: a new run that starts from the old run's weights that still fit.
    warm = _ok("train", "blobs.py", "--model-dir", "runs/warm", "--warm-start", "runs/blobs", cwd=tmp_path)
    assert "(estimax checkpoint): 3 loaded" in warm, warm


def test_one_progress_bar_in_a_terminal_with_the_log_lines_above_it(tmp_path):
    if shutil.which("tmux") is None:
        pytest.skip("needs tmux: a real terminal for the progress bar")
    (tmp_path / "blobs.py").write_text(TASK)
    socket, raw = f"estimax-{os.getpid()}", tmp_path / "raw.txt"
    tmux = ["tmux", "-L", socket]
    command = (
        f"cd {tmp_path} && PYTHONPATH={ROOT} {sys.executable} -m estimax.cli train blobs.py --max-steps 8 "
        f"--eval-every 4; tmux -L {socket} wait-for -S done; sleep 60"  # the screen stays until it is read
    )
    env = user_env("TMUX")
    subprocess.run([*tmux, "new-session", "-d", "-x", "150", "-y", "40", command], check=True, env=env)
    try:
        subprocess.run([*tmux, "pipe-pane", "-o", f"cat >> {raw}"], check=True)  # every byte the terminal got
        subprocess.run([*tmux, "wait-for", "done"], check=True)
        screen = subprocess.run([*tmux, "capture-pane", "-p"], capture_output=True, text=True, check=True).stdout
    finally:
        subprocess.run([*tmux, "kill-server"], check=False)
    lines = [line for line in screen.splitlines() if line.strip()]
    bars = [i for i, line in enumerate(lines) if "step/s" in line or "%|" in line]
    assert len(bars) == 1 and "train: 100%" in lines[bars[0]] and "8/8" in lines[bars[0]], screen
    done = next(i for i, line in enumerate(lines) if "estimax  Done at step 8" in line)
    evals = [i for i, line in enumerate(lines) if re.search(r"estimax  eval step [48] ", line)]
    assert len(evals) == 2 and evals[0] < bars[0] < evals[1] < done, screen  # whole lines, above the bar
    assert all(re.match(r"\d\d:\d\d:\d\d estimax |held-out|train: 100%", line) for line in lines), screen
    assert "compiling:   0%" in raw.read_text(errors="replace")  # the bar's state before the first loop ended


def test_a_damaged_cli_json_is_one_line_naming_it_and_affects_only_its_own_run(tmp_path):
    (tmp_path / "blobs.py").write_text(TASK)
    record = tmp_path / "runs" / "blobs" / "cli.json"
    _ok("train", "blobs.py", cwd=tmp_path)
    whole = record.read_text()
    record.write_text(whole[: len(whole) // 2])  # cut short, as by a full disk
    line = _refused("evaluate", "blobs.py", "--model-dir", "runs/blobs", cwd=tmp_path)
    assert f"{record} is damaged: " in line and "Fix: restore it, or delete it" in line, line
    # Another run of the task is not held back: it trains beside the damaged one, which is named once.
    other = _ok("train", "blobs.py", "--set", "hidden=8", cwd=tmp_path)
    assert f"Skipping {record.parent}: {record} is damaged" in other
    assert "Run directory" in other and "blobs-2: a new run (--set hidden=8)" in other
    for content, said in (("", "is empty"), ("[1, 2]", "is damaged: a JSON list, not an object")):
        record.write_text(content)
        line = _refused("evaluate", "blobs.py", "--model-dir", "runs/blobs", cwd=tmp_path)
        assert f"{record} {said}" in line, line


def test_every_predict_input_file_a_user_hands_over_gets_one_line_naming_it(tmp_path):
    """Empty, unreadable and wrong-kind files of each format: one line (exit 2) naming the file and what is
    wrong; a CSV of a feature with two numbers per example says the CSV rule. A good file streams its
    predictions to --output."""
    (tmp_path / "blobs.py").write_text(TASK)
    _ok("train", "blobs.py", cwd=tmp_path)
    np.savez(tmp_path / "empty.npz")
    np.save(tmp_path / "none.npy", np.zeros((0, 2), np.float32))
    np.savez(tmp_path / "text.npz", x=np.array([["a", "b"]]))
    (tmp_path / "blank.npy").write_bytes(b"")
    (tmp_path / "empty.jsonl").write_text("")
    (tmp_path / "broken.jsonl").write_text('{"x": [0.0, 3.0]}\n{"x": [1.0,\n')
    (tmp_path / "vector.csv").write_text("x\n0.5\n")
    cases = {
        "empty.npz": "holds the arrays []; expected the task's features ['x']",
        "none.npy": "holds no examples",
        "text.npz": "x has dtype <U1; expected numbers",
        "blank.npy": "not a readable .npy file",
        "empty.jsonl": "not a readable json file",
        "broken.jsonl": "not a readable json file",
        "vector.csv": "a CSV column holds one number per example, and the task's features hold more (x (2,) per",
    }
    for name, said in cases.items():
        line = _refused("predict", "blobs.py", "--input", name, "--quiet", cwd=tmp_path)
        assert line.startswith(f"estimax: error: --input {name}: ") and said in line, (name, line)
    x = np.random.default_rng(0).standard_normal((1000, 2)).astype(np.float32)
    np.save(tmp_path / "many.npy", x)
    said = _ok("predict", "blobs.py", "--input", "many.npy", "--output", "many.jsonl", "--quiet", cwd=tmp_path)
    assert "1000 predictions; written to many.jsonl" in said and "Generating" not in said
    lines = (tmp_path / "many.jsonl").read_text().splitlines()
    assert [json.loads(line)["index"] for line in lines] == list(range(1000))


def _eval_records(model_dir):
    lines = (model_dir / "metrics.jsonl").read_text().splitlines()
    return [record for record in map(json.loads, lines) if record["split"] == "eval"]


def test_an_edit_of_the_computation_is_a_new_run_and_evaluate_takes_the_run_that_fits(tmp_path):
    """The user's loop: relu -> gelu keeps every array but is another run, named in one line; the relu run's
    history stays its own; after the revert, evaluate takes the relu run, not the newer gelu one."""
    task = tmp_path / "blobs.py"
    task.write_text(TASK)
    runs = tmp_path / "runs"
    _ok("train", "blobs.py", cwd=tmp_path)
    relu_evals = _eval_records(runs / "blobs")

    task.write_text(TASK.replace("nnx.relu(", "nnx.gelu("))
    gelu = _ok("train", "blobs.py", cwd=tmp_path)
    assert (
        f"Run directory {runs}/blobs-2: a new run (no --set values), as {runs}/blobs was trained by another "
        "computation (code: the training step computes otherwise (the model, loss or optimizer), with the same "
        "arrays)." in gelu
    )
    assert "after 4 steps" in gelu and _eval_records(runs / "blobs") == relu_evals  # nothing of gelu's there
    computations = [json.loads((runs / run / "cli.json").read_text())["computation"] for run in ("blobs", "blobs-2")]
    assert (
        computations[0]["arrays"] == computations[1]["arrays"]
        and computations[0]["digest"] != computations[1]["digest"]
    )

    task.write_text(TASK)  # reverted
    evaluated = _ok("evaluate", "blobs.py", cwd=tmp_path)
    assert (
        f"Using {runs}/blobs, the latest run this code fits (no --set values); newer runs differ: {runs}/blobs-2 "
        "(code: " in evaluated
    )
    # Its results are the relu run's weights under relu: the reference is numpy on the weights Orbax reads.
    results = json.loads(evaluated.strip().splitlines()[-1])
    step, params = _params(runs / "blobs")
    rng = np.random.default_rng(1)  # eval_input: _blobs(1)
    labels = rng.integers(0, 3, 192)
    x = np.array([[0.0, 3.0], [3.0, -2.0], [-3.0, -2.0]])[labels] + rng.standard_normal((192, 2)).astype(np.float32)
    hidden = np.maximum(x @ params["hidden"]["kernel"]["value"] + params["hidden"]["bias"]["value"], 0)
    logits = hidden @ params["out"]["kernel"]["value"] + params["out"]["bias"]["value"]
    assert step == 4 and results["accuracy"] == pytest.approx(np.mean(logits.argmax(-1) == labels))
    # Training the reverted code continues the relu run, which is done.
    again = _ok("train", "blobs.py", cwd=tmp_path)
    assert f"Run directory {runs}/blobs: continuing the run (no --set values)." in again
    assert "Already at step 4 >= 4" in again

    # Code that trained no run: evaluate names each run and what differs, in one line.
    task.write_text(TASK.replace("nnx.relu(", "nnx.tanh("))
    line = _refused("evaluate", "blobs.py", cwd=tmp_path)
    assert line.startswith(f"estimax: error: No run under {runs}/blobs fits this code (no --set values): ") and (
        f"{runs}/blobs-2: code: " in line and f"{runs}/blobs: code: " in line and "Fix: `estimax train` first" in line
    ), line


def test_train_refuses_a_mean_loss_in_eval_mode_before_step_1(tmp_path):
    mean = TASK.replace("loss = optax.softmax_cross_entropy_with_integer_labels(logits, labels)", "loss = optax."
                        "softmax_cross_entropy_with_integer_labels(logits, labels).mean()")  # fmt: skip
    (tmp_path / "blobs.py").write_text(mean)
    line = _refused("train", "blobs.py", "--eval-batch-size", "40", cwd=tmp_path)  # 192 = 4 x 40 + 32 (padded)
    assert "model_fn returned scalar ['loss'] in eval mode" in line, line
    assert not (tmp_path / "runs" / "blobs" / "checkpoints").exists()  # refused before step 1
