"""An adapters-only export: a LoRA run's adapters and program, on top of a base artifact.

Runs fine-tuned with LoRA on one base export the base once (a whole export of the base
model, e.g. the base run's ``Estimator.export``) and each run's adapters as a small
artifact, ``Estimator.export(path, base_artifact=BASE)``:

    <path>/model.jaxexport   the base model's program (the merged export's), parameters as arguments
    <path>/params/           the adapters alone, ``{"blocks/0/attn/query/lora/lora_a": array}``
    <path>/signature.json    format ``estimax.adapters/1``: ``param_arrays`` are the base's, with
                             their checksums; ``adapters`` holds the adapters' checksums, each
                             layer's merge (kernel, lora_a, lora_b, scale) and the base: its path,
                             its path from here, its step and the digest of its ``param_arrays``

Loading (``artifact.py``) merges each adapter into the base's kernel with the merged
export's arithmetic, so the two predict alike. Owns writing it and refusing a base artifact
that does not hold this run's base. Does not own loading.
"""

from __future__ import annotations

import os
import tempfile

from estimax import storage
from estimax.errors import ArtifactError
from estimax.serving import artifact
from estimax.serving import export as export_lib


def export(core, state, path: str, features, base_artifact: str, adapters: dict, rules: list[dict]) -> str:
    """Writes the adapters-only artifact to ``path``; returns it.

    ``core``, ``state``: the base model and the run's base parameters (adapters left out);
    ``adapters``: the adapter arrays by path; ``rules``: each layer's merge by parameter path
    (``lora.merge_rules``).
    """
    base = storage.resolve(base_artifact)
    if storage.resolve(path) == base:
        raise ArtifactError(
            f"export({path!r}, base_artifact={base_artifact!r}) would write the adapters over their base; "
            "expected another path for the adapters. Fix: e.g. exports/<run> beside exports/base."
        )
    path = export_lib.target(path)
    base_signature = _signature_of(base)
    arrays, program, signature = export_lib.build(core, state, features)
    if base_signature["param_arrays"] != signature["param_arrays"]:
        raise ArtifactError(
            f"export(base_artifact={base_artifact!r}) does not hold this run's base parameters: "
            f"{artifact.param_differences(signature['param_arrays'], base_signature['param_arrays'])}; expected "
            "the export of the base the adapters were trained on, array for array. Fix: export that base (the "
            "run it warm-started from) and name it, e.g. Estimator(model, model_fn, optimizer, "
            "RunConfig(model_dir=BASE_RUN)).export(BASE)."
        )
    merge = [{**rule, "kernel": _argument(rule["kernel"], arrays)} for rule in rules]
    record = {
        "path": base,
        "relative": None if storage.is_url(base) or storage.is_url(path) else os.path.relpath(base, path),
        "step": base_signature["step"],
        "digest": export_lib.params_digest(base_signature["param_arrays"]),
    }
    signature = {**signature, "format": export_lib.ADAPTERS_FORMAT}
    signature["adapters"] = {
        "arrays": {
            k: {"dtype": v.dtype.name, "shape": list(v.shape), "sha256": export_lib.array_sha256(v)}
            for k, v in adapters.items()
        },
        "merge": merge,
        "base": record,
    }
    return export_lib.write(path, program, adapters, signature)


def _signature_of(base: str) -> dict:
    """The base artifact's signature, checked to be a whole export."""
    if not storage.exists(storage.join(base, export_lib.SIGNATURE)):
        raise ArtifactError(
            f"export(base_artifact={base!r}) holds no export (no {export_lib.SIGNATURE}); expected the whole "
            "export of the base model the adapters were trained on. Fix: export the base first, e.g. "
            f"Estimator(model, model_fn, optimizer, RunConfig(model_dir=BASE_RUN)).export({base!r})."
        )
    with tempfile.TemporaryDirectory(prefix="estimax-base-") as local:
        with open(os.path.join(local, export_lib.SIGNATURE), "wb") as f:
            f.write(storage.read_bytes(storage.join(base, export_lib.SIGNATURE)))
        signature = artifact.read_signature(local)
    if signature["format"] != export_lib.FORMAT:
        raise ArtifactError(
            f"export(base_artifact={base!r}) is an adapters-only export; expected the whole export of the base "
            f"model ({export_lib.FORMAT}). Fix: base_artifact= the base that export names, "
            f"{signature['adapters']['base']['path']}."
        )
    return signature


def _argument(parameter: str, arrays: dict) -> str:
    """The program's argument of a parameter path (``export.flat_program`` prefixes ``params/`` when
    parameters and model state share a name)."""
    return parameter if parameter in arrays else f"params/{parameter}"
