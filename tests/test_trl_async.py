"""TRL's AsyncGRPOTrainer syncing through deltasync, against a real vLLM server launched with the backend flag alone.

A real ``trl.experimental.async_grpo.AsyncGRPOTrainer`` (SmolLM2-135M, fp32 weights, CPU) generates through
a real vLLM CPU server started with ``--weight-transfer-config '{"backend": "deltasync"}'`` and nothing else
of deltasync's, with ``weight_transfer=DeltaSyncTransfer(store, server=url)``: the trainer is built by
``examples/async_grpo.py`` (:func:`make_trainer`), so the example runs as users run it. The test proves that

- training finishes and the store holds one version per sync, the anchor first;
- the server ends with the trainer's final bf16 weights: its ``/weight_info`` label names the last version of
  this run, the store's last version is those weights bit for bit, and the server's ``/weight_checker``
  checksums of the parameters it keeps under a checkpoint tensor's name equal SHA-256 of those weights'
  bytes (on the CPU platform vLLM packs the Linear weights out of its parameters; the backend reads them
  back after each write);
- the trainer's logs carry the ``deltasync/*`` figures of each sync, and so do the logs a reporting
  integration placed ahead of the trainer's own callbacks is given.

About 90 s on 2 CPU cores (the server's start included), more when the cores are shared.

The trainer runs in this one process (plus the rollout worker TRL spawns), without accelerate's launcher:
one process is what a CPU machine runs, and TRL calls ``send_weights`` on the main process only. What
stands between the trainer and a machine without a GPU is replaced for the test only, with ``monkeypatch``
and the example's own stand-ins (:func:`use_cpu_stand_ins`): flash-attention's varlen kernel by torch
attention per segment, and the MFU metric's ``torch.cuda`` device lookup. SmolLM2's chat template is
unknown to TRL: the example gives the tokenizer a ChatML ``response_template``. The server's KV cache is
bounded by ``VLLM_CPU_KVCACHE_SPACE``.
"""

from __future__ import annotations

import importlib.util
import json
import time
import urllib.request
from pathlib import Path
from typing import Any

import pytest
import torch

from deltasync import Subscriber, TorchModuleApplier
from deltasync.appliers.vllm.rpc import ServerEngine, parse_version_label
from deltasync.protocol.keys import MANIFEST_KEY
from deltasync.protocol.manifest import Manifest
from deltasync.stores import open_store
from deltasync.tensors import published_tensors

from .vllm_helpers import PROMPTS, VLLM_TESTS, assert_checksums_hold


def _has_async_grpo() -> bool:
    """Whether TRL ships ``trl.experimental.async_grpo``, found without importing TRL."""
    spec = importlib.util.find_spec("trl")
    return spec is not None and any(
        (Path(location) / "experimental" / "async_grpo" / "__init__.py").is_file()
        for location in spec.submodule_search_locations or ()
    )


pytestmark = [
    *VLLM_TESTS,
    pytest.mark.skipif(not _has_async_grpo(), reason="needs TRL's AsyncGRPOTrainer (trl.experimental.async_grpo)"),
]
STEPS = 2


