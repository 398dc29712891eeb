"""Loading an exported model: ``load(path)`` -> a callable on a dict of numpy arrays.

Owns reading and verifying an artifact written by ``export.py`` (every
file checked against ``signature.json``, a damaged one named), validating
and casting inputs against the signature, and running the program on any
batch size. An adapters-only export (``adapter_export.py``) is loaded on its
base artifact: found (the path given, else the one recorded, else the same
place relative to the adapters), checked against the digest recorded, its
arrays read, and each adapter merged into its kernel as the merged export
merged it (``fine_tuning.merge_adapter``). Needs only jax, numpy and Orbax:
never Flax, never the model's code. Does not own HTTP (``server.py``).
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import tempfile
import warnings

import jax
import numpy as np

from estimax import storage
from estimax.errors import ArtifactError, InputError, InputKindError
from estimax.fine_tuning import merge_adapter
from estimax.serving.export import (
    ADAPTERS_FORMAT,
    BATCH,
    FORMAT,
    SIGNATURE,
    SINGLE_OUTPUT,
    array_sha256,
    params_digest,
)

# jax.export's compatibility window: a consumer up to ~6 months newer or ~3 weeks older than the
# exporter. JAX releases a minor version about every two months, with patch releases within it, so
# versions stand in for dates: newer by more than 3 minor versions, or older by more than a patch.
NEWER_MINORS_SUPPORTED = 3


class ExportedModel:
    """A loaded artifact; ``model(features)`` returns the predictions for a batch.

    ``features``: a dict name -> array (or one array when the model takes one),
    every array with the same leading batch axis, any size including 0.
    Returns a dict name -> array (or one array when the model returns one).
    """

    def __init__(self, path: str, signature: dict, exported, arrays: dict):
        self.path, self.signature = path, signature
        self.step: int = signature["step"]
        self.inputs = {k: _Spec(v) for k, v in signature["inputs"].items()}
        self.outputs = {k: _Spec(v) for k, v in signature["outputs"].items()}
        self._arrays = jax.device_put(arrays)  # once: not copied to the device per call
        self._call = jax.jit(exported.call)

    def __call__(self, features):
        return self.unwrap(self.run(self.prepare(features)))

    def prepare(self, features) -> dict[str, np.ndarray]:
        """``features`` checked against the signature and cast to its dtypes; raises InputError/InputKindError."""
        if not isinstance(features, dict):
            if len(self.inputs) != 1:
                raise InputKindError(
                    f"The model takes features {sorted(self.inputs)}; received {type(features).__name__}. "
                    "Expected a dict name -> array."
                )
            features = {next(iter(self.inputs)): features}
        missing, extra = sorted(set(self.inputs) - set(features)), sorted(set(features) - set(self.inputs))
        if missing or extra:
            raise InputError(
                f"Features {sorted(map(str, features))} do not match the signature: "
                + "; ".join(([f"missing {missing}"] if missing else []) + ([f"unexpected {extra}"] if extra else []))
                + f". Expected exactly {sorted(self.inputs)}."
            )
        prepared = {name: self.inputs[name].check(name, value) for name, value in features.items()}
        sizes = {name: len(x) for name, x in prepared.items()}
        if len(set(sizes.values())) > 1:
            raise InputError(f"Features have different batch sizes {sizes}; expected one leading batch axis.")
        return prepared

    def run(self, prepared: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
        """The predictions of ``prepare``'s output, a dict name -> numpy array."""
        batch = len(next(iter(prepared.values())))
        if batch == 0:  # jax.export needs b >= 1: the empty answer needs no program
            return {name: np.zeros((0, *spec.trailing), spec.dtype) for name, spec in self.outputs.items()}
        return jax.device_get(self._call(self._arrays, prepared))

    def unwrap(self, outputs: dict):
        """One array when the model returns one array (as ``predict()`` does), else the dict."""
        return outputs[SINGLE_OUTPUT] if self.signature["single_output"] else outputs


