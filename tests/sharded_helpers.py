"""What the trainer ranks of the sharded-publishing tests run (importable by spawned children).

Each rank joins a gloo process group, builds the same small model, shards it
with FSDP2 (``fully_shard``) or DeepSpeed ZeRO-3, or wraps it in DistributedDataParallel, trains a
few AdamW steps on its own batches and publishes every step with
:class:`~deltasync.publish.sharded.ShardedPublisher`. After each publish every rank
takes part in materialising the full weights (``full_tensor()``, a collective)
so rank 0 can record what the version must hold: the reference the replicas
are compared with, bit for bit. The reference is for the test only; the
publisher itself never gathers the model.
"""

from __future__ import annotations

import gc
import json
import os
import sys
import traceback
from pathlib import Path
from typing import Any

import torch

from tests.mp_helpers import digest, make_model

LR = 1e-3  # large enough that a 10k-parameter model changes visibly every step


def _zero3_engine(model: torch.nn.Module, rank: int, stage: int = 3) -> tuple[Any, Any]:
    """A real DeepSpeed ZeRO engine on CPU (gloo) around ``model``: under stage 3 each rank keeps a flat
    slice per parameter; under stages 1 and 2 every rank holds every parameter (optimizer state is split)."""
    os.environ.setdefault("DS_ACCELERATOR", "cpu")
    os.environ["LOCAL_RANK"] = str(rank)  # what a launcher would set; this rank joined the group already
    import deepspeed

    config = {
        "train_micro_batch_size_per_gpu": 8,
        "gradient_accumulation_steps": 1,
        "zero_optimization": {"stage": stage},
        "optimizer": {"type": "AdamW", "params": {"lr": LR, "torch_adam": True}},
    }
    trainable = [p for p in model.parameters() if p.requires_grad]  # all of them, but a LoRA model's factors
    engine, optimizer, _, _ = deepspeed.initialize(model=model, config=config, model_parameters=trainable)
    return engine, optimizer


