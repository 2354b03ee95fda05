"""Processes for the crash test: a trainer that publishes every step, and a replica that records what it applies.

Weights are a pure function of the step (``weights(step)``), so whoever checks
can recompute the weights any published step must carry, and a restart "from
a checkpoint" at step ``s`` is ``weights(s)``. Run as::

    python -m tests.crash_helpers trainer STORE OPTIONS_JSON START STEPS PROGRESS_FILE
    python -m tests.crash_helpers replica STORE OPTIONS_JSON LOG_FILE STOP_FILE
"""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path
from typing import Any

import torch

SHAPES = {"embed.weight": (1024, 512), "layers.0.weight": (512, 512), "layers.1.weight": (512, 1024), "head.bias": (1024,)}
PUBLISH_OPTIONS = {"part_bytes": 96 * 1024, "anchor_every": 4, "lease_s": 600.0}


def weights(step: int) -> dict[str, torch.Tensor]:
    """The trainer's fp32 weights after ``step`` steps (deterministic)."""
    out = {
        name: torch.randn(shape, generator=torch.Generator().manual_seed(1000 + i)) * 0.02
        for i, (name, shape) in enumerate(SHAPES.items())
    }
    for s in range(step):
        advance(out, s)
    return out


def advance(state: dict[str, torch.Tensor], step: int) -> None:
    """One training step in place: ``weights(step)`` becomes ``weights(step + 1)``."""
    for i, (name, tensor) in enumerate(state.items()):
        noise = torch.randn(tensor.shape, generator=torch.Generator().manual_seed(10_000 * (i + 1) + step))
        tensor += 2e-5 * noise


def digest(tensors: dict[str, torch.Tensor]) -> str:
    from deltasync.tensors import weights_digest

    return weights_digest(tensors.items())


def trainer(store: str, options: dict[str, Any], start: int, steps: int, progress: Path) -> None:
    """Publish ``weights(step)`` for steps ``start .. start + steps - 1``, taking the prefix over.

    ``options["slow_put_s"]``: every upload of a version object returns that long after the object landed
    (a slow link), so a kill aimed between an anchor's upload and its commit lands there.
    """
    from deltasync import Publisher, open_store
    from deltasync.stores.wrap import DelegatingStore

    options = dict(options)
    delay = options.pop("slow_put_s", 0.0)

    class SlowLink(DelegatingStore):
        def put(self, key: str, data: bytes, **kwargs: Any) -> Any:
            info = super().put(key, data, **kwargs)
            if not key.endswith(".json"):
                time.sleep(delay)  # the object is in the store, its commit is still to come
            return info

    state = weights(start)
    target = SlowLink(open_store(store, **options)) if delay else open_store(store, **options)
    with Publisher(state, target, takeover=True, **PUBLISH_OPTIONS) as publisher:
        for step in range(start, start + steps):
            if step > start:
                advance(state, step - 1)
            publisher.publish(step, block=True)
            publisher.flush()
            # The trainer's own "checkpoint": the last step it saw committed (renamed into place: a kill
            # never leaves it half-written).
            progress.with_suffix(".tmp").write_text(str(step))
            progress.with_suffix(".tmp").replace(progress)
            time.sleep(0.01)


def replica(store: str, options: dict[str, Any], log: Path, stop: Path) -> None:
    """Follow the run; append ``{version, step, digest}`` for every applied version until ``stop`` exists."""
    from deltasync import Subscriber, TorchModuleApplier

    held = {name: torch.zeros(shape, dtype=torch.bfloat16) for name, shape in SHAPES.items()}
    with open(log, "a") as out:

        def record(info: Any) -> None:
            out.write(json.dumps({"version": info.version, "step": info.step, "digest": digest(held)}) + "\n")
            out.flush()

        sub = Subscriber(store, TorchModuleApplier(held), on_update=record, poll_interval=0.05,
                         max_poll_interval=0.2, replica_id="crash-replica", **options)
        while not stop.exists():
            sub.poll()
            time.sleep(0.05)
        sub.update()
        sub.close()


if __name__ == "__main__":
    kind, store_url, options_json, *rest = sys.argv[1:]
    opts = json.loads(options_json)
    if kind == "trainer":
        trainer(store_url, opts, int(rest[0]), int(rest[1]), Path(rest[2]))
    else:
        replica(store_url, opts, Path(rest[0]), Path(rest[1]))
