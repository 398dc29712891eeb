"""Orbax checkpoints on ``s3://``: the patch that teaches Orbax the scheme, and the options it needs.

Orbax 0.12 builds the TensorStore spec of every array itself and knows local
paths and ``gs://`` only; TensorStore has an ``s3`` kvstore driver. Until
Orbax supports S3 itself (google/orbax PR #2739), ``enable()`` replaces
three private Orbax functions, so that an ``s3://`` path keeps its ``//``,
counts as remote and gets TensorStore's ``s3`` spec, and the method that
deletes a step, so that the step's commit marker goes before its other
objects (S3 deletes object by object: a step that lost some of them must not
still look committed). S3 has no rename either, so a step is written in
place and committed last by that marker (``options()``: Orbax's commit-file
atomicity). The endpoint, region and keys come from the standard AWS
variables (``AWS_ENDPOINT_URL_S3``, else ``AWS_ENDPOINT_URL``; ``AWS_REGION``;
``AWS_ACCESS_KEY_ID``...), which TensorStore does not read itself: MinIO, R2
and moto work as AWS does.

The patch checks itself when applied (the signatures it replaces, then the
spec Orbax builds with it): an Orbax that changed under it is one
``StorageError`` naming this module and the versions it fits, raised before
anything is written. Owns the patch and the S3 spec; does not own when or
what is saved (``checkpoint.py``) nor fsspec access to the bucket
(``storage.py``).
"""

from __future__ import annotations

import functools
import inspect
import os
import re

from estimax.errors import StorageError

KNOWN_ORBAX = ">=0.12.8,<0.13"  # the orbax-checkpoint versions the patch fits (pyproject's s3 extra pins them)
COMMIT_MARKER = "commit_success.txt"  # Orbax's marker of a committed step (commit-file atomicity)

# What the patch replaces, with the parameters Orbax calls them with.
_REPLACED = {
    "tensorstore_utils._normalize_path": ["path"],
    "tensorstore_utils._use_gcs_driver": ["directory"],
    "gcs_utils.get_kvstore_for_gcs": ["ckpt_path"],
    "StandardCheckpointDeleter._delete_step_permanently": ["self", "step", "delete_target"],
}


def options() -> dict:
    """The ``CheckpointManagerOptions`` arguments of an ``s3://`` directory, with the patch applied."""
    from orbax.checkpoint import options as ocp_options

    enable()
    return {"atomicity_options": ocp_options.AtomicityOptions(mode=ocp_options.AtomicityMode.COMMIT_FILE)}


@functools.cache
def enable() -> None:
    """Applies the patch once per process and checks it; raises ``StorageError`` where Orbax changed under it."""
    import orbax.checkpoint
    from orbax.checkpoint._src.path import deleter, gcs_utils
    from orbax.checkpoint._src.serialization import tensorstore_utils

    owners = {
        "tensorstore_utils": tensorstore_utils,
        "gcs_utils": gcs_utils,
        "StandardCheckpointDeleter": getattr(deleter, "StandardCheckpointDeleter", None),
    }
    originals = {}
    for dotted, parameters in _REPLACED.items():
        owner, name = dotted.split(".")
        function = getattr(owners[owner], name, None)
        found = None if function is None else list(inspect.signature(function).parameters)
        if found != parameters:
            _refuse(orbax.checkpoint.__version__, f"{dotted} is {'gone' if found is None else found}")
        originals[dotted] = function

    gcs_kvstore = originals["gcs_utils.get_kvstore_for_gcs"]
    delete_step = originals["StandardCheckpointDeleter._delete_step_permanently"]

    def normalize_path(path: str) -> str:  # os.path.normpath makes "s3://b" "s3:/b"
        return re.sub(r"^(gs|s3):/(?!/)", r"\1://", os.path.normpath(path))

    def use_remote_driver(directory: str) -> bool:
        return directory.startswith(("gs://", "s3://"))

    def get_kvstore(ckpt_path: str) -> dict:
        return kvstore_spec(ckpt_path) if ckpt_path.startswith("s3://") else gcs_kvstore(ckpt_path)

    def delete_step_permanently(self, step, delete_target) -> None:
        if str(delete_target).startswith("s3://"):  # uncommitted first: a half-deleted step is never listed
            (delete_target / COMMIT_MARKER).unlink(missing_ok=True)
        delete_step(self, step, delete_target)

    replacements = {
        "tensorstore_utils._normalize_path": normalize_path,
        "tensorstore_utils._use_gcs_driver": use_remote_driver,
        "gcs_utils.get_kvstore_for_gcs": get_kvstore,
        "StandardCheckpointDeleter._delete_step_permanently": delete_step_permanently,
    }
    _replace(owners, replacements)
    try:
        built = tensorstore_utils.build_kvstore_tspec("s3://bucket/run/1/state", "w", use_ocdbt=True).get("base")
    except Exception as error:  # whatever a changed Orbax raises: reported below
        built = error
    if not (isinstance(built, dict) and built.get("driver") == "s3" and built.get("bucket") == "bucket"):
        _replace(owners, originals)  # Orbax as it was: gs:// and local paths unaffected
        _refuse(orbax.checkpoint.__version__, f"the array spec it builds for s3://bucket/run/1/state is {built!r}")


def _replace(owners: dict, functions: dict) -> None:
    for dotted, function in functions.items():
        owner, name = dotted.split(".")
        setattr(owners[owner], name, function)


def kvstore_spec(url: str) -> dict:
    """TensorStore's ``s3`` kvstore spec of ``url``, endpoint, region and credentials from the AWS variables."""
    bucket, _, key = url[len("s3://") :].partition("/")
    spec: dict = {"driver": "s3", "bucket": bucket, "path": key}
    endpoint = os.environ.get("AWS_ENDPOINT_URL_S3") or os.environ.get("AWS_ENDPOINT_URL")
    if endpoint:
        spec["endpoint"] = endpoint
    region = os.environ.get("AWS_REGION") or os.environ.get("AWS_DEFAULT_REGION")
    if region:
        spec["aws_region"] = region
    if os.environ.get("AWS_ACCESS_KEY_ID"):  # keys in the environment: skip TensorStore's probes of ~/.aws and IMDS
        spec["aws_credentials"] = {"type": "environment"}
    return spec


def _refuse(version: str, what: str) -> None:
    raise StorageError(
        f"s3:// checkpoints need estimax's Orbax patch (estimax/storage/orbax_s3.py), which does not fit the installed "
        f"orbax-checkpoint {version}: {what}. Expected orbax-checkpoint{KNOWN_ORBAX}. Fix: "
        f"pip install 'orbax-checkpoint{KNOWN_ORBAX}' (or 'estimax[s3]'), or use a local path or gs://."
    )
