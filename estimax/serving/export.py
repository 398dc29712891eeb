"""Export: a trained model as one directory that runs without its Python code.

Owns the artifact and writing it. The program is the ``jax.export`` of the
PREDICT-mode model_fn (``Core.predictions``, the function ``predict()``
runs), lowered for CPU, CUDA and TPU with a symbolic batch dimension ``b``.
Parameters and model state are its arguments, not constants, so the program
stays small and weights can be swapped:

    <path>/model.jaxexport   the serialized program (jax.export, no VJP)
    <path>/params/           an Orbax checkpoint of a flat dict ``{"conv1/kernel": array}``
    <path>/signature.json    inputs, outputs, platforms, step, versions, checksums

An adapters-only artifact (``adapter_export.py``) has the same files, but ``params/``
holds LoRA adapters alone and ``signature.json`` names the base artifact whose
arrays the program takes, by the digest of its ``param_arrays``.

Does not own loading (``artifact.py``) nor serving over HTTP (``server.py``).
"""

from __future__ import annotations

import datetime
import hashlib
import importlib.metadata
import json
import os
import re
import shutil
import tempfile

import jax
import numpy as np

from estimax import storage
from estimax.errors import ConfigError, InputKindError, ServingError, SpecError
from estimax.state import leaf_names

PROGRAM, PARAMS, SIGNATURE = "model.jaxexport", "params", "signature.json"
PLATFORMS = ("cpu", "cuda", "tpu")
FORMAT = "estimax.export/1"
# LoRA adapters alone, run on the parameters of a base artifact (``adapter_export.py``).
ADAPTERS_FORMAT = "estimax.adapters/1"
BATCH = "b"
# Names of an input or output that is one array rather than a dict of arrays.
SINGLE_INPUT, SINGLE_OUTPUT = "features", "predictions"
# Operations that draw random numbers: a PREDICT program must contain none.
_RANDOM_OPS = ("threefry2x32", "rng_bit_generator", "stablehlo.rng ")


def export(core, state, path: str, features, *, platforms=PLATFORMS) -> str:
    """Writes the artifact of ``state`` to ``path`` (replacing an earlier artifact there); returns it.

    ``features``: per-example ``ShapeDtypeStruct``s (``plan.feature_spec``), a dict or one array.
    """
    path = target(path)
    arrays, program, signature = build(core, state, features, platforms)
    return write(path, program, arrays, signature)


def target(path: str) -> str:
    """``path`` resolved and checked (``check_target``), in a single process."""
    if jax.process_count() > 1:
        raise ServingError(
            f"export() runs in one process; this is process {jax.process_index()} of {jax.process_count()}. "
            "Fix: export from the checkpoint in a single process: `estimax export --model-dir DIR --output PATH` "
            "or `Estimator(...).export(path)` with the same model_dir."
        )
    path = storage.resolve(path)
    check_target(path)
    return path


def build(core, state, features, platforms=PLATFORMS) -> tuple[dict, bytes, dict]:
    """``(arrays, program, signature)`` of ``state``: the program traced and serialized, nothing written."""
    inputs = named(features, SINGLE_INPUT, "features")
    arrays, program_fn, single_output = flat_program(core, state, isinstance(features, dict))
    exported = _trace(core.model_fn, program_fn, arrays, inputs, platforms)
    outputs = jax.tree.unflatten(exported.out_tree, exported.out_avals)
    program = exported.serialize()
    signature = {
        "format": FORMAT,
        "program": PROGRAM,
        "program_sha256": hashlib.sha256(program).hexdigest(),
        "params": PARAMS,
        "param_arrays": {k: {**_describe(v.shape, v.dtype), "sha256": array_sha256(v)} for k, v in arrays.items()},
        "inputs": {k: _describe((BATCH, *v.shape), v.dtype) for k, v in inputs.items()},
        "outputs": {k: _describe(v.shape, v.dtype) for k, v in outputs.items()},
        "single_input": not isinstance(features, dict),
        "single_output": single_output[0],
        "platforms": list(exported.platforms),
        "calling_convention_version": exported.calling_convention_version,
        "nr_devices": exported.nr_devices,
        "step": int(jax.device_get(state.step)),
        "model_fn": _qualified_name(core.model_fn),
        "versions": {"jax": jax.__version__, "jaxlib": _jaxlib_version(), "estimax": _estimax_version()},
        "exported_at": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
    }
    return arrays, program, signature


