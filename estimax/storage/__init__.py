"""Paths, files and deadlines on a local disk or a store (``file://``, ``gs://``, ``s3://``, ``memory://``).

The package's public names, used as ``storage.join(...)``, ``storage.read_bytes(...)``,
``storage.bounded(...)``, come from its modules, each owning one thing:

- ``paths.py``: turning what a user typed into a location, and taking it apart;
- ``files.py``: the file operations (through fsspec) and checking a bucket before use;
- ``deadlines.py``: how long a store operation may take, and trying again until then;
- ``clients.py``: the clients' global configuration (one ``gs://`` client, request timeouts);
- ``conditional.py``: the conditional writes of one small object (the lease, the holds);
- ``orbax_s3.py``: Orbax's checkpoints on S3.

Importing the package sends every ``gs://`` access through one client
(``clients.use_one_client``, which must run before etils first resolves a
``gs://`` path). Does not own what is written where (``run_dir.py``) nor the
checkpoint format (Orbax); the model_dir's lease bounds training's own writes
(``lease.py``).
"""

from __future__ import annotations

from estimax.storage.clients import use_one_client
from estimax.storage.deadlines import (
    DEADLINE_SECONDS,
    DEFAULT_DEADLINE_SECONDS,
    RETRY_FIX,
    Deadline,
    bounded,
    deadline_seconds,
    seconds_from_environment,
    unanswered,
)
from estimax.storage.files import (
    PROBE,
    check_store,
    download,
    exists,
    filesystem,
    forget_listings,
    isdir,
    listdir,
    makedirs,
    move,
    quiet_tensorstore,
    read_bytes,
    remove,
    upload,
    write_bytes,
    writing,
)
from estimax.storage.paths import expand, is_url, join, name, parent, resolve, scheme

use_one_client()

__all__ = [
    "DEADLINE_SECONDS",
    "DEFAULT_DEADLINE_SECONDS",
    "PROBE",
    "RETRY_FIX",
    "Deadline",
    "bounded",
    "check_store",
    "deadline_seconds",
    "download",
    "exists",
    "expand",
    "filesystem",
    "forget_listings",
    "is_url",
    "isdir",
    "join",
    "listdir",
    "makedirs",
    "move",
    "name",
    "parent",
    "quiet_tensorstore",
    "read_bytes",
    "remove",
    "resolve",
    "scheme",
    "seconds_from_environment",
    "unanswered",
    "upload",
    "use_one_client",
    "write_bytes",
    "writing",
]
