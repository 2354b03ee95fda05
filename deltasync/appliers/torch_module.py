"""Apply deltas in place into a PyTorch module (or any mapping of tensors).

Writes go through :func:`~deltasync.tensors.write_at` (``index_put_`` or
``index_copy_``), or for a tensor held whole on the CPU in its published dtype
the compiled :func:`~deltasync.codec.kernels.put`, into the existing storage
of each parameter on its own device: O(changed elements), no reallocation, so optimizers, hooks and
captured graphs that hold the tensors keep seeing the live weights. Parameters
may be held in the published dtype (bit-exact writes of the bit patterns) or in
a wider float dtype (values are cast up, which is exact for bf16 -> fp32), and
may be non-contiguous views (transposed, sliced): flat indices are logical
(row-major) positions, written through the tensor's own strides.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

import numpy as np
import torch
from torch.autograd.graph import increment_version

from ..codec import Decoded
from ..codec.base import FlatLookup
from ..codec.device import DeviceReader
from ..codec.kernels import put, take
from ..errors import ConfigError, TensorMismatch
from ..format import Header
from ..replica.applier import Applier
from ..tensors import TensorSpec, bits_view, fingerprint, published_tensors, settle, stage, write_at
from ..tensors.fp8 import FP8_DTYPE, view_names
from ..util.threads import map_shared
from .apply import check_header

__all__ = ["TorchModuleApplier"]


class TorchModuleApplier(Applier):
    """Applies decoded deltas and anchors to a module's tensors in place.

    Args:
        target (`nn.Module` or `Mapping[str, Tensor]`): the receiving weights.
        dtype (`torch.dtype`, *optional*, defaults to `torch.bfloat16`): the
            published dtype; ``None`` takes each tensor's own dtype. The tensors of a block-fp8 view (e4m3
            tensors and their ``_scale_inv`` scales, :mod:`deltasync.tensors.fp8`) always keep their own.
        stage (`bool`, *optional*): decode and write CPU tensors' patches through
            the paths tensors on an accelerator always take: rebuilt on the device
            (:attr:`on_device`) and staged (:meth:`apply`).
    """

    def __init__(
        self,
        target: torch.nn.Module | Mapping[str, torch.Tensor],
        *,
        dtype: torch.dtype | None = torch.bfloat16,
        stage: bool = False,
    ) -> None:
        if not isinstance(target, (torch.nn.Module, Mapping)):
            raise ConfigError(
                f"target must be an nn.Module or a mapping of name -> tensor, not {type(target).__name__}",
                argument="target",
            )
        self._stage = stage
        self._tensors = dict(published_tensors(target))
        # A block-fp8 view's tensors keep their dtypes.
        fixed = view_names((n for n, t in self._tensors.items() if t.dtype == FP8_DTYPE), self._tensors)
        self.specs = {
            name: TensorSpec.of(name, t, None if name in fixed else dtype) for name, t in self._tensors.items()
        }
        self.fingerprint = fingerprint(self.specs.values())
        self._accelerated = stage or any(t.device.type != "cpu" for t in self._tensors.values())

    # Both made on access, not kept: an attribute that referred back to this applier would keep it, and
    # the weights, alive after its last user dropped it, until Python's cycle collector next runs.
    @property
    def lookup(self) -> FlatLookup:
        """The published bit patterns these tensors hold now, read only: ``lookup(name, indices)`` at flat
        indices, the base a delta is decoded against (``decode(data, base=applier.lookup)``); where a tensor is
        held whole on the CPU the host decoder reads it in place (:class:`~deltasync.codec.base.FlatLookup`)."""
        return FlatLookup(self._read, self._flat)

    @property
    def on_device(self) -> DeviceReader | None:
        """This applier when some tensor is on an accelerator, or with ``stage`` (else ``None``): the decoder
        then rebuilds ``compact`` patches on the weights' device (:mod:`deltasync.codec.device`), with one host
        wait per file instead of a read of the replica per tensor, and leaves them there."""
        return self if self._accelerated else None

    def validate(self, header: Header) -> None:
        """Refuse a file that does not fit these tensors, before anything is decoded.

        Raises:
            `FingerprintMismatch`: made for another model.
            `TensorMismatch`: a carried tensor is unknown here or laid out differently.
        """
        check_header(header, self.specs, self.fingerprint)

    def _read(self, name: str, indices: np.ndarray) -> np.ndarray:
        """Current published bit patterns at ``indices`` of tensor ``name`` (read only)."""
        flat = self._flat(name)
        if flat is not None:  # a compiled gather (refuses an index out of range)
            picked = take(flat, np.ascontiguousarray(indices, dtype=np.int64))
            if picked is not None:
                return picked
        tensor = self._held(name)
        return self.gather(name, _tensor(indices).to(tensor.device)).cpu().numpy()

    def _flat(self, name: str) -> np.ndarray | None:
        """All of tensor ``name``'s bit patterns as a flat array, where it is held on the CPU, contiguous and
        in its published dtype (else ``None``); a view of the weights as they are now."""
        tensor = self._held(name)
        if tensor.is_cpu and tensor.is_contiguous() and tensor.dtype == self.specs[name].torch_dtype:
            return bits_view(tensor).numpy().reshape(-1)
        return None

    def device_of(self, name: str) -> torch.device:
        """The device tensor ``name`` lives on."""
        return self._held(name).device

    def gather(self, name: str, index: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
        """Published bit patterns of tensor ``name`` at flat ``index`` (on the tensor's device), into ``out``
        where given (the device path's buffer of a batch's bases: read straight into it)."""
        tensor = self._held(name)
        published = self.specs[name].torch_dtype
        if tensor.is_contiguous():
            if out is not None and tensor.dtype == published:
                return torch.index_select(bits_view(tensor).view(-1), 0, index, out=out)
            picked = tensor.view(-1).index_select(0, index)  # faster than flat[idx] on the CPU
        else:  # a transposed or sliced view: address elements by their logical coordinates
            picked = tensor[torch.unravel_index(index, tensor.shape)]
        bits = bits_view(picked.to(published))
        return bits if out is None else out.copy_(bits)

    def gather_into(self, requests: Sequence[tuple[str, torch.Tensor]], out: torch.Tensor) -> None:
        """:meth:`gather` of each ``(name, index)`` request into its place in ``out``, in order (the device
        path's read of a batch's bases)."""
        for (name, index), place in zip(requests, out.split([index.numel() for _, index in requests])):
            self.gather(name, index, place)

    def _held(self, name: str) -> torch.Tensor:
        """Tensor ``name``, detached; a name this receiver does not hold is a typed refusal (a file decoded
        before :meth:`validate` may name anything), not a ``KeyError``."""
        tensor = self._tensors.get(name)
        if tensor is None:
            raise TensorMismatch(f"unknown tensor {name!r} in file; this receiver does not hold it", name=name)
        return tensor.detach()

    def apply(self, decoded: Mapping[str, Decoded]) -> None:
        """Write validated patches in place; call :meth:`validate` first.

        Patches rebuilt on the weights' device (:attr:`on_device`) are written from
        there. Other patches of tensors on the CPU are written by the compiled scatter where
        the tensor is held whole in its published dtype (on the decode threads, without the
        GIL), else one by one by torch. The changed
        elements of other tensors on an accelerator are staged: all their indices and values are
        copied into one pinned host buffer per kind, moved to the device in one
        asynchronous copy each, and written from there, so the host never waits
        for the device tensor by tensor (``stage=True`` at construction stages CPU
        tensors too). Whole tensors (anchors) are large enough to go one by one. It returns once the
        writes have run on the device, so any stream that reads the weights next sees them whole.
        """
        with torch.no_grad():
            staged: dict[torch.device, list[tuple[str, Decoded]]] = {}
            scattered: list[tuple[np.ndarray, np.ndarray, np.ndarray]] = []  # put's arguments, per patch
            for name, patch in decoded.items():
                device = self._tensors[name].device
                if isinstance(patch.values, torch.Tensor):  # rebuilt on the device: written from there
                    self._write(name, _optional(patch.indices), patch.values)
                elif patch.indices is not None and (self._stage or device.type != "cpu"):
                    staged.setdefault(device, []).append((name, patch))
                elif (args := self._scatter_args(name, patch)) is not None:
                    scattered.append(args)
                    increment_version(self._tensors[name])  # as torch's in-place writes do: autograd sees it
                else:
                    self._write(name, _optional(patch.indices), _tensor(patch.values))
            # The compiled scatter holds no GIL: the patches are shared among the decode threads.
            map_shared(_put, scattered, [indices.size for _, indices, _ in scattered])
            for device, items in staged.items():
                self._apply_staged(device, items)
        # Done means done on every stream: inference may read the weights on a stream of its own.
        settle(self._tensors[name].device for name in decoded)

    def _apply_staged(self, device: torch.device, items: list[tuple[str, Decoded]]) -> None:
        """One host buffer per kind (indices, 2- and 4-byte bit patterns), one copy each to ``device``
        (:func:`~deltasync.tensors.stage`). Every patch here has indices, one value per index."""
        bits = {2: torch.int16, 4: torch.int32}
        moved = iter(stage([t for name, patch in items for t in (
            _tensor(patch.indices).to(torch.int64),
            _tensor(patch.values).view(bits[self.specs[name].torch_dtype.itemsize]),
        )], device))
        for name, _ in items:
            self._write(name, next(moved), next(moved))

    def _scatter_args(self, name: str, patch: Decoded) -> tuple[np.ndarray, np.ndarray, np.ndarray] | None:
        """The arguments of the compiled scatter (:func:`~deltasync.codec.kernels.put`) that writes this host
        patch into tensor ``name``, where the tensor is held whole on the CPU in its published dtype and the
        patch is numpy (faster than torch's kernels into weights not in cache, on one thread). Else ``None``."""
        indices, values = patch.indices, patch.values
        if not isinstance(indices, np.ndarray) or not isinstance(values, np.ndarray):
            return None
        flat = self._flat(name)
        if flat is None or values.dtype.itemsize != flat.itemsize:
            return None
        return flat, indices.astype(np.int64, copy=False), values.view(flat.dtype)

    def _write(self, name: str, indices: torch.Tensor | None, values: torch.Tensor) -> None:
        """Write bit patterns ``values`` (at flat ``indices``, or all) into tensor ``name`` on its device."""
        tensor = self._tensors[name]
        published = self.specs[name].torch_dtype
        values = values.view(published).to(tensor.device)
        target = tensor.detach()
        if tensor.dtype == published:
            target, values = bits_view(target), bits_view(values)
        else:
            values = values.to(tensor.dtype)
        if indices is None:
            target.copy_(values.view(target.shape))
        elif target.is_contiguous():
            write_at(target.view(-1), indices.to(target.device), values)
        else:  # a transposed or sliced view: write through its own strides, still in place
            target.index_put_(torch.unravel_index(indices.to(target.device), target.shape), values)

    def state(self) -> dict[str, torch.Tensor]:
        """The receiving tensors by published name (live views, not copies)."""
        return dict(self._tensors)


def _put(args: tuple[np.ndarray, np.ndarray, np.ndarray]) -> None:
    put(*args)


def _optional(array: np.ndarray | torch.Tensor | None) -> torch.Tensor | None:
    return None if array is None else _tensor(array)


def _tensor(array: np.ndarray | torch.Tensor) -> torch.Tensor:
    if isinstance(array, torch.Tensor):
        return array
    # torch refuses to wrap read-only buffers without a warning; those are small copies.
    return torch.from_numpy(array if array.flags.writeable else array.copy())
