"""Every test sees 8 simulated CPU devices, as a TPU v2-8 host would; no process a test starts outlives it.

The tests' own process compiles without XLA's backend optimisations (``--xla_backend_optimization_level=0``):
its programs are tiny and compiled hundreds of times, and what they check does not depend on it (each test
compares numbers computed under the same flags, or within a tolerance). So do the jobs it starts
(``helpers.job_env``: small models, a few steps each); the command line, the examples and the user's programs
the tests start compile as a user's do (``helpers.user_env``; XLA's default flags train the digits CNN 6x
faster), but where a test compares a child's numbers bitwise with its own (``helpers.compiler_flags``).
``TESTS_XLA_OPTIMIZATION=on`` compiles everything as a user's process does.
"""

import collections
import gc
import json
import logging
import math
import os
import pathlib
import types

# Each module's seconds in a whole run (``--record-durations`` writes it): the order in which they are handed out.
DURATIONS = pathlib.Path(__file__).with_name("durations.json")
_FAST_COMPILE = "" if os.environ.get("TESTS_XLA_OPTIMIZATION") == "on" else " --xla_backend_optimization_level=0"
# A worker was lost to an abort (SIGABRT, no Python error) inside a step loop's dispatch on 8 devices. The likely
# cause: XLA:CPU aborts a process whose collective waited 40 s for one of its devices (openxla/xla PR 32115 made it
# a flag for uneven loads), and 2 cores shared by several workers of 8 devices and the processes they start are
# uneven. Longer here: a collective that waits that long fails its test at pytest-timeout, with every thread's stack.
_PATIENT_COLLECTIVES = " --xla_cpu_collective_call_terminate_timeout_seconds=300"
os.environ["XLA_FLAGS"] = (
    os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=8" + _FAST_COMPILE + _PATIENT_COLLECTIVES
)
os.environ.setdefault("JAX_PLATFORMS", "cpu")
os.environ.setdefault("KERAS_BACKEND", "jax")  # before anything imports keras
# The session's GCS is an emulator (tests/stores.py), named only once gcsfs is imported here: gcsfs's plain file
# system, which estimax chooses where STORAGE_EMULATOR_HOST is set on its import (estimax.storage.clients).
os.environ.setdefault("GCSFS_EXPERIMENTAL_ZB_HNS_SUPPORT", "false")

import jax  # noqa: E402
import psutil  # noqa: E402
import pytest  # noqa: E402
import warm  # noqa: E402
from filelock import FileLock  # noqa: E402
from helpers import CACHE_MAX_SIZE, processes_killed_on_exit, shared_cache_env  # noqa: E402
from stores import gcs, s3  # noqa: E402, F401 (storage servers on 127.0.0.1)


def pytest_configure(config):
    assert jax.device_count() == 8, "tests expect 8 simulated CPU devices; JAX was initialised too early"
    if config.getoption("record_durations") and os.environ.get("PYTEST_XDIST_WORKER") is None:
        config.pluginmanager.register(DurationsRecorder(), "record-durations")


@pytest.fixture(scope="session", autouse=True)
def compiled_programs_kept_for_the_session(tmp_path_factory):
    """JAX's persistent compilation cache, one for the session: a test, or a process it starts, that builds a
    program an earlier one compiled with the same flags reads it back instead of compiling it (a child that
    trains 10 steps spends about a third less CPU). Its variables are in the environment the processes inherit
    (``helpers.SHARED_CACHE``); with a size limit JAX locks the folder while it reads or writes an entry, so no
    process reads one half written (the limit is never reached, so no process scans it for entries to evict:
    ``warm.keep_cache_entries``). What is computed is the same (the cache holds the compiled program, keyed by
    everything that went into it); TESTS_COMPILATION_CACHE=off compiles everything afresh."""
    if os.environ.get("TESTS_COMPILATION_CACHE", "on") == "off":
        yield None
        return
    from estimax import compile_cache

    directory = str(shared_dir(tmp_path_factory, "jax-compilation-cache"))
    os.environ.update(shared_cache_env(directory))
    jax.config.update("jax_compilation_cache_max_size", CACHE_MAX_SIZE)  # this process read its variables before
    warm.keep_cache_entries()
    programs_read_once()
    yield compile_cache.enable(directory)


def programs_read_once():
    """A program this process read from the session's cache is read from the cache's file once: an Estimator
    builds its programs anew, and each read of the same entry (the same key: the same program, compiled with
    the same options for the same devices) would load the same executable again (0.03-0.07 CPU-s a program).
    Programs with host callbacks, which are loaded with them, are read each time."""
    from jax._src import compiler

    read = compiler._cache_read
    loaded: dict = {}

    def read_once(module_name, cache_key, *rest):  # rest: the options, backend, devices (and host callbacks)
        if cache_key in loaded:
            return loaded[cache_key]
        found = read(module_name, cache_key, *rest)
        host_callbacks = rest[3] if len(rest) > 3 else ()  # jax 0.12 passes them; 0.10 caches no such program
        if found[0] is not None and not host_callbacks:
            loaded[cache_key] = found
        return found

    compiler._cache_read = read_once


