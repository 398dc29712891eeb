"""Children of the tests forked from a warm interpreter instead of started cold.

A child that trains, evaluates or predicts spends about 2.3 s of CPU importing JAX, Flax, Optax, Orbax,
Grain and estimax before its first line (1.7 s more for scikit-learn where it trains the command line's
digits task), and the suite starts hundreds of them on 2 cores. A warm
interpreter (this file run as a script: one per distinct start-up environment, kept for the session)
imports them once and forks each child. The child is still a real process of its own: its own pid,
environment, working directory, standard streams, session and signal dispositions, and the test's process
is its parent (made a subreaper: the warm interpreter forks twice and the child is handed up), so
``wait``, ``kill``, ``send_signal``, ``communicate`` and timeouts work as for any ``subprocess.Popen``. It
runs ``python SCRIPT ...``, ``python -m MODULE ...`` or ``python -c CODE ...`` as the interpreter would.

What differs from a cold start is only what was imported before the child's first line, and that its ending
leaves out the teardown of that heap (``_run_and_end``: threads, atexit, streams and exit status as the
interpreter's own), so a test of what a fresh interpreter imports, of start-up, of interpreter flags or of
what objects do when the interpreter tears them down uses ``subprocess`` itself (and the
session's compilation cache does not look for entries to evict: ``keep_cache_entries``). Variables read
on import (``START_UP``) select the warm interpreter; every other variable is the child's own, and what
estimax derives from the environment on import is derived again from the child's
(``estimax.storage.clients.use_one_client``). XLA reads its flags when the first backend starts, not on
import, and JAX's device count is a setting the child applies before that (``APPLIED``,
``JAX_SETTINGS``): children that differ only in those share an interpreter. So do children whose PYTHONPATHs
differ but for folders that hold no package the warm interpreter imported (``_holders``; the tests' own folder, a
user's task): the child's ``sys.path`` is made from its own PYTHONPATH. ``TESTS_WARM_CHILDREN=off`` starts every
child cold.

The processes ``estimax launch`` starts are the launcher's children, not the test's, so they hand over
instead (``hand_over``, which tests/sitecustomize.py calls before anything is imported): each asks the
test's process (``serve_launched``, its socket in ``LAUNCH_ENV``) for a warm child that runs its command,
with its streams, environment and working directory, in a session of its own. It stays as the launcher's
process: it passes on the signals it gets and ends as the child did, with its exit code or signal. A
SIGKILL of it kills the child too (the child watches a pipe only it holds), and the child holds the
launcher's pipe of its output, so the launcher, which reads that to its end, sees the two end together.
Two launched processes reach the launcher in the order their relays report, not always the order their
children ended in, so a test of that order leaves ``LAUNCH_ENV`` out of the launcher's environment.
"""

import atexit
import contextlib
import ctypes
import gc
import json
import os
import runpy
import signal
import socket
import subprocess
import sys
import threading
import types

WARM_CHILDREN = os.environ.get("TESTS_WARM_CHILDREN", "on") != "off"
LAUNCH_ENV = "TESTS_WARM_LAUNCH"  # the socket where a launched process asks for a warm child
RELAYED = (signal.SIGTERM, signal.SIGINT, signal.SIGUSR1, signal.SIGUSR2, signal.SIGHUP, signal.SIGQUIT)
# Variables that libraries read on import (or when their native code loads): children that differ in them
# get a warm interpreter of their own.
START_UP = ("JAX_", "XLA_", "TF_", "TPU_", "PYTHON", "KERAS_", "OPENBLAS_", "OMP_", "MKL_", "LANG", "LC_", "GCSFS_")
# ... but not these, which the child reads itself: XLA's flags when its first backend starts (a warm interpreter
# starts none), a group's placement when it joins one and PYTHONPATH (its sys.path; but ``_holders``) ...
APPLIED = ("XLA_FLAGS", "JAX_COORDINATOR_ADDRESS", "JAX_NUM_PROCESSES", "JAX_PROCESS_ID", "JAX_LOCAL_DEVICE_IDS",
           "PYTHONPATH")  # fmt: skip
