"""A version's files decoded where the weights live, through a rank's index map (no vLLM needed here;
``tests/test_vllm.py`` runs the same path in a real engine)."""

from __future__ import annotations

import contextlib
import dataclasses
from collections.abc import Iterator

import pytest
import torch

from deltasync.appliers.apply import write_patches
from deltasync.appliers.mapping import IndexMap, Target
from deltasync.appliers.verify import check_written, same_bits
from deltasync.appliers.vllm.rank_decode import decode_here, refusal_from_json, refusal_to_json, warm_decoder
from deltasync.errors import DeltaSyncError, IntegrityError, TensorMismatch
from deltasync.format import encode_anchor, encode_delta
from deltasync.publish.diff import Snapshot, diff
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


@pytest.mark.parametrize("on_device", [False, True], ids=["host", "device-path"])
def test_a_delta_decoded_against_the_rank_s_own_weights_writes_them_exactly(on_device: bool) -> None:
    old = _weights()
    new = _step(old)
    index, fused = _engine(old)
    patches = decode_here(index, [_delta(old, new)], whole=False, on_device=on_device)
    assert {p.name for p in patches} == {"q.weight", "k.weight"}
    assert all(p.indices is not None and p.indices.dtype == torch.int64 for p in patches)
    write_patches(index, patches)
    expected = torch.cat([new["q.weight"], new["k.weight"]])
    assert torch.equal(fused.data.view(torch.int16), expected.view(torch.int16))
    assert check_written(index, patches) == (sum(p.indices.numel() for p in patches), [])


def test_an_anchor_decodes_to_whole_tensors() -> None:
    old, new = _weights(), _weights(seed=5)
    index, fused = _engine(old)
    anchor = encode_anchor(new, version=3)
    patches = decode_here(index, [anchor], whole=True, on_device=True)  # anchors decode on the host either way
    assert all(p.indices is None for p in patches)
    write_patches(index, patches)
    assert torch.equal(fused.data.view(torch.int16), torch.cat([new["q.weight"], new["k.weight"]]).view(torch.int16))


@pytest.mark.parametrize("on_device", [False, True], ids=["host", "device-path"])
def test_other_weights_than_the_delta_s_base_are_refused_before_anything_is_written(on_device: bool) -> None:
    old = _weights()
    new = _step(old)
    index, fused = _engine(old)
    fused.data.view(torch.int16).view(-1)[:] += 1  # changed behind deltasync's back: not the delta's base
    held = fused.data.clone()
    with pytest.raises(IntegrityError, match="base version"):
        decode_here(index, [_delta(old, new)], whole=False, on_device=on_device)
    assert torch.equal(fused.data.view(torch.int16), held.view(torch.int16))


@pytest.mark.parametrize("on_device", [False, True], ids=["host", "device-path"])
def test_a_change_to_an_element_the_rank_does_not_hold_is_refused(on_device: bool) -> None:
    old = _weights()
    new = dict(old)
    bits = old["k.weight"].clone().view(torch.int16)
    bits[3, 5] += 1  # in k's last row, which this rank does not hold
    new["k.weight"] = bits.view(torch.bfloat16)
    index, _ = _engine(old, k_rows=3)
    with pytest.raises(TensorMismatch, match="k.weight: 1 changed elements are not held by this rank"):
        decode_here(index, [_delta(old, new)], whole=False, on_device=on_device)


