"""TRL / transformers integration: the callback on a real Trainer, and GRPOTrainer through a real vLLM server.

The fast tests drive a transformers ``Trainer`` on a tiny model (no vLLM). The
slow ones train SmolLM2-135M with TRL's ``GRPOTrainer`` (vLLM server mode) on
CPU; the server is a real ``vllm.entrypoints.openai.api_server`` process that
follows the store through ``deltasync follow``. One
server serves both store backends (the follower is restarted per store).
"""

from __future__ import annotations

import importlib.util
import time
from pathlib import Path
from typing import Any

import pytest
import torch

from deltasync.appliers import TorchModuleApplier
from deltasync.protocol.manifest import MANIFEST_KEY, Manifest
from deltasync.replica.subscriber import Subscriber
from deltasync.stores import open_store

HAS_TRANSFORMERS = importlib.util.find_spec("transformers") is not None
needs_transformers = pytest.mark.skipif(
    not HAS_TRANSFORMERS, reason="transformers is not installed (pip install 'deltasync[trl]')"
)


class Tiny(torch.nn.Module):
    """A two-layer regression model with the Trainer's calling convention (kwargs in, ``{"loss"}`` out)."""

    def __init__(self, delay: float = 0.0) -> None:
        super().__init__()
        self.a = torch.nn.Linear(32, 64)
        self.b = torch.nn.Linear(64, 8)
        self.delay = delay

    def forward(self, x: torch.Tensor, labels: torch.Tensor) -> dict[str, torch.Tensor]:
        if self.delay:
            time.sleep(self.delay)  # lets the background commit of step k land before step k+1's log
        return {"loss": torch.nn.functional.mse_loss(self.b(torch.relu(self.a(x))), labels)}


def _data(n: int = 32) -> list[dict[str, torch.Tensor]]:
    g = torch.Generator().manual_seed(0)
    return [{"x": torch.randn(32, generator=g), "labels": torch.randn(8, generator=g)} for _ in range(n)]


def _trainer(model: torch.nn.Module, out: Path, *, steps: int = 3, accumulation: int = 1) -> Any:
    import transformers

    args = transformers.TrainingArguments(
        output_dir=str(out), max_steps=steps, per_device_train_batch_size=4, gradient_accumulation_steps=accumulation,
        learning_rate=1e-4, logging_steps=1, report_to="none", use_cpu=True, save_strategy="no",
        remove_unused_columns=False, disable_tqdm=True,
    )
    return transformers.Trainer(model=model, args=args, train_dataset=_data())


def _bits(t: torch.Tensor) -> torch.Tensor:
    return t.detach().to(torch.bfloat16).view(torch.int16)


