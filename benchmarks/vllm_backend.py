"""A training step's weights reaching a vLLM server: deltasync's backend, deltasync's follower, a full reload.

Real servers (vLLM's CPU build, ``python -m vllm.entrypoints.openai.api_server``, TP=1) and a real trainer
(fp32 masters, AdamW). For each training step the trainer publishes one version, and three paths bring
that version to a server, one after another, medians over the steps:

- (a) **backend**: a server launched with ``--weight-transfer-config '{"backend": "deltasync"}'`` and
  nothing else of ours, driven through vLLM's round trip (``/start_weight_update``, ``/update_weights``,
  ``/finish_weight_update``) by :class:`~deltasync.appliers.vllm.server_follower.ServerFollower`; the
  server's rank fetches, checks and applies the version itself;
- (b) **follower**: a server launched with deltasync's worker extension, kept current by
  :class:`~deltasync.appliers.vllm.VLLMFollower` (the follower downloads and checks; the worker decodes the
  files against its weights), through ``/collective_rpc``;
- (c) **full reload**: the same version as a full bf16 checkpoint written to disk, then the server's own
  ``reload_weights`` (vLLM's ``load_weights`` path) through ``/collective_rpc``.

Per path: seconds from ``publish()`` to the server serving the version (the publish is shared by (a) and
(b): diff, encode, upload, commit; (c)'s is the checkpoint write), the seconds the engine spent in the
update (generation waits for them: collective RPCs run between engine steps), and the bytes moved.
Both servers end bit-exact with the trainer (checked at the end through the follower's read-back).

Writes ``benchmarks/results/vllm_backend.json`` and prints a table.

    python benchmarks/vllm_backend.py                  # SmolLM2-135M, 6 steps
    python benchmarks/vllm_backend.py --model moe      # the tiny Qwen3-MoE of the tests (random weights)
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT.parent))  # the servers' workers import tests.vllm_helpers by name

from _common import machine, median, table, write_json  # noqa: E402


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--steps", type=int, default=6)
    parser.add_argument("--lr", type=float, default=3e-6)
    parser.add_argument("--model", choices=["smollm2", "moe"], default="smollm2")
    parser.add_argument("--out", default=None, help="results directory (default benchmarks/results)")
    args = parser.parse_args()
    logging.basicConfig(level=logging.WARNING)


    from deltasync.appliers.vllm.follower import VLLMFollower
    from deltasync.appliers.vllm.rpc import ServerEngine
    from deltasync.appliers.vllm.server_follower import ServerFollower
    from deltasync.demo.models import smollm2_checkpoint
    from deltasync.publish.publisher import Publisher
    from examples.grpo_delta_sync import _stop, free_port, wait_healthy
    from tests.vllm_helpers import Trainer, assert_engine_exact, save_checkpoint, tiny_qwen3_moe

    work = Path(tempfile.mkdtemp(prefix="vllm-backend-"))
    base = smollm2_checkpoint()
    model = base if args.model == "smollm2" else tiny_qwen3_moe(work / "moe", base)
    lr = args.lr if args.model == "smollm2" else 1e-3
    store = str(work / "run")
    trainer = Trainer(model, lr=lr)
    common = ["--model", str(model), "--host", "127.0.0.1", "--dtype", "bfloat16", "--gpu-memory-utilization",
              "0.15", "--max-model-len", "512", "--enforce-eager", "--seed", "0"]
    env = {**os.environ, "VLLM_SERVER_DEV_MODE": "1", "VLLM_CPU_KVCACHE_SPACE": "1"}
    env.pop("DELTASYNC_VLLM_PLAIN_WEIGHTS", None)
    ports = free_port(), free_port()
    logs = open(work / "servers.log", "wb")  # noqa: SIM115 - closed at the end
    backend = _start([*common, "--port", str(ports[0]), "--weight-transfer-config", '{"backend": "deltasync"}'],
                     env, logs)
    extension = _start([*common, "--port", str(ports[1]), "--worker-extension-cls",
                        "deltasync.appliers.vllm.worker.DeltaSyncWorkerExtension"], env, logs)
    urls = [f"http://127.0.0.1:{p}" for p in ports]
    rows: list[dict[str, Any]] = []
    try:
        for url, process in zip(urls, (backend, extension)):
            wait_healthy(url, process, timeout=600)
        server = ServerFollower(urls[0], store)
        follower = VLLMFollower(urls[1], model=model)
        sub = follower.subscriber(store, ack=False)
        engine = ServerEngine(urls[1])
        with Publisher(trainer.model, store) as pub:
            for step in range(args.steps + 1):
                if step:
                    trainer.step()
                started = time.perf_counter()
                pub.publish(step, block=True)
                pub.flush()
                published = time.perf_counter()
                a = server.update()
                a_done = time.perf_counter()
                b = sub.update()
                b_done = time.perf_counter()
                full = save_checkpoint(trainer.bf16(), model, work / f"full-{step}")
                written = time.perf_counter()
                engine.rpc("reload_weights", weights_path=str(full))
                reloaded = time.perf_counter()
                assert a is not None and b is not None and a.version == b.version == pub.version
                info = pub.stats.last
                assert info is not None
                rows.append({
                    "step": step, "version": pub.version, "kind": info.kind, "bytes": info.bytes,
                    "dense_bytes": info.dense_bytes,
                    "full_bytes": sum(f.stat().st_size for f in full.glob("*.safetensors")),
                    "publish_s": published - started,
                    "backend_apply_s": a_done - published, "follower_apply_s": b_done - a_done,
                    "full_write_s": written - b_done, "full_reload_s": reloaded - written,
                })
                print(json.dumps(rows[-1]), flush=True)
        weights = trainer.bf16()
        assert_engine_exact(follower, weights)
        follower.close()
        sub.close()
    finally:
        for process in (backend, extension):
            _stop(process)
        logs.close()
    steady = [r for r in rows if r["kind"] == "delta"]
    summary = {
        "backend": {"publish_to_serving_s": median([r["publish_s"] + r["backend_apply_s"] for r in steady]),
                    "engine_s": median([r["backend_apply_s"] for r in steady]),
                    "bytes": median([r["bytes"] for r in steady])},
        "follower": {"publish_to_serving_s": median([r["publish_s"] + r["follower_apply_s"] for r in steady]),
                     "engine_s": median([r["follower_apply_s"] for r in steady]),
                     "bytes": median([r["bytes"] for r in steady])},
        "full_reload": {"publish_to_serving_s": median([r["full_write_s"] + r["full_reload_s"] for r in steady]),
                        "engine_s": median([r["full_reload_s"] for r in steady]),
                        "bytes": median([r["full_bytes"] for r in steady])},
    }
    path = write_json(f"vllm_backend{'' if args.model == 'smollm2' else '_moe'}", {
        "machine": machine(), "model": args.model, "lr": lr, "steps": rows, "medians": summary,
    }, args.out)
    print(f"\n{args.model}: {len(steady)} training steps, medians (the anchor of the first version excluded)\n")
    print(table(
        [[name, f"{s['publish_to_serving_s']:.3f}", f"{s['engine_s']:.3f}", f"{s['bytes']:,.0f}"]
         for name, s in (("(a) deltasync backend", summary["backend"]),
                         ("(b) deltasync follower + extension", summary["follower"]),
                         ("(c) full reload (reload_weights)", summary["full_reload"]))],
        ["path", "publish -> serving (s)", "engine busy (s)", "bytes"],
    ))
    print(f"\nwrote {path}")


def _start(args: list[str], env: dict[str, str], log: Any) -> Any:
    import subprocess

    return subprocess.Popen([sys.executable, "-m", "vllm.entrypoints.openai.api_server", *args], env=env,
                            stdout=log, stderr=subprocess.STDOUT)


if __name__ == "__main__":
    main()
