"""The applier protocol: what a replica's weights must offer a :class:`~deltasync.replica.subscriber.Subscriber`.

A subscriber validates each file against the applier (:meth:`Applier.validate`), decodes it against the
bits the applier holds now (:meth:`Applier.lookup`), and hands it the validated patches
(:meth:`Applier.apply`). Two optional capabilities have default answers here, so a subscriber asks
instead of probing: an applier may decode whole files where its weights live (:meth:`Applier.takes_files`,
:meth:`Applier.apply_files`: a vLLM engine's ranks), range-read parts of them too (:meth:`Applier.takes_ranges`:
an expert-parallel rank), and may ask for ``compact`` patches rebuilt on
its weights' accelerator (:attr:`Applier.on_device`).

The appliers deltasync ships (:class:`~deltasync.appliers.TorchModuleApplier`,
:class:`~deltasync.appliers.CheckpointDirApplier`, :class:`~deltasync.appliers.VLLMFollower`) subclass it;
so does any applier of your own.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Mapping

import numpy as np

from ..codec import Decoded
from ..codec.device import DeviceReader
from ..errors import DeltaSyncError
from ..format import Header
from ..protocol.manifest import Plan
from ..tensors import TensorSpec
from .ranged import Fetched

__all__ = ["Applier"]


class Applier(ABC):
    """Where a subscriber writes: validates files against, reads from and patches the weights.

    Subclasses set :attr:`fingerprint` and :attr:`specs` and implement :meth:`validate`, :meth:`lookup`
    and :meth:`apply`.
    """

    fingerprint: str
    """The fingerprint of the published tensors these weights hold (:func:`~deltasync.tensors.fingerprint`)."""
    specs: dict[str, TensorSpec]
    """Every tensor held, by checkpoint name."""

    @abstractmethod
    def validate(self, header: Header) -> None:
        """Refuse a file that does not fit these weights (another model, an unknown tensor), before any decode."""

    @abstractmethod
    def lookup(self, name: str, indices: np.ndarray) -> np.ndarray:
        """Current bit patterns of ``name`` at flat ``indices``; called from several decoding threads at once."""

    @abstractmethod
    def apply(self, decoded: Mapping[str, Decoded]) -> None:
        """Write a version's validated patches; every check has passed before this is called."""

    @property
    def local_reads(self) -> bool:
        """Whether :meth:`lookup` reads weights this process holds, cheaply enough that the subscriber reads
        what each write will overwrite before it (all-or-nothing writes, :mod:`deltasync.replica.undo`).
        ``True`` here; an applier whose reads are calls to another process says ``False``, and a write of it
        that fails midway leaves the replica needing an anchor."""
        return True

    def restore(self, patches: Mapping[str, Decoded], run_id: str | None, version: int | None) -> None:
        """Write back the values an interrupted or undone apply overwrote (:mod:`deltasync.replica.undo`): the
        weights are then exactly ``version`` of ``run_id`` again. Writes them as :meth:`apply` does here; an
        applier that records its version (a checkpoint directory) records this one."""
        self.apply(patches)

    def accept_route(self, plan: Plan) -> None:
        """Called with each route before its first download; raise a :class:`DeltaSyncError` to refuse it
        (nothing of it is then fetched). Accepts every route here."""

    def takes_files(self, kind: str) -> bool:
        """Whether this applier takes a version of ``kind`` (``"delta"`` or ``"anchor"``) as whole files, to
        decode where its weights live (:meth:`apply_files`); ``False`` here: the subscriber decodes."""
        return False

    def takes_ranges(self) -> bool:
        """Whether :meth:`apply_files` also takes the range-read tensors of a file
        (:class:`~deltasync.replica.ranged.Fetched`, a subscriber's ``only=``); ``False`` here: the subscriber
        decodes those."""
        return False

    def apply_files(self, kind: str, blobs: list[bytes | memoryview | Fetched]) -> DeltaSyncError | None:
        """Decode a version's files (or, where :meth:`takes_ranges`, their range-read tensors) where the
        weights live, check everything, then write.

        Returns:
            The error that refused the files before anything was written, or ``None`` once applied.

        Raises:
            An error of a write that failed (the weights may then be partly written).
        """
        raise NotImplementedError(f"{type(self).__name__} takes no whole files (takes_files is False)")

    @property
    def on_device(self) -> DeviceReader | None:
        """A reader of these weights on their accelerator, for the decoder to rebuild ``compact`` patches
        there (:mod:`deltasync.codec.device`); ``None`` here: patches are decoded on the host."""
        return None
