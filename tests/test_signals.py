"""Every entry point that starts processes stops them all on Ctrl-C / SIGTERM, prints one line, cleans up.

Run as subprocesses in their own sessions (as from a terminal), signalled, and checked: a prompt exit, no
traceback, no process of theirs left, no temporary store left behind.
"""

from __future__ import annotations

import importlib.util
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest

psutil = pytest.importorskip("psutil")

ROOT = Path(__file__).resolve().parents[1]


def read_until(process: subprocess.Popen, pattern: str, timeout: float) -> re.Match[str]:
    """Lines of the process's stdout until one matches ``pattern``."""
    deadline = time.monotonic() + timeout
    seen = []
    while time.monotonic() < deadline:
        line = process.stdout.readline()
        if not line:
            if process.poll() is not None:
                break
            continue
        seen.append(line)
        found = re.search(pattern, line)
        if found:
            return found
    raise AssertionError(f"no {pattern!r} in the output: {''.join(seen)[-3000:]}")


def family(pid: int) -> list[Any]:
    try:
        return psutil.Process(pid).children(recursive=True)
    except psutil.NoSuchProcess:
        return []


def assert_all_gone(processes: list[Any], timeout: float = 30.0) -> None:
    _, alive = psutil.wait_procs(processes, timeout=timeout)
    assert not alive, [p.cmdline()[:4] for p in alive]


@pytest.mark.slow
def test_ctrl_c_stops_the_demo_and_its_replicas_and_removes_its_store() -> None:
    process = subprocess.Popen(
        [sys.executable, "-m", "deltasync.cli", "demo", "--quick", "--steps", "40"], cwd=ROOT,
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, start_new_session=True,
    )
    try:
        store = Path(read_until(process, r"store: (\S+)", 120).group(1))
        deadline = time.monotonic() + 300
        while not list(store.glob("deltas/*.safetensors")):  # training has started and published
            assert time.monotonic() < deadline and process.poll() is None, process.stderr.read()[-3000:]
            time.sleep(0.5)
        children = family(process.pid)
        assert children  # the replica processes
        os.killpg(process.pid, signal.SIGINT)  # what a terminal's Ctrl-C does: the whole process group
        out, err = process.communicate(timeout=90)
    finally:
        if process.poll() is None:
            os.killpg(process.pid, signal.SIGKILL)
    assert process.returncode == 130, err[-3000:]
    assert "Traceback" not in err and "Traceback" not in out, err[-3000:]
    assert "interrupted: stopping the replicas" in out
    assert_all_gone(children)
    assert not store.exists()


@pytest.mark.slow
@pytest.mark.skipif(importlib.util.find_spec("vllm") is None, reason="vllm is not installed")
def test_sigterm_stops_the_example_replica_with_its_server_and_follower(tmp_path: Path) -> None:
    port = _free_port()
    process = subprocess.Popen(
        [sys.executable, str(ROOT / "examples" / "grpo_delta_sync.py"), "replica", "--store", str(tmp_path / "run"),
         "--port", str(port)], cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True,
        start_new_session=True,
    )
    try:
        read_until(process, r"replica ready", 300)
        children = family(process.pid)
        assert len(children) >= 2  # the vLLM server (and its engine) and the follower
        process.send_signal(signal.SIGTERM)  # to the example only, as a process manager would
        out, _ = process.communicate(timeout=90)
    finally:
        if process.poll() is None:
            os.killpg(process.pid, signal.SIGKILL)
    assert process.returncode == 0 and "replica stopped" in out
    assert_all_gone(children, timeout=60)


def _free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]
