"""A decoder-only transformer language model over bytes (vocabulary 256): a task module.

``estimax train --example lm`` (or ``estimax train estimax.examples.lm``) runs
it: it defines what every task module defines (``model``, ``model_fn``,
``optimizer``, ``train_input``, ``eval_input``, ``params``), and the optional
``DEFAULTS`` and ``prediction_record``; see ``estimax/cli/task.py``.

Pre-norm blocks of causal multi-head self-attention and an MLP, learned
position embeddings, a final LayerNorm and an untied output projection,
written in Flax NNX with parameter paths that sharding rules can target
(``blocks/0/attn/query/kernel``, ``blocks/0/mlp/up/kernel``, ...).
``SHARDING_RULES`` are the Megatron-style tensor-parallel rules over a
``model`` mesh axis: query, key and value projections column-parallel (split
over heads), the attention output row-parallel, the MLP up projection
column-parallel and its down projection row-parallel, the byte embedding and
the output projection split over the vocabulary.

The default corpus needs no download: the standard library's own ``.py``
files (``sysconfig.get_paths()["stdlib"]``, without ``site-packages`` and the
test suites, which differ between installations), sorted by path, one file in
ten held out. ``params["data_dir"]`` (``--data-dir``) reads any directory of text files instead.
The loss is the mean cross-entropy per byte (nats); the metric
``bits_per_byte`` is that loss over ln 2.

Run it: ``estimax train --example lm`` or ``python -m estimax.examples.lm``.
"""

from __future__ import annotations

import dataclasses
import math
import os
import sysconfig

import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import nnx

import estimax as ex
from estimax.cli.task import with_task_rules

VOCAB_SIZE = 256  # bytes
HELD_OUT_EVERY = 10  # file i is held out when i % 10 == 9
# Model and run sizes that train in a few minutes on 2 CPU cores (docs/guides/models.md: Examples).
MODEL = {"seq_len": 128, "dim": 128, "num_heads": 4, "num_layers": 2, "mlp_ratio": 4}
# `--set preset=gpt2-small`: GPT-2 small's shape over bytes (12 layers, 768 wide, 12 heads, 1,024 bytes
# of context; ~85M parameters with the byte vocabulary), computed in bfloat16.
PRESETS = {"gpt2-small": {"seq_len": 1024, "dim": 768, "num_heads": 12, "num_layers": 12, "mlp_ratio": 4}}
WARMUP_STEPS, WEIGHT_DECAY, CLIP_NORM = 50, 0.1, 1.0
DEFAULTS = {"batch_size": 16, "max_steps": 600, "steps_per_loop": 50, "loop": "scan"}
# Corpus slices: the first bytes of the sorted training and held-out files.
TRAIN_BYTES, HELD_OUT_BYTES = 4_000_000, 65_536
# The hyper-parameters: `estimax train --example lm --set dim=256` overrides one. `decay_steps`: the
# cosine schedule's length (the CLI's default max_steps); `data_dir`: "" reads the standard library.
params = {
    **MODEL,
    "learning_rate": 3e-3,
    "decay_steps": DEFAULTS["max_steps"],
    "data_dir": "",
    "preset": "",
    "train_bytes": TRAIN_BYTES,
    "held_out_bytes": HELD_OUT_BYTES,
}

# Megatron-style tensor parallelism over the "model" axis: `(regex, spec)`, full match on the path.
SHARDING_RULES = [
    (r"blocks/\d+/attn/(query|key|value)/kernel", (None, "model")),  # column-parallel: heads split
    (r"blocks/\d+/attn/out/kernel", ("model", None)),  # row-parallel: the head outputs are summed
    (r"blocks/\d+/mlp/up/kernel", (None, "model")),  # column-parallel: hidden units split
    (r"blocks/\d+/mlp/down/kernel", ("model", None)),  # row-parallel
    (r"embed/embedding", ("model", None)),  # vocabulary-parallel embedding
    (r"head/kernel", (None, "model")),  # logits split over the vocabulary
]