# ... nor JAX settings read on import, which the child sets again (``_become``) before its backend starts.
JAX_SETTINGS = {"JAX_NUM_CPU_DEVICES": ("jax_num_cpu_devices", int)}
_CHILDS_OWN = (*APPLIED, *JAX_SETTINGS)
# What nearly every child imports; scikit-learn for the digits task the command line trains by default, gcsfs for
# a model_dir on gs:// (0.4 CPU-s; it reads GCSFS_EXPERIMENTAL_ZB_HNS_SUPPORT on import), and the MLIR dialect
# that JAX loads at a process's first lowering (0.02 CPU-s).
PRELOADED = ("numpy", "jax", "flax.nnx", "optax", "orbax.checkpoint", "grain", "estimax.estimator", "estimax.cli",
             "sklearn.datasets", "sklearn.model_selection", "gcsfs", "jaxlib.mlir.dialects.mhlo")  # fmt: skip
_PRELOADED_PACKAGES = frozenset(name.partition(".")[0] for name in PRELOADED)
_PR_SET_CHILD_SUBREAPER = 36


class Popen(subprocess.Popen):
    """``subprocess.Popen`` that forks a Python child from a warm interpreter when it can: the command is
    ``sys.executable`` with a script, ``-m MODULE`` or ``-c CODE``, and no option a fork cannot honour
    (``preexec_fn``, ``pass_fds``, ``shell``, users, groups, umask, a process group). Otherwise, or with
    ``TESTS_WARM_CHILDREN=off``, it starts the command as ``subprocess.Popen`` does."""

    def _execute_child(self, args, executable, preexec_fn, close_fds, pass_fds, cwd, env, startupinfo,
                       creationflags, shell, p2cread, p2cwrite, c2pread, c2pwrite, errread, errwrite,
                       restore_signals, gid, gids, uid, umask, start_new_session, process_group):  # fmt: skip
        argv = [os.fsdecode(a) for a in ([args] if isinstance(args, (str, bytes)) else args)]
        forkable = WARM_CHILDREN and _warmable(argv, executable, shell) and preexec_fn is None and not pass_fds
        if not forkable or (gid, gids, uid, umask) != (None, None, None, -1) or process_group not in (None, -1):
            return super()._execute_child(
                args, executable, preexec_fn, close_fds, pass_fds, cwd, env, startupinfo, creationflags, shell,
                p2cread, p2cwrite, c2pread, c2pwrite, errread, errwrite, restore_signals, gid, gids, uid, umask,
                start_new_session, process_group,
            )  # fmt: skip
        env = {os.fsdecode(k): os.fsdecode(v) for k, v in (os.environ if env is None else env).items()}
        streams = [fd if fd != -1 else default for fd, default in ((p2cread, 0), (c2pwrite, 1), (errwrite, 2))]
        cwd = os.path.abspath(os.fsdecode(cwd)) if cwd is not None else os.getcwd()
        self.pid = _interpreter_for(env, cwd).fork(argv, env, cwd, bool(start_new_session), streams)
        self._child_created = True
        self._close_pipe_fds(p2cread, p2cwrite, c2pread, c2pwrite, errread, errwrite)


def run(args, *, input=None, capture_output=False, timeout=None, check=False, **kwargs):
    """``subprocess.run`` with a warm child (``Popen``)."""
    if capture_output:
        kwargs["stdout"] = kwargs["stderr"] = subprocess.PIPE
    with Popen(args, stdin=subprocess.PIPE if input is not None else kwargs.pop("stdin", None), **kwargs) as process:
        try:
            out, err = process.communicate(input, timeout=timeout)
        except BaseException:
            process.kill()
            process.wait()
            raise
    done = subprocess.CompletedProcess(process.args, process.returncode, out, err)
    if check:
        done.check_returncode()
    return done


def _warmable(argv: list[str], executable, shell: bool) -> bool:
    if shell or executable not in (None, sys.executable) or len(argv) < 2 or argv[0] != sys.executable:
        return False
    return not argv[1].startswith("-") or (argv[1] in ("-m", "-c") and len(argv) > 2)


