"""TF Serving's REST formats: predict requests and answers, and the metadata answer, as JSON.

Owns reading ``{"instances": [...]}`` rows or ``{"inputs": {...}}`` columns
into arrays by feature, writing ``{"predictions": ...}`` or ``{"outputs": ...}``
back as strict JSON, and describing a signature the way TF Serving's metadata
does. Does not own HTTP (``server.py``) nor checking arrays against the
signature (``artifact.py``).
"""

from __future__ import annotations

import json
import math
from typing import TYPE_CHECKING

from estimax.serving.batching import empty

if TYPE_CHECKING:  # numpy is imported only to serve: `estimax --help` stays light
    import numpy as np

SIGNATURE_NAME = "serving_default"
_TF_DTYPES = {"float32": "DT_FLOAT", "float64": "DT_DOUBLE", "float16": "DT_HALF"}  # the others match TF's names


class RequestError(ValueError):
    """A request the server cannot answer: HTTP 400 with this message."""


class BodyTooLarge(RequestError):
    """A request body beyond ``--max-body-mb``: HTTP 413, read no further."""


def parse_request(body: bytes, model) -> tuple[dict, bool]:
    """``(features, row_format)`` of a TF Serving predict request; raises RequestError."""
    try:
        request = json.loads(body)
    except (json.JSONDecodeError, UnicodeDecodeError) as error:
        raise RequestError(
            f'Malformed JSON body ({error}); expected {{"instances": [...]}} or {{"inputs": ...}}.'
        ) from None
    if not isinstance(request, dict) or ("instances" in request) == ("inputs" in request):
        keys = sorted(request) if isinstance(request, dict) else type(request).__name__
        raise RequestError(f"Request has {keys}; expected a JSON object with exactly one of 'instances' and 'inputs'.")
    extra = sorted(set(request) - {"instances", "inputs", "signature_name"})
    if extra:
        raise RequestError(
            f"Request has unknown keys {extra}; expected 'instances' or 'inputs' (and 'signature_name')."
        )
    if request.get("signature_name", SIGNATURE_NAME) not in (SIGNATURE_NAME, ""):
        raise RequestError(f"signature_name {request['signature_name']!r}; this model has {SIGNATURE_NAME!r} only.")
    names = list(model.inputs)
    if "inputs" in request:
        inputs = request["inputs"]
        if not isinstance(inputs, dict) or (len(names) == 1 and names[0] not in inputs):
            if len(names) != 1:
                raise RequestError(f"'inputs' is {type(inputs).__name__}; expected an object with {names}.")
            inputs = {names[0]: inputs}
        return inputs, False
    instances = request["instances"]
    if not isinstance(instances, list):
        raise RequestError(f"'instances' is {type(instances).__name__}; expected a list, one entry per example.")
    if not instances:
        return {k: empty(0, s) for k, s in model.inputs.items()}, True
    if not all(isinstance(row, dict) for row in instances):
        if len(names) != 1:
            raise RequestError(f"'instances' holds values; this model takes {names}: expected one object per example.")
        return {names[0]: instances}, True
    for i, row in enumerate(instances):
        if set(row) != set(names):
            raise RequestError(f"instances[{i}] has features {sorted(row)}; expected {sorted(names)}.")
    return {k: [row[k] for row in instances] for k in names}, True


def format_response(outputs: dict[str, np.ndarray], model, rows: bool) -> dict:
    """TF Serving's answer: ``predictions`` as rows, or ``outputs`` as columns."""
    single = model.signature["single_output"]
    if not rows:
        return {"outputs": model.unwrap(outputs).tolist() if single else {k: v.tolist() for k, v in outputs.items()}}
    if single:
        return {"predictions": model.unwrap(outputs).tolist()}
    lists = {k: v.tolist() for k, v in outputs.items()}
    count = len(next(iter(lists.values())))
    return {"predictions": [{k: v[i] for k, v in lists.items()} for i in range(count)]}


def signature_def(signature: dict) -> dict:
    """TF Serving's ``signature_def`` of an estimax signature.json."""

    def tensors(entries):
        return {
            k: {
                "dtype": _TF_DTYPES.get(v["dtype"], "DT_" + v["dtype"].upper()),
                "tensor_shape": {"dim": [{"size": str(d if isinstance(d, int) else -1)} for d in v["shape"]]},
                "name": k,
            }
            for k, v in entries.items()
        }

    return {
        "signature_def": {
            SIGNATURE_NAME: {
                "inputs": tensors(signature["inputs"]),
                "outputs": tensors(signature["outputs"]),
                "method_name": "tensorflow/serving/predict",
            }
        }
    }


def dumps(value) -> str:
    """Strict JSON: NaN and infinities, which JSON has no numbers for, become the strings "NaN",
    "Infinity" and "-Infinity" (as the protobuf JSON mapping writes them)."""
    try:
        return json.dumps(value, separators=(",", ":"), allow_nan=False)
    except ValueError:  # a non-finite value somewhere: only then walk the answer
        return json.dumps(_finite(value), separators=(",", ":"), allow_nan=False)


def _finite(value):
    if isinstance(value, float) and not math.isfinite(value):
        return "NaN" if math.isnan(value) else ("Infinity" if value > 0 else "-Infinity")
    if isinstance(value, dict):
        return {k: _finite(v) for k, v in value.items()}
    if isinstance(value, list):
        return [_finite(v) for v in value]
    return value
