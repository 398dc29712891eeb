"""The store clients' global configuration: one client per store, and every request bounded.

Owns the process-wide settings that the clients of the stores read: the
environment variables of etils (``EPATH_USE_TF``), of gcsfs (which file system
it is) and of the C++ clients (TensorStore, which writes Orbax's arrays, and
google-cloud-cpp, which reads ArrayRecord files), and fsspec's configuration
of gcsfs and s3fs. A variable
a user already set is kept. Does not own the deadline itself
(``deadlines.py``) nor any file operation (``files.py``).

``use_one_client`` runs once when ``estimax.storage`` is imported, before any
store is used: etils chooses its ``gs://`` client the first time it resolves
such a path (Orbax's checkpoints, the serving export, a user's own code),
caches the choice, and not every one of those passes through a function of
this package first.
"""

from __future__ import annotations

import os

# The client library and the extra that installs it, per URL scheme.
CLIENTS = {"gs": ("gcsfs", "estimax[gcs]"), "s3": ("s3fs", "estimax[s3]")}
# The GCS emulator variable of each C++ client: TensorStore's (Orbax's arrays), google-cloud-cpp's (ArrayRecord).
EMULATOR_VARIABLES = ("TENSORSTORE_GCS_HTTP_URL", "CLOUD_STORAGE_EMULATOR_ENDPOINT")
# gcsfs's choice of its file system for zonal and hierarchical buckets, read when gcsfs is imported.
GCSFS_BUCKET_LAYOUTS = "GCSFS_EXPERIMENTAL_ZB_HNS_SUPPORT"


def use_one_client() -> None:
    """Sends every ``gs://`` access through the clients estimax checks, whatever else is installed.

    With TensorFlow importable, etils.epath (Orbax's paths) would read ``gs://``
    through ``tf.io.gfile``, a second client that ignores ``STORAGE_EMULATOR_HOST``:
    ``EPATH_USE_TF=false`` keeps it on fsspec (gcsfs), as estimax's own files are.
    It must be set before etils first resolves a ``gs://`` path (it caches the
    choice), hence on import. The C++ clients each read their own emulator
    variable: they are derived from ``STORAGE_EMULATOR_HOST``, the one the
    Python clients read, on every store access. With an emulator, gcsfs's plain
    file system is chosen (before gcsfs is imported): its default one asks
    Google's Storage Control API, never the emulator, for each bucket's layout,
    and asks again on every operation when that fails. A variable already set is kept.
    """
    os.environ.setdefault("EPATH_USE_TF", "false")
    endpoint = emulator_endpoint()
    if endpoint:
        for variable in EMULATOR_VARIABLES:
            os.environ.setdefault(variable, endpoint)
        os.environ.setdefault(GCSFS_BUCKET_LAYOUTS, "false")


def emulator_endpoint() -> str | None:
    """The GCS emulator's URL, from ``STORAGE_EMULATOR_HOST`` (the Python clients' variable); ``None`` if unset."""
    host = os.environ.get("STORAGE_EMULATOR_HOST")
    return (host if "://" in host else f"http://{host}") if host else None


def client_options(deadline: float) -> None:
    """Gives every request of every client a quarter of the ``deadline`` (seconds), so that a stalled store
    (one that accepts connections and answers nothing) fails a request rather than hanging it,
    and ``bounded`` can try again: gcsfs and s3fs through fsspec's configuration (which Orbax's
    paths also read), TensorStore through its curl variables (a transfer under 1 byte/s for that
    long is abandoned; TensorStore then retries by itself). A TensorStore variable already set is kept."""
    import fsspec.config

    seconds = deadline / 4
    fsspec.config.conf.setdefault("gcs", {})["requests_timeout"] = seconds
    s3_config = fsspec.config.conf.setdefault("s3", {}).setdefault("config_kwargs", {})
    s3_config.update(connect_timeout=seconds, read_timeout=seconds)
    whole = str(max(1, round(seconds)))
    for variable, value in (("TIME_SECONDS", whole), ("LIMIT_BYTES", "1")):
        os.environ.setdefault(f"TENSORSTORE_CURL_LOW_SPEED_{variable}", value)
    os.environ.setdefault("TENSORSTORE_CURL_CONNECT_TIMEOUT_SECONDS", whole)
