"""Model FLOP/s and MFU: what a training step costs by the compiler's count, against the device's peak.

The FLOPs of one training step come from XLA's cost analysis of the program
the loop runs, lowered before its first call (which compiles that lowering,
from JAX's cache: nothing is lowered or compiled twice), for the whole global
batch. XLA counts a loop's body once: a rolled loop of steps counts one step,
and a loop inside the step (gradient accumulation's micro-batches) is
multiplied by the micro-batches. The
achieved rate per device is that count times the steps per second over the
number of devices; MFU divides it by the device's dense peak for the compute
dtype, from ``PEAKS``. Owns the count, the table and the arithmetic, and the
walk over a traced step's equations that the loop's choice (``loop.py``) and
the mixed-precision check (``precision.py``) read; does not own when they are
logged (``hooks/metric_logger.py``).
"""

from __future__ import annotations

import logging

import jax

logger = logging.getLogger("estimax")

# Dense peak TFLOP/s per device (never the "with sparsity" figures, which are twice these), for
# bfloat16/float16 and for float32 matmuls as JAX runs them by default (TF32 on NVIDIA GPUs since
# Ampere; bfloat16 passes on TPUs). Matched in order against jax.Device.device_kind.
PEAKS: tuple[tuple[str, float, float], ...] = (
    # https://www.nvidia.com/en-us/data-center/h200/ (H200 SXM: 989 bf16, 494 TF32 dense)
    ("H200", 989.0, 494.5),
    # https://www.nvidia.com/en-us/data-center/h100/ (H100 PCIe: 756 bf16, 378 TF32 dense)
    ("H100 PCIe", 756.0, 378.0),
    # same page (H100 SXM: 989 bf16, 494 TF32 dense; 1,979 is with sparsity)
    ("H100", 989.0, 494.5),
    # https://www.nvidia.com/en-us/data-center/a100/ (312 bf16, 156 TF32 dense)
    ("A100", 312.0, 156.0),
    # https://cloud.google.com/tpu/docs/v6e (Trillium: 918 bf16 per chip)
    ("TPU v6 lite", 918.0, 918.0),
    # https://cloud.google.com/tpu/docs/v5e (197 bf16 per chip)
    ("TPU v5 lite", 197.0, 197.0),
    # https://cloud.google.com/tpu/docs/v5p (459 bf16 per chip)
    ("TPU v5", 459.0, 459.0),
    # https://cloud.google.com/tpu/docs/v4 (275 bf16 per chip)
    ("TPU v4", 275.0, 275.0),
)


def step_flops(jitted_step, *args, micro_batches: int = 1) -> float | None:
    """The FLOPs of one step of ``jitted_step(*args)`` (arrays or ShapeDtypeStructs) by XLA's
    count of the lowered program: one call of a step, or one iteration of a rolled loop of
    steps; ``None`` where the backend gives none."""
    try:
        lowered = jitted_step.lower(*args)
        # None on PJRT plugins (CUDA, TPU), which analyse compiled programs only (seen on an H200, jax 0.11.2)
        analysis = lowered.cost_analysis() or host_cost_analysis(lowered)
    except Exception as error:  # an estimate only: never a reason to stop training
        logger.debug("No FLOP count of the training step: %s", error)
        return None
    if isinstance(analysis, (list, tuple)):  # one dict per computation on some versions
        analysis = analysis[0] if analysis else None
    flops = (analysis or {}).get("flops")
    return float(flops) * micro_batches if flops and flops > 0 else None


def host_cost_analysis(lowered) -> dict:
    """XLA's cost analysis of a program lowered for an accelerator, run by the host's (CPU) client.

    The count is of the program as written, before any backend's optimisations, as on a
    CPU; a call into a library kernel (cuDNN's attention) counts nothing. JAX has no
    public way to analyse a lowered program on a plugin backend (it compiles first, which
    would compile a program the loop may never run): this uses its private
    ``hlo_module_cost_analysis``, kept here alone (``tests/test_flops.py`` names it).
    """
    import jax.extend.backend
    from jax._src.lib import _jax

    module = lowered.compiler_ir("hlo").as_hlo_module()
    return _jax.hlo_module_cost_analysis(jax.extend.backend.get_backend("cpu"), module)


def peak_tflops(device_kind: str, compute_dtype: str | None) -> float | None:
    """The dense peak TFLOP/s of one device of ``device_kind``; ``None`` if unknown (CPUs)."""
    for name, half, full in PEAKS:
        if name.lower() in device_kind.lower():
            return half if compute_dtype in ("bfloat16", "float16") else full
    return None


def achieved(flops_per_step: float, steps_per_sec: float, num_devices: int, peak: float | None) -> dict[str, float]:
    """``tflops_per_device`` and, with a known ``peak`` (TFLOP/s), ``mfu``."""
    tflops = flops_per_step * steps_per_sec / num_devices / 1e12
    return {"tflops_per_device": tflops, **({"mfu": tflops / peak} if peak else {})}


def device_peak(compute_dtype: str | None) -> float | None:
    """The peak of this process's devices (all of one kind in a mesh)."""
    return peak_tflops(jax.devices()[0].device_kind, compute_dtype)


def equations(jaxpr):
    """Every equation of ``jaxpr`` (or a ClosedJaxpr) and of the jaxprs inside it (loop bodies,
    branches, calls), each once: what a traced step does, before the compiler counts it."""
    for eqn in getattr(jaxpr, "jaxpr", jaxpr).eqns:
        yield eqn
        for value in eqn.params.values():
            for inner in value if isinstance(value, tuple | list) else (value,):
                if hasattr(inner, "eqns") or hasattr(getattr(inner, "jaxpr", None), "eqns"):
                    yield from equations(inner)