def _split_engine(weights: dict[str, torch.Tensor]) -> tuple[IndexMap, dict[str, torch.nn.Parameter]]:
    """q's rows in two runtime parameters (boxes, the second shifted down two rows, a row held twice),
    k stored transposed (an explicit table): every read on the device path is masked and merged."""
    specs = [TensorSpec.of(name, tensor) for name, tensor in weights.items()]
    index = IndexMap(specs)
    q, k = weights["q.weight"], weights["k.weight"]
    top = torch.nn.Parameter(q[:5].clone(), requires_grad=False)
    bottom = torch.nn.Parameter(torch.cat([torch.zeros(2, 16, dtype=q.dtype), q[4:]]), requires_grad=False)
    k_t = torch.nn.Parameter(k.t().contiguous(), requires_grad=False)
    index.targets["q.weight"] += [
        Target(top, "top", q.shape, lo=(0, 0), hi=(5, 16), offset=(0, 0)),
        Target(bottom, "bottom", q.shape, lo=(4, 0), hi=(8, 16), offset=(-2, 0)),
    ]
    keys = torch.arange(k.numel())
    index.targets["k.weight"].append(Target(k_t, "k_t", k.shape, table=(keys, (keys % 16) * 4 + keys // 16)))
    return index, {"top": top, "bottom": bottom, "k_t": k_t}


def test_the_host_decode_reads_whole_plain_tensors_in_place_and_others_through_the_map(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A tensor held whole in one plain CPU parameter in its published dtype is read by the compiled rebuild
    from a view of the weights (``IndexMap.flat_bits``); boxes, tables, a tensor held in part or in a wider
    dtype are read through the map. Both end exact."""
    from deltasync.appliers.vllm import rank_decode as worker_decode

    reads: list[str] = []
    real = worker_decode.read_bits

    def read_bits(index: IndexMap, payload: dict) -> dict:
        reads.extend(payload)
        return real(index, payload)

    monkeypatch.setattr(worker_decode, "read_bits", read_bits)
    old = _weights()
    new = _step(old)
    index, fused = _engine(old)
    q = index.flat_bits("q.weight")
    assert q is not None and q.size == 128 and torch.from_numpy(q).data_ptr() == fused.data.data_ptr()
    assert index.flat_bits("k.weight") is not None  # its rows after q's, whole
    patches = decode_here(index, [_delta(old, new)], whole=False)
    assert reads == []
    write_patches(index, patches)
    assert torch.equal(fused.data.view(torch.int16), torch.cat([new["q.weight"], new["k.weight"]]).view(torch.int16))

    tied, _ = _engine(old)
    tied.targets["k.weight"].append(Target(fused, "qk_proj.weight", (4, 16), lo=(0, 0), hi=(4, 16), offset=(0, 0)))
    assert tied.flat_bits("k.weight") is not None  # held twice: read from the first, as the map reads
    tied.targets["k.weight"].reverse()
    assert tied.flat_bits("k.weight") is None  # the first a box without its flat range: read through the map
    split, params = _split_engine(old)  # q in two boxes, k through a table
    partial, _ = _engine(old, k_rows=2)  # k held in part
    wide = IndexMap([TensorSpec.of(n, t) for n, t in old.items()])  # published bf16, held in fp32
    for name, whole in IndexMap.whole({n: torch.nn.Parameter(t.float(), requires_grad=False)
                                       for n, t in old.items()}).targets.items():
        wide.targets[name] += whole
    for other in (split, partial, wide):
        assert other.flat_bits("k.weight") is None
    assert split.flat_bits("q.weight") is None and wide.flat_bits("q.weight") is None
    patches = decode_here(split, [_delta(old, new)], whole=False)
    assert sorted(reads) == ["k.weight", "q.weight"]
    write_patches(split, patches)
    assert torch.equal(params["k_t"].data.t().view(torch.int16), new["k.weight"].view(torch.int16))


def test_the_device_path_reads_and_writes_through_boxes_and_tables_exactly() -> None:
    old = _weights()
    new = _step(old)
    host_index, _ = _split_engine(old)
    index, params = _split_engine(old)
    want = decode_here(host_index, [_delta(old, new)], whole=False, on_device=False)
    got = decode_here(index, [_delta(old, new)], whole=False, on_device=True)
    for a, b in zip(want, got):
        assert a.name == b.name and torch.equal(a.indices, b.indices) and torch.equal(a.values, b.values)
    write_patches(index, got)
    q, k = new["q.weight"].view(torch.int16), new["k.weight"].view(torch.int16)
    assert torch.equal(params["top"].data.view(torch.int16), q[:5])
    assert torch.equal(params["bottom"].data.view(torch.int16)[2:], q[4:])
    assert torch.equal(params["k_t"].data.view(torch.int16), k.t())
    assert check_written(index, got)[1] == []
    k_patch = next(p for p in got if p.name == "k.weight")
    first = int(k_patch.indices[0])
    params["k_t"].data.view(torch.int16).view(-1)[(first % 16) * 4 + first // 16] += 1  # a write that did not land
    checked, wrong = check_written(index, [k_patch], samples=10_000)
    assert wrong == [{"tensor": "k.weight", "param": "k_t", "wrong": 1, "read": checked}]


def test_read_backs_of_many_sampled_patches_are_compared_together() -> None:
    """The read-back samples every sparse patch from one draw copied once per device and compares every
    plain read of a device in one pass (a GPU's host would otherwise wait once per tensor: a small copy from
    pageable memory waits for everything queued); a write that did not land is still found, in its tensor."""
    from tests.dispatch_helpers import recorded_ops

    gen = torch.Generator().manual_seed(4)
    weights = {f"w{i}": torch.randn(4000, generator=gen).to(torch.bfloat16) for i in range(40)}
    weights["f32"] = torch.randn(3000, generator=gen)  # another width: compared in a pass of its own
    index = IndexMap.whole({n: torch.nn.Parameter(t.clone(), requires_grad=False) for n, t in weights.items()})
    new = {n: (t.float() + torch.where(torch.rand(t.numel(), generator=gen) < 0.2, 1.0, 0.0)).to(t.dtype)
           for n, t in weights.items()}
    data = encode_delta(diff(Snapshot.capture(weights, dtype=None), new), version=1, base_version=0)
    patches = decode_here(index, [data], whole=False, on_device=True)
    assert all(p.indices is not None and p.indices.numel() > 300 for p in patches)
    write_patches(index, patches)
    with recorded_ops() as ops:
        checked, wrong = check_written(index, patches, samples=256)
    assert (checked, wrong) == (256 * len(patches), [])
    assert ops.count("aten.ne") == 2 and "aten.randint" not in ops  # one compare per width, one draw
    assert checked == check_written(index, patches, samples=256)[0]
    victim = next(p for p in patches if p.name == "w7")
    index.targets["w7"][0].param.data.view(torch.int16)[victim.indices] += 1  # none of its writes landed
    checked, wrong = check_written(index, patches, samples=256)
    assert wrong == [{"tensor": "w7", "param": "w7", "wrong": 256, "read": 256}]


def test_a_rank_reads_each_base_straight_into_the_batch() -> None:
    """On the device path, a tensor held whole in a plain parameter is read with one gather straight into
    the batch's buffer (one kernel a tensor on a GPU, not a gather and a copy)."""
    from tests.dispatch_helpers import recorded_ops

    old = _many(40)
    new = _step(old)
    index, params = _on("cpu", old)
    data = _delta(old, new)
    with recorded_ops() as ops:
        patches = decode_here(index, [data], whole=False, on_device=True)
    assert ops.count("aten.index_select") == 40 and ops.count("aten.copy_") <= 2
    write_patches(index, patches)
    for name, param in params.items():
        assert torch.equal(param.data.view(torch.int16), new[name].view(torch.int16)), name


def test_a_fused_parameter_s_tensors_are_written_in_one_scatter(monkeypatch: pytest.MonkeyPatch) -> None:
    """40 checkpoint tensors stacked in one runtime parameter (a layer's experts): their bases are read with one
    gather, their changes go in one scatter and are read back with one gather (one kernel each on a GPU instead
    of 40), each exactly where the map puts it."""
    from deltasync.appliers import mapping
    from tests.dispatch_helpers import recorded_ops

    old = _many(40)
    new = _step(old)
    index, (fused,) = _fused(old, "cpu")
    scatters = []
    real = mapping._write_bits
    monkeypatch.setattr(mapping, "_write_bits", lambda *args: (scatters.append(args[1].numel()), real(*args)))
    data = _delta(old, new)
    with recorded_ops() as ops:  # all 40 bases with one gather, each tensor's indices shifted by one lookup
        patches = decode_here(index, [data], whole=False, on_device=True)
    assert ops.count("aten.index_select") == 1  # 40 before, one a tensor
    assert ops.count("aten.add") + ops.count("aten.add_") == 4  # the decode's three and the one shift for all
    with recorded_ops() as ops:  # and every tensor's indices shifted to its place by one lookup, not 40 adds
        written, touched = write_patches(index, patches)
    assert ops.count("aten.add") + ops.count("aten.add_") == 1
    with recorded_ops() as ops:  # read back where each tensor lies too, all 40 with one gather
        assert check_written(index, patches, samples=10_000) == (written, [])
    assert ops.count("aten.index_select") == 1 and "aten.add" not in ops
    assert scatters == [written] and touched == [fused]
    assert torch.equal(fused.data.view(torch.int16), torch.cat(list(new.values())).view(torch.int16))
    assert check_written(index, patches, samples=10_000) == (written, [])
    victim = next(p for p in patches if p.name == "layer7.weight")
    fused.data.view(torch.int16).view(-1)[victim.indices + 7 * 64 * 32] += 1  # none of its writes landed
    n = victim.indices.numel()
    assert check_written(index, patches, samples=10_000)[1] == [
        {"tensor": "layer7.weight", "param": "experts.0.weight", "wrong": n, "read": n}]
    with recorded_ops() as ops:  # sampled: the 40 draws taken from the decode's buffers together, then read
        checked, wrong = check_written(index, patches, samples=100)
    assert checked == 40 * 100 and wrong == [
        {"tensor": "layer7.weight", "param": "experts.0.weight", "wrong": 100, "read": 100}]
    assert ops.count("aten.index_select") == 4  # the draws' rows, their indices, their values, the parameter
    as_host = [dataclasses.replace(p, indices=p.indices.clone(), values=p.values.clone()) for p in patches]
    with recorded_ops() as ops:  # patches of buffers of their own (decoded on the host): a draw's two a tensor
        assert check_written(index, as_host, samples=100) == (checked, wrong)
    assert ops.count("aten.index_select") == 2 * 40 + 1
    for name, shift in (("layer20.weight", 20 * 64 * 32), ("layer31.weight", 31 * 64 * 32)):  # a few wrong
        patch = next(p for p in patches if p.name == name)
        fused.data.view(torch.int16).view(-1)[patch.indices[::37] + shift] += 1
    for seed in range(5):  # whichever positions are drawn, both ways see the same
        joined = check_written(index, patches, samples=100, seed=seed)
        assert joined == check_written(index, as_host, samples=100, seed=seed) and len(joined[1]) >= 1


@pytest.mark.parametrize("batch", [None, 9000], ids=["one-batch", "two-batches"])
@pytest.mark.parametrize("params", [0, 1, 2], ids=["a-parameter-each", "fused", "two-taking-turns"])
def test_a_read_back_takes_its_draws_from_the_decode_s_buffers_and_sees_what_a_tensor_by_tensor_one_sees(
    monkeypatch: pytest.MonkeyPatch, params: int, batch: int | None
) -> None:
    """The device path's patches are slices of a batch's results: the read-back takes every tensor's drawn
    positions from those buffers together (a lot per batch), whether the tensors have parameters of their
    own or share them, and finds exactly what drawing tensor by tensor finds, wrong elements included."""
    from deltasync.codec import device
    from tests.dispatch_helpers import recorded_ops

    if batch is not None:
        monkeypatch.setattr(device, "BATCH", batch)  # 40 tensors of 409 changes: two batches
    old = _many(40)
    new = _step(old)
    index, stacked = _fused(old, "cpu", params) if params else _on("cpu", old)
    patches = decode_here(index, [_delta(old, new)], whole=False, on_device=True)
    write_patches(index, patches)
    alone = [dataclasses.replace(p, indices=p.indices.clone(), values=p.values.clone()) for p in patches]
    with recorded_ops() as ops:
        assert check_written(index, patches) == (256 * 40, [])
    with recorded_ops() as ops_alone:
        assert check_written(index, alone) == (256 * 40, [])
    reads = params or 40  # a read for each parameter, or a read a tensor
    assert ops_alone.count("aten.index_select") == 2 * 40 + reads  # a draw's indices and values a tensor
    if batch is None:  # the draws' rows, their indices and their values: once (for each parameter, if fused)
        assert ops.count("aten.index_select") == 3 * max(params, 1) + reads
    else:  # a lot per batch (a lot of fewer than 8 tensors drawn tensor by tensor)
        assert ops.count("aten.index_select") < ops_alone.count("aten.index_select")
    planted = 0
    for k, patch in enumerate(patches[::3]):  # some wrong elements in every third tensor
        held, start = index.in_place(patch.name)  # type: ignore[misc]
        flat = held.param.data.view(torch.int16).view(-1)[start:]
        flat[patch.indices[k % 5 :: 23]] += 1
        planted += 1
    for seed in range(3):
        got = check_written(index, patches, seed=seed)
        assert got == check_written(index, alone, seed=seed) and len(got[1]) >= planted // 2


def test_tensors_tied_to_one_place_are_written_one_after_another() -> None:
    """Two checkpoint tensors a map sends to the same elements are not joined into one scatter (which would
    leave either value, by the kernel's whim): each is written in turn, the last one's values stay."""
    from deltasync.appliers.apply import Patch

    param = torch.nn.Parameter(torch.zeros(8, 4, dtype=torch.bfloat16), requires_grad=False)
    specs = [TensorSpec("a", (8, 4), "BF16"), TensorSpec("b", (8, 4), "BF16")]
    index = IndexMap(specs)
    for spec in specs:
        index.targets[spec.name].append(Target(param, "tied.weight", spec.shape, lo=(0, 0), hi=spec.shape,
                                               offset=(0, 0), flat=(0, 32, 0)))
    at = torch.tensor([3, 17, 30])
    patches = [Patch(spec.name, spec, at, torch.full((3,), k + 1, dtype=torch.int16)) for k, spec in enumerate(specs)]
    assert write_patches(index, patches) == (6, [param])
    assert param.data.view(torch.int16).view(-1)[at].tolist() == [2, 2, 2]


def _halves(weights: dict[str, torch.Tensor]) -> tuple[IndexMap, dict[str, torch.nn.Parameter]]:
    """Each tensor's rows in two runtime parameters (a tensor-parallel rank's shards, both held here)."""
    index = IndexMap([TensorSpec.of(name, tensor) for name, tensor in weights.items()])
    params = {}
    for name, tensor in weights.items():
        rows, cols = tensor.shape
        half = rows // 2
        for part, lo, hi in (("top", 0, half), ("bottom", half, rows)):
            param = params[f"{name}.{part}"] = torch.nn.Parameter(tensor[lo:hi].clone(), requires_grad=False)
            index.targets[name].append(Target(param, f"{name}.{part}", tensor.shape, lo=(lo, 0), hi=(hi, cols),
                                              offset=(-lo, 0), flat=(lo * cols, hi * cols, -lo * cols)))
    return index, params


def test_shards_are_written_with_their_shares_counted_together() -> None:
    """A sparse patch's share of each shard is counted on the device for every shard first and read back
    once (a GPU's host waited once per shard: ``nonzero``), then written exactly, for 8 tensors as for 40."""
    from tests.dispatch_helpers import host_wait_ops, recorded_ops

    waits = []
    for count in (8, 40):
        old = _many(count)
        new = _step(old)
        index, params = _halves(old)
        patches = decode_here(index, [_delta(old, new)], whole=False, on_device=True)
        with recorded_ops() as ops:
            written, touched = write_patches(index, patches)
        waits.append(sorted(op for op in ops if op in host_wait_ops(ops)))
        assert written == sum(p.indices.numel() for p in patches) and len(touched) == 2 * count
        for name, tensor in new.items():
            both = torch.cat([params[f"{name}.top"].data, params[f"{name}.bottom"].data])
            assert torch.equal(both.view(torch.int16), tensor.view(torch.int16)), name
        assert check_written(index, patches, samples=10_000) == (written, [])
    assert "aten.nonzero" not in waits[1] and len(waits[0]) == len(waits[1])


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


def _many(count: int) -> dict[str, torch.Tensor]:
    gen = torch.Generator().manual_seed(count)
    return {f"layer{i}.weight": (torch.randn(64, 32, generator=gen) * 0.02).to(torch.bfloat16) for i in range(count)}


def _on(device: str, weights: dict[str, torch.Tensor]) -> tuple[IndexMap, dict[str, torch.nn.Parameter]]:
    """Each tensor whole in a runtime parameter of its own on ``device``."""
    params = {name: torch.nn.Parameter(tensor.to(device), requires_grad=False) for name, tensor in weights.items()}
    return IndexMap.whole(params), params


@contextlib.contextmanager
def _sync_warnings() -> Iterator[None]:
    """CUDA's sync debug mode on "warn" for the block: every host wait for the GPU becomes a warning to count."""
    torch.cuda.set_sync_debug_mode("warn")
    try:
        yield
    finally:
        torch.cuda.set_sync_debug_mode("default")


def _fused(
    weights: dict[str, torch.Tensor], device: str, params: int = 1
) -> tuple[IndexMap, list[torch.nn.Parameter]]:
    """Every tensor of ``weights`` (each ``[64, 32]``) stacked in a runtime parameter on ``device`` (a layer's
    fused experts): with ``params`` > 1, tensor ``i`` in parameter ``i % params``, so that the parameters take
    turns in the file's order, as an expert's ``gate_proj`` and ``up_proj`` (one parameter) and its
    ``down_proj`` (another) do in a checkpoint."""
    specs = [TensorSpec.of(name, tensor) for name, tensor in weights.items()]
    names = list(weights)
    stacked = [torch.nn.Parameter(torch.cat([weights[n] for n in names[p::params]]).to(device), requires_grad=False)
               for p in range(params)]
    index = IndexMap(specs)
    for i, spec in enumerate(specs):
        row = i // params
        index.targets[spec.name].append(Target(stacked[i % params], f"experts.{i % params}.weight", spec.shape,
                                               lo=(0, 0), hi=spec.shape, offset=(64 * row, 0),
                                               flat=(0, spec.numel, spec.numel * row)))
    return index, stacked


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("codec", ["compact", "compact-exp"])  # rebuilt on the device; decoded on the host
def test_a_rank_on_cuda_rebuilds_writes_and_reads_back_on_the_device_waiting_as_often_for_40_tensors_as_for_8(
    codec: str,
) -> None:
    import warnings

    syncs = []
    for count in (8, 40):
        old = _many(count)
        new = _step(old)
        data = encode_delta(diff(Snapshot.capture(old), new), version=1, base_version=0, codec=codec)
        index, params = _on("cuda", old)
        with warnings.catch_warnings(record=True) as caught, _sync_warnings():
            warnings.simplefilter("always")
            patches = decode_here(index, [data], whole=False)  # the device path: weights on an accelerator
            write_patches(index, patches)
            checked, wrong = check_written(index, patches)
        syncs.append(sum("synchroniz" in str(w.message) for w in caught))
        assert all(p.values.device.type == "cuda" for p in patches) and wrong == [] and checked > 0
        for name, param in params.items():
            assert torch.equal(param.data.cpu().view(torch.int16), new[name].view(torch.int16)), name
    assert syncs[0] == syncs[1], syncs


@pytest.mark.parametrize("params", [1, 2], ids=["in-a-row", "taking-turns"])
@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=[
    pytest.mark.cuda, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")])])
def test_a_rank_writes_fused_parameters_tensors_on_the_device_path_exactly_waiting_as_often_for_40_as_for_4(
    device: str, params: int
) -> None:
    """A layer's experts stacked in one parameter, or two taking turns in the file's order, where the weights
    live: 4 tensors take a gather and a shift each, 40 the joined paths (one gather for each parameter's bases,
    one scatter, one read-back gather, their drawn samples taken together); all land exactly, a missed write is
    still named, and on a GPU neither waits for it more often than the other."""
    import warnings

    from tests.dispatch_helpers import recorded_ops

    syncs = []
    for count in (4, 40):
        old = _many(count)
        new = _step(old)
        index, stacked = _fused(old, device, params)
        data = _delta(old, new)
        with warnings.catch_warnings(record=True) as caught, recorded_ops() as ops:
            warnings.simplefilter("always")
            with _sync_warnings() if device == "cuda" else contextlib.nullcontext():
                patches = decode_here(index, [data], whole=False, on_device=True)
                written, touched = write_patches(index, patches)
                checked, wrong = check_written(index, patches, samples=10_000)  # all of them: no draw
                with recorded_ops() as drawn_ops:
                    drawn = check_written(index, patches)  # 256 of each tensor's 409 changes, drawn
        syncs.append(sum("synchroniz" in str(w.message) for w in caught))
        assert drawn == (256 * count, [])
        if count == 40:  # each parameter's bases read in one gather (placed by one copy where they take turns),
            assert drawn_ops.count("aten.index_select") == 4 * params  # draws taken together, read together
            assert ops.count("aten.index_select") - 4 * params == 2 * params  # and read back whole in one
            assert ops.count("aten.index_copy_") == (params if params > 1 else 0)
        assert wrong == [] and checked > 0 and written > 0 and {id(p) for p in touched} == {id(p) for p in stacked}
        assert all(p.indices is not None and p.indices.device.type == device for p in patches)
        names = list(new)
        for p, param in enumerate(stacked):
            expected = torch.cat([new[n] for n in names[p::params]]).view(torch.int16)
            assert torch.equal(param.data.cpu().view(torch.int16), expected), p
        victim = next(p for p in patches if p.name == f"layer{count - 1}.weight")
        param, start = index.in_place(victim.name)  # type: ignore[misc]
        from_start = param.param.data.view(torch.int16).view(-1)[start:]
        from_start[victim.indices] += 1  # none of its writes landed
        n = victim.indices.numel()
        assert check_written(index, patches, samples=10_000)[1] == [
            {"tensor": victim.name, "param": param.param_name, "wrong": n, "read": n}]
    assert syncs[0] == syncs[1], syncs


def _layouts() -> list[tuple[str, torch.Size, torch.Tensor, torch.Tensor, torch.dtype]]:
    """(label, runtime shape, checkpoint flat indices, their runtime flat indices, runtime dtype) of a
    ``[8, 16]`` checkpoint tensor: the ways engines hold one, as a rank observes them."""
    rows, cols = torch.meshgrid(torch.arange(8), torch.arange(16), indexing="ij")
    every = rows * 16 + cols
    right = cols >= 8  # a column shard: this rank holds columns 8..15
    slot = 2 * 8 * 8  # the second expert slot of a [3, 8, 8] stacked parameter
    return [
        ("fused rows", torch.Size([12, 16]), every.flatten(), every.flatten() + 4 * 16, torch.bfloat16),
        ("fused rows, fp32", torch.Size([12, 16]), every.flatten(), every.flatten() + 4 * 16, torch.float32),
        ("row shard", torch.Size([3, 16]), every[2:5].flatten(), every[:3].flatten(), torch.bfloat16),
        ("column shard", torch.Size([8, 8]), every[right], (rows * 8 + cols - 8)[right], torch.bfloat16),
        ("expert slot, column shard", torch.Size([3, 8, 8]), every[right], (slot + rows * 8 + cols - 8)[right],
         torch.bfloat16),
        ("transposed: a table", torch.Size([16, 8]), every.flatten(), (cols * 8 + rows).flatten(), torch.float32),
    ]


@pytest.mark.parametrize("layout", _layouts(), ids=lambda layout: layout[0])
def test_a_whole_tensor_written_in_one_copy_lands_where_element_writes_do(layout: tuple) -> None:
    """An anchor's whole tensors take one strided copy and one compare per target (``Target.region``); they
    must land exactly where a write of every element by index does, and a wrong element must still show."""
    from deltasync.appliers.apply import Patch
    from deltasync.appliers.mapping import fit_targets

    label, shape, c, r, dtype = layout
    spec = TensorSpec("w", (8, 16), "BF16")
    values = (torch.randn(8, 16, generator=torch.Generator().manual_seed(3)) * 0.02).to(torch.bfloat16)
    bits = values.view(torch.int16).flatten()
    written = {}
    for whole in (True, False):
        param = torch.nn.Parameter(torch.full(shape, -7.0, dtype=dtype), requires_grad=False)
        index = IndexMap([spec])
        index.targets["w"] = fit_targets(param, "runtime.w", spec, c, r)
        (target,) = index.targets["w"]
        assert (target.region(param.data, bits) is None) == label.startswith("transposed")
        patch = Patch("w", spec, None, bits) if whole else Patch("w", spec, torch.arange(spec.numel), bits)
        assert write_patches(index, [patch])[0] == c.numel()
        assert check_written(index, [patch], samples=spec.numel) == (c.numel(), [])
        written[whole] = param.data.clone()
        if whole:
            expected = torch.full(shape, -7.0, dtype=dtype).view(-1)
            expected[r] = values.view(-1)[c].to(dtype)
            assert torch.equal(param.data.view(-1), expected)
            param.data.view(-1)[r[5]] = 1.0  # one element of the write lost
            assert check_written(index, [patch]) == (c.numel(), [
                {"tensor": "w", "param": "runtime.w", "wrong": 1, "read": c.numel()}])
    assert torch.equal(written[True], written[False])


@pytest.mark.parametrize("cut", ["whole", "odd length", "offset by one element", "strided"])
def test_bits_compared_eight_bytes_at_a_time_or_not_tell_every_element(cut: str) -> None:
    """``same_bits`` compares as 8-byte words where it can and as the elements where it cannot (a length or an
    offset off the word, a strided view); either way one flipped bit in any element shows."""
    base = torch.randint(-(1 << 15), 1 << 15, (4, 1031), dtype=torch.int16, generator=torch.Generator().manual_seed(0))
    view = {"whole": lambda t: t.view(-1)[:4096], "odd length": lambda t: t.view(-1)[: 4 * 1031 - 1],
            "offset by one element": lambda t: t.view(-1)[1:4097], "strided": lambda t: t[:, ::2]}[cut]
    a = view(base)
    assert (cut == "whole") == (a.is_contiguous() and a.numel() % 4 == 0 and a.storage_offset() % 4 == 0)
    assert same_bits(a, view(base.clone()))
    for at in (0, a.numel() // 2, a.numel() - 1):
        other = base.clone()
        view(other)[tuple(int(i) for i in torch.unravel_index(torch.tensor(at), a.shape))] ^= 1
        assert not same_bits(a, view(other)), at