class _Spec:
    """One input or output of the signature: dtype and shape after the batch axis."""

    def __init__(self, entry: dict):
        self.dtype = np.dtype(jax.numpy.dtype(entry["dtype"]))
        self.trailing = tuple(entry["shape"][1:])
        self.text = f"{entry['dtype']}[{', '.join(map(str, entry['shape']))}]"

    def check(self, name: str, value) -> np.ndarray:
        try:
            x = np.asarray(value)
        except ValueError as error:  # ragged nested lists
            raise InputError(
                f"Feature {name!r} is not a rectangular array ({error}); the signature says {self.text}."
            ) from None
        if x.dtype == object:
            raise InputError(f"Feature {name!r} is not a rectangular array of numbers; the signature says {self.text}.")
        if x.ndim == 0 or x.shape[1:] != self.trailing:
            raise InputError(
                f"Feature {name!r} has shape {x.shape}; the signature says {self.text} ({BATCH}: any batch size). "
                f"Expected shape (batch, {', '.join(map(str, self.trailing))})."
            )
        return self._cast(name, x)

    def _cast(self, name: str, x: np.ndarray) -> np.ndarray:
        if x.dtype == self.dtype:
            return x
        if np.can_cast(x.dtype, self.dtype, "same_kind") and _kind(x.dtype) == _kind(self.dtype) == "f":
            return x.astype(self.dtype)  # float64 -> float32: rounding only, as in any float pipeline
        if _kind(x.dtype) in "biu" and _kind(self.dtype) in "biuf":
            cast = x.astype(self.dtype)
            if x.size == 0 or np.array_equal(cast.astype(x.dtype), x):
                return cast  # integers that fit exactly (int64 -> int32, int -> float32 pixel values)
            raise InputError(
                f"Feature {name!r} has {x.dtype} values that do not fit {self.dtype} exactly (e.g. "
                f"{_first_lossy(x, cast)}); the signature says {self.text}. Fix: send values in range."
            )
        raise InputKindError(
            f"Feature {name!r} has dtype {x.dtype}; the signature says {self.text}, and casting "
            f"{x.dtype} to {self.dtype} would lose information. Fix: send {self.dtype} values."
        )


def load(path: str, base_artifact: str | None = None) -> ExportedModel:
    """The model exported to ``path`` by ``Estimator.export``, ready to call on numpy arrays.

    ``base_artifact``: where the base of an adapters-only export (``export(..., base_artifact=...)``)
    is now; default: the path recorded at export, then the same place relative to ``path``.
    """
    written = storage.resolve(path)
    if storage.is_url(written) and not storage.exists(storage.join(written, SIGNATURE)):
        raise ArtifactError(f"{written} holds no {SIGNATURE}; expected the directory written by Estimator.export().")
    with _local(written) as path:
        return _load_local(path, written, base_artifact)


def _load_local(path: str, written: str, base_artifact: str | None) -> ExportedModel:
    """``load`` of the artifact exported to ``written``, read from ``path`` on this machine."""
    from jax import export as jax_export

    signature = read_signature(path)
    if base_artifact is not None and signature["format"] != ADAPTERS_FORMAT:
        raise ArtifactError(
            f"load({written!r}, base_artifact={base_artifact!r}): {written} is a whole export ({FORMAT}), not "
            "an adapters-only one; expected an export written by Estimator.export(..., base_artifact=...). "
            f"Fix: load({written!r}) without base_artifact."
        )
    program_path = os.path.join(path, signature["program"])
    program = _read_bytes(program_path)
    if _sha256(program) != signature["program_sha256"]:
        raise ArtifactError(
            f"{program_path} differs from what was exported (checksum mismatch: truncated or altered); "
            "expected the file written with its signature.json. Fix: export the model again."
        )
    try:
        exported = jax_export.deserialize(bytearray(program))
    except Exception as error:
        raise ArtifactError(f"{program_path} cannot be deserialized by jax {jax.__version__}: {error}") from error
    _check_program(path, signature, exported)
    if signature["format"] == ADAPTERS_FORMAT:
        arrays = _on_base(path, written, signature, base_artifact)
    else:
        arrays = read_params(os.path.join(path, signature["params"]), signature["param_arrays"])
    _warn_outside_window(written, signature["versions"]["jaxlib"])
    return ExportedModel(written, signature, exported, arrays)


@contextlib.contextmanager
def _local(path: str):
    """``path`` on this machine: a store's artifact is copied to a temporary folder, deleted once read
    (the program and the arrays are read whole into memory)."""
    if not storage.is_url(path):
        yield path
        return
    with tempfile.TemporaryDirectory(prefix="estimax-serving-") as local:
        yield storage.download(path, local)


