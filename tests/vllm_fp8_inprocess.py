"""vLLM's own block-fp8 loading, run in this process on CPU tensors, followed by deltasync's worker extension.

    python tests/vllm_fp8_inprocess.py REQUEST.json     # prints one JSON line: what happened

vLLM 0.32's CPU build has block-fp8 GEMMs only for AMX machines, and those repack the weights for their
kernel; on GPUs the CUTLASS block kernel keeps the checkpoint's bytes. This script builds the model with
vLLM's real config, loaders and post-processing (``initialize_model``, ``load_weights``,
``process_weights_after_loading``), choosing either vLLM's own CPU kernel (``"kernel": "native"``) or a
reference block-fp8 GEMM that, like CUTLASS's, leaves the loaded bytes as they are (``"reference"``).
The deltasync worker extension then maps and proves the model's parameters, applies the run's versions
(``deltasync_apply_files``, as a follower sends them), and reads every tensor back through the map; at
the end every runtime parameter is compared with a fresh model loaded from the last version's reference
checkpoint. It runs in a process of its own because vLLM's distributed state is process-wide.

The request: ``model`` (the checkpoint the engine loads), ``store`` (a local run prefix), ``kernel``,
``expected`` (per version, per tensor, the SHA-256 of the reference's bytes) and ``fresh`` (the last
version's reference checkpoint). A tensor-parallel rank (``tp`` > 1, ``rank``, ``init`` a file for the
ranks' rendezvous; one process per rank) writes each version's anchor, as the worker extension does on
every rank, and answers ``compared``: per version its :func:`~deltasync.appliers.verify.compare_held`
against ``checkpoints[version]``, for the caller to merge across ranks.
"""

from __future__ import annotations

import hashlib
import json
import sys
import tempfile
from pathlib import Path
from typing import Any

import torch


def _reference_kernel() -> None:
    """Put a reference block-fp8 GEMM first among vLLM's CPU kernels, and the MoE backend whose weight
    conversion leaves the experts as loaded (as on an H100 at expert-parallel size 1)."""
    import vllm.model_executor.kernels.linear as kernels
    import vllm.model_executor.layers.quantization.fp8 as fp8
    from vllm.model_executor.kernels.linear.scaled_mm.BlockScaledMMLinearKernel import Fp8BlockScaledMMLinearKernel
    from vllm.model_executor.layers.fused_moe.oracle.fp8 import Fp8MoeBackend, backend_to_kernel_cls
    from vllm.platforms import PlatformEnum

    class ReferenceBlockFp8(Fp8BlockScaledMMLinearKernel):
        apply_input_quant = False

        @classmethod
        def is_supported(cls, compute_capability: int | None = None) -> tuple[bool, str | None]:
            return True, None

        def apply_block_scaled_mm(self, A: Any, B: Any, As: Any, Bs: Any) -> Any:
            rows, cols = self.weight_group_shape.row, self.weight_group_shape.col
            scales = Bs.repeat_interleave(rows, 0)[: B.shape[0]].repeat_interleave(cols, 1)[:, : B.shape[1]]
            return A.float() @ (B.float() * scales).t()

    kernels._POSSIBLE_FP8_BLOCK_KERNELS[PlatformEnum.CPU].insert(0, ReferenceBlockFp8)
    fp8.select_fp8_moe_backend = lambda **_: (Fp8MoeBackend.TRITON, backend_to_kernel_cls(Fp8MoeBackend.TRITON)[0])


def _build(path: str) -> tuple[Any, Any]:
    from safetensors.torch import load_file
    from vllm.config import ModelConfig, VllmConfig, set_current_vllm_config
    from vllm.model_executor.model_loader.utils import initialize_model, process_weights_after_loading
    from vllm.utils.torch_utils import set_default_torch_dtype

    config = VllmConfig(model_config=ModelConfig(model=path, dtype="bfloat16", enforce_eager=True))
    with set_current_vllm_config(config):
        with set_default_torch_dtype(torch.bfloat16), torch.device("cpu"):
            model = initialize_model(vllm_config=config)
        weights = {}
        for file in sorted(Path(path).glob("*.safetensors")):
            weights.update(load_file(file))
        model.load_weights(iter(weights.items()))
        process_weights_after_loading(model, config.model_config, torch.device("cpu"))
    return model, config


def _digest(tensor: torch.Tensor) -> str:
    return hashlib.sha256(tensor.detach().contiguous().view(-1).view(torch.uint8).numpy()).hexdigest()


