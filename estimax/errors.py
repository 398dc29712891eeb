"""The estimax error family: what estimax raises about the user's input or setup.

Every such error is an ``EstimaxError``; its subclasses say the kind
(configuration, input, storage, ...). Each also derives from the built-in
exception that code written before this family caught (``ValueError``,
``PermissionError``, ...), so ``except ValueError`` keeps working. The command
line prints any ``EstimaxError`` as one line. Imports nothing heavy: the CLI
reads it before JAX is imported. Does not own the messages: each raiser
writes its own (what it received, what it expected, the fix).
"""

from __future__ import annotations


class EstimaxError(Exception):
    """Base of every error estimax raises about the user's input, configuration or environment."""


class ConfigError(EstimaxError, ValueError):
    """A RunConfig, Estimator or call argument that cannot work."""


class InputError(EstimaxError, ValueError):
    """An input source or batch that does not fit (shapes, sizes, corrupt records)."""


class InputKindError(InputError, TypeError):
    """An input of a kind that cannot serve this use (epochs of an input of unknown size, ...)."""


class ModelFnError(EstimaxError, ValueError):
    """The model_fn failed on the input it received."""


class CheckpointError(EstimaxError, ValueError):
    """No usable checkpoint where one was asked for, or a save that failed."""


class StorageError(EstimaxError, OSError):
    """A path or URL that cannot be used: missing client library, credentials, bucket, permission."""


STORE_FAILURE_EXIT_CODE = 74
"""The exit status of the ``estimax`` command when the store stopped answering mid-run or another
process took the model_dir's lease over (``EX_IOERR``): distinct from a preemption (75), a mistake in
the input (2) and a bug (1)."""


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


class NonFiniteError(EstimaxError, FloatingPointError):
    """A NaN or Inf in the loss or the gradients stopped training."""


class ModelDirLockedError(EstimaxError, RuntimeError):
    """Another process writes into this model_dir."""


class LeaseLostError(ModelDirLockedError):
    """Another process took over the model_dir's lease while this one held it (this one was paused,
    starved or cut off for longer than the lease): this one has stopped writing."""

    exit_code = STORE_FAILURE_EXIT_CODE


class ModelDirNotWritableError(EstimaxError, PermissionError):
    """The model_dir cannot be written (permissions, a read-only file system, a full disk)."""


class ServingError(EstimaxError, ValueError):
    """An exported model or a serving setup that cannot work."""


class ArtifactError(ServingError):
    """An exported model that cannot be loaded: missing, truncated or altered files."""


def one_line(error: BaseException) -> str:
    """``"KeyError: 'x'"``: an error as a message quotes it, on one line."""
    text = " ".join(str(error).split())
    return f"{type(error).__name__}: {text}" if text else type(error).__name__


ModelDirLocked = ModelDirLockedError
"""The name of ``ModelDirLockedError`` in earlier releases."""

ModelDirNotWritable = ModelDirNotWritableError
"""The name of ``ModelDirNotWritableError`` in earlier releases."""