def _on_base(path: str, written: str, signature: dict, given: str | None) -> dict[str, np.ndarray]:
    """The program's arrays of the adapters-only export at ``path`` (exported to ``written``): its base
    artifact's, checked against the recorded digest, each adapter merged into its kernel."""
    record = signature["adapters"]["base"]
    adapters = read_params(os.path.join(path, signature["params"]), signature["adapters"]["arrays"])
    candidates = [storage.resolve(given)] if given is not None else _base_candidates(written, record)
    base = next((c for c in candidates if storage.exists(storage.join(c, SIGNATURE))), None)
    if base is None:
        raise ArtifactError(
            f"{written} holds LoRA adapters whose base artifact is not at {' nor '.join(candidates)} (no "
            f"{SIGNATURE} there); expected the export of the base they were trained on (step {record['step']}, "
            f"digest {record['digest'][:16]}). Fix: load({written!r}, base_artifact=DIR) or `estimax serve "
            f"{written} --base-artifact DIR`, with DIR that base's export."
        )
    with _local(base) as local:
        return _merged(local, base, written, signature, adapters)


def _merged(local: str, base: str, written: str, signature: dict, adapters: dict) -> dict[str, np.ndarray]:
    """The base artifact's arrays read from ``local`` (a copy of ``base``), checked, adapters merged in."""
    record = signature["adapters"]["base"]
    base_signature = read_signature(local)
    if base_signature["format"] != FORMAT:
        raise ArtifactError(
            f"{base} is an adapters-only export itself; expected the whole export of the base model that "
            f"{written}'s adapters were trained on ({FORMAT}). Fix: base_artifact= that base's export."
        )
    digest = params_digest(base_signature["param_arrays"])
    if digest != record["digest"] or params_digest(signature["param_arrays"]) != record["digest"]:
        raise ArtifactError(
            f"{base} is not the base artifact {written}'s adapters were trained on: "
            f"{param_differences(signature['param_arrays'], base_signature['param_arrays'])}; received digest "
            f"{digest[:16]} (step {base_signature['step']}), expected {record['digest'][:16]} (step "
            f"{record['step']}, exported to {record['path']}). Fix: base_artifact= the export of the base the run "
            "started from."
        )
    arrays = read_params(os.path.join(local, base_signature["params"]), base_signature["param_arrays"])
    for rule in signature["adapters"]["merge"]:
        lora_a, lora_b = adapters[rule["lora_a"]], adapters[rule["lora_b"]]
        arrays[rule["kernel"]] = merge_adapter(arrays[rule["kernel"]], lora_a, lora_b, rule["scale"])
    return arrays


def _base_candidates(written: str, record: dict) -> list[str]:
    """Where an adapters-only export exported to ``written`` looks for its base: the recorded path, then
    the recorded path relative to it (a tree of exports moved or copied whole)."""
    candidates = [record["path"]]
    if record.get("relative") and not storage.is_url(written):
        moved = os.path.normpath(os.path.join(written, record["relative"]))
        candidates += [moved] if moved != record["path"] else []
    return candidates


def param_differences(expected: dict, received: dict) -> str:
    """What differs between two signatures' ``param_arrays``, in a few names."""
    missing, extra = sorted(set(expected) - set(received)), sorted(set(received) - set(expected))
    changed = sorted(n for n in set(expected) & set(received) if expected[n] != received[n])
    parts = [f"{len(changed)} arrays differ ({', '.join(changed[:3])}{', ...' if len(changed) > 3 else ''})"]
    parts += [f"missing {missing[:3]}"] if missing else []
    parts += [f"unexpected {extra[:3]}"] if extra else []
    return "; ".join(parts if changed or not (missing or extra) else parts[1:])


def read_signature(path: str) -> dict:
    """The signature of the artifact directory ``path`` (local), checked to be one."""
    file = os.path.join(path, SIGNATURE)
    if not os.path.isdir(path):
        raise ArtifactError(f"{path} is not a directory; expected the directory written by Estimator.export().")
    try:
        with open(file) as f:
            signature = json.load(f)
    except FileNotFoundError:
        raise ArtifactError(f"{file} is missing; expected the directory written by Estimator.export().") from None
    except (json.JSONDecodeError, UnicodeDecodeError) as error:
        raise ArtifactError(f"{file} is not valid JSON ({error}): truncated or altered. Fix: export again.") from None
    required = ("format", "program", "program_sha256", "params", "param_arrays", "inputs", "outputs", "step")
    adapters = ("arrays", "merge", "base")  # and, in an adapters-only export, what it runs on
    if (
        not isinstance(signature, dict)
        or signature.get("format") not in (FORMAT, ADAPTERS_FORMAT)
        or not all(k in signature for k in required)
        or (signature["format"] == ADAPTERS_FORMAT and not all(k in signature.get("adapters", {}) for k in adapters))
    ):
        raise ArtifactError(
            f"{file} is not an estimax export signature ({FORMAT}); expected the keys {list(required)}. "
            "Fix: export the model again with this version of estimax."
        )
    signature.setdefault("versions", {}).setdefault("jaxlib", "unknown")
    return signature


