"""What replica processes in the multi-process tests run.

Spawned children import their target by module name, so the model and the
replica's main function live here, importable as ``tests.mp_helpers``. A
replica talks to the test over its own one-way pipe (a killed replica can only
break its own channel), and stops when its event is set.
"""

from __future__ import annotations

import hashlib
import os
import threading
import traceback
from collections.abc import Iterable
from typing import Any

import torch

from deltasync.appliers import TorchModuleApplier
from deltasync.replica.subscriber import Subscriber, UpdateInfo
from deltasync.tensors import bits_view, published_tensors

POLL_S = 0.01  # replicas poll fast: the tests wait on their reports, not on a poll interval
MAX_POLL_S = 0.05


def make_model(seed: int = 0, *, empty: bool = False) -> torch.nn.Module:
    """A small MLP (about 10k parameters, one tensor of each common kind); ``seed`` sets its weights.

    ``empty`` adds two zero-element parameters, shaped ``(0, 4)`` and ``(4, 0)``.
    """
    torch.manual_seed(seed)
    model = torch.nn.Sequential(
        torch.nn.Linear(48, 96), torch.nn.LayerNorm(96), torch.nn.GELU(), torch.nn.Linear(96, 48)
    )
    if empty:
        model.register_parameter("no_rows", torch.nn.Parameter(torch.empty(0, 4)))
        model.register_parameter("no_cols", torch.nn.Parameter(torch.empty(4, 0)))
    return model


def bf16_bits(tensors: Iterable[tuple[str, torch.Tensor]]) -> dict[str, bytes]:
    """Name -> int16 bit patterns of the bf16 cast (what a replica must hold exactly)."""
    out = {}
    for name, tensor in tensors:
        t = tensor.detach().to(torch.bfloat16).contiguous()
        out[name] = bits_view(t).numpy().tobytes()
    return out


def digest(tensors: Iterable[tuple[str, torch.Tensor]]) -> str:
    """SHA-256 over names and bf16 bit patterns, in name order."""
    h = hashlib.sha256()
    for name, data in sorted(bf16_bits(tensors).items()):
        h.update(name.encode() + b"\0" + data)
    return h.hexdigest()


def model_digest(model: torch.nn.Module) -> str:
    return digest(published_tensors(model))


def replica_main(name: str, url: str, options: dict[str, Any], conn: Any, stop: Any) -> None:
    """Follow ``url`` into a bf16 model; report every update's hash; on ``stop``, send the final weights.

    Messages on ``conn``: ``("ready", name, pid)``, ``("applied", name, version,
    previous, route, digest)``, ``("final", name, version, bits, rejected)``,
    ``("error", name, traceback)``.
    """
    lock = threading.Lock()  # the follow thread and the main thread both send

    def send(msg: tuple[Any, ...]) -> None:
        with lock:
            conn.send(msg)

    try:
        torch.set_num_threads(1)
        # Other initial weights than the trainer's: whatever matches came through the store.
        model = make_model(seed=1234).to(torch.bfloat16)
        applier = TorchModuleApplier(model)

        def on_update(info: UpdateInfo) -> None:
            send(("applied", name, info.version, info.previous, info.route, digest(applier.state().items())))

        sub = Subscriber(
            url, applier, replica_id=name, poll_interval=POLL_S, max_poll_interval=MAX_POLL_S,
            on_update=on_update, **options,
        )
        with sub:
            sub.start()
            send(("ready", name, os.getpid()))
            stop.wait()
            sub.stop()
            send(("final", name, sub.version, bf16_bits(applier.state().items()), dict(sub.stats.rejected)))
    except BaseException:
        send(("error", name, traceback.format_exc()))
        raise
    finally:
        conn.close()