class _Interpreter:
    """One warm interpreter, started with the start-up variables ``key``; forks children on request."""

    def __init__(self, key: tuple):
        ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        # Nothing else: what /proc shows of a child's environment is this one (tests/helpers.py's cleanup
        # tells the interpreters, kept for the session, by their pids instead).
        env = {k: os.environ[k] for k in ("HOME", "PATH", "TMPDIR") if k in os.environ}
        env.update(dict(key))
        self.process = subprocess.Popen(
            [sys.executable, __file__, str(theirs.fileno())], env=env, pass_fds=[theirs.fileno()],
            stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL,
        )  # fmt: skip
        theirs.close()
        self.socket, self.lock = ours, threading.Lock()

    def fork(self, argv: list[str], env: dict, cwd: str, new_session: bool, streams: list[int]) -> int:
        """The pid of a child with ``streams`` (stdin, stdout, stderr, and the read end of a lifeline:
        the child kills itself when it reaches its end)."""
        request = json.dumps({"argv": argv, "env": env, "cwd": cwd, "new_session": new_session}).encode()
        with self.lock:
            socket.send_fds(self.socket, [request], streams)
            answer = self.socket.recv(64)
        if not answer:
            raise RuntimeError(f"the warm interpreter (pid {self.process.pid}) ended: {self.process.poll()}")
        return int(answer)


_interpreters: dict[tuple, _Interpreter] = {}
_made = threading.Lock()


def interpreter_pids() -> set[int]:
    """The warm interpreters of this process: kept for the session, not children of a test."""
    return {i.process.pid for i in _interpreters.values()}


def _interpreter_for(env: dict, cwd: str) -> _Interpreter:
    key = tuple(sorted((k, v) for k, v in env.items() if k.startswith(START_UP) and k not in _CHILDS_OWN))
    if holders := _holders(_python_path(env, cwd)):
        key += (("PYTHONPATH", os.pathsep.join(holders)),)
    with _made:
        if not _interpreters:  # orphans of this process's children come back to it, to be waited for
            if ctypes.CDLL(None, use_errno=True).prctl(_PR_SET_CHILD_SUBREAPER, 1, 0, 0, 0) != 0:
                raise OSError(ctypes.get_errno(), "prctl(PR_SET_CHILD_SUBREAPER)")
        if key not in _interpreters or _interpreters[key].process.poll() is not None:
            _interpreters[key] = _Interpreter(key)
        return _interpreters[key]


def _python_path(env: dict, cwd: str) -> list[str]:
    """The folders PYTHONPATH puts on ``sys.path``, as Python's start-up does: each absolute (an empty entry is
    the working directory), the first of each kept."""
    value = env.get("PYTHONPATH")
    entries = value.split(os.pathsep) if value else []
    return list(dict.fromkeys(os.path.normpath(os.path.join(cwd, entry)) for entry in entries))


def _holders(folders: list[str]) -> tuple[str, ...]:
    """The folders that hold a package the warm interpreter imports (``PRELOADED``): where its estimax, say,
    comes from, and so what a child's PYTHONPATH must agree on to share it."""
    return tuple(f for f in folders if any(os.path.exists(os.path.join(f, p)) for p in _PRELOADED_PACKAGES))


def serve_launched(path: str) -> None:
    """Serves the processes ``estimax launch`` starts (``hand_over``) from this process, on the socket ``path``."""
    server = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    server.bind(path)
    server.listen()
    threading.Thread(target=_accept, args=(server,), name="warm-launch", daemon=True).start()


def _accept(server: socket.socket) -> None:
    while True:
        connection, _ = server.accept()
        threading.Thread(target=_launch, args=(connection,), name="warm-launched", daemon=True).start()