def _read_bytes(file: str) -> bytes:
    try:
        with open(file, "rb") as f:
            return f.read()
    except OSError as error:
        raise ArtifactError(f"{file} cannot be read ({error.strerror}); expected the exported program.") from None


def _check_program(path: str, signature: dict, exported) -> None:
    """The program's inputs and outputs must be what signature.json says (an edited signature fails here)."""
    in_avals = jax.tree.unflatten(exported.in_tree, exported.in_avals)[0]
    out_avals = jax.tree.unflatten(exported.out_tree, exported.out_avals)
    program = {
        "param_arrays": {k: _describe(v) for k, v in in_avals[0].items()},
        "inputs": {k: _describe(v) for k, v in in_avals[1].items()},
        "outputs": {k: _describe(v) for k, v in out_avals.items()},
    }
    for key, described in program.items():
        listed = {k: {"dtype": v["dtype"], "shape": v["shape"]} for k, v in signature[key].items()}
        if listed != described:
            raise ArtifactError(
                f"{os.path.join(path, SIGNATURE)} does not match {signature['program']}: its {key!r} are {listed}, "
                f"the program's are {described}. The signature was altered; fix: export the model again."
            )


def _describe(aval) -> dict:
    return {"dtype": np.dtype(aval.dtype).name, "shape": [d if isinstance(d, int) else str(d) for d in aval.shape]}


def read_params(directory: str, expected: dict) -> dict[str, np.ndarray]:
    """An artifact's parameter arrays by name (``export.save_params``' counterpart), checked
    against ``expected`` (the signature's ``param_arrays``); ``ArtifactError`` names what differs."""
    import orbax.checkpoint as ocp

    try:
        arrays = ocp.PyTreeCheckpointer().restore(directory)  # no target: numpy arrays
    except Exception as error:  # truncated tensorstore files, missing metadata
        first = (str(error).strip().splitlines() or [""])[0]
        raise ArtifactError(
            f"{directory} cannot be restored ({type(error).__name__}: {first}); expected the parameter "
            "checkpoint written by Estimator.export(). Fix: export the model again."
        ) from None
    arrays = {k: np.asarray(v) for k, v in arrays.items()}
    if sorted(arrays) != sorted(expected):
        raise ArtifactError(
            f"{directory} holds arrays {sorted(arrays)}; signature.json lists {sorted(expected)}. Fix: export again."
        )
    for name, entry in expected.items():
        if array_sha256(arrays[name]) != entry["sha256"]:
            raise ArtifactError(
                f"{directory}: array {name!r} differs from what was exported (checksum mismatch: altered or "
                "truncated). Fix: export the model again."
            )
    return arrays


def _warn_outside_window(path: str, exporter: str) -> None:
    import jaxlib

    running, exported = _version(jaxlib.__version__), _version(exporter)
    if running is None or exported is None:
        return
    newer = running[:2] > exported[:2] and (
        running[0] > exported[0] or running[1] - exported[1] > NEWER_MINORS_SUPPORTED
    )
    older = running[:2] < exported[:2] or (running[:2] == exported[:2] and exported[2] - running[2] > 1)
    if newer or older:
        warnings.warn(
            f"{path} was exported with jaxlib {exporter}; this is jaxlib {jaxlib.__version__}, "
            f"{'newer' if newer else 'older'} than jax.export supports (about 6 months newer to 3 weeks "
            f"older than the exporter). It may fail or misbehave. Fix: export again with this jaxlib, or "
            f"run with jaxlib {exporter}.",
            RuntimeWarning,
            stacklevel=3,
        )


def _version(text: str) -> tuple[int, int, int] | None:
    match = re.match(r"(\d+)\.(\d+)\.(\d+)", text)
    return tuple(int(g) for g in match.groups()) if match else None


def _kind(dtype) -> str:
    return "f" if np.issubdtype(dtype, np.floating) else np.dtype(dtype).kind


def _first_lossy(x: np.ndarray, cast: np.ndarray):
    index = np.argwhere(cast.astype(x.dtype) != x)[0]
    return x[tuple(index)].item()


def _sha256(data: bytes) -> str:
    import hashlib

    return hashlib.sha256(data).hexdigest()


__all__ = ["ArtifactError", "ExportedModel", "load"]
