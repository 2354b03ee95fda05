"""A version's files decoded where the weights live, through a rank's index map (no vLLM needed here;
``tests/test_vllm.py`` runs the same path in a real engine)."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from deltasync.appliers.apply import plan_patches, write_patches
from deltasync.appliers.mapping import IndexMap, Target
from deltasync.appliers.worker_decode import decode_here, refusal_from_json, refusal_to_json, warm_decoder
from deltasync.diff import Snapshot, diff
from deltasync.errors import DeltaSyncError, IntegrityError, TensorMismatch
from deltasync.format import encode_anchor, encode_delta
from deltasync.tensors import TensorSpec


def _weights(seed: int = 0) -> dict[str, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    return {
        "q.weight": (torch.randn(8, 16, generator=gen) * 0.02).to(torch.bfloat16),
        "k.weight": (torch.randn(4, 16, generator=gen) * 0.02).to(torch.bfloat16),
    }


def _step(weights: dict[str, torch.Tensor], seed: int = 1) -> dict[str, torch.Tensor]:
    """Some elements of every tensor move by one or a few ulps."""
    gen = torch.Generator().manual_seed(seed)
    out = {}
    for name, tensor in weights.items():
        bits = tensor.clone().view(torch.int16).view(-1)
        where = torch.randperm(bits.numel(), generator=gen)[: bits.numel() // 5]
        bits[where] += torch.randint(1, 4, (where.numel(),), generator=gen, dtype=torch.int16)
        out[name] = bits.view(torch.bfloat16).view(tensor.shape)
    return out


def _engine(weights: dict[str, torch.Tensor], *, k_rows: int = 4) -> tuple[IndexMap, torch.nn.Parameter]:
    """One fused runtime parameter: q's rows, then k's first ``k_rows`` (all of them unless told)."""
    specs = [TensorSpec.of(name, tensor) for name, tensor in weights.items()]
    fused = torch.nn.Parameter(torch.cat([weights["q.weight"], weights["k.weight"][:k_rows]]), requires_grad=False)
    index = IndexMap(specs)
    q, k = (index.specs[n] for n in ("q.weight", "k.weight"))
    index.targets["q.weight"].append(Target(fused, "qk_proj.weight", q.shape, lo=(0, 0), hi=q.shape,
                                            offset=(0, 0), flat=(0, q.numel, 0)))
    index.targets["k.weight"].append(Target(fused, "qk_proj.weight", k.shape, lo=(0, 0), hi=(k_rows, 16),
                                            offset=(8, 0), flat=(0, k_rows * 16, q.numel)))
    return index, fused


def _delta(old: dict[str, torch.Tensor], new: dict[str, torch.Tensor]) -> bytes:
    return encode_delta(diff(Snapshot.capture(old), new), version=1, base_version=0)


def test_a_delta_decoded_against_the_rank_s_own_weights_writes_them_exactly() -> None:
    old = _weights()
    new = _step(old)
    index, fused = _engine(old)
    payload = decode_here(index, [_delta(old, new)], whole=False)
    assert set(payload) == {"q.weight", "k.weight"} and all(p["idx"].dtype == np.int64 for p in payload.values())
    write_patches(index, plan_patches(index, payload))
    expected = torch.cat([new["q.weight"], new["k.weight"]])
    assert torch.equal(fused.data.view(torch.int16), expected.view(torch.int16))


def test_an_anchor_decodes_to_whole_tensors() -> None:
    old, new = _weights(), _weights(seed=5)
    index, fused = _engine(old)
    anchor = encode_anchor(new, version=3)
    payload = decode_here(index, [anchor], whole=True)
    assert all(set(p) == {"val"} for p in payload.values())
    write_patches(index, plan_patches(index, payload))
    assert torch.equal(fused.data.view(torch.int16), torch.cat([new["q.weight"], new["k.weight"]]).view(torch.int16))


def test_other_weights_than_the_delta_s_base_are_refused_before_anything_is_written() -> None:
    old = _weights()
    new = _step(old)
    index, fused = _engine(old)
    fused.data.view(torch.int16).view(-1)[:] += 1  # changed behind deltasync's back: not the delta's base
    held = fused.data.clone()
    with pytest.raises(IntegrityError, match="base version"):
        decode_here(index, [_delta(old, new)], whole=False)
    assert torch.equal(fused.data.view(torch.int16), held.view(torch.int16))


def test_a_change_to_an_element_the_rank_does_not_hold_is_refused() -> None:
    old = _weights()
    new = dict(old)
    bits = old["k.weight"].clone().view(torch.int16)
    bits[3, 5] += 1  # in k's last row, which this rank does not hold
    new["k.weight"] = bits.view(torch.bfloat16)
    index, _ = _engine(old, k_rows=3)
    with pytest.raises(TensorMismatch, match="not held by this rank"):
        decode_here(index, [_delta(old, new)], whole=False)


def test_a_refusal_crosses_as_data_and_comes_back_as_its_own_class() -> None:
    exc = IntegrityError("k.weight: decoded values do not match", name="k.weight", where=object())
    back = refusal_from_json(refusal_to_json(exc))
    assert type(back) is IntegrityError and str(back) == str(exc) and back.name == "k.weight"
    assert not hasattr(back, "where")  # only plain context values travel
    unknown = refusal_from_json({"type": "NoSuchError", "message": "odd", "context": {}})
    assert type(unknown) is DeltaSyncError and str(unknown) == "odd"
    not_ours = refusal_from_json({"type": "ValueError", "message": "odd"})
    assert type(not_ours) is DeltaSyncError


def test_the_warm_up_decodes_through_the_same_kernels_without_touching_anything() -> None:
    from deltasync.codec import kernels

    warm_decoder()
    assert kernels._JIT is not None  # loaded: a rank's first real decode finds them ready
