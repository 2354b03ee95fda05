"""What kind of distributed model a trainer hands over, and the gathered views of those published whole.

The TRL callback publishes a model differently by how its parameters are laid
out across ranks: FSDP2 and DeepSpeed ZeRO-3 shards are published where they
lie (:class:`~deltasync.publish.sharded.ShardedPublisher`); FSDP1, and a PEFT model
under ZeRO-3 (whose merged weights need whole LoRA factors and base rows), are
gathered per version (:class:`Gathered`) and published by the main process;
anything else is published whole by the main process.

A PEFT model's merged weights under ZeRO-3 are gathered one decoder layer at a time and published as a
stream (:attr:`Gathered.stream`): every rank gathers a layer's parameters, the main process diffs that
layer's merged tensors, and the layer is let go before the next is gathered, so no rank holds the whole
model. FSDP1 gathers to rank 0 only (``rank0_only``), one FSDP unit at a time, published as a stream the same
way: rank 0 holds one unit's full parameters at once (a decoder layer, under the usual wrap policy), and its
other ranks never hold more than their shards.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass
from typing import Any, NoReturn

from ..publish.sharded import is_zero3

__all__ = ["Gathered", "NotGathered", "fsdp1_gathered", "fsdp1_units", "full_weights", "layer_groups",
           "sharding_of", "unwrapped_names", "zero3_gathered"]


def sharding_of(model: Any) -> str | None:
    """``"fsdp2"`` (DTensor parameters), ``"zero3"`` (DeepSpeed ZeRO-3), ``"fsdp1"`` (FSDP-wrapped) or ``None``."""
    found = None
    for name, param in model.named_parameters():
        if type(param).__name__ == "DTensor" or type(getattr(param, "data", None)).__name__ == "DTensor":
            found = "fsdp2"
        elif is_zero3(param):
            found = "zero3"  # DeepSpeed ZeRO-3: every rank publishes its flat slices, as under FSDP2
        elif "_fsdp_wrapped_module" in name or "_flat_param" in name:
            found = "fsdp1"
    return found


_WRAPPER_SEGMENTS = ("_fsdp_wrapped_module.", "_checkpoint_wrapped_module.", "_orig_mod.")


def unwrapped_names(model: Any) -> dict[str, Any]:
    """The parameters under their checkpoint names (wrapper segments removed), as FSDP1 shows them gathered."""
    return {_unwrapped(name): param for name, param in model.named_parameters()}


@dataclass(frozen=True)
class Gathered:
    """A model whose full weights every rank gathers around each publish (a collective); the main
    process publishes ``weights()`` inside the gather, and only copies of them leave it."""

    gather: Callable[[], contextlib.AbstractContextManager[Any]]
    """The collective that makes the full weights readable (on the main process at least)."""
    weights: Callable[[], Mapping[str, Any]]
    """What the main process publishes, read inside the gather."""
    stream: Callable[[], Iterator[tuple[str, Any]]] | None = None
    """The same weights gathered a layer at a time, on every rank in the same order (``None``: gathered whole)."""


def fsdp1_gathered(model: Any) -> Gathered:
    """FSDP1: every rank gathers to rank 0, which publishes the parameters under their checkpoint names, one FSDP
    unit at a time (:func:`fsdp1_units`): rank 0 holds one unit's full parameters at once, never the model's."""
    return Gathered(lambda: full_weights(model), lambda: unwrapped_names(model), lambda: fsdp1_units(model))


def fsdp1_units(model: Any) -> Iterator[tuple[str, Any]]:
    """FSDP1's parameters under their checkpoint names, gathered to rank 0 one FSDP unit at a time (its own
    parameters, not those of the units nested in it), on every rank in the same order."""
    from torch.distributed.fsdp import FullyShardedDataParallel as FSDP

    names = {id(module): name for name, module in model.named_modules()}
    offload = any(p.device.type != "cpu" for p in model.parameters())  # as in full_weights
    for unit in FSDP.fsdp_modules(model):
        with FSDP.summon_full_params(unit, recurse=False, writeback=False, rank0_only=True, offload_to_cpu=offload):
            for module in _own_modules(unit, FSDP):
                prefix = names[id(module)]
                for local, param in module.named_parameters(recurse=False):
                    if local == "_flat_param" or local.endswith("._flat_param"):
                        continue  # a unit gathered with nothing unflattened (none of its own parameters)
                    yield _unwrapped(f"{prefix}.{local}" if prefix else local), param


def _own_modules(unit: Any, fsdp: type) -> Iterator[Any]:
    """``unit`` and the modules under it that no nested FSDP unit wraps."""
    stack = [unit]
    while stack:
        module = stack.pop()
        yield module
        stack.extend(reversed([c for c in module.children() if not isinstance(c, fsdp)]))


def _unwrapped(name: str) -> str:
    for segment in _WRAPPER_SEGMENTS:
        name = name.replace(segment, "")
    return name


def zero3_gathered(model: Any, weights: Callable[[], Mapping[str, Any]]) -> Gathered:
    """DeepSpeed ZeRO-3 with a PEFT model: every rank gathers, and the main process publishes ``weights()`` (the
    merged weights or the adapter, :func:`deltasync.publish.lora.publishable`). Merged weights are gathered one
    layer at a time (:attr:`Gathered.stream`); a run that may publish the adapter form compares whole forms, so
    it gathers every parameter at once (ZeRO-3 has no gather to one rank)."""

    def gather() -> contextlib.AbstractContextManager[Any]:
        import deepspeed

        return deepspeed.zero.GatheredParameters(list(model.parameters()))

    def stream() -> Iterator[tuple[str, Any]]:
        import deepspeed

        merged = weights()
        for group in layer_groups(list(merged)):
            params = list({id(p): p for name in group for p in merged.parameters_of(name)}.values())
            with deepspeed.zero.GatheredParameters(params):
                for name in group:
                    yield name, merged[name]

    return Gathered(gather, weights, stream if _merged(weights) else None)


def _merged(weights: Callable[[], Mapping[str, Any]]) -> bool:
    from ..publish.peft import MergedWeights

    return isinstance(weights(), MergedWeights)


def layer_groups(names: list[str]) -> list[list[str]]:
    """``names`` cut into one group per decoder layer (by the first all-digit segment: ``model.layers.3.mlp...``
    is layer 3 of ``model.layers``), in order of first appearance; names of no layer form a group before the
    layers and one after them."""
    before: list[str] = []
    after: list[str] = []
    layers: dict[tuple[str, str], list[str]] = {}
    for name in names:
        parts = name.split(".")
        at = next((i for i, part in enumerate(parts) if part.isdigit()), None)
        if at is None:
            (after if layers else before).append(name)
        else:
            layers.setdefault((".".join(parts[:at]), parts[at]), []).append(name)
    return [g for g in (before, *layers.values(), after) if g]


class NotGathered(Mapping[str, Any]):
    """Stands in for a gathered model's full parameters outside the gather: reading them is a bug, said
    loudly (the freed shards could otherwise be read as garbage weights)."""

    def _refuse(self) -> NoReturn:
        raise RuntimeError(
            "the full parameters of an FSDP1 or ZeRO-3 PEFT model exist only inside the gather around a "
            "publish; a publish outside it would read freed shards. Publish through DeltaSyncCallback's "
            "hooks on every rank."
        )

    def __getitem__(self, name: str) -> Any:
        self._refuse()

    def __iter__(self) -> Iterator[str]:
        self._refuse()

    def __len__(self) -> int:
        self._refuse()


def full_weights(model: Any) -> Any:
    """FSDP1: every rank takes part in gathering the full parameters; rank 0 holds them (in host memory)."""
    from torch.distributed.fsdp import FullyShardedDataParallel

    # Offloading moves accelerator memory to the host; for parameters already on the CPU it must be off.
    offload = any(p.device.type != "cpu" for p in model.parameters())
    return FullyShardedDataParallel.summon_full_params(model, writeback=False, rank0_only=True, offload_to_cpu=offload)
