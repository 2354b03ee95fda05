"""Transport, worker side: the vLLM worker extension, O(changed elements) in every worker.

Start vLLM with this class as its worker extension::

    VLLM_SERVER_DEV_MODE=1 vllm serve MODEL_DIR \\
        --worker-extension-cls deltasync.appliers.vllm.worker.DeltaSyncWorkerExtension
    deltasync follow --store s3://bucket/run1 \\
        --server http://127.0.0.1:8000 --model MODEL_DIR

or ``LLM(MODEL_DIR, worker_extension_cls="deltasync.appliers.vllm.worker.DeltaSyncWorkerExtension")``
with :class:`~deltasync.appliers.vllm.follower.VLLMFollower` in the same process.
The follower downloads and decodes once per node; the workers only read and
write the changed elements, through ``collective_rpc`` (which runs between
engine steps, so it never races a forward pass). An engine on the follower's
machine reads anchors from files the follower drops for it (:mod:`.file_drop`).

This module is thin: each RPC method unpacks its arguments (:mod:`.wire`) and
delegates to the mapping layer (:mod:`.vllm_mapping` builds the rank's index
map on ``deltasync_init``) and the apply layer (:mod:`.apply` checks a whole
payload, then writes it). Importing it installs the CPU-backend hooks
(:mod:`.cpu_hooks`), so in a worker they are in place before the model loads.

Limitations:

- Unquantized weights, held in the published dtype (bf16) or a wider float
  (written by exact up-cast), and block-fp8 weights and scales as loaded from
  an fp8 checkpoint, for a run that publishes its block-fp8 view
  (:mod:`.quantized` checks the engine's rule first). Other quantized layers,
  weights that loaders or kernels transform (scaling, repacking,
  requantizing), and causal-conv weights packed by the CPU backend are
  refused at init, by name.
- Pipeline and expert parallel are untested. MoE experts (vLLM's stacked
  ``w13_weight`` / ``w2_weight``, prepacked on CPU: :mod:`.cpu_experts`) are
  tested at TP=1 and TP=2.
- Every map is proven against the checkpoint the engine loaded before the
  first write (:mod:`.verify`); a parameter that does not prove is refused.
- Worker-side apply is O(changed elements) but a scattered write: on one CPU
  core a large fraction of a full ``load_weights`` for a sparse SmolLM2 delta
  (``benchmarks/vllm_apply.py`` times both).
- LoRA adapters are not touched (they are not checkpoint tensors).
"""

from __future__ import annotations

import base64
import logging
import time
from pathlib import Path
from typing import Any

import torch

from ...errors import DeltaSyncError
from ..apply import Patch, plan_patches, read_bits, write_patches
from ..checkpoint.files import checkpoint_reader
from ..mapping import IndexMap
from ..verify import VERIFY_SAMPLES, check_written, compare_held, pack_held, prove_map
from .cpu_experts import install_expert_hooks
from .cpu_hooks import (
    PLAIN_WEIGHTS_ENV,
    install_cpu_hooks,
    packed_layer_names,
    plain_weights,
    plain_weights_attached,
    repack_touched,
)
from .file_drop import read_dropped
from .mapping import probe_index_map, runtime_params
from .quantized import check_quantization
from .rank_decode import accelerator_of, decode_here, refusal_to_json, warm_decoder
from .wire import pack, specs_from_json, unpack

__all__ = ["DeltaSyncWorkerExtension", "PLAIN_WEIGHTS_ENV", "install_cpu_hooks"]

logger = logging.getLogger("deltasync.vllm")

_CPU_HOOK_MODE = install_cpu_hooks()  # "plain", "stash" or None; reported by deltasync_init
_EXPERT_HOOKS = install_expert_hooks()  # prepacked CPU MoE experts are tagged with their ISA


