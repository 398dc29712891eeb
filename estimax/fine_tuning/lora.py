"""LoRA: low-rank adapters on an NNX model's linear layers, trained while the base stays frozen.

Owns the model surgery (each ``nnx.Linear`` whose module path fully matches a rule of
``RunConfig(lora=LoRA(...))`` becomes a ``ScaledLoRALinear``: Flax's ``nnx.LoRALinear``
holding the same ``kernel`` and ``bias`` variables plus ``lora/lora_a`` and ``lora/lora_b``,
its adapter output scaled by ``alpha / rank``), which parameters are adapters, the adapter
file (an ``.npz`` of the adapter arrays by path), and the merge of adapters into the base
(``kernel + lora_a @ lora_b * alpha / rank``, ``fine_tuning.merge_adapter``) for export, with the
rules an adapters-only export records to merge them when it is loaded. Freezing everything but the
adapters is ``freezing.py``'s; the settings (``LoRA``) are ``fine_tuning.py``'s.

Base parameters keep their paths (``blocks/0/attn/query/kernel``), so sharding rules and
``WarmStart`` from a base checkpoint apply unchanged.
"""

from __future__ import annotations

import io
import logging
import os
import re

import jax
import numpy as np
from flax import nnx

from estimax import storage
from estimax.errors import CheckpointError, ConfigError, ConfigTypeError
from estimax.fine_tuning import LoRA, merge_adapter
from estimax.layout import format_bytes
from estimax.models.base import WrappedModel
from estimax.state import leaf_names

logger = logging.getLogger("estimax")

ADAPTER_SUFFIXES = ("/lora/lora_a", "/lora/lora_b")


class ScaledLoRALinear(nnx.LoRALinear):
    """``nnx.LoRALinear`` over an existing ``nnx.Linear``'s variables, its adapter scaled by ``alpha / rank``.

    ``lora_b`` starts at zero (Flax's default), so the wrapped layer starts as the base layer.
    """

    def __init__(self, base: nnx.Linear, rank: int, alpha: float, *, rngs: nnx.Rngs):
        super().__init__(
            base.in_features,
            base.out_features,
            lora_rank=rank,
            use_bias=base.use_bias,
            dtype=base.dtype,
            param_dtype=base.param_dtype,
            precision=base.precision,
            lora_param_dtype=base.param_dtype,
            rngs=rngs,
        )
        self.kernel, self.bias = base.kernel, base.bias  # the base's variables: same values, paths, shardings
        self.scale = alpha / rank

    def __call__(self, x: jax.Array, out_sharding=None) -> jax.Array:
        return nnx.Linear.__call__(self, x, out_sharding=out_sharding) + self.lora(x) * self.scale


def is_adapter(name: str) -> bool:
    """Whether a parameter path names an adapter array (``.../lora/lora_a`` or ``.../lora/lora_b``)."""
    return name.endswith(ADAPTER_SUFFIXES)


def wrap(model, settings: LoRA | None):
    """``model`` (an NNX factory ``(rngs, params) -> nnx.Module``) with adapters added; unchanged without
    ``settings``."""
    if settings is None:
        return model
    if isinstance(model, WrappedModel) or isinstance(model, type) or not callable(model):
        raise ConfigTypeError(
            f"RunConfig(lora=...) needs a Flax NNX model factory; received Estimator(model={model!r}). Fix: "
            "model=lambda rngs, params: MyModule(rngs=rngs), with nnx.Linear layers for the rules to name."
        )

    def with_adapters(rngs: nnx.Rngs, params: dict) -> nnx.Module:
        module = model(rngs, params)
        add_adapters(module, settings, rngs)
        return module

    return with_adapters


def add_adapters(module: nnx.Module, settings: LoRA, rngs: nnx.Rngs) -> list[str]:
    """Replaces the ``nnx.Linear`` layers of ``module`` that the rules name; returns their paths."""
    linears = {
        "/".join(map(str, path)): node
        for path, node in nnx.iter_graph(module)
        if isinstance(node, nnx.Linear) and not isinstance(node, nnx.LoRALinear) and path
    }
    chosen = [p for p in linears if any(re.fullmatch(rule, p) for rule in settings.layers)]
    for rule in settings.layers:
        if not any(re.fullmatch(rule, p) for p in linears):
            raise ConfigError(
                f"RunConfig(lora=LoRA(layers=[{rule!r}, ...])) matches no nnx.Linear layer; expected a regex that "
                f"fully matches a layer's path, e.g. {', '.join(list(linears)[:6]) or '(the model has none)'}. "
                "Fix: correct the regex or remove it."
            )
    for path in chosen:
        *parents, name = path.split("/")
        parent = module
        for part in parents:
            parent = parent[int(part)] if part.isdigit() else getattr(parent, part)
        adapted = ScaledLoRALinear(linears[path], settings.rank, settings.alpha, rngs=rngs)
        if name.isdigit():
            parent[int(name)] = adapted
        else:
            setattr(parent, name, adapted)
    return chosen


# -- the adapter file ----------------------------------------------------------------------
def adapters_of(params) -> dict[str, np.ndarray]:
    """The adapter arrays of a parameter tree by path, on the host."""
    names, leaves = leaf_names(params), jax.tree.leaves(params)
    chosen = [(n, x) for n, x in zip(names, leaves, strict=True) if is_adapter(n)]
    if not chosen:
        raise ConfigError("The model has no LoRA adapters; expected RunConfig(lora=ex.LoRA(layers=[...])).")
    host = jax.device_get([x for _, x in chosen])  # host sync: the adapters only
    return {n: np.asarray(x) for (n, _), x in zip(chosen, host, strict=True)}