def write(path: str, program: bytes, arrays: dict[str, np.ndarray], signature: dict) -> str:
    """The program, ``arrays`` (``params/``) and ``signature`` published at ``path`` at once."""

    def write_into(directory: str) -> None:
        with open(os.path.join(directory, PROGRAM), "wb") as f:
            f.write(program)
        save_params(os.path.join(directory, PARAMS), arrays)
        with open(os.path.join(directory, SIGNATURE), "w") as f:
            f.write(_readable_json(signature))

    return publish(path, write_into)


def params_digest(param_arrays: dict) -> str:
    """One sha256 over a signature's ``param_arrays`` (each array's name, dtype, shape and sha256)."""
    return hashlib.sha256(json.dumps(param_arrays, sort_keys=True, separators=(",", ":")).encode()).hexdigest()


def publish(path: str, write) -> str:
    """``write(directory)`` into a new directory that then replaces ``path`` at once (no half artifact);
    on an object store, staged on local disk and uploaded with the signature last."""
    if storage.is_url(path):
        staging = tempfile.mkdtemp(prefix="estimax-export-")
        try:
            write(staging)
            storage.remove(path, recursive=True)  # an earlier export (check_target refused anything else)
            storage.upload(staging, path, last=SIGNATURE)
        finally:
            shutil.rmtree(staging, ignore_errors=True)
        return path
    os.makedirs(os.path.dirname(path), exist_ok=True)
    staging = tempfile.mkdtemp(prefix=".export-", dir=os.path.dirname(path))
    try:
        write(staging)
        if os.path.isdir(path):
            shutil.rmtree(path)  # an earlier export (check_target refused anything else)
        os.rename(staging, path)
    except BaseException:
        shutil.rmtree(staging, ignore_errors=True)
        raise
    return path


def save_params(directory: str, arrays: dict[str, np.ndarray]) -> None:
    import orbax.checkpoint as ocp

    ocp.PyTreeCheckpointer().save(directory, arrays)  # synchronous: no background thread outlives it


def array_sha256(x) -> str:
    return hashlib.sha256(np.ascontiguousarray(x).tobytes()).hexdigest()


def check_target(path: str) -> None:
    """Raises unless ``path`` is new, empty, or an earlier export (which is replaced), and, on an object
    store, writable (a missing bucket is a ``StorageError`` naming the URL before anything is traced)."""
    storage.check_store(path, write=True)
    # The program is uploaded first and the signature last: an upload the store cut off left the program.
    earlier = any(storage.exists(storage.join(path, name)) for name in (SIGNATURE, PROGRAM, "saved_model.pb"))
    if storage.isdir(path) and storage.listdir(path) and not earlier:
        raise ServingError(
            f"export() target {path} is a non-empty directory that is not an estimax export; expected a new "
            "path or an earlier export to replace. Fix: choose another path, e.g. exports/<model>/<step>."
        )
    if storage.exists(path) and not storage.isdir(path):
        raise ServingError(f"export() target {path} is a file; expected a directory path.")


def named(tree, single_name: str, what: str) -> dict:
    """A dict name -> leaf of a dict of leaves, or ``{single_name: leaf}``; raises on deeper trees."""
    if not isinstance(tree, dict):
        tree = {single_name: tree}
    for name, leaf in tree.items():
        if not isinstance(name, str) or not hasattr(leaf, "shape") or not hasattr(leaf, "dtype"):
            kind = SpecError if what == "predictions" else InputKindError  # the model_fn's, else the input's
            raise kind(
                f"export() needs {what} as one array or a dict name -> array; {what}[{name!r}] is "
                f"{type(leaf).__name__}. Fix: flatten nested {what} into one dict with string keys."
            )
    return tree


