"""What kind of distributed model a trainer hands over, and the gathered views of those published whole.

The TRL callback publishes a model differently by how its parameters are laid
out across ranks: FSDP2 and DeepSpeed ZeRO-3 shards are published where they
lie (:class:`~deltasync.publish.sharded.ShardedPublisher`); FSDP1, and a PEFT model
under ZeRO-3 (whose merged weights need whole LoRA factors and base rows), are
gathered per version (:class:`Gathered`) and published by the main process;
anything else is published whole by the main process.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass
from typing import Any, NoReturn

from ..publish.sharded import is_zero3

__all__ = ["Gathered", "NotGathered", "fsdp1_gathered", "full_weights", "sharding_of", "unwrapped_names",
           "zero3_gathered"]


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
    out = {}
    for name, param in model.named_parameters():
        for segment in _WRAPPER_SEGMENTS:
            name = name.replace(segment, "")
        out[name] = param
    return out


@dataclass(frozen=True)
class Gathered:
    """A model whose full weights every rank gathers around each publish (a collective); the main
    process publishes ``weights()`` inside the gather, and only copies of them leave it."""

    gather: Callable[[], contextlib.AbstractContextManager[Any]]
    """The collective that makes the full weights readable (on the main process at least)."""
    weights: Callable[[], Mapping[str, Any]]
    """What the main process publishes, read inside the gather."""


def fsdp1_gathered(model: Any) -> Gathered:
    """FSDP1: every rank gathers to rank 0, which publishes the parameters under their checkpoint names."""
    return Gathered(lambda: full_weights(model), lambda: unwrapped_names(model))


def zero3_gathered(model: Any, weights: Callable[[], Mapping[str, Any]]) -> Gathered:
    """DeepSpeed ZeRO-3 with a PEFT model: every rank gathers every parameter (ZeRO-3 has no gather to one
    rank; TRL's own vLLM sync of such a model gathers the same), and the main process publishes ``weights()``
    (the merged weights or the adapter, :func:`deltasync.publish.lora.publishable`) inside."""

    def gather() -> contextlib.AbstractContextManager[Any]:
        import deepspeed

        return deepspeed.zero.GatheredParameters(list(model.parameters()))

    return Gathered(gather, weights)


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
