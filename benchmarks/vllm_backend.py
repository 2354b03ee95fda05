"""A training step's weights reaching a vLLM server: deltasync's backend, deltasync's follower, a full reload.

Real servers (vLLM's CPU build, ``python -m vllm.entrypoints.openai.api_server``, TP=1) and a real trainer
(fp32 masters, AdamW). The trainer first publishes one version per training step (and saves each step's
weights as a full checkpoint); then each path brings every version, one at a time, to a server of its own
that runs alone on the machine; medians over the steps:

- (a) **backend**: a server launched with ``--weight-transfer-config '{"backend": "deltasync"}'`` and
  nothing else of ours, driven through vLLM's round trip (``/start_weight_update``, ``/update_weights``,
  ``/finish_weight_update``) by :class:`~deltasync.appliers.vllm.server_follower.ServerFollower`; the
  server's rank fetches, checks and applies the version itself;
- (b) **follower**: a server launched with deltasync's worker extension, kept current by
  :class:`~deltasync.appliers.vllm.VLLMFollower` (the follower downloads and checks; the worker decodes the
  files against its weights), through ``/collective_rpc``;
- (c) **full reload**: the same version as a full bf16 checkpoint written to disk, then the server's own
  ``reload_weights`` (vLLM's ``load_weights`` path) through ``/collective_rpc``.

Per path: seconds from ``publish()`` to the server serving the version (the publish, shared by (a) and
(b): diff, encode, upload, commit; for (c), writing the checkpoint), the seconds of the update itself
(generation waits for the part of it that runs in the engine: collective RPCs run between engine steps),
and the bytes moved. Every server ends bit-exact with the trainer (the follower's read-back, and the
backend server's ``/weight_checker`` checksums against the reloaded one's).

Writes ``benchmarks/results/vllm_backend.json`` and prints a table.

    python benchmarks/vllm_backend.py                  # SmolLM2-135M, 6 steps
    python benchmarks/vllm_backend.py --model moe      # the tiny Qwen3-MoE of the tests (random weights)
"""

from __future__ import annotations