def flat_program(core, state, dict_input: bool):
    """``(arrays, fn, single_output)``: the parameters and model state as host arrays by flat
    name; ``fn(arrays, inputs) -> outputs``, which rebuilds the trees and runs
    ``core.predictions``; and a list that holds, once traced, whether predictions are one array."""
    params_names, state_names = leaf_names(state.params), leaf_names(state.model_state)
    if set(params_names) & set(state_names):  # e.g. two lists: give each its own namespace
        params_names = [f"params/{n}" for n in params_names]
        state_names = [f"model_state/{n}" for n in state_names]
    params_def = jax.tree.structure(state.params)
    state_def = jax.tree.structure(state.model_state)
    # Whole arrays on the host, whatever their sharding: the program is single-device.
    leaves = jax.device_get(jax.tree.leaves(state.params) + jax.tree.leaves(state.model_state))
    arrays = {name: np.asarray(leaf) for name, leaf in zip(params_names + state_names, leaves, strict=True)}
    single_output = [False]

    def program(arrays, inputs):
        params = jax.tree.unflatten(params_def, [arrays[n] for n in params_names])
        model_state = jax.tree.unflatten(state_def, [arrays[n] for n in state_names])
        features = inputs if dict_input else inputs[SINGLE_INPUT]
        predictions = core.predictions(params, model_state, (features, None))
        single_output[0] = not isinstance(predictions, dict)
        return named(predictions, SINGLE_OUTPUT, "predictions")

    return arrays, program, single_output


def _trace(model_fn, program_fn, arrays: dict, inputs: dict, platforms):
    from jax import export as jax_export

    (batch,) = jax_export.symbolic_shape(BATCH)
    array_specs = {k: jax.ShapeDtypeStruct(v.shape, v.dtype) for k, v in arrays.items()}
    input_specs = {k: jax.ShapeDtypeStruct((batch, *v.shape), v.dtype) for k, v in inputs.items()}
    try:
        exported = jax_export.export(jax.jit(program_fn), platforms=tuple(platforms))(array_specs, input_specs)
    except (
        jax.errors.InconclusiveDimensionOperation,
        jax.errors.TracerBoolConversionError,
        jax.errors.ConcretizationTypeError,
        jax.errors.TracerIntegerConversionError,
    ) as error:
        raise ServingError(
            f"model_fn {_qualified_name(model_fn)} cannot be exported for any batch size: "
            f"{str(error).strip().splitlines()[0]}. Under export the batch size (params['batch_size'] and "
            f"x.shape[0]) is the symbol '{BATCH}', so Python code that branches on its value cannot be decided. "
            "Fix: do not branch on the batch size in PREDICT mode; shapes may use it (x.reshape(batch_size, -1), "
            "jnp.zeros((batch_size, n)) work), and values may use jnp.where / jax.lax.cond."
        ) from error
    text = exported.mlir_module()
    drawn = [op.strip() for op in _RANDOM_OPS if op in text]
    if drawn:
        raise ServingError(
            f"model_fn {_qualified_name(model_fn)} draws random numbers in PREDICT mode ({', '.join(drawn)} in "
            "the program); an export would bake a fixed key into every prediction. Fix: make PREDICT "
            "deterministic (dropout and sampling off outside TRAIN)."
        )
    return exported


def _readable_json(value) -> str:
    """Indented JSON with each list of numbers or strings (shapes, platforms) on one line."""
    text = json.dumps(value, indent=1)
    return re.sub(r"\[\s+([^\[\]{}]*?)\s+\]", lambda m: "[" + re.sub(r",\s+", ", ", m.group(1)) + "]", text) + "\n"


def _describe(shape, dtype) -> dict:
    return {"dtype": np.dtype(dtype).name, "shape": [d if isinstance(d, int) else str(d) for d in shape]}


def _qualified_name(fn) -> str:
    module = getattr(fn, "__module__", None)
    name = getattr(fn, "__qualname__", None) or repr(fn)
    return f"{module}.{name}" if module else name


def _jaxlib_version() -> str:
    import jaxlib

    return jaxlib.__version__


def _estimax_version() -> str:
    try:
        return importlib.metadata.version("estimax")
    except importlib.metadata.PackageNotFoundError:
        return "unknown"


def check_format(format: str, base_artifact: str | None, lora) -> None:
    """``export(format=, base_artifact=)`` checked before anything is traced: adapters go alone only on a
    base, only as ``"jax"``, and only from a LoRA run (``lora``: its ``RunConfig.lora``)."""
    if format not in ("jax", "tf_saved_model"):
        raise ConfigError(f"export(format={format!r}); expected 'jax' (the default) or 'tf_saved_model'.")
    if base_artifact is not None and (lora is None or format != "jax"):
        raise ConfigError(
            f"export(base_artifact={base_artifact!r}, format={format!r}) with RunConfig(lora={lora!r}); "
            "expected a LoRA run exported as 'jax': only adapters go on a base. "
            "Fix: leave base_artifact out for a whole artifact."
        )
