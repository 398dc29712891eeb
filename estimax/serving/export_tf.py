"""Export as a TensorFlow SavedModel through ``jax2tf``, for TF Serving itself (``estimax[tf]``).

The same PREDICT program as ``export.py`` (``export.flat_program``), wrapped
by ``jax2tf.convert`` with a polymorphic batch dimension; parameters and
model state are ``tf.Variable``s of the SavedModel, not graph constants. One
signature, ``serving_default``, takes each feature by name and returns each
prediction by name. TensorFlow is imported here only: never by the core.
"""

from __future__ import annotations

import os

import jax

from estimax.errors import MissingLibraryError
from estimax.serving import export as export_lib


def export(core, state, path: str, features) -> str:
    """Writes a SavedModel of ``state`` to ``path``; returns ``path``."""
    try:
        import tensorflow as tf
        from jax.experimental import jax2tf
    except ImportError as error:
        raise MissingLibraryError(
            f"export(format='tf_saved_model') needs TensorFlow ({error}). Fix: pip install 'estimax[tf]'."
        ) from None
    path = os.path.abspath(os.fspath(path))
    export_lib.check_target(path)
    inputs = export_lib.named(features, export_lib.SINGLE_INPUT, "features")
    arrays, program, _ = export_lib.flat_program(core, state, isinstance(features, dict))
    names = list(inputs)
    converted = jax2tf.convert(
        program,
        polymorphic_shapes=[None, {k: f"({export_lib.BATCH}, ...)" for k in names}],
        native_serialization_platforms=export_lib.PLATFORMS,
        with_gradient=False,
    )
    module = tf.Module()
    module.arrays = {k: tf.Variable(v, trainable=False, name=k.replace("/", "__")) for k, v in arrays.items()}
    specs = [tf.TensorSpec((None, *inputs[k].shape), tf.as_dtype(inputs[k].dtype), name=k) for k in names]

    @tf.function(input_signature=specs, autograph=False)
    def serving_default(*tensors):
        return converted(dict(module.arrays), dict(zip(names, tensors, strict=True)))

    module.serving_default = serving_default
    step = int(jax.device_get(state.step))

    def write(directory: str) -> None:
        tf.saved_model.save(module, directory, signatures={"serving_default": serving_default})
        with open(os.path.join(directory, "step"), "w") as f:
            f.write(f"{step}\n")

    return export_lib.publish(path, write)
