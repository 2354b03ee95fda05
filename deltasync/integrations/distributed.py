"""What kind of distributed model a trainer hands over, and FSDP1's gathered view of it.

The TRL callback publishes a model differently by how its parameters are laid
out across ranks: FSDP2 and DeepSpeed ZeRO-3 shards are published where they
lie (:class:`~deltasync.sharded.ShardedPublisher`), FSDP1 is gathered per
version to rank 0, anything else is published whole by the main process.
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping
from typing import Any, NoReturn

from ..sharded import is_zero3

__all__ = ["NotGathered", "full_weights", "sharding_of", "unwrapped_names"]


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


class NotGathered(Mapping[str, Any]):
    """Stands in for FSDP1's full parameters outside the gather: reading them is a bug, said loudly
    (the freed shards could otherwise be read as garbage weights)."""

    def _refuse(self) -> NoReturn:
        raise RuntimeError(
            "FSDP1's full parameters exist only inside summon_full_params; a publish outside it "
            "would read freed shards. Publish through DeltaSyncCallback's hooks on every rank."
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
