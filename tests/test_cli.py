"""The ``deltasync`` command line, run as a user runs it."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from deltasync.cli import main

GOLDEN = Path(__file__).parent / "golden"


def run(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "deltasync.cli", *args], capture_output=True, text=True, timeout=120)


class TestInspect:
    def test_table(self) -> None:
        result = run("inspect", str(GOLDEN / "delta_v1_compact.safetensors"))
        assert result.returncode == 0, result.stderr
        out = result.stdout
        assert "delta version 2 (base 1), format v1" in out
        assert "5 of 104 carried" in out and "embed.weight" in out and "compact" in out

    def test_json(self, capsys: pytest.CaptureFixture[str]) -> None:
        assert main(["inspect", "--json", str(GOLDEN / "delta_v1_raw.safetensors")]) == 0
        info = json.loads(capsys.readouterr().out)
        assert info["kind"] == "delta" and info["nnz"] == 5
        assert {t["name"]: t["codec"] for t in info["tensors"]} == {"embed.weight": "raw", "norm.weight": "raw"}
        assert sum(t["bytes"] for t in info["tensors"]) == 5 * 6

    def test_refused_file_is_a_clear_error(self, tmp_path: Path) -> None:
        bad = tmp_path / "bad.safetensors"
        bad.write_bytes(b"\x10\x00\x00\x00\x00\x00\x00\x00{not json at all")
        result = run("inspect", str(bad))
        assert result.returncode == 2
        assert "DeltaFormatError" in result.stderr and "JSON" in result.stderr

    def test_missing_file(self, tmp_path: Path) -> None:
        result = run("inspect", str(tmp_path / "nope"))
        assert result.returncode == 2 and "No such file" in result.stderr

    def test_store_url(self, servers, capsys: pytest.CaptureFixture[str]) -> None:
        from deltasync.stores import open_store

        server = servers["get"]("s3")
        with open_store(server.store_url("cli"), **server.store_options()) as store:
            store.put("deltas/000002.safetensors", (GOLDEN / "delta_v1_compact.safetensors").read_bytes())
        # Credentials and endpoint come from the environment, as a user's shell would provide them.
        env = {
            "AWS_ENDPOINT_URL": server.endpoint, "AWS_ALLOW_HTTP": "true", "AWS_REGION": server.region,
            "AWS_ACCESS_KEY_ID": server.access_key_id, "AWS_SECRET_ACCESS_KEY": server.secret_access_key,
        }
        result = subprocess.run(
            [sys.executable, "-m", "deltasync.cli", "inspect", "--json", server.store_url("cli") + "/deltas/000002.safetensors"],
            capture_output=True, text=True, timeout=120, env={**__import__("os").environ, **env},
        )
        assert result.returncode == 0, result.stderr
        assert json.loads(result.stdout)["version"] == 2