class Attention(nnx.Module):
    """Causal multi-head self-attention; heads are contiguous blocks of the projections' columns."""

    def __init__(self, dim: int, num_heads: int, *, rngs: nnx.Rngs):
        if dim % num_heads:
            raise ex.ConfigError(f"lm: dim={dim} must be a multiple of num_heads={num_heads}.")
        self.num_heads = num_heads
        self.query = nnx.Linear(dim, dim, use_bias=False, rngs=rngs)
        self.key = nnx.Linear(dim, dim, use_bias=False, rngs=rngs)
        self.value = nnx.Linear(dim, dim, use_bias=False, rngs=rngs)
        self.out = nnx.Linear(dim, dim, use_bias=False, rngs=rngs)

    def __call__(self, x: jax.Array, fused: bool = True) -> jax.Array:
        batch, length, dim = x.shape
        heads = lambda y: y.reshape(batch, length, self.num_heads, dim // self.num_heads)  # noqa: E731
        query, key, value = heads(self.query(x)), heads(self.key(x)), heads(self.value(x))
        implementation = "cudnn" if fused and cudnn_attention_fits(query) else None  # None: XLA's
        attended = jax.nn.dot_product_attention(query, key, value, is_causal=True, implementation=implementation)
        return self.out(attended.reshape(batch, length, dim))


def cudnn_attention_fits(query: jax.Array) -> bool:
    """Whether cuDNN's flash attention takes these heads here: an NVIDIA GPU from Ampere on, 16-bit
    floats, a head width that is a multiple of 8 up to 128. JAX's default is XLA's written-out
    softmax, which keeps every (length x length) score of every head for the backward pass."""
    device = jax.devices()[0]
    capability = getattr(device, "compute_capability", "")  # "9.0" on an H100; absent off CUDA
    return (
        device.platform == "gpu"
        and capability[:1].isdigit()
        and int(capability.split(".")[0]) >= 8
        and query.dtype in (jnp.bfloat16, jnp.float16)
        and query.shape[-1] % 8 == 0
        and query.shape[-1] <= 128
    )


class MLP(nnx.Module):
    def __init__(self, dim: int, hidden: int, *, rngs: nnx.Rngs):
        self.up = nnx.Linear(dim, hidden, use_bias=False, rngs=rngs)
        self.down = nnx.Linear(hidden, dim, use_bias=False, rngs=rngs)

    def __call__(self, x: jax.Array) -> jax.Array:
        return self.down(nnx.gelu(self.up(x)))


class Block(nnx.Module):
    """Pre-norm: ``x + attn(norm(x))``, then ``x + mlp(norm(x))``."""

    def __init__(self, dim: int, num_heads: int, mlp_ratio: int, *, rngs: nnx.Rngs):
        self.attn_norm = nnx.LayerNorm(dim, rngs=rngs)
        self.attn = Attention(dim, num_heads, rngs=rngs)
        self.mlp_norm = nnx.LayerNorm(dim, rngs=rngs)
        self.mlp = MLP(dim, mlp_ratio * dim, rngs=rngs)

    def __call__(self, x: jax.Array, fused: bool = True) -> jax.Array:
        x = x + self.attn(self.attn_norm(x), fused)
        return x + self.mlp(self.mlp_norm(x))


class Transformer(nnx.Module):
    """``(batch, length) int bytes -> (batch, length, 256)`` next-byte logits.

    ``fused=False`` keeps XLA's attention on every platform: the program then lowers for any
    platform (an export), where cuDNN's kernel is a call that only CUDA has.
    """

    def __init__(self, seq_len: int, dim: int, num_heads: int, num_layers: int, mlp_ratio: int, *, rngs: nnx.Rngs):
        self.embed = nnx.Embed(VOCAB_SIZE, dim, rngs=rngs)
        self.positions = nnx.Embed(seq_len, dim, rngs=rngs)
        self.blocks = nnx.List([Block(dim, num_heads, mlp_ratio, rngs=rngs) for _ in range(num_layers)])
        self.norm = nnx.LayerNorm(dim, rngs=rngs)
        self.head = nnx.Linear(dim, VOCAB_SIZE, use_bias=False, rngs=rngs)

    def __call__(self, tokens: jax.Array, fused: bool = True) -> jax.Array:
        # In the parameters' dtype (bfloat16 under RunConfig(compute_dtype=...)): nnx.Embed returns its
        # param_dtype, float32, whatever its table holds, and every layer after it would follow.
        x = (self.embed(tokens) + self.positions(jnp.arange(tokens.shape[1]))).astype(self.embed.embedding.dtype)
        for block in self.blocks:
            x = block(x, fused)
        return self.head(self.norm(x))


def sizes(params: dict) -> dict:
    """The model's shape: ``params``' sizes, or those of its ``preset``."""
    preset = params.get("preset") or ""
    if preset and preset not in PRESETS:
        raise ex.ConfigError(f"lm: preset={preset!r} is not a preset; expected one of {sorted(PRESETS)} or ''.")
    return {**{k: params.get(k, v) for k, v in MODEL.items()}, **PRESETS.get(preset, {})}


def model(rngs: nnx.Rngs, params: dict) -> Transformer:
    return Transformer(**sizes(params), rngs=rngs)


def run_config(config: ex.RunConfig, params: dict) -> ex.RunConfig:
    """The settings that follow the params: each example is ``seq_len`` tokens (train lines show
    tokens/s), and a preset computes in bfloat16 unless the config says otherwise."""
    return dataclasses.replace(
        config,
        tokens_per_example=config.tokens_per_example or sizes(params)["seq_len"],
        compute_dtype=config.compute_dtype or ("bfloat16" if params.get("preset") else None),
    )


build_model = model  # the name the other examples expose too


def model_fn(model, features, labels, mode, params) -> ex.Spec:
    """Features ``{"bytes": (batch, length)}``, labels the next bytes ``(batch, length)``."""
    # PREDICT is what an export traces, for every platform: the portable attention there.
    logits = model(features["bytes"], fused=mode != ex.PREDICT).astype(jnp.float32)
    if mode == ex.PREDICT:
        return ex.Spec(predictions={"next_byte": logits[:, -1].argmax(-1)})
    loss = optax.softmax_cross_entropy_with_integer_labels(logits, labels).mean(-1)  # nats per byte, per example
    return ex.Spec(loss=loss, metrics={"bits_per_byte": loss / math.log(2)})


def prediction_record(row) -> dict:
    return {"next_byte": row["next_byte"].item()}


def optimizer(params: dict = params) -> optax.GradientTransformation:
    """AdamW, clipped, with a linear warm-up and a cosine decay to a tenth over ``decay_steps`` (then constant)."""
    peak, decay_steps = params["learning_rate"], max(params["decay_steps"], WARMUP_STEPS + 1)
    schedule = optax.warmup_cosine_decay_schedule(0.0, peak, WARMUP_STEPS, decay_steps, end_value=peak / 10)
    # inject_hyperparams exposes the learning rate, so the engine logs it every step.
    adamw = optax.inject_hyperparams(optax.adamw)(learning_rate=schedule, b2=0.95, weight_decay=WEIGHT_DECAY)
    return optax.chain(optax.clip_by_global_norm(CLIP_NORM), adamw)


def estimator(config: ex.RunConfig, **overrides) -> ex.Estimator:
    """This task's Estimator under ``config``, for use from Python; ``overrides`` update ``params``.

    On a mesh with a ``model`` axis and no rules of the user's, ``SHARDING_RULES``
    apply (and an ``fsdp`` axis adds FSDP on the other dimension of each kernel).
    """
    hparams = {**params, **overrides}
    config = run_config(with_task_rules(config, SHARDING_RULES), hparams)
    return ex.Estimator(model=model, model_fn=model_fn, optimizer=optimizer(hparams), config=config, params=hparams)


def train_input(params: dict) -> ex.data.ArrayDataset:
    return windows(_files(params)[0], sizes(params)["seq_len"], params["train_bytes"])


def eval_input(params: dict) -> ex.data.ArrayDataset:
    return windows(_files(params)[1], sizes(params)["seq_len"], params["held_out_bytes"])


# -- the corpus ------------------------------------------------------------------------------
def stdlib_files() -> list[str]:
    """The standard library's ``.py`` files, sorted by relative path, without tests and site-packages."""
    root = sysconfig.get_paths()["stdlib"]
    skip = {"site-packages", "dist-packages", "test", "tests", "idle_test", "__pycache__"}
    found = []
    for directory, subdirectories, names in os.walk(root):
        subdirectories[:] = [d for d in subdirectories if d not in skip]
        found += [os.path.join(directory, n) for n in names if n.endswith(".py")]
    return sorted(found, key=lambda path: os.path.relpath(path, root))


def text_files(data_dir: str) -> list[str]:
    """Every regular file under ``data_dir``, sorted by relative path."""
    found = [os.path.join(d, n) for d, _, names in os.walk(data_dir) for n in names]
    if not found:
        raise ex.InputNotFoundError(f"lm: --data-dir {data_dir!r} holds no files; expected a directory of text files.")
    return sorted(found, key=lambda path: os.path.relpath(path, data_dir))


def windows(files: list[str], seq_len: int, max_bytes: int) -> ex.data.ArrayDataset:
    """The files' bytes, concatenated (up to ``max_bytes``), cut into inputs and next-byte targets.

    Window ``i`` is bytes ``i * seq_len`` to ``(i + 1) * seq_len``; its targets are
    the same span shifted by one, so every byte but the first is predicted once.
    """
    chunks, total = [], 0
    for path in files:
        with open(path, "rb") as f:
            chunks.append(f.read(max_bytes - total))
        total += len(chunks[-1])
        if total >= max_bytes:
            break
    data = np.frombuffer(b"".join(chunks), np.uint8)
    count = (len(data) - 1) // seq_len
    if count < 1:
        raise ex.InputError(f"lm: the corpus has {len(data)} bytes; expected at least seq_len + 1 = {seq_len + 1}.")
    inputs = data[: count * seq_len].reshape(count, seq_len).astype(np.int32)
    targets = data[1 : count * seq_len + 1].reshape(count, seq_len).astype(np.int32)
    return ex.data.from_arrays({"bytes": inputs}, targets)


def _files(params: dict) -> tuple[list[str], list[str]]:
    """(training files, held-out files): one file in ten is held out (the standard library, or ``data_dir``)."""
    files = text_files(params["data_dir"]) if params.get("data_dir") else stdlib_files()
    if len(files) < HELD_OUT_EVERY:
        raise ex.InputError(f"lm: {len(files)} files; expected at least {HELD_OUT_EVERY} (one in ten is held out).")
    held_out = [f for i, f in enumerate(files) if i % HELD_OUT_EVERY == HELD_OUT_EVERY - 1]
    train = [f for i, f in enumerate(files) if i % HELD_OUT_EVERY != HELD_OUT_EVERY - 1]
    return train, held_out


def load(data_dir: str = "", **overrides) -> tuple[ex.data.ArrayDataset, ex.data.ArrayDataset]:
    """(train, held-out) windows; ``overrides`` update ``params`` (``seq_len``, ``train_bytes``, ...)."""
    hparams = {**params, "data_dir": data_dir, **overrides}
    return train_input(hparams), eval_input(hparams)


if __name__ == "__main__":
    from estimax import cli

    raise SystemExit(cli.main(["train", "--example", "lm"]))
