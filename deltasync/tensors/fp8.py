"""Block fp8: the one reference quantizer of the published fp8 view (docs/FORMAT.md, "Block fp8").

A tensor kept in block fp8 is published as two tensors: its elements in e4m3 (``torch.float8_e4m3fn``,
same name and shape) and one float32 *scale* per block of ``block`` elements of its last two dimensions
(name ``<name>_scale_inv``, shape the block grid), the layout the fp8 checkpoints of DeepSeek-V3 and the
Qwen3 FP8 models use and vLLM loads from ``quantization_config.weight_block_size``. The scale is the
*dequantization* multiplier (``w ~ q * scale``), which those checkpoints call ``weight_scale_inv``.

The rule, for each block ``B`` of the bf16 cast ``w`` of the weights (edge blocks of a shape that the
block does not divide hold only the elements that exist; nothing is padded into them):

1. ``amax = max |w|`` over ``B``, exact in float32; an inf or NaN anywhere in ``w`` is refused
   (:class:`~deltasync.errors.QuantizationError`, naming the tensor);
2. ``scale = float32(amax / 448)`` rounded to nearest even, or ``1.0`` where ``amax`` is zero;
3. ``q = e4m3fn(clamp(float32(w) / scale, -448, 448))``: an IEEE float32 division (rounded to nearest
   even), then the nearest e4m3 value, ties to even (448 is e4m3fn's largest finite value).

Every step is a correctly rounded IEEE operation, so any device computes the same bits; an all-zero block
has scale 1.0 and zero elements; a block whose ``amax`` changes moves its scale and every element.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Container, Iterable, Iterator, Mapping
from dataclasses import dataclass

import torch

from ..errors import ConfigError, QuantizationError

__all__ = [
    "BlockFp8", "FP8_DTYPE", "FP8_MAX", "SCALE_SUFFIX", "scale_name", "quantize", "quantize_all", "view_items",
    "view_names",
]

FP8_DTYPE = torch.float8_e4m3fn
"""The element type of the fp8 view: e4m3, no infinities, one NaN pattern per sign."""
FP8_MAX = 448.0
"""The largest finite e4m3fn value: the amax of a block maps onto it."""
SCALE_SUFFIX = "_scale_inv"
"""A scale tensor's name is its weight's name plus this suffix (``q_proj.weight_scale_inv``)."""
# Rows of blocks quantized per step: bounds the float32 scratch to this many block rows of one tensor.
_ROWS_PER_STEP = 8


def scale_name(name: str) -> str:
    """The name of the scale tensor of the fp8 tensor ``name``."""
    return name + SCALE_SUFFIX


def view_names(quantized: Iterable[str], names: Container[str]) -> set[str]:
    """Which of ``names`` hold a block-fp8 view, given its e4m3 tensors ``quantized``: those and their scales,
    whose dtypes are the view's whatever dtype a receiver holds the rest in."""
    quantized = set(quantized)
    return quantized | {scale_name(name) for name in quantized if scale_name(name) in names}


