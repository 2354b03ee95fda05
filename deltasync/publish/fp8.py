"""The fp8 view of a bf16 trainer: what a run publishes for replicas that serve block-fp8 weights.

:class:`BlockFp8View` wraps the trainer's model as the mapping a :class:`~deltasync.Publisher` publishes:
each tensor the serving checkpoint keeps in block fp8 becomes its e4m3 elements and its float32 block
scales by the reference rule (:mod:`deltasync.tensors.fp8`), every other tensor its bf16 cast. The
publisher diffs that view against the last published one as it diffs any weights, bit for bit, so only
the fp8 elements and the scales that changed travel, and its snapshot of an fp8 tensor costs one byte an
element (plus four bytes a block) instead of two.

Every version quantizes every block of the chosen tensors. A block whose bf16 elements did not change
quantizes to the same bits, so the result is exact whatever changed; telling untouched blocks apart
beforehand would need the bf16 copy this view exists to avoid, and at RL sparsities nearly every
128x128 block holds a changed element anyway (``benchmarks/fp8.py`` measures both).

The view is read one tensor at a time (the publisher streams it through its diff), so a version's
scratch is one tensor's fp8 copy, never a second copy of the model.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Iterable, Iterator, Mapping

import torch

from ..errors import ConfigError
from ..tensors import TensorSpec, dtype_name, published_tensors
from ..tensors.fp8 import FP8_DTYPE, BlockFp8, scale_name, view_items

__all__ = ["BlockFp8View", "fp8_by_default", "fp8_stream", "fp8_rule"]

# Tensors a block-fp8 checkpoint keeps in bf16 whatever their shape: embeddings, the output head, norms,
# and routers (a MoE's `mlp.gate`, a shared expert's gate), as DeepSeek-V3's and Qwen3's fp8 checkpoints do.
_KEPT = re.compile(r"(^|\.)(embed_tokens|embeddings?|wte|wpe|lm_head|.*norm[^.]*|gate|shared_expert_gate)\.weight$")


def fp8_by_default(name: str, tensor: torch.Tensor) -> bool:
    """Whether the fp8 checkpoints' convention quantizes ``name``: every 2-D ``.weight`` of a linear
    layer, not embeddings, the output head, norms or routers."""
    return tensor.dim() == 2 and name.endswith(".weight") and _KEPT.search(name) is None


def fp8_rule(fp8: object) -> BlockFp8 | None:
    """An integration's ``fp8`` option as a rule: ``False`` none, ``True`` the default 128x128, or a :class:`BlockFp8`.

    Raises:
        `ConfigError`: anything else.
    """
    if isinstance(fp8, BlockFp8):
        return fp8
    if fp8 is True:
        return BlockFp8()
    if fp8 is False:
        return None
    raise ConfigError(f"fp8 is True, False or a BlockFp8 rule, not {fp8!r}", argument="fp8")


def fp8_stream(
    tensors: Iterable[tuple[str, torch.Tensor]],
    rule: BlockFp8 | None = None,
    *,
    names: Callable[[str, torch.Tensor], bool] | None = None,
) -> Iterator[tuple[str, torch.Tensor]]:
    """The block-fp8 view of a stream of ``(name, tensor)`` (a trainer that hands over one tensor at a time):
    each chosen tensor (``names``, default :func:`fp8_by_default`) as its e4m3 elements then its scales, every
    other as its bf16 cast, each made as its tensor arrives. Publish it with ``Publisher(None, ..., dtype=None)``.
    """
    return view_items(tensors, names or fp8_by_default, rule or BlockFp8())


class BlockFp8View(Mapping[str, torch.Tensor]):
    """A model as published to block-fp8 replicas: chosen tensors in e4m3 with block scales, others in bf16.

    Args:
        model (`nn.Module` or `Mapping[str, Tensor]`): the trainer's weights (any floating dtype; the
            values quantized are their bf16 cast).
        rule (`BlockFp8`, *optional*): the block shape (defaults to 128x128, the checkpoints' own).
        names (`Iterable[str]` or callable, *optional*): the tensors to publish in fp8, as names or as a
            predicate ``(name, tensor) -> bool``; defaults to :func:`fp8_by_default`. Pass the serving
            checkpoint's fp8 tensors when its ``modules_to_not_convert`` differs from the convention.

    Raises:
        `ConfigError`: a named tensor is missing or has fewer than two dimensions, or a published name
            would collide with a scale's.

    Example:
        ```python
        >>> publisher = Publisher(BlockFp8View(model), "s3://bucket/run1")
        ```
    """

    def __init__(
        self,
        model: torch.nn.Module | Mapping[str, torch.Tensor],
        rule: BlockFp8 | None = None,
        *,
        names: Iterable[str] | Callable[[str, torch.Tensor], bool] | None = None,
    ) -> None:
        self.model = model
        self.rule = rule or BlockFp8()
        source = dict(published_tensors(model))
        if names is None or callable(names):
            chosen = names or fp8_by_default
            self.quantized = frozenset(n for n, t in source.items() if chosen(n, t))
        else:
            self.quantized = frozenset(names)
            missing = sorted(self.quantized - source.keys())
            if missing:
                raise ConfigError(f"no tensors {missing[:5]} in the model to publish in fp8", argument="names")
        for name in sorted(self.quantized):
            if source[name].dim() < 2:
                raise ConfigError(f"{name!r} has {source[name].dim()} dimensions; block fp8 needs two",
                                  argument="names")
            if scale_name(name) in source:
                raise ConfigError(f"{name!r}'s scale would be named {scale_name(name)!r}, which the model "
                                  "already holds", argument="names")
        self._order = [
            n for name in source for n in ((name, scale_name(name)) if name in self.quantized else (name,))
        ]
        self._names = frozenset(self._order)
        self._scale_of = {scale_name(n): n for n in self.quantized}

    @property
    def own_dtype(self) -> frozenset[str]:
        """Every name: the view is already in its published dtypes (see :func:`~deltasync.tensors.published_dtype`)."""
        return self._names

    def specs(self) -> tuple[TensorSpec, ...]:
        """The published tensors' specs, read from the model's shapes (nothing is quantized)."""
        out = []
        for name, tensor in published_tensors(self.model):
            if name in self.quantized:
                out.append(TensorSpec(name, tuple(tensor.shape), dtype_name(FP8_DTYPE)))
                out.append(TensorSpec(scale_name(name), self.rule.grid(tensor.shape), dtype_name(torch.float32)))
            else:
                out.append(TensorSpec(name, tuple(tensor.shape), dtype_name(torch.bfloat16)))
        return tuple(out)

    def __iter__(self) -> Iterator[str]:
        return iter(self._order)

    def __len__(self) -> int:
        return len(self._order)

    def __contains__(self, name: object) -> bool:
        return name in self._names

    def __getitem__(self, name: str) -> torch.Tensor:
        """One tensor of the view, computed now (:meth:`items` computes each weight's scales with it)."""
        weight = self._scale_of.get(name, name)
        tensor = self._source(weight)
        if weight not in self.quantized:
            return tensor.detach().to(torch.bfloat16)
        q, scales = self.rule.quantize(weight, tensor)
        return scales if weight != name else q

    def _source(self, name: str) -> torch.Tensor:
        for found, tensor in published_tensors(self.model):
            if found == name:
                return tensor
        raise KeyError(name)

    def items(self) -> Iterator[tuple[str, torch.Tensor]]:  # type: ignore[override]
        """``(name, tensor)`` in publishing order, each quantized as it is reached (one pass over the model)."""
        yield from view_items(published_tensors(self.model), lambda name, _: name in self.quantized, self.rule)
