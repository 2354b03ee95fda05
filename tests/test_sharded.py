"""Sharded publishing: FSDP2, DeepSpeed ZeRO-3 and data-parallel ranks each upload their own shard, replicas end exact.

Real torch.distributed (gloo on CPU), 2 and 4 trainer processes, the loopback
S3 server. A replica follows while the ranks train (every state it ever holds
must be a published version: no partial versions), a second joins at the end
from the anchor; both must equal the full bf16 weights the ranks materialise
for reference, bit for bit.
"""

from __future__ import annotations

import importlib.util
import json
import threading
import uuid
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.multiprocessing as mp

from deltasync.appliers import TorchModuleApplier
from deltasync.format import read_header
from deltasync.protocol.manifest import Manifest
from deltasync.publish.sharded import chunk_rows, shard_layout
from deltasync.replica.subscriber import Subscriber, UpdateInfo
from deltasync.stores import open_store
from tests.mp_helpers import make_model, model_digest
from tests.sharded_helpers import callback_main, rank_main

STEPS = 3


def _run_ranks(
    world: int, mode: str, url: str, options: dict[str, Any], tmp_path: Path, **publisher: Any
) -> dict[str, Any]:
    init = f"file://{tmp_path / 'rendezvous'}"
    mp.start_processes(
        rank_main, args=(world, init, mode, STEPS, url, {**options, **publisher}, str(tmp_path)),
        nprocs=world, start_method="spawn", join=True,
    )
    errors = sorted(tmp_path.glob("error-*.txt"))
    assert not errors, errors[0].read_text()
    return json.loads((tmp_path / "result.json").read_text())


