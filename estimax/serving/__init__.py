"""Serving: exporting a trained model, loading the artifact without Flax, and the HTTP server.

``export.py`` writes an artifact (a ``jax.export`` program, its parameters and
``signature.json``); ``export_tf.py`` writes a TensorFlow SavedModel beside it;
``artifact.py`` loads and verifies one (``estimax.serving.load``); ``server.py``
answers TF Serving's REST API over it. Nothing here imports the model's code.

The public names are imported on first use, so that ``estimax serve --help``
does not import JAX.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING

from estimax.errors import unknown_name

if TYPE_CHECKING:
    from estimax.serving.artifact import ArtifactError as ArtifactError
    from estimax.serving.artifact import ExportedModel as ExportedModel
    from estimax.serving.artifact import load as load
    from estimax.serving.export_base import ExportBase as ExportBase

__all__ = ["ArtifactError", "ExportBase", "ExportedModel", "load"]
_MODULES = {"ExportBase": "estimax.serving.export_base"}  # the others: estimax.serving.artifact


def __getattr__(name: str):
    if name not in __all__:
        raise unknown_name("estimax.serving", name, __all__)
    value = getattr(importlib.import_module(_MODULES.get(name, "estimax.serving.artifact")), name)
    globals()[name] = value  # later lookups skip this function
    return value


def __dir__() -> list[str]:
    return sorted([*globals(), *__all__])