import argparse
import contextlib
import json
import logging
import os
import sys
import tempfile
import time
from collections.abc import Callable, Iterator
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
    from deltasync.errors import DeltaSyncError
    from deltasync.publish.publisher import Publisher
    from tests.vllm_helpers import Trainer, assert_engine_exact, save_checkpoint, tiny_qwen3_moe

    work = Path(tempfile.mkdtemp(prefix="vllm-backend-"))
    base = smollm2_checkpoint()
    model = base if args.model == "smollm2" else tiny_qwen3_moe(work / "moe", base)
    lr = args.lr if args.model == "smollm2" else 1e-3
    store = str(work / "run")
    trainer = Trainer(model, lr=lr)
    rows: list[dict[str, Any]] = []
    # Every version first, with its full checkpoint beside it. No catch-up spans: they follow a version's commit
    # (a server can take it before they exist), and flush() would count their writing here (see catchup.py).
    with Publisher(trainer.model, store, max_span=0) as pub:
        for step in range(args.steps + 1):
            if step:
                trainer.step()
            started = time.perf_counter()
            pub.publish(step, block=True)
            pub.flush()
            published = time.perf_counter()
            full = save_checkpoint(trainer.bf16(), model, work / f"full-{step}")
            info = pub.stats.last
            assert info is not None and pub.version == step
            rows.append({"step": step, "version": step, "kind": info.kind, "bytes": info.bytes,
                         "dense_bytes": info.dense_bytes, "publish_s": published - started,
                         "full_bytes": sum(f.stat().st_size for f in full.glob("*.safetensors")),
                         "full_write_s": time.perf_counter() - published, "full": str(full)})
    final = trainer.bf16()
    common = ["--model", str(model), "--host", "127.0.0.1", "--dtype", "bfloat16", "--gpu-memory-utilization",
              "0.15", "--max-model-len", "512", "--enforce-eager", "--seed", "0"]
    env = {**os.environ, "VLLM_SERVER_DEV_MODE": "1", "VLLM_CPU_KVCACHE_SPACE": "1"}
    env.pop("DELTASYNC_VLLM_PLAIN_WEIGHTS", None)
    reload_failed: str | None = None
    with open(work / "servers.log", "wb") as logs:
        with _server([*common, "--weight-transfer-config", '{"backend": "deltasync"}'], env, logs) as url:
            server = ServerFollower(url, store)
            server.initialise()
            for row in rows:
                row["backend_apply_s"] = _timed(lambda v=row["version"]: server.update(version=v))
            backend_checksums = _checksums(url)
        with _server([*common, "--worker-extension-cls", "deltasync.appliers.vllm.worker.DeltaSyncWorkerExtension"],
                     env, logs) as url:
            follower = VLLMFollower(url, model=model)
            with follower.subscriber(store, ack=False) as sub:
                for row in rows:
                    row["follower_apply_s"] = _timed(lambda v=row["version"]: sub.update(version=v))
            assert_engine_exact(follower, final)
            # The backend's server holds what the follower's (read back exact) does.
            assert _checksums(url) == backend_checksums
            engine = ServerEngine(url)
            try:
                for row in rows:
                    row["full_reload_s"] = _timed(lambda f=row.pop("full"): engine.rpc("reload_weights",
                                                                                    weights_path=f))
                assert _checksums(url) == backend_checksums  # and what vLLM's own reload gives
            except DeltaSyncError as exc:  # vLLM's reload path refuses this model on this build: say so
                reload_failed = str(exc)
                print(f"vLLM's own reload_weights failed on {args.model}: {exc}", flush=True)
            follower.close()
    for row in rows:
        row.pop("full", None)
        print(json.dumps(row), flush=True)
    steady = [r for r in rows if r["kind"] == "delta"]
    summary = {
        "backend": {"publish_to_serving_s": median([r["publish_s"] + r["backend_apply_s"] for r in steady]),
                    "update_s": median([r["backend_apply_s"] for r in steady]),
                    "bytes": median([r["bytes"] for r in steady])},
        "follower": {"publish_to_serving_s": median([r["publish_s"] + r["follower_apply_s"] for r in steady]),
                     "update_s": median([r["follower_apply_s"] for r in steady]),
                     "bytes": median([r["bytes"] for r in steady])},
    }
    if reload_failed is None:
        summary["full_reload"] = {
            "publish_to_serving_s": median([r["full_write_s"] + r["full_reload_s"] for r in steady]),
            "update_s": median([r["full_reload_s"] for r in steady]),
            "bytes": median([r["full_bytes"] for r in steady]),
        }
    path = write_json(f"vllm_backend{'' if args.model == 'smollm2' else '_moe'}", {
        "machine": machine(), "model": args.model, "lr": lr, "steps": rows, "medians": summary,
        "full_reload_failed": reload_failed,
    }, args.out)
    print(f"\n{args.model}: {len(steady)} training steps, medians (the anchor of the first version excluded)\n")
    print(table(
        [[name, f"{s['publish_to_serving_s']:.3f}", f"{s['update_s']:.3f}", f"{s['bytes']:,.0f}"]
         for name, s in (("(a) deltasync backend", summary["backend"]),
                         ("(b) deltasync follower + extension", summary["follower"]),
                         ("(c) full reload (reload_weights)", summary.get("full_reload")))
         if s is not None],
        ["path", "publish -> serving (s)", "update (s)", "bytes"],
    ))
    print(f"\nwrote {path}")


@contextlib.contextmanager
def _server(args: list[str], env: dict[str, str], log: Any) -> Iterator[str]:
    """A vLLM server alone on the machine for one path; yields its URL."""
    import subprocess

    from examples.grpo_delta_sync import _stop, free_port, wait_healthy

    port = free_port()
    process = subprocess.Popen([sys.executable, "-m", "vllm.entrypoints.openai.api_server", *args, "--port",
                                str(port)], env=env, stdout=log, stderr=subprocess.STDOUT)
    url = f"http://127.0.0.1:{port}"
    try:
        wait_healthy(url, process, timeout=600)
        yield url
    finally:
        _stop(process)


def _timed(fn: Callable[[], Any]) -> float:
    started = time.perf_counter()
    fn()
    return time.perf_counter() - started


def _checksums(url: str) -> dict[str, str]:
    import urllib.request

    request = urllib.request.Request(f"{url}/weight_checker", data=json.dumps({"action": "checksum"}).encode(),
                                     method="POST", headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(request, timeout=600) as response:
        return json.loads(response.read())["checksums"]


if __name__ == "__main__":
    main()
