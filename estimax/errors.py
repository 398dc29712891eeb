"""The estimax error family: what estimax raises about the user's input or setup.

Owns every kind: each error estimax raises for a user's mistake or environment
is an ``EstimaxError``, and its subclass says the kind (configuration, input,
storage, ...). Each kind also derives from the built-in exception that code
written before this family caught (``ValueError``, ``TypeError``,
``FileNotFoundError``, ``PermissionError``, ...), so ``except ValueError``
keeps working. A built-in exception raised bare by estimax means a bug in
estimax itself. The command line prints any ``EstimaxError`` as one line and
exits with its kind's ``exit_code``. Imports nothing heavy: the CLI reads it
before JAX is imported. Does not own the messages: each raiser writes its own
(what it received, what it expected, the fix).

A new error: its kind here (deriving from the built-in a caller would catch),
the raise site, and a row in the errors guide (docs/guides/errors.md), whose
list a test walks.
"""

from __future__ import annotations

# Every kind, its earlier names and the exit statuses: each is also a top-level name (``ex.ConfigError``),
# which estimax/__init__.py takes from this list.
__all__ = [
    "EstimaxError",
    "ConfigError",
    "ConfigTypeError",
    "MissingLibraryError",
    "NotFoundError",
    "InputError",
    "InputKindError",
    "InputNotFoundError",
    "InputIndexError",
    "ModelFnError",
    "SpecError",
    "MissingMethodError",
    "UnknownNameError",
    "CheckpointError",
    "StorageError",
    "StoreUnavailableError",
    "DistributedError",
    "SyncTimeoutError",
    "WriterError",
    "EvaluationError",
    "ModelUnavailableError",
    "NonFiniteError",
    "ModelDirLockedError",
    "LeaseLostError",
    "SupersededError",
    "ModelDirNotWritableError",
    "ServingError",
    "ArtifactError",
    "ModelDirLocked",
    "ModelDirNotWritable",
    "PREEMPTED_EXIT_CODE",
    "STORE_FAILURE_EXIT_CODE",
    "USER_ERROR_EXIT_CODE",
]

USER_ERROR_EXIT_CODE = 2
"""The exit status of the ``estimax`` command for a mistake in its input or setup, as for a mistake in
its arguments (argparse's): an ``EstimaxError`` without an exit status of its own."""


class EstimaxError(Exception):
    """Base of every error estimax raises about the user's input, configuration or environment."""

    exit_code = USER_ERROR_EXIT_CODE
    """The ``estimax`` command's exit status when it stops on this kind of error."""


class ConfigError(EstimaxError, ValueError):
    """A RunConfig, Estimator or call argument that cannot work."""


class ConfigTypeError(ConfigError, TypeError):
    """A setting, argument or function of a type that cannot serve (a function where a Hook is expected,
    a list where a dict is, a class where a factory is, a host_metrics function that returns no dict)."""


class MissingLibraryError(ConfigError, ImportError):
    """A feature asked for whose optional library is not installed (the error names the extra to install).
    A store's client library is a ``StorageError``."""


class NotFoundError(EstimaxError, FileNotFoundError):
    """A file or directory the user named that does not exist (a task file, ...)."""


class InputError(EstimaxError, ValueError):
    """An input source or batch that does not fit (shapes, sizes, corrupt records)."""


class InputKindError(InputError, TypeError):
    """An input of a kind that cannot serve this use (epochs of an input of unknown size, a PyTorch
    DataLoader, a batch that is no (features, labels) pair, ...)."""


class InputNotFoundError(InputError, NotFoundError):
    """Input files, a pattern or a data directory that match nothing."""


class InputIndexError(InputError, IndexError):
    """A position past the end of a random-access source (``source[n]`` of a source of n records)."""


class ModelFnError(EstimaxError, ValueError):
    """The model_fn failed on the input it received, or returned what cannot work."""


class SpecError(ModelFnError, TypeError):
    """What a model_fn returned cannot work: no ``Spec``, a loss or predictions missing, values of
    another type or shape than estimax reads (a scalar where padding must be masked, a metric state
    instead of its inputs, a metric whose ``empty()`` does not fit its states)."""


