"""Recording the torch ops a device path dispatches: how tests show it never waits per tensor."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

from torch.utils._python_dispatch import TorchDispatchMode

# Ops that make the host wait for a device's result (a data-dependent size, or a scalar read).
HOST_WAIT_OPS = ("nonzero", "_local_scalar_dense", "item", "is_nonzero")


@contextmanager
def recorded_ops() -> Iterator[list[str]]:
    """Inside the block, every dispatched op's name (``aten.cumsum_``...) is appended to the list yielded."""
    ops: list[str] = []

    class Record(TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # type: ignore[no-untyped-def]
            ops.append(str(func.overloadpacket))
            return func(*args, **(kwargs or {}))

    with Record():
        yield ops


def host_wait_ops(ops: list[Any]) -> set[str]:
    """The ops in ``ops`` that would make the host wait for the device."""
    return {op for op in ops if op.split(".")[-1] in HOST_WAIT_OPS}


def without_static_nonzero(monkeypatch: Any) -> None:
    """Make ``torch.nonzero_static`` raise as a backend without the kernel does (CUDA before torch 2.6),
    with no backend yet remembered as lacking it (``deltasync.tensors.positions``)."""
    import torch

    from deltasync.tensors import device as tensors

    def missing(*args: object, **kwargs: object) -> torch.Tensor:
        raise NotImplementedError("Could not run 'aten::nonzero_static' with arguments from this backend")

    monkeypatch.setattr(tensors, "_NO_STATIC_KERNEL", set())
    monkeypatch.setattr(torch, "nonzero_static", missing)


@contextmanager
def recorded_shapes() -> Iterator[list[tuple[str, list[tuple[int, ...]]]]]:
    """Inside the block, every dispatched op's name and the shapes of its tensor arguments."""
    import torch

    calls: list[tuple[str, list[tuple[int, ...]]]] = []

    class Record(TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # type: ignore[no-untyped-def]
            shapes = [tuple(a.shape) for a in args if isinstance(a, torch.Tensor)]
            calls.append((str(func.overloadpacket), shapes))
            return func(*args, **(kwargs or {}))

    with Record():
        yield calls


def scans_along_rows(calls: list[tuple[str, list[tuple[int, ...]]]]) -> list[tuple[str, list[tuple[int, ...]]]]:
    """The prefix sums in ``calls`` over a tensor of more than one dimension: on CUDA torch scans those
    along the first dimension with one thread per column, seconds for a few million rows."""
    return [call for call in calls if call[0].split(".")[-1] in ("cumsum", "cumsum_") and len(call[1][0]) > 1]
