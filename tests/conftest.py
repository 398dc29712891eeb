"""Every test sees 8 simulated CPU devices, as a TPU v2-8 host would; no process a test starts outlives it."""

import logging
import os

os.environ["XLA_FLAGS"] = os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=8"
os.environ.setdefault("JAX_PLATFORMS", "cpu")
os.environ.setdefault("KERAS_BACKEND", "jax")  # before anything imports keras

import jax  # noqa: E402
import pytest  # noqa: E402
from helpers import processes_killed_on_exit  # noqa: E402
from stores import gcs, s3  # noqa: E402, F401 (storage servers on 127.0.0.1)


def pytest_configure(config):
    assert jax.device_count() == 8, "tests expect 8 simulated CPU devices; JAX was initialised too early"


@pytest.fixture(autouse=True)
def no_process_outlives_its_test():
    """Every process a test starts, and every process those start, is killed at its end, passed or failed."""
    with processes_killed_on_exit():
        yield


@pytest.fixture(scope="session")
def uninterrupted_two_processes(tmp_path_factory):
    """The result of tests/multihost_job.py trained uninterrupted by 2 processes x 4 devices on a local
    model_dir: what a killed and restarted group on any store must end with, bit for bit."""
    from helpers import MULTIHOST_STEPS, finish, launch_group, read_result

    root = tmp_path_factory.mktemp("uninterrupted-two-processes")
    finish(launch_group(str(root / "run"), str(root / "out"), "train", str(MULTIHOST_STEPS)))
    return read_result(root / "out")


@pytest.fixture
def model_dir(tmp_path):
    return str(tmp_path / "run")


@pytest.fixture
def estimax_log(caplog):
    """The estimax logger's records, each once: caught at the logger itself, not by propagation
    (which the logger stops once it has its console handler)."""
    logger, propagated = logging.getLogger("estimax"), logging.getLogger("estimax").propagate
    logger.propagate = False
    logger.addHandler(caplog.handler)
    with caplog.at_level("INFO", logger="estimax"):
        yield caplog
    logger.removeHandler(caplog.handler)
    logger.propagate = propagated and not logger.handlers  # a console handler added meanwhile stops it