def _launch(connection: socket.socket) -> None:
    """Forks the child a launched process asked for, tells it the pid, then how the child ended."""
    with connection:
        message, fds, _, _ = socket.recv_fds(connection, 1 << 20, 4)
        try:
            request = json.loads(message)
            pid = _interpreter_for(request["env"], request["cwd"]).fork(
                request["argv"], request["env"], request["cwd"], True, fds
            )
        except Exception:  # noqa: BLE001 - the launched process runs its command itself
            connection.send(b"0\n")
            return
        finally:
            for fd in fds:
                os.close(fd)
        connection.send(f"{pid}\n".encode())  # lines: the status may follow at once
        try:
            code = os.waitstatus_to_exitcode(os.waitpid(pid, 0)[1])  # this process is its subreaper
        except ChildProcessError:  # reaped by a test's cleanup, which kills
            code = -signal.SIGKILL
        with contextlib.suppress(OSError):  # the launched process is gone already
            connection.send(f"{code}\n".encode())


def hand_over(path: str) -> None:
    """Runs this process's command in a warm child (``serve_launched``) and ends as it did; returns
    without doing anything when it cannot (the command then runs here, cold)."""
    argv = list(sys.orig_argv)
    if not _warmable(argv, None, False):
        return
    connection = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        connection.connect(path)
    except OSError:
        return
    lifeline, _held = os.pipe()  # the write end stays open here: its end is the child's sign that this one died
    request = json.dumps({"argv": argv, "env": dict(os.environ), "cwd": os.getcwd()}).encode()
    # Held from here until they can be relayed: the child may speak (and be signalled) before its pid arrives.
    signal.pthread_sigmask(signal.SIG_BLOCK, RELAYED)
    try:
        socket.send_fds(connection, [request], [0, 1, 2, lifeline])
        os.close(lifeline)
        answers = connection.makefile("rb")
        pid = int(answers.readline() or 0)
        if pid:
            for signum in RELAYED:
                signal.signal(signum, lambda signum, frame: _signal(pid, signum))
    finally:
        signal.pthread_sigmask(signal.SIG_UNBLOCK, RELAYED)
    if not pid:
        return
    answer = answers.readline()
    code = int(answer) if answer else -signal.SIGKILL
    if code < 0:  # ends as the child did: by the same signal
        with contextlib.suppress(OSError):  # SIGKILL's cannot be set
            signal.signal(-code, signal.SIG_DFL)
        os.kill(os.getpid(), -code)
    os._exit(code)


# The warm interpreter itself.


def _serve(connection: socket.socket):
    """Forks a child for each request until the test's process is gone; returns in the child."""
    while True:
        try:
            message, streams, _, _ = socket.recv_fds(connection, 1 << 20, 4)
        except OSError:
            message = b""
        if not message:
            os._exit(0)
        read_end, write_end = os.pipe()
        middle = os.fork()
        if middle == 0:  # forks the child and exits at once: the child is handed up to the subreaper
            child = os.fork()
            if child == 0:
                os.close(read_end)
                os.close(write_end)
                connection.close()
                return json.loads(message), streams
            os.write(write_end, str(child).encode())
            os._exit(0)
        os.waitpid(middle, 0)
        os.close(write_end)
        child = os.read(read_end, 64)
        os.close(read_end)
        for fd in streams:
            os.close(fd)
        connection.send(child)


def _become(request: dict, streams: list[int], added: dict, installed: list[str]):
    """This forked process becomes the child ``request`` describes, then runs its program. ``installed``: the
    folders on ``sys.path`` that no PYTHONPATH put there (the standard library, site-packages)."""
    gc.enable()  # collects what the child makes, as any interpreter does
    if request["new_session"]:
        os.setsid()
    if len(streams) > 3:  # a launched process's child: it dies with that process
        threading.Thread(target=_dies_with, args=(streams.pop(),), daemon=True).start()
        request["env"].pop(LAUNCH_ENV, None)  # the processes it starts run their commands themselves
    for target, fd in enumerate(streams):
        os.dup2(fd, target)
    for fd in set(streams) - {0, 1, 2}:
        os.close(fd)
    os.chdir(request["cwd"])
    os.environ.clear()
    os.environ.update(request["env"])
    sys.path[1:] = dict.fromkeys([*_python_path(os.environ, os.getcwd()), *installed])
    for name, value in added.items():  # what the imports set, as they would have in this environment
        os.environ.setdefault(name, value)
    import jax

    for variable, (setting, kind) in JAX_SETTINGS.items():
        if variable in os.environ:
            jax.config.update(setting, kind(os.environ[variable]))
    from estimax.storage import clients

    clients.use_one_client()
    signal.signal(signal.SIGCHLD, signal.SIG_DFL)
    sys.orig_argv = request["argv"]  # the command line the child was started with (/proc keeps this one's)
    _run_and_end(request["argv"][1:])


