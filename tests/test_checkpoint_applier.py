"""CheckpointDirApplier: a safetensors checkpoint directory patched in place."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from deltasync.appliers.checkpoint.applier import (
    CheckpointDirApplier,
    CheckpointState,
    read_state,
    write_empty_checkpoint,
)
from deltasync.errors import DeltaFormatError, FingerprintMismatch, TensorMismatch, VersionError
from deltasync.format import decode, encode_anchor, encode_delta, read_header
from deltasync.publish.diff import Snapshot, diff
from deltasync.replica.subscriber import Subscriber
from deltasync.tensors import TensorSpec, fingerprint


def weights(seed: int = 0) -> dict[str, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    return {
        "a.weight": torch.randn(32, 8, generator=gen),
        "b.weight": torch.randn(16, generator=gen),
        "c.weight": torch.randn(4, 4, 4, generator=gen),
    }


def bf16(source: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    return {n: t.to(torch.bfloat16).contiguous() for n, t in source.items()}


def sharded(directory: Path, tensors: dict[str, torch.Tensor]) -> None:
    """An HF-style sharded checkpoint: two files and an index."""
    directory.mkdir(parents=True, exist_ok=True)
    shards = {"model-00001-of-00002.safetensors": ["a.weight"], "model-00002-of-00002.safetensors": ["b.weight", "c.weight"]}
    weight_map = {}
    for file, names in shards.items():
        save_file({n: tensors[n] for n in names}, directory / file)
        weight_map.update({n: file for n in names})
    (directory / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))


def on_disk(directory: Path) -> dict[str, torch.Tensor]:
    out: dict[str, torch.Tensor] = {}
    for path in directory.glob("*.safetensors"):
        out.update(load_file(path))
    return out


def assert_bits_equal(got: dict[str, torch.Tensor], want: dict[str, torch.Tensor]) -> None:
    assert got.keys() == want.keys()
    for name in want:
        assert torch.equal(got[name].view(torch.int16), want[name].view(torch.int16)), name


def apply_file(applier: CheckpointDirApplier, data: bytes) -> None:
    header = read_header(data)
    applier.validate(header)
    applier.apply(decode(data, base=applier.lookup, header=header)[1])


class TestLayout:
    def test_sharded_checkpoint_specs_and_fingerprint(self, tmp_path: Path) -> None:
        sharded(tmp_path, bf16(weights()))
        applier = CheckpointDirApplier(tmp_path)
        assert applier.specs["c.weight"] == TensorSpec("c.weight", (4, 4, 4), "BF16")
        assert applier.fingerprint == fingerprint(applier.specs.values())
        assert applier.state is None

    def test_empty_checkpoint_is_valid_and_zero(self, tmp_path: Path) -> None:
        specs = [TensorSpec("x", (3, 5), "BF16"), TensorSpec("y", (7,), "F32"), TensorSpec("z", (0,), "BF16")]
        write_empty_checkpoint(tmp_path / "model.safetensors", specs)
        loaded = load_file(tmp_path / "model.safetensors")
        assert {n: (t.dtype, tuple(t.shape)) for n, t in loaded.items()} == {
            "x": (torch.bfloat16, (3, 5)), "y": (torch.float32, (7,)), "z": (torch.bfloat16, (0,)),
        }
        assert all(not t.any() for t in loaded.values())
        assert set(CheckpointDirApplier(tmp_path, dtype=None).specs) == {"x", "y", "z"}

    def test_other_dtype_refused(self, tmp_path: Path) -> None:
        save_file({"a": torch.zeros(4), "b": torch.zeros(4, dtype=torch.bfloat16)}, tmp_path / "model.safetensors")
        with pytest.raises(TensorMismatch, match="'a' is F32.*BF16"):
            CheckpointDirApplier(tmp_path)

    def test_no_checkpoint(self, tmp_path: Path) -> None:
        with pytest.raises(FileNotFoundError, match="no \\*.safetensors"):
            CheckpointDirApplier(tmp_path / "missing")

    def test_index_cannot_point_outside(self, tmp_path: Path) -> None:
        save_file({"a": torch.zeros(4, dtype=torch.bfloat16)}, tmp_path / "model.safetensors")
        (tmp_path / "model.safetensors.index.json").write_text(json.dumps({"weight_map": {"a": "../x.safetensors"}}))
        with pytest.raises(DeltaFormatError, match="same directory"):
            CheckpointDirApplier(tmp_path)

    def test_index_and_shards_must_agree(self, tmp_path: Path) -> None:
        sharded(tmp_path, bf16(weights()))
        index = json.loads((tmp_path / "model.safetensors.index.json").read_text())
        index["weight_map"]["ghost.weight"] = "model-00001-of-00002.safetensors"
        (tmp_path / "model.safetensors.index.json").write_text(json.dumps(index))
        with pytest.raises(DeltaFormatError, match="disagree"):
            CheckpointDirApplier(tmp_path)

    def test_truncated_file(self, tmp_path: Path) -> None:
        save_file({"a": torch.zeros(64, dtype=torch.bfloat16)}, tmp_path / "model.safetensors")
        data = (tmp_path / "model.safetensors").read_bytes()
        (tmp_path / "model.safetensors").write_bytes(data[:-10])
        with pytest.raises(DeltaFormatError, match="does not fit"):
            CheckpointDirApplier(tmp_path)


class TestApply:
    def test_anchor_then_delta_in_place_bit_exact(self, tmp_path: Path) -> None:
        live = weights()
        sharded(tmp_path, bf16(weights(seed=9)))  # other values, same layout
        applier = CheckpointDirApplier(tmp_path)
        snapshot = Snapshot.capture(live, dtype=torch.bfloat16)
        apply_file(applier, encode_anchor(bf16(live), version=4))
        assert applier.state == CheckpointState(None, 4, clean=True)
        applier.record_run("run-a", 4)

        live["a.weight"][3, 2] += 1.0
        live["c.weight"][1] -= 0.5
        changes = diff(snapshot, live)
        apply_file(applier, encode_delta(changes, version=5, base_version=4))
        assert_bits_equal(on_disk(tmp_path), bf16(live))
        assert read_state(tmp_path) == CheckpointState("run-a", 5, clean=True)  # a delta keeps the run
        assert applier.resume_options() == {"start_version": 5, "run_id": "run-a"}

    def test_validate_first(self, tmp_path: Path) -> None:
        save_file(bf16(weights()), tmp_path / "model.safetensors")
        with pytest.raises(RuntimeError, match="validate"):
            CheckpointDirApplier(tmp_path).apply({})

    def test_foreign_file_refused_before_any_write(self, tmp_path: Path) -> None:
        save_file(bf16(weights()), tmp_path / "model.safetensors")
        before = (tmp_path / "model.safetensors").read_bytes()
        applier = CheckpointDirApplier(tmp_path)
        other = {"a.weight": torch.zeros(32, 9, dtype=torch.bfloat16)}
        with pytest.raises(FingerprintMismatch):
            applier.validate(read_header(encode_anchor(other, version=1)))
        assert (tmp_path / "model.safetensors").read_bytes() == before

    def test_torn_checkpoint_takes_no_delta(self, tmp_path: Path) -> None:
        live = weights()
        save_file(bf16(live), tmp_path / "model.safetensors")
        (tmp_path / "deltasync.json").write_text(
            json.dumps({"format": "deltasync-checkpoint", "run_id": "r", "version": 1, "clean": False})
        )
        applier = CheckpointDirApplier(tmp_path)
        assert applier.state is not None and not applier.state.resumable and applier.resume_options() == {}
        snapshot = Snapshot.capture(live, dtype=torch.bfloat16)
        live["b.weight"][0] += 1.0
        data = encode_delta(diff(snapshot, live), version=2, base_version=1)
        header = read_header(data)
        applier.validate(header)
        with pytest.raises(VersionError, match="torn"):
            applier.apply(decode(data, base=applier.lookup, header=header)[1])

    def test_record_run_needs_the_version(self, tmp_path: Path) -> None:
        save_file(bf16(weights()), tmp_path / "model.safetensors")
        with pytest.raises(VersionError):
            CheckpointDirApplier(tmp_path).record_run("r", 3)

    @pytest.mark.parametrize("text", ["not json", "[]", '{"format": "deltasync-checkpoint", "version": -1}'])
    def test_unreadable_state_means_start_from_an_anchor(self, tmp_path: Path, text: str) -> None:
        (tmp_path / "deltasync.json").write_text(text)
        assert read_state(tmp_path) is None


class TestSubscriberStart:
    def test_start_version_needs_run_id(self, tmp_path: Path) -> None:
        save_file(bf16(weights()), tmp_path / "model.safetensors")
        with pytest.raises(ValueError, match="together"):
            Subscriber(str(tmp_path / "store"), CheckpointDirApplier(tmp_path), start_version=3)

    def test_start_position_is_held(self, tmp_path: Path) -> None:
        save_file(bf16(weights()), tmp_path / "model.safetensors")
        with Subscriber(str(tmp_path / "store"), CheckpointDirApplier(tmp_path), start_version=3, run_id="r") as sub:
            assert (sub.version, sub.run_id) == (3, "r")
            assert sub.wait_for(3, timeout=0)


class TestOneWriter:
    def test_second_applier_on_a_directory_is_refused(self, tmp_path: Path) -> None:
        from deltasync.errors import ConflictError

        save_file(bf16(weights()), tmp_path / "model.safetensors")
        first = CheckpointDirApplier(tmp_path)
        with pytest.raises(ConflictError, match="another process is writing"):
            CheckpointDirApplier(tmp_path)
        first.close()
        CheckpointDirApplier(tmp_path).close()


def test_overlapping_tensors_refused(tmp_path: Path) -> None:
    import struct

    header = {
        "a": {"dtype": "BF16", "shape": [4], "data_offsets": [0, 8]},
        "b": {"dtype": "BF16", "shape": [4], "data_offsets": [4, 12]},
    }
    raw = json.dumps(header).encode()
    raw += b" " * (-len(raw) % 8)
    (tmp_path / "model.safetensors").write_bytes(struct.pack("<Q", len(raw)) + raw + bytes(12))
    with pytest.raises(DeltaFormatError, match="overlap"):
        CheckpointDirApplier(tmp_path)
