"""Real ``accelerate launch`` runs of TRL's GRPOTrainer (DeepSpeed ZeRO-3, FSDP2, and a LoRA model under ZeRO-3),
followed by a vLLM server replica.

Two trainer processes (on CPU, gloo) train SmolLM2-135M with GRPO, generating
through a vLLM server (module form, deltasync worker extension) that a
deltasync follower keeps current from a local store. Under ZeRO-3 (DeepSpeed
0.19) every rank publishes the flat parameter slices it holds; under FSDP2 (the
model loaded already sharded by transformers' ``DistributedConfig``, since
accelerate's own FSDP plugin shards only on accelerators) every rank publishes
the rows it holds. Nothing is gathered for the sync, except for the LoRA
model, whose merged weights every rank gathers for (the main process
publishes them under the base model's names). At the end the server's
weights, read back through its index map, equal the trainer's final weights
(gathered once, for the check) bit for bit, and the run's logs carry
deltasync's metrics.
"""

from __future__ import annotations

import importlib.util
import os
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

pytestmark = [
    pytest.mark.slow,
    pytest.mark.skipif(
        not all(importlib.util.find_spec(m) is not None for m in ("trl", "vllm", "datasets", "deepspeed", "accelerate")),
        reason="needs trl, vllm, datasets, deepspeed and accelerate",
    ),
]

ROOT = Path(__file__).resolve().parents[1]


LAUNCHES = {  # config file -> how accelerate runs the processes, and how their parameters are laid out
    "zero3": ("DistributedType.DEEPSPEED", "zero3"),
    "fsdp2": ("DistributedType.MULTI_CPU", "fsdp2"),
}


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    """One vLLM server (worker extension) for every launch: each run's follower brings it to that run's weights,
    from the run's first anchor."""
    from deltasync.demo.models import smollm2_checkpoint
    from tests.test_trl import _example

    example = _example()
    log = tmp_path_factory.mktemp("accelerate-server") / "server.log"
    with open(log, "wb") as out, example.start_server(smollm2_checkpoint(), example.free_port(), log=out) as url:
        yield url


# ZeRO-3's own slices are published on a real engine by tests/test_sharded.py; a launch here runs the LoRA model
# under ZeRO-3 (the harder path: gathered merged weights) and FSDP2.
@pytest.mark.parametrize(("config", "extra"), [("fsdp2", []), ("zero3", ["--lora-rank", "8"])],
                         ids=["fsdp2", "zero3-lora"])
def test_grpo_under_accelerate_launch_reaches_the_server_exactly(
    tmp_path: Path, server: str, config: str, extra: list[str]
) -> None:
    import safetensors.torch

    from deltasync.appliers.vllm.follower import VLLMFollower, checkpoint_specs
    from deltasync.demo.models import smollm2_checkpoint
    from tests.test_trl import _example
    from tests.vllm_helpers import assert_engine_exact

    example = _example()
    model_dir = smollm2_checkpoint()
    store, final = str(tmp_path / "run"), tmp_path / "final.safetensors"
    env = {**os.environ, "DS_ACCELERATOR": "cpu", "PYTHONPATH": str(ROOT)}
    url = server
    with (
        open(tmp_path / "follower.log", "wb") as log,
        example.start_follower(store, url, model_dir, replica_id="replica-0", log=log) as follower,
    ):
        launch = subprocess.run(
            [sys.executable, "-m", "accelerate.commands.launch", "--config_file",
             str(ROOT / "examples" / "accelerate" / f"{config}.yaml"), str(ROOT / "examples" / "grpo_delta_sync.py"),
             "train", "--store", store, "--server", url, "--steps", "2", "--model", str(model_dir),
             "--output-dir", str(tmp_path / "out"), "--save-final", str(final), *extra],
            env=env, cwd=tmp_path, capture_output=True, text=True, timeout=900,
        )
        output = launch.stdout + launch.stderr
        (tmp_path / "launch.log").write_text(output)
        assert launch.returncode == 0, output[-6000:]
        assert follower.poll() is None, (tmp_path / "follower.log").read_text()[-3000:]
        launched, sharding = LAUNCHES[config]
        assert f"training with 2 process(es), {launched}" in output, output[-3000:]
        assert f"trained {sharding} parameters" in output, output[-3000:]
        reader = VLLMFollower(url, model=model_dir)
        _wait_for_last_version(reader, store)
        names = {s.name for s in checkpoint_specs(model_dir)}
        weights = {n: t for n, t in safetensors.torch.load_file(str(final)).items() if n in names}
        assert set(weights) == names
        assert_engine_exact(reader, weights)
    # One object per rank per version: the ranks published their own slices. A LoRA model's merged
    # weights need whole factors and rows: the ranks gathered and the main process published them whole.
    from deltasync.protocol.keys import MANIFEST_KEY
    from deltasync.protocol.manifest import Manifest
    from deltasync.stores import open_store

    manifest = Manifest.from_bytes(open_store(store).get(MANIFEST_KEY))
    ranks = {None} if "--lora-rank" in extra else {0, 1}
    assert all({r.rank for r in e.objects()} == ranks for e in manifest.versions)
    assert "deltasync/bytes" in output


def _wait_for_last_version(reader: Any, store: str, timeout: float = 120.0) -> None:
    import time

    from deltasync.protocol.keys import MANIFEST_KEY
    from deltasync.protocol.manifest import Manifest
    from deltasync.stores import open_store

    latest = Manifest.from_bytes(open_store(store).get(MANIFEST_KEY)).latest
    deadline = time.monotonic() + timeout
    while reader.engine_version() != latest:
        assert time.monotonic() < deadline, f"the server did not reach v{latest}"
        time.sleep(0.5)