class MissingMethodError(EstimaxError, NotImplementedError):
    """A subclass of an estimax protocol (a ``Metric``) lacks a method the protocol needs."""


class UnknownNameError(EstimaxError, AttributeError):
    """A name estimax does not have (``estimax.Estimater``); close names are suggested."""


class CheckpointError(EstimaxError, ValueError):
    """No usable checkpoint where one was asked for, or a save that failed."""


class StorageError(EstimaxError, OSError):
    """A path or URL that cannot be used: missing client library, credentials, bucket, permission.
    (An ``OSError``, and so no ``ImportError`` for a missing client library: Python's two cannot be
    joined in one class.)"""


STORE_FAILURE_EXIT_CODE = 74
"""The exit status of the ``estimax`` command when the store stopped answering mid-run or another
process took the model_dir's lease over (``EX_IOERR``): distinct from a preemption (75), a mistake in
the input (2) and a bug (1)."""


PREEMPTED_EXIT_CODE = 75
"""The exit status after a preemption signal (SIGTERM, SIGUSR1) was answered with a checkpoint:
``EX_TEMPFAIL``, which tells a supervisor to start the job again."""


class StoreUnavailableError(StorageError):
    """The store did not answer an operation on the model_dir's lock within its deadline."""

    exit_code = STORE_FAILURE_EXIT_CODE


class DistributedError(EstimaxError, RuntimeError):
    """The process group cannot be formed or a peer is missing."""


class SyncTimeoutError(DistributedError):
    """A barrier was not reached by every process in time (the late ones are named)."""


class WriterError(EstimaxError, OSError):
    """A metrics, TensorBoard or tracker writer failed or stalled (a full disk, an unreachable server)."""


class EvaluationError(EstimaxError, ValueError):
    """The evaluation input, a metric's ``compute`` or a ``host_metrics`` function raised."""


class ModelUnavailableError(EstimaxError, RuntimeError):
    """A hook asked a record for its model after training had moved that step's state on."""


class NonFiniteError(EstimaxError, FloatingPointError):
    """A NaN or Inf in the loss or the gradients stopped training."""


class ModelDirLockedError(EstimaxError, RuntimeError):
    """Another process writes into this model_dir."""


class LeaseLostError(ModelDirLockedError):
    """Another process took over the model_dir's lease while this one held it (this one was paused,
    starved or cut off for longer than the lease): this one has stopped writing."""

    exit_code = STORE_FAILURE_EXIT_CODE


class SupersededError(ModelDirLockedError):
    """A later attempt of this process's run (``ESTIMAX_RUN_ID``) holds the model_dir: this one, started
    earlier, writes nothing and ends as a process whose lease was taken over does."""

    exit_code = STORE_FAILURE_EXIT_CODE


class ModelDirNotWritableError(EstimaxError, PermissionError):
    """The model_dir cannot be written (permissions, a read-only file system, a full disk)."""


class ServingError(EstimaxError, ValueError):
    """An exported model or a serving setup that cannot work."""


class ArtifactError(ServingError):
    """An exported model that cannot be loaded: missing, truncated or altered files."""


def unknown_name(module: str, name: str, names) -> UnknownNameError:
    """The error of ``module.name`` for a name the module lacks, with the closest of ``names``."""
    import difflib  # standard library, light: only when a name is missing

    close = difflib.get_close_matches(name, names, n=3)
    fix = f" Fix: did you mean {', '.join(close)}?" if close else ""
    return UnknownNameError(f"module {module!r} has no attribute {name!r}.{fix}")


def one_line(error: BaseException) -> str:
    """``"KeyError: 'x'"``: an error as a message quotes it, on one line."""
    text = " ".join(str(error).split())
    return f"{type(error).__name__}: {text}" if text else type(error).__name__


ModelDirLocked = ModelDirLockedError
"""The name of ``ModelDirLockedError`` in earlier releases."""

ModelDirNotWritable = ModelDirNotWritableError
"""The name of ``ModelDirNotWritableError`` in earlier releases."""