class DeltaSyncWorkerExtension:
    """Methods vLLM mixes into every worker; called through ``collective_rpc``.

    Arguments and results are strings or JSON-able dicts (see
    :mod:`deltasync.appliers.vllm.wire`), so the same calls work in process
    and through a server's ``/collective_rpc``. The follower drives them; users
    do not call them directly.
    """

    def deltasync_init(self, specs_json: str, checkpoint: str | None = None) -> dict[str, Any]:
        """Build this rank's index map for the checkpoint tensors ``specs_json`` lists, then prove it.

        ``checkpoint``: the directory the engine loaded. Before this rank's first write,
        every element it holds is read back through the map and compared with that
        checkpoint (:func:`~.verify.prove_map`); ``proof["failed"]`` names every runtime
        parameter that did not prove. After a write, the earlier proof stands (the
        engine no longer holds the checkpoint's values), reported as ``"earlier"``.
        """
        started = time.perf_counter()
        specs = specs_from_json(specs_json)
        check_quantization(getattr(getattr(self, "vllm_config", None), "quant_config", None), specs)
        model = self.get_model()  # type: ignore[attr-defined]
        params = runtime_params(model, plain_weights(model))
        with plain_weights_attached(model):
            index = probe_index_map(model, specs, params)
        self._deltasync_index = index
        # This rank may decode deltas itself: its first one should not wait for the kernels.
        warm_decoder(accelerator_of(index))
        self._deltasync_dtypes = {s.name: s.torch_dtype for s in specs}
        self._deltasync_version: int | None = getattr(self, "_deltasync_version", None)
        mapped_ms = 1e3 * (time.perf_counter() - started)
        proof: dict[str, Any] | str | None = None
        if checkpoint is not None:
            if getattr(self, "_deltasync_written", False):
                proof = "earlier"
            else:
                with checkpoint_reader(_engine_checkpoint(self, checkpoint)) as loaded, torch.no_grad():
                    proof = prove_map(index, loaded).as_dict()
        reached = {t.param_name for targets in index.targets.values() for t in targets}
        packed = packed_layer_names(model)
        if packed:
            logger.warning(
                "deltasync: %d CPU-packed layers are patched through a host copy and re-packed per apply "
                "(set %s=1 to patch them in place): %s", len(packed), PLAIN_WEIGHTS_ENV, ", ".join(packed[:8]),
            )
        return {
            "rank": _rank(self),
            "owned": index.owned(),
            "counts": index.counts(),
            "cpu_hooks": _CPU_HOOK_MODE,
            "repacked_layers": packed,
            "tables": index.table_params(),
            "layouts": index.layouts(),
            "proof": proof,
            # Runtime parameters no checkpoint element reaches: deltas could never update them.
            "unreached": sorted(set(params) - reached),
            "map_ms": mapped_ms,
            "decodes_files": True,  # it answers deltasync_apply_files (a follower checks before sending files)
            "ms": 1e3 * (time.perf_counter() - started),
        }

    def deltasync_lookup(self, payload: bytes | str) -> dict[str, Any]:
        """Current bits at the requested checkpoint indices this rank owns.

        ``payload``: ``{name: {"idx": int64}}``. Result ``data``: ``{name: {"pos": int64
        positions into idx, "bits": int16/int32}}``.
        """
        out = read_bits(_require_index(self), unpack(payload))
        return {"rank": _rank(self), "data": pack(out, text=isinstance(payload, str))}

    def deltasync_apply(
        self, payload: bytes | str, version: int | str | None = None, verify: int = VERIFY_SAMPLES
    ) -> dict[str, Any]:
        """Write ``{name: {"idx": int64, "val": bits}}`` where this rank holds it (``idx`` absent: whole tensor).

        Every entry is checked (names, bounds, sizes, dtypes) before the first write.
        Afterwards the patches are read back through the map (whole tensors fully,
        ``verify`` random positions of each sparse one; 0 skips sparse ones):
        ``wrong`` lists every tensor that reads back wrong, ``verify_ms`` the cost.
        """
        started = time.perf_counter()
        return self._deltasync_write(plan_patches(_require_index(self), unpack(payload)), version, verify, started)

    def deltasync_apply_files(
        self, files: list[bytes | str | dict[str, Any]], kind: str, version: int | str | None = None,
        verify: int = VERIFY_SAMPLES,
    ) -> dict[str, Any]:
        """Decode the files of one version here, against this rank's own weights, then write as
        :meth:`deltasync_apply` does (a delta: for an engine whose one rank holds every element; an
        anchor: on every rank, each writing what it holds).

        ``files``: the files themselves, or references to files the follower dropped on this machine
        (:func:`~.file_drop.read_dropped`). Nothing is written unless every file decodes exactly and every
        tensor's values match the publisher's digest; a refusal comes back as ``refused``
        (:func:`~.rank_decode.refusal_to_json`). A dropped file this rank cannot read, or that is not
        the follower's, comes back as ``unreadable``: the version is not at fault.
        """
        started = time.perf_counter()
        index = _require_index(self)
        try:
            dropped = [read_dropped(f) if isinstance(f, dict) else f for f in files]
        except (OSError, DeltaSyncError) as exc:
            return {"rank": _rank(self), "unreadable": f"{type(exc).__name__}: {exc}"}
        try:  # every check before the first write
            blobs = [base64.b64decode(f) if isinstance(f, str) else f for f in dropped]
            patches = decode_here(index, blobs, whole=kind == "anchor")
        except DeltaSyncError as exc:
            return {"rank": _rank(self), "refused": refusal_to_json(exc)}
        decoded_ms = 1e3 * (time.perf_counter() - started)
        return self._deltasync_write(patches, version, verify, started) | {"decode_ms": decoded_ms}

    def deltasync_read_dropped(self, ref: dict[str, Any]) -> dict[str, Any]:
        """Whether this rank reads a file the follower dropped (:func:`~.file_drop.read_dropped`): ``ok``,
        else ``why``."""
        try:
            read_dropped(ref).release()
        except (OSError, DeltaSyncError) as exc:
            return {"rank": _rank(self), "ok": False, "why": f"{type(exc).__name__}: {exc}"}
        return {"rank": _rank(self), "ok": True}

    def _deltasync_write(
        self, patches: list[Patch], version: int | str | None, verify: int, started: float
    ) -> dict[str, Any]:
        """Write checked ``patches``, re-pack what they touched and read them back (both applies end here)."""
        index = _require_index(self)
        with torch.no_grad():
            self._deltasync_written = True
            written, touched = write_patches(index, patches)
            repacked = repack_touched(touched)
            checked_at = time.perf_counter()
            checked, wrong = check_written(index, patches, samples=int(verify), seed=int(version or 0))
        if version is not None and not wrong:
            self._deltasync_version = int(version)
        return {
            "rank": _rank(self),
            "written": written,
            "repacked": repacked,
            "verified": checked,
            "wrong": wrong,
            "verify_ms": 1e3 * (time.perf_counter() - checked_at),
            "ms": 1e3 * (time.perf_counter() - started),
        }

    def deltasync_version(self) -> dict[str, Any]:
        """The deltasync version this rank last applied (``None`` before the first)."""
        return {"rank": _rank(self), "version": getattr(self, "_deltasync_version", None)}

    def deltasync_compare(self, checkpoint: str, text: bool = False) -> dict[str, Any]:
        """How the elements this rank holds compare with the safetensors checkpoint in the directory
        ``checkpoint`` on this worker's machine (:func:`~.verify.compare_held`): per tensor the directory has,
        elements read back and how many differ, and which elements were read (a bit per element,
        :func:`~.verify.pack_held`). O(numel) here; no weights go back."""
        index = _require_index(self)
        with checkpoint_reader(checkpoint) as loaded, torch.no_grad():
            counts, masks = compare_held(index, loaded)
        return {"rank": _rank(self), "tensors": counts, "held": pack_held(masks, text=text)}

    def deltasync_gather(self, name: str, text: bool = False) -> dict[str, Any]:
        """Every element of checkpoint tensor ``name`` this rank holds, read through the map (for tests).

        Result ``data``: ``{name: {"idx": int64 checkpoint indices, "bits": ...}}``. O(numel).
        """
        index = _require_index(self)
        spec = index.specs[name]
        idx = torch.arange(spec.numel, dtype=torch.int64)
        return self.deltasync_lookup(pack({name: {"idx": idx.numpy()}}, text=text)) | {"numel": spec.numel}


def _engine_checkpoint(worker: Any, given: str) -> str:
    """The checkpoint directory to prove against: ``given`` if it is one here, else the engine's own."""
    if Path(given).is_dir():
        return given
    config = getattr(getattr(worker, "vllm_config", None), "model_config", None)
    own = getattr(config, "model", None)
    if isinstance(own, str) and Path(own).is_dir():
        logger.info("deltasync: %s is not a directory on this worker; proving against the engine's %s", given, own)
        return own
    raise FileNotFoundError(
        f"deltasync: the checkpoint {given} the follower names is not on this worker, and the engine's model "
        f"{own!r} is not a local directory: pass --model the directory the engine loaded"
    )


def _require_index(worker: Any) -> IndexMap:
    index = getattr(worker, "_deltasync_index", None)
    if index is None:
        raise RuntimeError("deltasync: no index map in this worker; call deltasync_init first")
    return index


def _rank(worker: Any) -> int:
    return int(getattr(worker, "rank", 0))