def main(request: dict[str, Any]) -> dict[str, Any]:
    from vllm.config import set_current_vllm_config
    from vllm.distributed import init_distributed_environment, initialize_model_parallel

    from deltasync.appliers.checkpoint.files import checkpoint_specs

    # Imported before any model is built, as in a vLLM worker: its CPU hooks keep plain copies of packed weights.
    from deltasync.appliers.vllm.wire import specs_to_json, unpack
    from deltasync.appliers.vllm.worker import DeltaSyncWorkerExtension
    from deltasync.errors import DeltaSyncError
    from deltasync.protocol.manifest import Manifest

    if request["kernel"] == "reference":
        _reference_kernel()
    from vllm.config import ModelConfig, VllmConfig

    tp, rank = int(request.get("tp", 1)), int(request.get("rank", 0))
    init = request.get("init") or tempfile.mktemp()
    with set_current_vllm_config(VllmConfig(model_config=ModelConfig(model=request["model"], dtype="bfloat16"))):
        init_distributed_environment(tp, rank, f"file://{init}", rank, backend="gloo")
        initialize_model_parallel(tp, 1)
    try:
        model, config = _build(request["model"])
    except RuntimeError as exc:  # no fp8 kernel for this CPU (vLLM refuses at layer creation)
        return {"unbuildable": str(exc)}

    class Worker(DeltaSyncWorkerExtension):
        vllm_config = config

        def __init__(self) -> None:
            self.rank = rank

        def get_model(self) -> Any:
            return model

    worker = Worker()
    specs = checkpoint_specs(request["model"])
    out: dict[str, Any] = {"runtime": {n: [list(p.shape), str(p.dtype)] for n, p in model.named_parameters()
                                      if ".layers.0." in n}}
    try:
        init = worker.deltasync_init(specs_to_json(specs), request["model"])
    except DeltaSyncError as exc:
        return out | {"refused": {"error": type(exc).__name__, "message": str(exc), "name": getattr(exc, "name", None)}}
    out |= {"proof": init["proof"], "layouts": init["layouts"], "unreached": init["unreached"]}
    if init["proof"]["failed"]:
        return out
    store = Path(request["store"])
    manifest = Manifest.from_bytes((store / "manifest.json").read_bytes())
    if request.get("path") == "backend":
        return {"compared": _through_the_backend(model, config, manifest, request)} | _against_fresh(model, request)
    if tp > 1:
        compared = _anchors_on_this_rank(worker, store, manifest, request)
        return out | {"compared": compared} | _against_fresh(model, request)
    reached = {}
    for entry in sorted(manifest.versions, key=lambda e: e.version):
        if entry.version == 0:
            continue  # the checkpoint the engine loaded
        files = [(store / ref.key).read_bytes() for ref in entry.delta]
        applied = worker.deltasync_apply_files(files, "delta", entry.version, verify=1 << 20)
        if applied.get("refused") or applied["wrong"]:
            return out | {"apply": applied}
        got = {}
        for spec in specs:
            data = unpack(worker.deltasync_gather(spec.name)["data"])[spec.name]
            bits = torch.from_numpy(data["bits"].copy())
            got[spec.name] = _digest(bits[torch.from_numpy(data["pos"].copy()).argsort()])
        reached[str(entry.version)] = got == request["expected"][str(entry.version)] or sorted(
            n for n in got if got[n] != request["expected"][str(entry.version)][n])
    out["reached"] = reached
    return out | _against_fresh(model, request)


def _through_the_backend(model: Any, config: Any, manifest: Any, request: dict[str, Any]) -> dict[str, Any]:
    """The ``deltasync`` weight-transfer backend as vLLM builds it in a worker, driven as ``/update_weights`` drives
    it: initialised at the version the engine loaded, then told each version; after each, what this rank holds
    compared with that version's checkpoint."""
    from vllm.config.weight_transfer import WeightTransferConfig

    from deltasync.appliers.checkpoint.files import checkpoint_reader
    from deltasync.appliers.verify import compare_held
    from deltasync.appliers.vllm.backend import DeltaSyncWeightTransferEngine

    engine = DeltaSyncWeightTransferEngine(
        WeightTransferConfig(backend="deltasync"), config, torch.device("cpu"), model
    )
    engine.init_transfer_engine(engine.parse_init_info({
        "store": request["store"], "checkpoint": request["model"], "start_version": 0, "run_id": manifest.run_id,
    }))
    compared = {}
    for version in sorted(request["checkpoints"], key=int):
        engine.receive_weights(engine.parse_update_info({"version": int(version)}))
        with checkpoint_reader(request["checkpoints"][version]) as loaded, torch.no_grad():
            counts, _ = compare_held(engine.replica.index, loaded)
        compared[version] = counts
    engine.subscriber.close()
    return compared


def _anchors_on_this_rank(worker: Any, store: Path, manifest: Any, request: dict[str, Any]) -> dict[str, Any]:
    """Each later version's anchor written by this rank, then what it holds compared with that version's checkpoint."""
    compared = {}
    for entry in sorted(manifest.versions, key=lambda e: e.version):
        if entry.version == 0 or not entry.anchor:
            continue
        files = [(store / ref.key).read_bytes() for ref in entry.anchor]
        applied = worker.deltasync_apply_files(files, "anchor", entry.version, verify=1 << 20)
        if applied.get("refused") or applied["wrong"]:
            return {"apply": applied}
        compared[str(entry.version)] = worker.deltasync_compare(request["checkpoints"][str(entry.version)], text=True)
    return compared


def _against_fresh(model: Any, request: dict[str, Any]) -> dict[str, Any]:
    """Every runtime parameter of this rank against a fresh model's loaded from the last version's checkpoint."""
    fresh, _ = _build(request["fresh"])
    fresh_params = dict(fresh.named_parameters())
    differs = sorted(n for n, p in model.named_parameters() if _digest(p) != _digest(fresh_params[n]))
    return {"runtime_differs": differs, "runtime_compared": len(fresh_params)}


if __name__ == "__main__":
    print(json.dumps(main(json.loads(Path(sys.argv[1]).read_text()))), flush=True)