@needs_transformers
class TestCallback:
    def test_anchor_then_one_version_per_optimizer_step_with_metrics(self, tmp_path: Path) -> None:
        from deltasync.integrations import DeltaSyncCallback

        torch.manual_seed(0)
        model = Tiny(delay=0.05)
        store = str(tmp_path / "run")
        callback = DeltaSyncCallback(store)
        trainer = _trainer(model, tmp_path / "out", steps=3, accumulation=2)  # 2 micro-batches per optimizer step
        callback.attach(trainer)
        assert trainer.callback_handler.callbacks[0] is callback
        trainer.train()

        anchor, *rest = callback.history
        assert (anchor.kind, anchor.version, anchor.step) == ("anchor", 0, 0)
        deltas = [i for i in rest if i.kind == "delta"]  # (the anchor policy may add anchors after deltas)
        # One version per optimizer step (not per micro-batch); a coalesced publish is covered by the next one.
        assert len(deltas) + sum(i.coalesced for i in deltas) == 3
        assert deltas[-1].step == 3 and [i.version for i in deltas] == list(range(1, len(deltas) + 1))
        manifest = Manifest.from_bytes(open_store(store).get(MANIFEST_KEY))
        assert manifest.latest == deltas[-1].version
        # Metrics reach the Trainer's logs (and log_history, which report_to integrations mirror).
        logged = [h for h in trainer.state.log_history if "deltasync/bytes" in h]
        assert logged, trainer.state.log_history
        numel = sum(p.numel() for p in model.parameters())
        assert all(h["deltasync/dense_bytes"] == 2 * numel and 0 <= h["deltasync/sparsity"] < 1 for h in logged)
        assert any("deltasync/anchor_bytes" in h for h in trainer.state.log_history)
        # The store holds the final bf16 weights exactly.
        replica = Tiny().to(torch.bfloat16)
        with Subscriber(store, TorchModuleApplier(replica), ack=False) as sub:
            sub.update()
        for mine, theirs in zip(model.parameters(), replica.parameters()):
            assert torch.equal(_bits(mine), theirs.view(torch.int16))

    def test_every_k_steps_and_final_weights(self, tmp_path: Path) -> None:
        from deltasync.integrations import DeltaSyncCallback

        model = Tiny(delay=0.02)
        callback = DeltaSyncCallback(str(tmp_path / "run"), every=2)
        trainer = _trainer(model, tmp_path / "out", steps=5)
        callback.attach(trainer)
        trainer.train()
        assert (callback.history[0].kind, callback.history[0].step) == ("anchor", 0)
        steps = [i.step for i in callback.history if i.kind == "delta"]  # (anchors may follow a delta)
        assert steps[-1] == 5  # the final weights are published whatever ``every`` says
        assert set(steps[:-1]) <= {2, 4}

    def test_on_policy_waits_for_the_replica_ack(self, tmp_path: Path) -> None:
        import transformers

        from deltasync.integrations import DeltaSyncCallback

        store = str(tmp_path / "run")
        model = Tiny()
        callback = DeltaSyncCallback(store, sync="on_policy", replicas=["r1"], wait_timeout=60)
        replica = Tiny().to(torch.bfloat16)
        seen: list[tuple[int, int | None]] = []

        class Generate(transformers.TrainerCallback):  # stands in for GRPOTrainer's sync before generation
            def on_step_end(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
                version = callback.sync()
                seen.append((version, sub.version))
                for mine, theirs in zip(model.parameters(), replica.parameters()):
                    assert torch.equal(_bits(mine), theirs.view(torch.int16))

        sub = Subscriber(store, TorchModuleApplier(replica), replica_id="r1", poll_interval=0.05, max_poll_interval=0.2)
        with sub.start():
            trainer = _trainer(model, tmp_path / "out", steps=3)
            callback.attach(trainer)
            trainer.add_callback(Generate())
            trainer.train()
        assert [v for v, _ in seen] == [1, 2, 3] and all(v == r for v, r in seen)
        logged = [h for h in trainer.state.log_history if "deltasync/wait_s" in h]
        assert logged and all(h["deltasync/replica_version"] >= 1 for h in logged)

    def test_acks_that_are_not_objects_do_not_stop_the_trainer(self, tmp_path: Path) -> None:
        """Acks are written by replicas: a list, a string, a number or a version that is not an integer is
        passed over, and the wait goes on with the acks that can be read."""
        import json

        import transformers

        from deltasync.integrations import DeltaSyncCallback

        store = str(tmp_path / "run")
        callback = DeltaSyncCallback(store, sync="on_policy", wait_timeout=5)
        state = transformers.TrainerState()
        callback.on_train_begin(None, state, None, model=Tiny())
        run_id = Manifest.from_bytes(open_store(store).get(MANIFEST_KEY)).run_id
        acks = {"list": [1, 2], "text": "r", "number": 3, "bool": {"replica": "b", "version": True, "run_id": run_id},
                "good": {"replica": "good", "version": 0, "run_id": run_id}}
        for name, body in acks.items():
            open_store(store).put(f"acks/{name}.json", json.dumps(body).encode())
        assert callback.replica_versions() == {"good": 0}
        callback.wait_for(0)
        callback.on_train_end(None, state, None)

    def test_on_policy_without_replica_times_out(self, tmp_path: Path) -> None:
        import transformers

        from deltasync.integrations import DeltaSyncCallback, ReplicaTimeout

        callback = DeltaSyncCallback(str(tmp_path / "run"), sync="on_policy", replicas=1, wait_timeout=0.3)
        state = transformers.TrainerState()
        callback.on_train_begin(None, state, None, model=Tiny())
        with pytest.raises(ReplicaTimeout, match="waited .* to reach v0.*Is the follower running"):
            callback.sync()
        callback.on_train_end(None, state, None)

    def test_async_max_staleness(self, tmp_path: Path) -> None:
        import transformers

        from deltasync.integrations import DeltaSyncCallback, ReplicaTimeout

        store = str(tmp_path / "run")
        model = Tiny()
        callback = DeltaSyncCallback(store, max_staleness=1, replicas=1, wait_timeout=0.3)
        state = transformers.TrainerState()
        callback.on_train_begin(None, state, None, model=model)
        callback.publisher.flush()
        assert callback.sync() == 0  # v0 - 1 < 0: nothing to wait for
        with torch.no_grad():
            model.a.weight.add_(1.0)
        state.global_step = 1
        callback.on_step_end(None, state, None)
        callback.publisher.flush()
        with pytest.raises(ReplicaTimeout):  # newest v1, staleness 1: a replica must hold v0 at least
            callback.sync()
        replica = Tiny().to(torch.bfloat16)
        with Subscriber(store, TorchModuleApplier(replica), replica_id="r") as sub:
            sub.update()
        assert callback.sync() == 1
        callback.on_train_end(None, state, None)

    def test_only_the_main_process_publishes(self, tmp_path: Path) -> None:
        import transformers

        from deltasync.integrations import DeltaSyncCallback

        store = tmp_path / "run"
        callback = DeltaSyncCallback(str(store), sync="on_policy")
        state = transformers.TrainerState(is_world_process_zero=False, is_local_process_zero=False)
        callback.on_train_begin(None, state, None, model=Tiny())
        state.global_step = 1
        callback.on_step_end(None, state, None)
        logs: dict[str, float] = {"loss": 1.0}
        callback.on_log(None, state, None, logs=logs)
        assert callback.sync() is None and callback.publisher is None
        callback.on_train_end(None, state, None)
        assert logs == {"loss": 1.0} and not store.exists()

    @pytest.mark.parametrize(
        "kwargs, match",
        [
            ({"every": 0}, "every must be"),
            ({"sync": "sometimes"}, "sync must be"),
            ({"sync": "on_policy", "max_staleness": 1}, "max_staleness"),
            ({"replicas": "r1"}, "replicas is"),
            ({"wait_timeout": 0}, "wait_timeout"),
        ],
    )
    def test_bad_options(self, kwargs: dict[str, Any], match: str) -> None:
        from deltasync.integrations import DeltaSyncCallback

        with pytest.raises(ValueError, match=match):
            DeltaSyncCallback("memory://x", **kwargs)


@pytest.mark.skipif(importlib.util.find_spec("trl") is None, reason="trl missing: pip install 'deltasync[trl]'")
def test_untested_trl_versions_fail_loudly(monkeypatch: pytest.MonkeyPatch) -> None:
    import trl

    from deltasync.integrations.trl import grpo_server as _trl_patch

    _trl_patch._check_trl()  # the installed, tested version passes
    monkeypatch.setattr(trl, "__version__", "9.9.9")
    match = "tested with TRL 1.16.0, not 9.9.9: pip install 'trl==1.16.0'"
    with pytest.raises(_trl_patch.TRLVersionError, match=match):
        _trl_patch._check_trl()
    monkeypatch.setenv(_trl_patch.UNTESTED_ENV, "1")
    _trl_patch._check_trl()


# ---------------------------------------------------------------------- GRPOTrainer through a real vLLM server

HAS_GRPO_STACK = all(importlib.util.find_spec(m) is not None for m in ("trl", "vllm", "datasets"))


def _example() -> Any:
    """``examples/grpo_delta_sync.py``, imported by path (the README's two commands run its functions)."""
    path = Path(__file__).resolve().parents[1] / "examples" / "grpo_delta_sync.py"
    spec = importlib.util.spec_from_file_location("grpo_delta_sync_example", path)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.fixture(scope="module")
def grpo_server(tmp_path_factory: pytest.TempPathFactory) -> Any:
    """One vLLM server (module form, plain CPU weights, deltasync worker extension) shared by both backends."""
    from deltasync.demo.models import smollm2_checkpoint

    example = _example()
    model = smollm2_checkpoint()
    logs = tmp_path_factory.mktemp("grpo-logs")
    with open(logs / "server.log", "wb") as log, example.start_server(model, example.free_port(), log=log) as url:
        yield example, model, url, logs


@pytest.mark.slow
@pytest.mark.skipif(not HAS_GRPO_STACK, reason="needs trl, vllm and datasets (pip install 'deltasync[trl,vllm]')")
class TestGRPOServerMode:
    @pytest.mark.parametrize("backend", ["local", "s3"])
    def test_grpo_trains_through_the_store_exactly_without_nccl(
        self, backend: str, grpo_server: Any, servers: dict[str, Any], tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
    ) -> None:
        import trl.generation.vllm_client as vllm_client

        from deltasync.appliers.vllm.file_drop import DROP_PREFIX, drop_parent
        from deltasync.appliers.vllm.follower import VLLMFollower
        from deltasync.integrations import DeltaSyncCallback
        from tests.vllm_helpers import assert_engine_exact

        example, model_dir, url, logs = grpo_server
        calls: list[Any] = []
        monkeypatch.setattr(vllm_client.VLLMClient, "init_communicator", lambda *a, **k: calls.append(a))
        if backend == "local":
            store, options, env = str(tmp_path / "run"), {}, {}
            # The trainer watches the server it generates from (its /weight_info label).
            callback = DeltaSyncCallback(store, sync="on_policy", wait_timeout=180)
        else:
            s3 = servers["get"]("s3")
            store, options = s3.store_url(f"grpo-{time.monotonic_ns()}"), s3.store_options()
            env = {"AWS_ENDPOINT_URL": s3.endpoint, "AWS_ACCESS_KEY_ID": s3.access_key_id,
                   "AWS_SECRET_ACCESS_KEY": s3.secret_access_key, "AWS_REGION": s3.region, "AWS_ALLOW_HTTP": "true"}
            # The server's label still says where the previous test left it: wait on this run's acks instead.
            callback = DeltaSyncCallback(store, sync="on_policy", replicas=["replica-s3"], wait_timeout=180, **options)
        with open(logs / f"follower-{backend}.log", "wb") as log, example.start_follower(
            store, url, model_dir, replica_id=f"replica-{backend}", env=env, log=log
        ) as follower_process:
            trainer = example.make_trainer(model_dir, url, callback, tmp_path / "out", steps=3)
            started = time.perf_counter()
            trainer.train()
            elapsed = time.perf_counter() - started
            assert follower_process.poll() is None, (logs / f"follower-{backend}.log").read_text()[-3000:]
            final = callback.version
            assert final is not None and final >= 3
            callback.wait_for(final, timeout=120)  # the last version is applied too (no generation waited for it)
        # The server runs on this machine: the anchor reached its worker as a dropped file, not as base64
        # text, and the stopped follower left nothing in the drop.
        follower_log = (logs / f"follower-{backend}.log").read_text()
        assert "anchors go to the engine's workers as files in" in follower_log, follower_log[-3000:]
        assert not list(drop_parent().glob(f"{DROP_PREFIX}{follower_process.pid}-*"))

        # No NCCL: the communicator was never opened and no process group exists.
        assert calls == [] and trainer.vllm_generation.vllm_client.communicator is None
        assert not torch.distributed.is_available() or not torch.distributed.is_initialized()
        # One anchor, then one sparse version per optimizer step, far below dense.
        deltas = [i for i in callback.history if i.kind == "delta"]
        assert callback.history[0].kind == "anchor" and len(deltas) + sum(i.coalesced for i in deltas) == 3
        for info in deltas:
            assert info.bytes < 0.05 * info.dense_bytes and info.sparsity > 0.95
        logged = [h["deltasync/bytes"] for h in trainer.state.log_history if "deltasync/bytes" in h]
        assert logged and all(b < 0.05 * deltas[0].dense_bytes for b in logged)
        print(
            f"\n[{backend}] {elapsed:.1f} s for 3 GRPO steps; bytes/version {[i.bytes for i in deltas]} vs dense "
            f"{deltas[0].dense_bytes}; sparsity {[round(100 * i.sparsity, 2) for i in deltas]} %; "
            f"waited {[h.get('deltasync/wait_s') for h in trainer.state.log_history if 'deltasync/wait_s' in h]} s"
        )
        # The server's weights equal the trainer's bf16 cast bit for bit, read back through the index map.
        reader = VLLMFollower(url, model=model_dir)
        assert reader.engine_version() == final
        assert_engine_exact(reader, {n: p.detach().to(torch.bfloat16) for n, p in trainer.model.named_parameters()})


def test_server_version_labels_are_tied_to_the_run() -> None:
    from deltasync.appliers.vllm.follower import parse_version_label, version_label

    run = "3f1d2c4b5a6e7788"
    assert version_label(7, run) == "7@3f1d2c4b5a6e" and version_label(7, None) == "7"
    assert parse_version_label(version_label(7, run), run) == 7
    assert parse_version_label(version_label(7, "another-run-0000"), run) is None
    assert parse_version_label("7", run) == 7  # a label without a run id is taken as it is
    assert parse_version_label("default", run) is None and parse_version_label(None, run) is None


@pytest.mark.parametrize(
    "body",
    [b"[1, 2]", b'"7"', b"7", b"[" * 100_000 + b"]" * 100_000, b'{"weight_version": "' + b"9" * (2 << 20) + b'"}',
     b'{"weight_version": ["7"]}', b"not json"],
    ids=["list", "text", "number", "deep", "huge", "label-not-text", "not-json"],
)
def test_a_server_answer_that_is_not_a_version_reads_as_none(body: bytes) -> None:
    """The trainer waits on what a server's /weight_info says; an answer of another shape reads as "no version
    yet" (the wait goes on, then times out with its hint), never as an error in the training step."""
    from deltasync.integrations.trl.callback import _server_version
    from tests.http_helpers import answering

    with answering(body) as url:
        assert _server_version(url, "3f1d2c4b5a6e7788") is None


@needs_transformers
def test_resume_from_checkpoint_publishes_the_restored_weights(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    """A trainer that saved at step 2 got to step 4; a new one resumes from checkpoint-2 (with takeover=True,
    as after a crash): its first version is an anchor of step 2's weights, and a replica ends exact."""
    import logging

    import transformers

    from deltasync import Subscriber, last_committed
    from deltasync.integrations import DeltaSyncCallback

    store = str(tmp_path / "run")

    def make(model: torch.nn.Module, steps: int) -> Any:
        args = transformers.TrainingArguments(
            output_dir=str(tmp_path / "out"), max_steps=steps, per_device_train_batch_size=4, learning_rate=1e-3,
            report_to="none", use_cpu=True, save_strategy="steps", save_steps=2, remove_unused_columns=False,
            disable_tqdm=True, lr_scheduler_type="constant",
        )
        return transformers.Trainer(model=model, args=args, train_dataset=_data())

    torch.manual_seed(0)
    first = make(Tiny(), 4)
    DeltaSyncCallback(store).attach(first)
    first.train()
    assert last_committed(store).step == 4  # it got to step 4; the run is resumed from its step-2 checkpoint

    torch.manual_seed(1)
    model = Tiny()
    second = make(model, 6)
    resumed = DeltaSyncCallback(store, takeover=True).attach(second)
    with caplog.at_level(logging.INFO, logger="deltasync.trl"):
        second.train(resume_from_checkpoint=str(tmp_path / "out" / "checkpoint-2"))
    assert "resuming at step 2" in caplog.text and "go back 2 steps" in caplog.text
    assert resumed.history[0].kind == "anchor" and resumed.history[0].step == 2
    assert last_committed(store).step == 6
    replica = Tiny()
    Subscriber(store, TorchModuleApplier(replica)).update()
    for name, param in model.named_parameters():
        assert torch.equal(_bits(param), _bits(replica.get_parameter(name))), name