def _post(url: str, body: Any) -> Any:
    request = urllib.request.Request(url, data=json.dumps(body).encode(), method="POST",
                                     headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(request, timeout=600) as response:
        return json.loads(response.read() or b"{}")


def _checksums(url: str) -> dict[str, str]:
    return _post(f"{url}/weight_checker", {"action": "checksum"})["checksums"]


def _greedy(url: str, model: Path) -> list[Any]:
    """Greedy tokens the server generates for the test prompts."""
    body = _post(f"{url}/v1/completions", {"model": str(model), "prompt": PROMPTS, "max_tokens": 8,
                                           "temperature": 0.0, "return_token_ids": True})
    return [c.get("token_ids") or c["text"] for c in sorted(body["choices"], key=lambda c: c["index"])]


def _reporter(seen: list[dict[str, Any]]) -> Any:
    """A callback that keeps what a reporting integration is given to log."""
    from transformers import TrainerCallback

    class Reporter(TrainerCallback):  # type: ignore[misc]
        def on_log(self, args: Any, state: Any, control: Any, logs: dict[str, Any] | None = None,
                   **kwargs: Any) -> None:
            seen.append(dict(logs or {}))

    return Reporter()


def test_async_grpo_trainer_follows_the_run_through_the_backend(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from deltasync.demo.models import smollm2_checkpoint
    from examples.async_grpo import make_trainer, use_cpu_stand_ins

    from .test_vllm_backend import backend_server

    monkeypatch.setenv("TRL_EXPERIMENTAL_SILENCE", "1")
    use_cpu_stand_ins(monkeypatch.setattr)
    model = smollm2_checkpoint()
    store = str(tmp_path / "run")
    started = time.monotonic()
    with backend_server(model, tmp_path / "server.log") as url:
        trainer = make_trainer(model, store, url, tmp_path / "out", steps=STEPS, cpu=True, completion_tokens=8)
        reported: list[dict[str, Any]] = []
        # Where transformers puts the reporting integrations (wandb...): ahead of the callbacks added later.
        trainer.callback_handler.callbacks.insert(0, _reporter(reported))
        trainer.train()
        label = ServerEngine(url).weight_version()
        checksums, served = _checksums(url), _greedy(url, model)
    trained_s = time.monotonic() - started

    # Training finished; one version per sync (the one before the first step, then one per step), anchor first.
    assert trainer.state.global_step == STEPS
    transfer = trainer.weight_transfer
    assert transfer.syncs == STEPS + 1
    manifest = Manifest.from_bytes(open_store(store).get(MANIFEST_KEY))
    assert [e.version for e in manifest.versions] == list(range(STEPS + 1))
    assert manifest.versions[0].anchor and all(e.delta for e in manifest.versions[1:])
    assert parse_version_label(label, manifest.run_id) == manifest.latest == STEPS, label

    # The store's last version is the trainer's final bf16 weights, bit for bit.
    final = {n: p.detach().to(torch.bfloat16).clone() for n, p in published_tensors(trainer.model)}
    replica = {n: torch.zeros_like(t) for n, t in final.items()}
    with Subscriber(store, TorchModuleApplier(replica), ack=False) as subscriber:
        subscriber.update()
    assert all(torch.equal(replica[n].view(torch.int16), t.view(torch.int16)) for n, t in final.items())

    # The server holds them: every parameter it keeps under a checkpoint tensor's name has those bytes (the Linear
    # weights, packed for the CPU kernels, are read back by the backend after each write; tests/test_vllm_backend.py
    # compares a followed engine's packed bytes with a fresh engine's).
    assert assert_checksums_hold(checksums, final) >= 2 and all(len(tokens) == 8 for tokens in served)

    # Each sync's figures reached the trainer's logs.
    logged = [h for h in trainer.state.log_history if "deltasync/bytes" in h]
    assert len(logged) == STEPS, trainer.state.log_history
    for h in logged:
        assert 0 < h["deltasync/bytes"] < h["deltasync/dense_bytes"] and 0 < h["deltasync/sparsity"] < 1
        assert h["deltasync/apply_s"] > 0
    assert [h["deltasync/version"] for h in logged] == list(range(1, STEPS + 1))
    assert any("deltasync/anchor_bytes" in h for h in trainer.state.log_history)
    assert sum("deltasync/bytes" in logs for logs in reported) == STEPS  # and reached the integrations
    figures = [f"v{h['deltasync/version']:.0f} {h['deltasync/bytes'] / 1e6:.2f} MB, sparsity "
               f"{100 * h['deltasync/sparsity']:.2f} %, applied in {h['deltasync/apply_s']:.2f} s" for h in logged]
    print(f"AsyncGRPOTrainer, {STEPS} steps: {trained_s:.0f} s (server start included); {'; '.join(figures)}")
