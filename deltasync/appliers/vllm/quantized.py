"""Whether an engine's quantization is the run's: a block-fp8 run into a block-fp8 engine, bf16 into bf16.

A run publishes either the trainer's bf16 cast or its block-fp8 view (:mod:`deltasync.publish.fp8`); an
engine holds its weights as its quantization config says. They must be the same rule, or a delta would
land on weights the engine computed otherwise (an engine that quantizes a bf16 checkpoint online holds
per-tensor fp8 of its own making; one that loads fp8 with another block size holds other scales). This
is checked from the engine's configuration before the map is built, and the refusal names the rule the
engine uses. What the configuration cannot show (a kernel that requantizes or repacks the loaded bytes)
the proof catches next, by parameter (:mod:`..verify`).
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

from ...errors import LayoutMismatch
from ...tensors import TensorSpec
from ...tensors.fp8 import BlockFp8, scale_name

__all__ = ["engine_rule", "check_quantization"]


def engine_rule(quant_config: Any) -> tuple[str, tuple[int, int] | None]:
    """What an engine's quantization config does to the checkpoint's weights, in words, and its fp8 block
    (``None`` unless it loads block-fp8 weights as they are in the checkpoint)."""
    if quant_config is None:
        return "none: weights as loaded", None
    name = quant_config.get_name() if hasattr(quant_config, "get_name") else type(quant_config).__name__
    kind = type(quant_config).__name__
    if name == "fp8":
        block = getattr(quant_config, "weight_block_size", None)
        serialized = getattr(quant_config, "is_checkpoint_fp8_serialized", False)
        if block and serialized:
            rows, cols = int(block[0]), int(block[1])
            return f"block fp8 {rows}x{cols} loaded from the checkpoint ({kind})", (rows, cols)
        if serialized:
            return f"per-tensor fp8 loaded from the checkpoint ({kind})", None
        return f"fp8 quantized online from the checkpoint's weights ({kind})", None
    if name == "online":
        return f"{_online_scheme(quant_config)} quantized online from the checkpoint's weights ({kind})", None
    return f"{name} ({kind}), which rewrites the weights it loads", None


def _online_scheme(quant_config: Any) -> str:
    """``"fp8 per tensor"`` or ``"fp8 per 128x128 block"`` for vLLM's online quantization (its linear weights'
    scale grouping), ``"weights"`` where the configuration does not say."""
    weight = getattr(getattr(getattr(quant_config, "args", None), "linear", None), "weight", None)
    group = getattr(getattr(weight, "scale", None), "group_shape", None)
    if group is None:
        return "weights"
    if group.row < 0 and group.col < 0:
        return "fp8 per tensor"
    return f"fp8 per {group.row}x{group.col} block"


def check_quantization(quant_config: Any, specs: Iterable[TensorSpec]) -> None:
    """Refuse an engine whose quantization is not the rule the run publishes by.

    Raises:
        `LayoutMismatch`: naming the engine's rule and a tensor it would hold otherwise.
    """
    specs = {s.name: s for s in specs}
    quantized = [s for s in specs.values() if s.dtype == "F8_E4M3"]
    rule, block = engine_rule(quant_config)
    if not quantized:
        if quant_config is not None:
            first = next(iter(specs), "")
            raise LayoutMismatch(
                f"this engine's quantization is {rule}, and the run publishes unquantized weights: a delta cannot "
                "be applied exactly to weights the engine computed. Serve the unquantized checkpoint, or publish "
                "the run's block-fp8 view (deltasync.publish.fp8.BlockFp8View) to an engine that loads an fp8 "
                "checkpoint", name=first,
            )
        return
    if block is None:
        raise LayoutMismatch(
            f"the run publishes block fp8 (e4m3 with float32 block scales, FORMAT.md \"Block fp8\") and this "
            f"engine's quantization is {rule}: start it from the checkpoint of the run's fp8 view",
            name=quantized[0].name,
        )
    for spec in quantized:
        scales = specs.get(scale_name(spec.name))
        want = BlockFp8(block).grid(spec.shape)
        if scales is None or scales.shape != want:
            found = "no scales" if scales is None else f"scales {list(scales.shape)}"
            raise LayoutMismatch(
                f"this engine's quantization is {rule}, so {spec.name} {list(spec.shape)} needs scales {list(want)}; "
                f"the run has {found}: publish with BlockFp8(block={tuple(block)})", name=spec.name,
            )