def pytest_collection_finish(session):
    """What collecting imported (JAX, Flax, the tests' modules: some 280,000 objects) is frozen out of the garbage
    collector's passes, as a long-lived heap: each full collection would walk it again (a worker's full collections
    took 0.9 CPU-s instead of 1.6 over three modules' 109)."""
    gc.collect()
    gc.freeze()


def pytest_ignore_collect(collection_path, config):
    """`pytest -m quick`: a test module that marks nothing quick is not even imported (the tier starts sooner)."""
    if config.getoption("markexpr") == "quick" and collection_path.name.startswith("test_"):
        return collection_path.suffix == ".py" and "pytest.mark.quick" not in collection_path.read_text() or None
    return None


def pytest_addoption(parser):
    parser.addoption("--record-durations", action="store_true", help=f"write each module's seconds to {DURATIONS}")


def pytest_collection_modifyitems(config, items):
    """The longest modules first (``DURATIONS``, as a whole run measured them; a module not there counts as
    longest): xdist hands a worker whole modules in this order (``--dist loadscope --no-loadscope-reorder``),
    so the suite ends on short ones instead of one worker finishing a long module alone. A module's tests
    keep their order."""
    seconds = _recorded()
    items.sort(key=lambda item: -seconds.get(_module(item.nodeid), math.inf))  # stable: modules stay whole


def _recorded() -> dict[str, float]:
    return json.loads(DURATIONS.read_text()) if DURATIONS.exists() else {}


def _module(nodeid: str) -> str:
    return nodeid.split("::")[0]


class DurationsRecorder:
    """``--record-durations``: each module's seconds (setup, call and teardown of its tests) in this run,
    written into ``DURATIONS`` when it ends, by the process that reports (with xdist, the controller)."""

    def __init__(self):
        self.seconds: collections.Counter[str] = collections.Counter()

    def pytest_runtest_logreport(self, report):
        self.seconds[_module(report.nodeid)] += report.duration

    def pytest_sessionfinish(self, session, exitstatus):
        seconds = _recorded()  # a run of part of the suite updates its modules
        seconds.update((module, round(s, 1)) for module, s in self.seconds.items())
        ordered = dict(sorted(seconds.items(), key=lambda kv: -kv[1]))
        DURATIONS.write_text(json.dumps(ordered, indent=1) + "\n")


def pytest_xdist_auto_num_workers(config):
    """`-n auto` (pyproject's addopts): two workers more than cores, since a test often waits on the processes
    or servers it started (on 2 cores, four workers took 9 min 4 s and 1,038 CPU-seconds, five 9 min 5 s and
    1,044, three 9 min 19 s and 1,034); at most one per 2 GB of available memory (a worker holds JAX and its
    programs)."""
    by_memory = psutil.virtual_memory().available // 2**31
    return max(1, min((os.cpu_count() or 1) + 2, by_memory))


def shared_dir(tmp_path_factory, name: str):
    """A folder of this session that every xdist worker sees (a worker's own temporary folders are not)."""
    if os.environ.get("PYTEST_XDIST_WORKER") is None:
        return tmp_path_factory.getbasetemp() / name
    return tmp_path_factory.getbasetemp().parent / name  # the session's folder, above the workers' own


@pytest.fixture(scope="session", autouse=True)
def launched_processes_served_warm(tmp_path_factory):
    """The processes ``estimax launch`` starts in a test run their commands in warm children (tests/warm.py)."""
    if warm.WARM_CHILDREN:
        path = str(tmp_path_factory.mktemp("warm-launch") / "socket")
        warm.serve_launched(path)
        os.environ[warm.LAUNCH_ENV] = path
    yield


@pytest.fixture(autouse=True)
def no_process_outlives_its_test():
    """Every process a test starts, and every process those start, is killed at its end, passed or failed."""
    with processes_killed_on_exit():
        yield


@pytest.fixture(scope="session")
def multihost_references(tmp_path_factory):
    """tests/multihost_job.py trained uninterrupted on local model_dirs, once for the session (by the first
    worker to ask): ``one`` by 1 process x 8 devices, ``two`` by 2 processes x 4 devices (their results), under
    ``root`` (model_dirs "one" and "two", outputs "one-out" and "two-out"), and ``log``, the launcher's output of
    ``two``. What any group must train like, and what a killed and restarted one must end with, bit for bit."""
    from helpers import MULTIHOST_STEPS, finish, launch_group, read_result, run_one_process

    root = shared_dir(tmp_path_factory, "multihost-references")
    with FileLock(f"{root}.lock"):
        if not (root / "log.txt").exists():
            run_one_process(str(root / "one"), str(root / "one-out"), "train", str(MULTIHOST_STEPS))
            log = finish(launch_group(str(root / "two"), str(root / "two-out"), "train", str(MULTIHOST_STEPS)))
            (root / "log.txt").write_text(log)  # last: its presence says both runs are complete
    one, two = read_result(root / "one-out"), read_result(root / "two-out")
    return types.SimpleNamespace(root=root, one=one, two=two, log=(root / "log.txt").read_text())


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