def save(params, path: str | os.PathLike) -> str:
    """Writes the adapters of ``params`` to ``path`` (``.npz``, local or a store URL); returns the path."""
    path = os.fspath(path)
    if not path.endswith(".npz"):
        raise ConfigError(f"save_adapters({path!r}); expected a path ending in .npz, e.g. 'adapters.npz'.")
    arrays = adapters_of(params)
    buffer = io.BytesIO()
    np.savez(buffer, **arrays)
    storage.write_bytes(storage.resolve(path), buffer.getvalue())
    size = sum(a.nbytes for a in arrays.values())
    logger.info("LoRA: %d adapter arrays (%s) written to %s", len(arrays), format_bytes(size), path)
    return path


def load(state, path: str | os.PathLike):
    """``state`` with its adapters replaced from an adapter file (every adapter, matching shapes)."""
    path = os.fspath(path)
    with np.load(io.BytesIO(storage.read_bytes(storage.resolve(path))), allow_pickle=False) as f:
        arrays = {k: f[k] for k in f.files}
    names, leaves = leaf_names(state.params), jax.tree.leaves(state.params)
    wanted = [n for n in names if is_adapter(n)]
    missing, extra = sorted(set(wanted) - set(arrays)), sorted(set(arrays) - set(wanted))
    if missing or extra:
        raise CheckpointError(
            f"LoRA(adapters={path!r}) holds other adapters than the model's: missing {missing[:4]}, unknown "
            f"{extra[:4]}; expected the adapters of the same layers. Fix: the same LoRA(layers=...) as the run "
            "that saved them."
        )
    replaced = []
    for name, leaf in zip(names, leaves, strict=True):
        if not is_adapter(name):
            replaced.append(leaf)
            continue
        if arrays[name].shape != leaf.shape:
            raise CheckpointError(
                f"LoRA(adapters={path!r}): {name} has shape {arrays[name].shape}, the model's {leaf.shape}; "
                "expected the same rank. Fix: LoRA(rank=...) as the run that saved them."
            )
        replaced.append(jax.device_put(arrays[name].astype(leaf.dtype), leaf.sharding))
    logger.info("LoRA: %d adapter arrays loaded from %s", len(wanted), path)
    return state._replace(params=jax.tree.unflatten(jax.tree.structure(state.params), replaced))


# -- merging -------------------------------------------------------------------------------
def split_params(params) -> tuple[dict[str, np.ndarray], dict[str, np.ndarray]]:
    """``(base arrays, adapter arrays)`` of a parameter tree, each by path, on the host."""
    names = leaf_names(params)
    arrays = dict(zip(names, (np.asarray(x) for x in jax.device_get(jax.tree.leaves(params))), strict=True))
    return {n: x for n, x in arrays.items() if not is_adapter(n)}, {n: x for n, x in arrays.items() if is_adapter(n)}


def merge_rules(params, settings: LoRA) -> list[dict]:
    """Each adapted layer's merge by parameter path: ``{"kernel", "lora_a", "lora_b", "scale"}``."""
    layers = [n[: -len(ADAPTER_SUFFIXES[0])] for n in leaf_names(params) if n.endswith(ADAPTER_SUFFIXES[0])]
    scale = settings.alpha / settings.rank
    return [
        {"kernel": f"{layer}/kernel", "lora_a": layer + ADAPTER_SUFFIXES[0], "lora_b": layer + ADAPTER_SUFFIXES[1],
         "scale": scale}
        for layer in layers
    ]  # fmt: skip


def merged_params(params, settings: LoRA) -> dict[str, np.ndarray]:
    """The parameters by path with each adapter merged into its kernel (``fine_tuning.merge_adapter``:
    ``kernel + a @ b * alpha / rank`` in float64, then the kernel's dtype) and the adapter arrays left out."""
    arrays, adapters = split_params(params)
    for rule in merge_rules(params, settings):
        lora_a, lora_b = adapters[rule["lora_a"]], adapters[rule["lora_b"]]
        arrays[rule["kernel"]] = merge_adapter(arrays[rule["kernel"]], lora_a, lora_b, rule["scale"])
    return arrays


def merged(base_adapter, state, settings: LoRA, merge: bool = True):
    """``state`` with the base model's parameter tree (of ``base_adapter``), adapters merged in (or left out)."""
    arrays = merged_params(state.params, settings) if merge else split_params(state.params)[0]
    abstract = jax.eval_shape(base_adapter.init)[0]
    leaves = [arrays[n] for n in leaf_names(abstract)]
    return state._replace(params=jax.tree.unflatten(jax.tree.structure(abstract), leaves), opt_state=None)


def adapters_on_base(merged, state, settings: LoRA) -> tuple:
    """What an adapter-only export writes: ``(core, base state, adapters, merge rules)``, where ``merged``
    is the run's ``state -> (base Core, state)`` and the base state keeps the base's own kernels."""
    core, base = merged(state, merge=False)
    return core, base, split_params(state.params)[1], merge_rules(state.params, settings)