@dataclass(frozen=True, slots=True)
class BlockFp8:
    """The block-fp8 rule: the block shape over a tensor's last two dimensions.

    Args:
        block (`tuple[int, int]`, *optional*, defaults to ``(128, 128)``): rows and columns per block,
            the checkpoint's ``quantization_config.weight_block_size``.
    """

    block: tuple[int, int] = (128, 128)

    def __post_init__(self) -> None:
        if len(self.block) != 2 or any(type(b) is not int or b < 1 for b in self.block):
            raise ConfigError(f"block must be two positive ints, got {self.block!r}", argument="block")
        object.__setattr__(self, "block", tuple(self.block))

    def grid(self, shape: Iterable[int]) -> tuple[int, ...]:
        """The shape of the scale tensor of a tensor of ``shape`` (leading dimensions kept, edge blocks counted)."""
        *lead, rows, cols = tuple(shape)
        return (*lead, math.ceil(rows / self.block[0]), math.ceil(cols / self.block[1]))

    def quantize(self, name: str, weights: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """The e4m3 elements and the float32 scales of ``weights`` by this rule, on their device.

        ``weights`` is read as its bf16 cast (the published values of a bf16 run) whatever its dtype.

        Raises:
            `QuantizationError`: an inf or NaN in ``weights`` (``name`` names the tensor).
            `ConfigError`: fewer than two dimensions.
        """
        if weights.dim() < 2:
            raise ConfigError(f"{name!r} has {weights.dim()} dimensions; block fp8 needs two or more", argument=name)
        w = weights.detach()
        q = torch.empty(w.shape, dtype=FP8_DTYPE, device=w.device)
        scales = torch.empty(self.grid(w.shape), dtype=torch.float32, device=w.device)
        rows, cols = w.shape[-2:]
        br, bc = self.block
        step = br * _ROWS_PER_STEP
        for lead in _leading(w.shape[:-2]):
            for top in range(0, rows, step):
                stripe = w[lead][top : top + step].to(torch.bfloat16).float()
                q[lead][top : top + step], scales[lead][top // br : (top + step) // br] = self._stripe(stripe, br, bc)
        # An inf or NaN makes its block's amax, then its scale, non-finite: one check (one host wait) a tensor.
        if not bool(torch.isfinite(scales).all()):
            raise QuantizationError(
                f"{name!r} holds an inf or NaN: it has no fp8 view; nothing was published (fix the weights, or "
                "publish this tensor in bf16 by leaving it out of the fp8 view)",
                name=name,
            )
        return q, scales

    @staticmethod
    def _stripe(w: torch.Tensor, br: int, bc: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Quantize a float32 stripe of whole block rows (the last may be short)."""
        rows, cols = w.shape
        grid_r, grid_c = math.ceil(rows / br), math.ceil(cols / bc)
        # Zero padding leaves each block's amax as it is (|0| is no larger than any amax) and is cut off below.
        padded = torch.nn.functional.pad(w, (0, grid_c * bc - cols, 0, grid_r * br - rows))
        blocks = padded.view(grid_r, br, grid_c, bc)
        amax = blocks.abs().amax(dim=(1, 3))
        # Divided by a tensor, not a Python number: an elementwise IEEE division on every device (a scalar divisor
        # may become a multiplication by its rounded reciprocal).
        # A NaN or an inf in a block leaves its scale non-finite (amax is NaN or inf), which the caller refuses.
        scale = torch.where(amax == 0, torch.ones_like(amax), amax / torch.full_like(amax, FP8_MAX))
        q = (blocks / scale[:, None, :, None]).clamp_(-FP8_MAX, FP8_MAX).to(FP8_DTYPE)
        return q.view(grid_r * br, grid_c * bc)[:rows, :cols], scale


def _leading(shape: torch.Size) -> Iterable[tuple[int, ...]]:
    """Every index of the leading dimensions (one empty index for a 2-D tensor)."""
    if not shape:
        yield ()
        return
    for flat in range(math.prod(shape)):
        index = []
        for size in reversed(shape):
            index.append(flat % size)
            flat //= size
        yield tuple(reversed(index))


def quantize(name: str, weights: torch.Tensor, rule: BlockFp8 | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """``rule.quantize(name, weights)`` with the default rule when none is given."""
    return (rule or BlockFp8()).quantize(name, weights)


def view_items(
    tensors: Iterable[tuple[str, torch.Tensor]], chosen: Callable[[str, torch.Tensor], bool], rule: BlockFp8
) -> Iterator[tuple[str, torch.Tensor]]:
    """The block-fp8 view of ``(name, tensor)`` pairs, made as each arrives: a tensor ``chosen`` says yes to as its
    e4m3 elements then its scales (:func:`scale_name`), every other as its bf16 cast."""
    for name, tensor in tensors:
        if chosen(name, tensor):
            q, scales = rule.quantize(name, tensor)
            yield name, q
            yield scale_name(name), scales
        else:
            yield name, tensor.detach().to(torch.bfloat16)


def quantize_all(
    weights: Mapping[str, torch.Tensor], names: Iterable[str], rule: BlockFp8 | None = None
) -> dict[str, torch.Tensor]:
    """A checkpoint of ``weights`` with the tensors in ``names`` in block fp8 (each followed by its scale)
    and every other tensor in bf16: the reference an fp8 replica is compared with, bit for bit."""
    chosen = set(names)
    return dict(view_items(weights.items(), lambda name, _: name in chosen, rule or BlockFp8()))