@pytest.mark.slow
@pytest.mark.parametrize(
    ("mode", "world"),
    [
        ("fsdp", 2), ("fsdp", 4), ("hsdp", 4), ("ddp", 2),
        *[pytest.param(f"zero{stage}", 2, marks=pytest.mark.skipif(
            importlib.util.find_spec("deepspeed") is None, reason="deepspeed is not installed")) for stage in (1, 2, 3)],
    ],
)
def test_ranks_publish_shards_and_replicas_end_exact(mode: str, world: int, servers: Any, tmp_path: Path) -> None:
    s3 = servers["get"]("s3")
    url, options = s3.store_url(f"sharded-{uuid.uuid4().hex[:8]}"), s3.store_options()
    follower = make_model(seed=1).to(torch.bfloat16)  # other weights: only the anchor can make it right
    held: list[str] = []
    stop = threading.Event()

    def record(info: UpdateInfo) -> None:
        held.append(model_digest(follower))

    sub = Subscriber(open_store(url, **options), TorchModuleApplier(follower), poll_interval=0.01,
                     max_poll_interval=0.05, on_update=record)
    thread = threading.Thread(target=sub.run, args=(stop,), daemon=True)
    thread.start()
    try:
        result = _run_ranks(world, mode, url, options, tmp_path)
        latest = max(int(v) for v in result["digests"])
        assert sub.wait_for(latest, timeout=60)
    finally:
        stop.set()
        thread.join(timeout=30)
        sub.close()

    final = torch.load(tmp_path / "final.pt")
    published = set(result["digests"].values())
    assert held and set(held) <= published  # never a partial version
    assert model_digest(follower) == result["digests"][str(latest)]
    for name, param in follower.named_parameters():
        assert torch.equal(param.detach().view(torch.int16), final[name].view(torch.int16)), name

    late = make_model(seed=2).to(torch.bfloat16)
    info = Subscriber(open_store(url, **options), TorchModuleApplier(late)).update()
    assert info is not None and info.version == latest and info.route[0] == "anchor"
    assert model_digest(late) == result["digests"][str(latest)]

    # The manifest lists one object per rank; each carries only that rank's rows.
    store = open_store(url, **options)
    manifest = Manifest.from_bytes(store.get("manifest.json"))
    # HSDP: the second replicate group holds copies of the first group's shards and uploads nothing.
    writers = list(range(world // 2 if mode == "hsdp" else world))
    anchors = [e for e in manifest.versions if e.anchor]
    assert anchors and all(sorted({r.rank for r in e.anchor}) == writers for e in anchors)
    for entry in manifest.versions:
        assert {r.rank for r in entry.objects()} <= set(range(world))
    numel = manifest.numel
    for ref in manifest.entry(latest).delta:  # type: ignore[union-attr]
        header = read_header(store.get(ref.key))
        assert sum(e.local_spec.numel for e in header.tensors.values()) < numel
        assert all(e.rows is not None for e in header.tensors.values() if e.spec.shape)
    assert [r["bytes"] > 0 for r in result["ranks"]] == [rank in writers for rank in range(world)]
    store.close()


@pytest.mark.slow
@pytest.mark.parametrize("mode", ["ddp", "fsdp"])
def test_zero_element_tensors_are_carried_by_rank_0_and_the_store_is_followed(mode: str, tmp_path: Path) -> None:
    """Anchors carry every tensor, the empty ones too (rank 0 writes them); a replica follows the run."""
    url = str(tmp_path / "run")
    result = _run_ranks(2, mode, url, {}, tmp_path, empty=True)
    latest = max(int(v) for v in result["digests"])
    replica = make_model(seed=2, empty=True).to(torch.bfloat16)
    info = Subscriber(url, TorchModuleApplier(replica)).update()
    assert info is not None and info.version == latest and info.route[0] == "anchor"
    assert model_digest(replica) == result["digests"][str(latest)]
    store = open_store(url)
    manifest = Manifest.from_bytes(store.get("manifest.json"))
    carried = {}
    for ref in manifest.anchors()[-1].anchor:
        carried.update({name: (ref.rank, e) for name, e in read_header(store.get(ref.key)).tensors.items()})
    for name, shape in (("no_rows", (0, 4)), ("no_cols", (4, 0))):
        rank, entry = carried[name]
        assert rank == 0 and entry.spec.shape == shape and entry.nnz == 0 and entry.rows is None


@pytest.mark.slow
def test_a_failed_shard_fails_the_version_on_every_rank_and_the_next_covers_it(servers: Any, tmp_path: Path) -> None:
    s3 = servers["get"]("s3")
    url, options = s3.store_url(f"sharded-{uuid.uuid4().hex[:8]}"), s3.store_options()
    result = _run_ranks(2, "ddp", url, options, tmp_path, fail={"rank": 1, "prefix": "deltas/0000000002"})
    assert [r["failures"] for r in result["ranks"]] == [1, 1]
    assert sorted(int(v) for v in result["digests"]) == list(range(STEPS))  # one step folded into the next
    store = open_store(url, **options)
    manifest = Manifest.from_bytes(store.get("manifest.json"))
    named = {r.key for e in manifest.versions for r in e.objects()} | {k for k, _ in manifest.retired}
    stored = {i.key for i in store.list("deltas/")} | {i.key for i in store.list("anchors/")}
    assert named <= stored and stored == named  # the failed version's other shard was removed
    replica = make_model(seed=3).to(torch.bfloat16)
    assert Subscriber(store, TorchModuleApplier(replica)).update() is not None
    final = torch.load(tmp_path / "final.pt")
    for name, param in replica.named_parameters():
        assert torch.equal(param.detach().view(torch.int16), final[name].view(torch.int16)), name


@pytest.mark.slow
@pytest.mark.parametrize(
    "mode",
    ["fsdp2", "fsdp1", *[pytest.param(mode, marks=pytest.mark.skipif(
        importlib.util.find_spec("deepspeed") is None or importlib.util.find_spec("peft") is None,
        reason="deepspeed and peft are not installed")) for mode in ("zero3", "zero3-lora", "zero3-lora-adapter")]],
)
def test_trainer_callback_on_fsdp_ranks_publishes_and_waits_on_policy(mode: str, tmp_path: Path) -> None:
    """DeltaSyncCallback's hooks on 2 sharded ranks: FSDP2 and ZeRO-3 publish a shard per rank, FSDP1 (a unit
    at a time) and a LoRA model under ZeRO-3 (a layer at a time) gather (every rank takes part) and rank 0
    publishes; rank 0 waits for
    the replica; the replica ends bit-exact (a LoRA run: with PEFT's merge_and_unload of the final model,
    or with the adapter's own bits when it publishes the adapter)."""
    url = str(tmp_path / "store")
    replica = dict(make_model(seed=1).to(torch.bfloat16).named_parameters())
    if mode == "zero3-lora-adapter":  # base weights in bf16 and the factors in their own dtype, as published
        from deltasync.publish.lora import LoraWeights
        from tests.sharded_helpers import lora

        weights = LoraWeights(lora(make_model(seed=1)), mode="adapter")
        replica = {n: t.detach().clone().to(t.dtype if n in weights.own_dtype else torch.bfloat16)
                   for n, t in weights.items()}
    stop = threading.Event()
    sub = Subscriber(
        url, TorchModuleApplier(replica, dtype=None), replica_id="replica-0", poll_interval=0.01,
        max_poll_interval=0.05,
    )
    thread = threading.Thread(target=sub.run, args=(stop,), daemon=True)
    thread.start()
    try:
        mp.start_processes(
            callback_main, args=(2, f"file://{tmp_path / 'rendezvous'}", STEPS, url, str(tmp_path), mode),
            nprocs=2, start_method="spawn", join=True,
        )
        errors = sorted(tmp_path.glob("error-*.txt"))
        assert not errors, errors[0].read_text()
        result = json.loads((tmp_path / "result.json").read_text())
        assert sub.wait_for(result["version"], timeout=60)
    finally:
        stop.set()
        thread.join(timeout=30)
        sub.close()
    assert result["version"] == STEPS, result  # the anchor, then one version per step
    assert result["logs"]["deltasync/bytes"] > 0 and "deltasync/sparsity" in result["logs"]
    final = torch.load(tmp_path / "final.pt")
    assert replica.keys() == final.keys()
    for name, held in replica.items():
        bits = torch.int16 if held.element_size() == 2 else torch.int32
        assert torch.equal(held.view(bits), final[name].to(held.dtype).view(bits)), name
    if mode == "zero3-lora-adapter":
        assert result["logs"]["deltasync/adapter_form"] == 1.0
    if mode == "zero3-lora":  # merged weights: gathered a layer at a time, never the whole model at once
        assert result["gathers"] and max(result["gathers"]) < result["parameters"], result
    if mode == "fsdp1":  # one FSDP unit at a time (3 per version), never with its nested units
        assert len(result["summons"]) == 3 * (STEPS + 1) and not any(result["summons"]), result["summons"]
    manifest = Manifest.from_bytes(open_store(url).get("manifest.json"))
    expected = {0, 1} if mode in ("fsdp2", "zero3") else {None}  # gathered: rank 0 publishes whole versions
    assert all({r.rank for r in e.objects()} == expected for e in manifest.versions)


def test_chunk_rows_matches_torch_chunk() -> None:
    for n in range(0, 12):
        for parts in (1, 2, 3, 4, 5):
            chunks = torch.arange(n).chunk(parts) if n else ()
            for index in range(parts):
                start, stop = chunk_rows(n, parts, index)
                expected = chunks[index].tolist() if index < len(chunks) else []
                assert list(range(start, stop)) == expected


def test_layout_of_a_data_parallel_rank_splits_rows_and_keeps_full_specs() -> None:
    model = make_model()
    layouts = [shard_layout(model, rank=r, world=3)[0] for r in range(3)]
    assert all(layout.specs == layouts[0].specs for layout in layouts)
    for name, param in model.named_parameters():
        covered = sorted(layout.rows[name] for layout in layouts if name in layout.rows)
        assert covered[0][0] == 0 and covered[-1][1] == param.shape[0]
        assert all(a[1] == b[0] for a, b in zip(covered, covered[1:]))


def test_layer_groups_cut_names_by_decoder_layer() -> None:
    from deltasync.integrations.distributed import layer_groups

    names = ["model.embed_tokens.weight", "model.layers.0.q.weight", "model.layers.0.k.weight",
             "model.layers.1.q.weight", "model.layers.10.q.weight", "model.norm.weight", "lm_head.weight"]
    assert layer_groups(names) == [
        ["model.embed_tokens.weight"], ["model.layers.0.q.weight", "model.layers.0.k.weight"],
        ["model.layers.1.q.weight"], ["model.layers.10.q.weight"], ["model.norm.weight", "lm_head.weight"],
    ]
    assert layer_groups(["w", "b"]) == [["w", "b"]]
