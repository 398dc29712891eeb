"""The tutorial notebook (docs/tutorial.ipynb) runs in a real Jupyter kernel, twice, as a user runs it."""

import os
import shutil

NOTEBOOK = os.path.join(os.path.dirname(__file__), "..", "docs", "tutorial.ipynb")


def _execute(path, cwd):
    import nbclient
    import nbformat

    notebook = nbformat.read(path, as_version=4)
    client = nbclient.NotebookClient(
        notebook, timeout=600, kernel_name="python3", resources={"metadata": {"path": cwd}}
    )
    client.execute()
    outputs = [o for cell in notebook.cells if cell.cell_type == "code" for o in cell.outputs]
    stream = lambda name: "".join(o.text for o in outputs if o.output_type == "stream" and o.name == name)  # noqa: E731
    images = [o for o in outputs if o.output_type == "display_data" and "image/png" in o.data]
    return stream("stdout"), stream("stderr"), images


def test_the_tutorial_runs_in_a_kernel_twice_with_a_progress_bar_and_a_plot(tmp_path):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    shutil.copy(NOTEBOOK, tmp_path / "tutorial.ipynb")
    stdout, stderr, images = _execute(str(tmp_path / "tutorial.ipynb"), str(tmp_path))
    accuracy = float(stdout.split("held-out accuracy ")[1].split()[0])
    assert accuracy > 0.9 and "on 360 images" in stdout
    assert "the exported model agrees: True" in stdout and len(images) == 1  # the learning curves
    # A bar redrawn in place, not a line per record; no internal choice of the loop opens the output.
    assert "\rtrain: 100%|" in stderr and "train step" not in stderr and "loop=auto" not in stderr
    assert "eval step 300  accuracy" in stderr and "Done at step 300" in stderr

    events = EventAccumulator(str(tmp_path / "runs" / "tutorial"), {"images": 0})  # the run's one TensorBoard run
    events.Reload()
    assert [image.step for image in events.Images("eval/hidden_units")] == [100, 200, 300]

    # Again, in a new kernel: the run is found at its last step; it is evaluated, plotted and exported again.
    stdout, stderr, images = _execute(str(tmp_path / "tutorial.ipynb"), str(tmp_path))
    assert "Already at step 300 >= 300: nothing to train" in stderr
    assert float(stdout.split("held-out accuracy ")[1].split()[0]) == accuracy
    assert "the exported model agrees: True" in stdout and len(images) == 1