def _run_and_end(argv: list[str]):
    """Runs ``python ARGV`` as the interpreter would, then ends as it ends a process: the non-daemon threads
    joined, the atexit functions called, the standard streams flushed, the same exit status (a message for a
    non-integer ``sys.exit``, a traceback and 1 for an uncaught exception, SIGINT for a KeyboardInterrupt).
    Only the teardown of the heap is left out: what the warm interpreter imported is shared with it until it is
    written, and a teardown writes to every object (0.22 CPU-s and 43,000 copied pages a child)."""
    status, interrupted = 0, False
    try:
        if argv[0] == "-m":
            sys.argv, sys.path[0] = argv[1:], os.getcwd()
            runpy._run_module_as_main(argv[1], alter_argv=True)
        elif argv[0] == "-c":
            sys.argv, sys.path[0] = ["-c", *argv[2:]], ""
            main = types.ModuleType("__main__")
            sys.modules["__main__"] = main
            exec(compile(argv[1], "<string>", "exec"), main.__dict__)
        else:
            sys.argv, sys.path[0] = argv, os.path.dirname(os.path.abspath(argv[0]))
            runpy.run_path(argv[0], run_name="__main__")
    except SystemExit as exit:
        status = _exit_status(exit.code)
    except BaseException as error:  # noqa: BLE001 - told as the interpreter tells it
        sys.excepthook(type(error), error, error.__traceback__)
        status, interrupted = 1, isinstance(error, KeyboardInterrupt)
    threading._shutdown()  # what the interpreter's own teardown does first, then the atexit functions
    atexit._run_exitfuncs()
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except (OSError, ValueError, AttributeError):
            status = status or 120  # as the interpreter's exit status when its streams cannot be flushed
    if interrupted:
        signal.signal(signal.SIGINT, signal.SIG_DFL)
        os.kill(os.getpid(), signal.SIGINT)
    os._exit(status)


def _exit_status(code) -> int:
    """The exit status of ``sys.exit(code)``: an integer is the status, ``None`` 0, anything else is printed."""
    if code is None or isinstance(code, int):
        return (code or 0) & 0xFF
    print(code, file=sys.stderr)
    return 1


def keep_cache_entries() -> None:
    """The session's compilation cache never fills (``helpers.CACHE_MAX_SIZE``, set for the lock JAX then
    takes around each entry), so this process skips the scan for entries to evict that JAX makes on each write:
    it reads every entry's access time, a cost that grows with the cache (quadratic over a session)."""
    from jax._src import lru_cache

    if hasattr(lru_cache.LRUCache, "_evict_if_needed"):
        lru_cache.LRUCache._evict_if_needed = lambda self, *, additional_size=0: None


def _signal(pid: int, signum: int) -> None:
    with contextlib.suppress(ProcessLookupError):  # it has ended: its status is on its way
        os.kill(pid, signum)


def _dies_with(lifeline: int) -> None:
    os.read(lifeline, 1)  # returns once the launched process is gone
    os.kill(os.getpid(), signal.SIGKILL)


if __name__ == "__main__":
    # Python's recipe for forking without exec (gc.freeze's documentation): no collection while importing, and
    # what was imported frozen out of every later one. Else each child's collections, and the last one at its
    # exit, write to every imported object and copy each page of the heap it shares: 0.8 CPU-s a child.
    gc.disable()
    before = dict(os.environ)
    for name in PRELOADED:
        __import__(name)
    added = {k: v for k, v in os.environ.items() if before.get(k) != v}
    keep_cache_entries()
    own = set(_python_path(before, os.getcwd()))
    installed = [p for p in sys.path[1:] if p not in own]
    sys.path[0] = ""  # the child sets its own
    gc.freeze()
    _become(*_serve(socket.socket(fileno=int(sys.argv[1]))), added, installed)