def full_state(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """Every parameter as a full tensor (a collective for DTensors and ZeRO-3), names without DDP's prefix."""
    if hasattr(model, "zero_optimization_partition_weights"):  # a DeepSpeed engine
        import deepspeed

        params = list(model.module.named_parameters())
        with deepspeed.zero.GatheredParameters([p for _, p in params]):
            return {name: param.detach().clone() for name, param in params}
    out = {}
    for name, param in model.named_parameters():
        if not param.numel():  # (DTensor.full_tensor fails on a zero-element tensor)
            tensor = torch.empty(param.shape, dtype=param.dtype)
        else:
            tensor = param.full_tensor() if hasattr(param, "full_tensor") else param
        out[name.removeprefix("module.")] = tensor.detach().clone()
    return out


def lora(model: torch.nn.Module) -> Any:
    """``model`` with LoRA on both Linear layers (factors initialised non-zero: merging changes every weight)."""
    import peft

    return peft.get_peft_model(model, peft.LoraConfig(r=4, lora_alpha=8, target_modules=["0", "3"],
                                                      init_lora_weights=False))


def merged_by_peft(state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """What the merged weights of a LoRA model with parameters ``state`` are, by PEFT's own
    ``merge_and_unload`` on a fresh unsharded copy: the reference for a ZeRO-3 LoRA run."""
    model = lora(make_model(seed=0))
    model.load_state_dict(state)
    return {name: param.detach().clone() for name, param in model.merge_and_unload().named_parameters()}


def adapter_form(state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """The adapter form (base weights and the factors' own bits) of a LoRA model with parameters ``state``,
    read on a fresh unsharded copy: the reference for a ZeRO-3 LoRA run published with ``lora="adapter"``."""
    from deltasync.publish.lora import LoraWeights

    model = lora(make_model(seed=0))
    model.load_state_dict(state)
    form = LoraWeights(model, mode="adapter").forms()["adapter"]
    return {name: tensor.detach().clone() for name, tensor in form.items()}


def fsdp1_state(model: Any) -> dict[str, torch.Tensor]:
    """Every parameter of an FSDP1 model, gathered on all ranks, under its checkpoint name."""
    from torch.distributed.fsdp import FullyShardedDataParallel

    with FullyShardedDataParallel.summon_full_params(model, writeback=False):
        return {n.replace("_fsdp_wrapped_module.", ""): p.detach().clone() for n, p in model.named_parameters()}


def _run_rank(body: Any, rank: int, world: int, init: str, out: str, *args: Any) -> None:
    """Join the gloo group, run ``body(rank, world, *args)``, record a failure, and tear down in order.

    The model and the publisher are dropped, and their reference cycles collected (FSDP's
    hooks hold the model, the model holds process groups), before ``destroy_process_group``:
    a gloo group that survives until interpreter exit aborts the process there (SIGABRT,
    "terminate called without an active exception"), about one run in four. Objects that still
    hold a group after that (DDP's reducer, DeepSpeed's module globals) can abort the teardown
    anyway, so a rank whose work is done and recorded leaves without it.
    """
    import torch.distributed as dist

    dist.init_process_group("gloo", init_method=init, rank=rank, world_size=world)
    failed = False
    try:
        body(rank, world, *args)
    except BaseException:
        failed = True
        Path(out, f"error-{rank}.txt").write_text(traceback.format_exc())
        raise
    finally:
        gc.collect()
        dist.destroy_process_group()
        if not failed:
            # Whatever still holds a gloo group (DDP's reducer, DeepSpeed's process groups in module
            # globals) can abort the interpreter's teardown now and then. The work is done and recorded:
            # leave without that teardown. A failure is raised above, for the spawner to report.
            sys.stdout.flush()
            sys.stderr.flush()
            os._exit(0)


def rank_main(
    rank: int, world: int, init: str, mode: str, steps: int, url: str, options: dict[str, Any], out: str
) -> None:
    """One trainer rank; rank 0 writes ``result.json`` (digests per version) and ``final.pt``."""
    _run_rank(_publishing_rank, rank, world, init, out, mode, steps, url, options, out)


def _publishing_rank(
    rank: int, world: int, mode: str, steps: int, url: str, options: dict[str, Any], out: str
) -> None:
    import torch.distributed as dist

    from deltasync.errors import StoreError
    from deltasync.publish.sharded import ShardedPublisher
    from deltasync.stores import open_store

    torch.set_num_threads(1)
    options = dict(options)
    fail = options.pop("fail", None)  # {"rank": r, "prefix": p}: that rank's next put under p fails
    empty = options.pop("empty", False)  # the model has zero-element parameters too
    store: Any = url
    if fail is not None and fail["rank"] == rank:
        from tests.faults import FaultyStore

        store = FaultyStore(open_store(url, **options))
        store.inject("put", fail["prefix"])
        options = {}
    failures = 0
    model = make_model(seed=0, empty=empty)
    if mode in ("fsdp", "hsdp"):
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.fsdp import fully_shard

        # HSDP: shard within groups of world/2 ranks, replicate across the two groups.
        mesh = None
        if mode == "hsdp":
            mesh = init_device_mesh("cpu", (2, world // 2), mesh_dim_names=("replicate", "shard"))
        for layer in model:
            if isinstance(layer, torch.nn.Linear):
                fully_shard(layer, mesh=mesh)
        fully_shard(model, mesh=mesh)
        published: Any = model
    elif mode in ("zero1", "zero2", "zero3"):
        model, optimizer = _zero3_engine(model, rank, stage=int(mode[-1]))
        published = model.module
    else:
        model = torch.nn.parallel.DistributedDataParallel(model, find_unused_parameters=empty)
        published = model.module
    deepspeed = mode.startswith("zero")
    if not deepspeed:
        optimizer = torch.optim.AdamW(model.parameters(), lr=LR)
    digests: dict[int, str] = {}
    with ShardedPublisher(published, store, **options) as publisher:
        for step in range(steps + 1):
            if step:
                g = torch.Generator().manual_seed(1000 * step + rank)  # each rank its own batch
                x = torch.randn(8, 48, generator=g)
                loss = (model(x) - x).pow(2).mean()
                if deepspeed:
                    model.backward(loss)
                    model.step()
                else:
                    loss.backward()
                    optimizer.step()
                    optimizer.zero_grad()
            before = publisher.version
            publisher.publish(step, block=True)  # block: one version per step, so digests map to versions
            try:
                publisher.flush()
            except StoreError:
                failures += 1  # every rank sees the failed version; the next one covers it
            state = full_state(model)
            if rank == 0 and publisher.version != before:
                digests[publisher.version] = digest(state.items())  # type: ignore[index]
        stats = {"published": publisher.stats.published, "bytes": publisher.stats.bytes, "failures": failures}
    state = full_state(model)
    gathered: list[Any] = [None] * world
    dist.all_gather_object(gathered, stats)
    if rank == 0:
        torch.save({k: v.to(torch.bfloat16) for k, v in state.items()}, os.path.join(out, "final.pt"))
        Path(out, "result.json").write_text(json.dumps({"digests": digests, "ranks": gathered}))


def callback_main(rank: int, world: int, init: str, steps: int, url: str, out: str, mode: str = "fsdp2") -> None:
    """One FSDP2 (or FSDP1) rank driving DeltaSyncCallback's Trainer hooks as a Trainer would, in lockstep."""
    torch.set_num_threads(1)
    _run_rank(_callback_rank, rank, world, init, out, steps, url, out, mode)


def _callback_rank(rank: int, world: int, steps: int, url: str, out: str, mode: str) -> None:
    import transformers
    from torch.distributed.fsdp import fully_shard

    from deltasync.integrations import DeltaSyncCallback

    model = make_model(seed=0)
    engine = None
    gathers: list[int] = []  # parameters per ZeRO-3 gather the callback makes (LoRA)
    summons: list[bool] = []  # per FSDP1 gather the callback makes: whether it gathered nested units too
    if mode == "fsdp1":  # each Linear its own unit, the LayerNorm in the root's, as a wrap policy would
        from torch.distributed.fsdp import FullyShardedDataParallel
        from torch.distributed.fsdp.wrap import ModuleWrapPolicy

        model = FullyShardedDataParallel(model, device_id=torch.device("cpu"),
                                         auto_wrap_policy=ModuleWrapPolicy({torch.nn.Linear}))
        summon = FullyShardedDataParallel.summon_full_params

        def counted_summon(module: Any, *args: Any, **kwargs: Any) -> Any:
            summons.append(bool(kwargs.get("recurse", True)) and any(
                isinstance(m, FullyShardedDataParallel) for m in list(module.modules())[1:]))
            return summon(module, *args, **kwargs)

        FullyShardedDataParallel.summon_full_params = counted_summon
    elif mode.startswith("zero3"):
        engine, _ = _zero3_engine(lora(model) if mode.startswith("zero3-lora") else model, rank)
        model = engine.module  # what the HF Trainer hands its callbacks under DeepSpeed
    else:
        for layer in model:
            if isinstance(layer, torch.nn.Linear):
                fully_shard(layer)
        fully_shard(model)
    optimizer = torch.optim.AdamW(model.parameters(), lr=LR) if engine is None else None
    if mode.startswith("zero3-lora"):
        import deepspeed

        gathered = deepspeed.zero.GatheredParameters

        def counted(params: Any, *args: Any, **kwargs: Any) -> Any:
            gathers.append(len(list(params)) if not isinstance(params, torch.nn.Parameter) else 1)
            return gathered(params, *args, **kwargs)

        deepspeed.zero.GatheredParameters = counted
    callback = DeltaSyncCallback(url, sync="on_policy", replicas=1, wait_timeout=120,
                                 lora="adapter" if mode.endswith("adapter") else "merged")
    state = transformers.TrainerState(is_world_process_zero=rank == 0, is_local_process_zero=rank == 0)
    callback.on_train_begin(None, state, None, model=model)
    logs: dict[str, float] = {}
    for step in range(1, steps + 1):
        g = torch.Generator().manual_seed(1000 * step + rank)
        x = torch.randn(8, 48, generator=g)
        if engine is not None:
            engine.backward((engine(x) - x).pow(2).mean())
            engine.step()
        else:
            (model(x) - x).pow(2).mean().backward()
            optimizer.step()
            optimizer.zero_grad()
        state.global_step = step
        callback.on_step_end(None, state, None)
        callback.sync()  # on_policy: rank 0 waits until the replica holds this step's version
        callback.on_log(None, state, None, logs=logs)
    callback.on_train_end(None, state, None)
    if mode.startswith("zero3-lora"):
        deepspeed.zero.GatheredParameters = gathered  # the checks below gather everything: not the callback's
    if mode == "fsdp1":
        FullyShardedDataParallel.summon_full_params = summon
    state_dict = {
        "fsdp2": lambda: full_state(model), "zero3": lambda: full_state(engine),
        "zero3-lora": lambda: merged_by_peft(full_state(engine)),
        "zero3-lora-adapter": lambda: adapter_form(full_state(engine)),
    }.get(mode, lambda: fsdp1_state(model))()
    if rank == 0:
        torch.save(state_dict, os.path.join(out, "final.pt"))  # the test casts to what the replica holds
        history = [[i.version, i.step, i.kind, i.form] for i in callback.history]
        Path(out, "result.json").write_text(json.dumps({
            "version": callback.version, "logs": logs, "history": history, "gathers": gathers, "summons": summons,
            "parameters": len(list(model.parameters())),
        }))
