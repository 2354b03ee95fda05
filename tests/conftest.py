"""Shared fixtures: every store backend, real servers included, started by the tests."""

from __future__ import annotations

import atexit
import contextlib
import importlib
import os
import shutil
import tempfile
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from deltasync.stores import MemoryStore, Store, open_store, store_schemes

# vLLM names a Unix socket in the temporary directory for every engine's IPC and leaves it there when the
# engine stops: thousands over a few runs. Engines started by the tests (in process or as servers, which
# inherit the environment) put theirs in a directory of this run's, removed when the run ends.
if "VLLM_RPC_BASE_PATH" not in os.environ:
    os.environ["VLLM_RPC_BASE_PATH"] = _IPC_DIR = tempfile.mkdtemp(prefix="deltasync-tests-ipc-")
    atexit.register(shutil.rmtree, _IPC_DIR, ignore_errors=True)

# Every registered backend runs the store suite, discovered from the registry: "local" is the "file" scheme,
# "memory" is in process, and every other scheme runs against a real loopback server that
# tests/servers/<scheme>.py starts (serve() -> a context manager with store_url/store_options).
BACKENDS = ["local" if scheme == "file" else scheme for scheme in store_schemes()]
SERVERS = Path(__file__).parent / "servers"


@pytest.fixture(scope="session")
def servers() -> Iterator[dict[str, Any]]:
    """Loopback servers, started lazily once per session and stopped at the end."""
    with contextlib.ExitStack() as stack:
        running: dict[str, Any] = {}

        def get(name: str) -> Any:
            if name not in running:
                module = importlib.import_module(f"tests.servers.{name}")
                running[name] = stack.enter_context(module.serve())
            return running[name]

        yield {"get": get}


def make_store(backend: str, servers: dict[str, Any], tmp_path: Any) -> Store:
    """A fresh, empty store of ``backend`` kind."""
    prefix = f"run-{uuid.uuid4().hex[:8]}"
    if backend == "memory":
        return MemoryStore(prefix)
    if backend == "local":
        return open_store(str(tmp_path / prefix))
    if not (SERVERS / f"{backend}.py").exists():
        raise LookupError(
            f"store scheme {backend!r} is registered but the tests cannot start a server for it: add "
            f"tests/servers/{backend}.py with serve()"
        )
    server = servers["get"](backend)
    return open_store(server.store_url(prefix), **server.store_options())


@pytest.fixture(params=BACKENDS)
def store(request: pytest.FixtureRequest, servers: dict[str, Any], tmp_path: Any) -> Iterator[Store]:
    """Every backend in turn, each fresh and empty."""
    s = make_store(request.param, servers, tmp_path)
    yield s
    s.close()
