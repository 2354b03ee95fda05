"""PEFT / LoRA models published as their exact merged weights, never touching the trainer's weights.

A LoRA run trains small adapter matrices beside frozen base weights. A replica
that loaded the *base* checkpoint serves the trained policy once it holds the
merged weights ``W + scale * (B @ A)``. :class:`MergedWeights` is a read-only
``Mapping[str, Tensor]`` of those merged weights in the base model's
checkpoint names (what its ``save_pretrained`` writes and vLLM loads, e.g.
``model.layers.0.self_attn.q_proj.weight``), for :class:`~deltasync.Publisher`:

- The weight of a LoRA ``Linear`` or ``Embedding`` layer is merged when it is
  read, into a fresh tensor, with PEFT's own arithmetic: the layer's
  ``get_delta_weight`` for each active adapter in turn, added to the base
  weight as ``merge_and_unload()`` adds it (``fan_in_fan_out``,
  rsLoRA scaling, several active adapters and ``lora_bias`` come out as PEFT
  merges them; dropout plays no part). The result is bit-identical to what
  ``merge_and_unload()`` leaves in the weights on the same device, and a
  replica ends bit-identical to its cast to the published dtype: the weights
  an engine loads from the merged checkpoint. With fp32 masters that is the
  fp32 sum rounded once to bf16. With a bf16 base and several active adapters
  PEFT rounds to bf16 after each adapter, and so does this (one fp32 sum
  rounded once would differ from it in many elements).
- Every other tensor is the base parameter itself (zero copy); fused MoE
  experts come out per expert, as for a plain model
  (:mod:`deltasync.tensors.saved_layout`).
- A ``modules_to_save`` module is published under the base module's name (the
  active adapter's copy); adapter tensors (``lora_*``) and the frozen
  ``original_module`` copies are not published.

Why not merge in place, as TRL does around each vLLM sync
(``merge_adapter()``, copy, ``unmerge_adapter()``): ``W + d - d`` is not ``W``
in floating point, so an fp32 base drifts by a rounding step in some elements
at every sync, and the trainer's frozen weights change (over a short run most
of the adapted fp32 base elements move, ``tests/test_peft.py``). Here they are
only read.

Cost: a pass over the mapping computes each merged tensor once, one layer at a
time, on the weight's device: PEFT's delta (one layer-sized scratch in the
adapter's dtype) added to the base weight straight into the published dtype
(summed in fp32 and rounded once, as a cast of the fp32 sum would be). The
tensors of one pass stay referenced until the pass ends (:func:`~deltasync.publish.diff.snapshot.diff` collects the whole
mapping before comparing, and a freed tensor's address could otherwise come
back for the next one and be taken for an alias), so a publish holds one
published-dtype copy of the adapted layers (2 bytes per adapted parameter in
bf16) while it diffs. :class:`~deltasync.Publisher` reads the mapping once when
it is made and once per publish.

Limitations (refused with :class:`~deltasync.errors.ConfigError`, naming what):

- LoRA only: other PEFT tuners (IA3, LoHa, LoKr, prefix and prompt tuning...),
  LoRA variants whose merge differs (DoRA and the others PEFT keeps in
  ``lora_variant``), LoRA on layers other than ``nn.Linear`` / ``nn.Embedding``
  (convolutions, raw parameters through ``target_parameters``, quantized or
  tensor-parallel layers) and ``trainable_token_indices``.
- LoRA or ``modules_to_save`` on a tied weight (``lm_head`` tied to
  ``embed_tokens``): the trained model uses two different tensors there, the
  base checkpoint holds one.
- LoRA or ``modules_to_save`` on a fused MoE expert parameter (LoRA on the
  attention and dense layers of an MoE model is fine).
- A layer whose adapter is merged into its weights at read time
  (``merge_adapter()`` not undone) raises ``RuntimeError``.
- Sharded models (FSDP, DeepSpeed ZeRO-3): merging needs whole base weights (the TRL callback
  reads a ZeRO-3 model inside a gather around each publish, where they are whole).
- Names are fixed when the mapping is made (add adapters to new layers before);
  active adapters and scaling are read on every pass.
"""

from __future__ import annotations

from collections.abc import ItemsView, Iterator, Mapping
from dataclasses import dataclass
from typing import Any

import torch

from ..errors import ConfigError, require
from ..tensors.saved_layout import View, checkpoint_plan

__all__ = ["MergedWeights", "is_peft_model"]

# The tuner a PeftConfig names for LoRA (peft.PeftType.LORA); every other one is refused.
LORA = "LORA"


def is_peft_model(model: Any) -> bool:
    """Whether ``model`` carries PEFT adapters (a ``PeftModel``, or a transformers model with adapters loaded)."""
    return hasattr(model, "peft_config")


@dataclass(frozen=True, slots=True)
class _Param:
    """A base parameter read as it is (or as a checkpoint view of it)."""

    owner: torch.nn.Module
    attr: str
    view: View | None = None

    def read(self) -> torch.Tensor:
        param = getattr(self.owner, self.attr).detach()
        v = self.view
        return param if v is None else param.as_strided(v.size, v.stride, param.storage_offset() + v.offset)


@dataclass(frozen=True, slots=True)
class _Lora:
    """A LoRA layer's base weight (or bias, with ``lora_bias``), merged with its active adapters."""

    layer: Any
    attr: str


@dataclass(frozen=True, slots=True)
class _Saved:
    """A ``modules_to_save`` parameter: the active adapter's copy, else the original module's."""

    wrapper: Any
    path: str


_Source = _Param | _Lora | _Saved


class MergedWeights(Mapping[str, torch.Tensor]):
    """A PEFT LoRA model's merged weights in the base checkpoint's names, computed on read; the model is never written.

    Args:
        model: a ``peft.PeftModel`` with LoRA adapters (or a transformers model with LoRA adapters loaded).
        dtype (`torch.dtype`, *optional*, defaults to `torch.bfloat16`): dtype of the merged tensors handed
            out: the :class:`~deltasync.Publisher`'s ``dtype`` (``None``: the base weight's own dtype).
        merge (`bool`, *optional*, defaults to `True`): ``False`` hands out the LoRA layers' frozen base
            weights instead (zero copy): the base half of a LoRA run's adapter form (:mod:`deltasync.publish.lora`).

    Raises:
        `ConfigError`: a tuner, layer or weight tying that merged weights cannot express (see the module doc).

    Example:
        ```python
        >>> model = peft.get_peft_model(base, peft.LoraConfig(r=16, target_modules="all-linear"))
        >>> publisher = Publisher(MergedWeights(model), "./run1")   # replicas load the base checkpoint
        >>> publisher.publish(step)                                  # W + scale * (B @ A), exactly
        ```
    """

    def __init__(self, model: Any, *, dtype: torch.dtype | None = torch.bfloat16, merge: bool = True) -> None:
        require("peft", "peft")
        if not is_peft_model(model):
            raise ConfigError(f"{type(model).__name__} has no PEFT adapters: publish it directly", argument="model")
        for adapter, config in dict(model.peft_config).items():
            kind = getattr(config, "peft_type", None)
            kind = str(getattr(kind, "value", kind))
            if kind != LORA:
                raise ConfigError(
                    f"adapter {adapter!r} uses the {kind} tuner; deltasync publishes merged weights of LoRA "
                    "adapters only (IA3, LoHa, LoKr, prompt and prefix tuning have no merged form here)",
                    argument="model",
                )
        self.model = model
        self.dtype = dtype
        self.merge = merge
        self._embedding = require("peft.tuners.lora", "peft").Embedding  # merges with a cast first
        base = model.get_base_model() if hasattr(model, "get_base_model") else model
        self._sources = _checkpoint_names(base, _Walk().run(base))

    @property
    def merged_names(self) -> tuple[str, ...]:
        """Names whose tensors are computed from a LoRA layer (the others are base parameters)."""
        return tuple(n for n, s in self._sources.items() if isinstance(s, _Lora))

    def parameters_of(self, name: str) -> list[torch.nn.Parameter]:
        """The model's parameters that reading ``name`` reads (a sharded trainer gathers them first)."""
        source = self._sources[name]
        if isinstance(source, _Param):
            return [getattr(source.owner, source.attr)]
        if isinstance(source, _Saved):
            return list(source.wrapper.parameters())
        return list(source.layer.parameters())

    def __getitem__(self, name: str) -> torch.Tensor:
        source = self._sources[name]
        if isinstance(source, _Param):
            return source.read()
        if isinstance(source, _Saved):
            wrapper = source.wrapper
            active = [a for a in wrapper.active_adapters if a in wrapper.modules_to_save]
            module = wrapper.modules_to_save[active[0]] if active else wrapper.original_module
            return module.get_parameter(source.path).detach()
        return self._merge(name, source)

    def __iter__(self) -> Iterator[str]:
        return iter(self._sources)

    def __len__(self) -> int:
        return len(self._sources)

    def __contains__(self, name: object) -> bool:
        return name in self._sources  # Mapping's default would compute the tensor

    def items(self) -> ItemsView[str, torch.Tensor]:
        """``(name, tensor)`` pairs; every merged tensor of a pass stays referenced until the pass ends."""
        return _KeptItems(self)

    def _merge(self, name: str, source: _Lora) -> torch.Tensor:
        layer, embedding = source.layer, isinstance(source.layer, self._embedding)
        if layer.merged:
            raise RuntimeError(
                f"{name}: adapter(s) {layer.merged_adapters} are merged into the base weights; call "
                "unmerge_adapter() first (deltasync merges into a copy and never needs merge_adapter())"
            )
        weights = layer.lora_embedding_A if embedding else layer.lora_A
        adapters = [a for a in layer.active_adapters if a in weights] if self.merge else []
        _check_variants(layer, adapters, name)
        if source.attr == "bias":
            adapters = [a for a in adapters if layer.lora_bias.get(a)]
        merged = getattr(layer.get_base_layer(), source.attr).detach()
        if not adapters:
            return merged
        base_dtype = merged.dtype
        with torch.no_grad():
            for i, adapter in enumerate(adapters):
                if source.attr == "bias":
                    delta = layer.lora_B[adapter].bias * layer.scaling[adapter]
                elif embedding:
                    delta = layer.get_delta_weight(adapter).to(base_dtype)  # lora.Embedding.merge casts first
                else:
                    delta = layer.get_delta_weight(adapter)  # lora.Linear.merge adds in the promoted dtype
                # PEFT's in-place ``weight += delta`` adds in the promoted dtype and rounds to the weight's dtype;
                # the last sum is rounded to the published dtype instead (the same single rounding as casting
                # the merged fp32 weight), which saves a full fp32 copy and a cast pass per layer.
                last = i == len(adapters) - 1 and self.dtype is not None and base_dtype in (torch.float32, self.dtype)
                out = torch.empty(merged.shape, dtype=self.dtype if last else base_dtype, device=merged.device)
                merged = torch.add(merged, delta, out=out)
                del delta
        return merged if self.dtype is None else merged.to(self.dtype)  # no copy when it is already


class _KeptItems(ItemsView[str, torch.Tensor]):
    """A pass over the mapping that keeps what it handed out until it ends (see the module doc)."""

    _mapping: MergedWeights

    def __iter__(self) -> Iterator[tuple[str, torch.Tensor]]:
        kept = []
        for name in self._mapping:
            tensor = self._mapping[name]
            kept.append(tensor)
            yield name, tensor


class _Walk:
    """The base model's published tensors, module by module, in ``named_parameters`` order."""

    def __init__(self) -> None:
        from peft.tuners import lora
        from peft.tuners.tuners_utils import BaseTunerLayer
        from peft.utils.other import AuxiliaryTrainingWrapper, ModulesToSaveWrapper

        self.lora_types = (lora.Linear, lora.Embedding)
        self.tuner, self.aux, self.saved = BaseTunerLayer, AuxiliaryTrainingWrapper, ModulesToSaveWrapper
        self.out: dict[str, _Source] = {}
        self.aliases: dict[str, str] = {}  # the PEFT model's parameter name -> published name
        self.first: dict[int, str] = {}  # parameter id -> the name it is published under
        self.uses: dict[int, list[str]] = {}  # parameter id -> every name it has (tied weights have several)
        self.special: dict[int, str] = {}  # ids of weights that LoRA or modules_to_save replace

    def run(self, base: torch.nn.Module) -> _Walk:
        self._module(base, "")
        tied = [self.uses[i] for i in self.special if len(self.uses[i]) > 1]
        if tied:
            raise ConfigError(
                f"{tied[0][0]!r} and {tied[0][1]!r} share one weight, and a LoRA adapter or modules_to_save "
                "replaces it under one name only: the trained model uses two different tensors where the base "
                "checkpoint holds one. Leave tied weights out of target_modules / modules_to_save",
                argument="model",
            )
        return self

    def _add(self, name: str, source: _Source, param: torch.Tensor, *, alias: str | None = None) -> None:
        self.uses.setdefault(id(param), []).append(name)
        if isinstance(source, _Param) and id(param) in self.first:
            return  # a tied parameter: published once, under its first name (as named_parameters does)
        self.first.setdefault(id(param), name)
        self.out[name] = source
        if alias is not None:
            self.aliases[alias] = name

    def _module(self, module: torch.nn.Module, prefix: str) -> None:
        if isinstance(module, self.tuner):
            return self._lora(module, prefix)
        if isinstance(module, self.aux):
            return self._saved(module, prefix)
        for attr, param in module.named_parameters(recurse=False):
            self._add(prefix + attr, _Param(module, attr), param)
        for child, sub in module.named_children():
            self._module(sub, f"{prefix}{child}.")
        return None

    def _lora(self, layer: Any, prefix: str) -> None:
        where = prefix.rstrip(".")
        if type(layer) not in self.lora_types:
            raise ConfigError(
                f"{where!r} is a {type(layer).__module__}.{type(layer).__name__} layer; deltasync merges LoRA on "
                "nn.Linear and nn.Embedding only (not other tuners, convolutions, target_parameters, quantized "
                "or tensor-parallel layers)",
                argument="model",
            )
        _check_variants(layer, list(layer.lora_variant), where)
        base = layer.base_layer
        if isinstance(base, self.tuner):
            raise ConfigError(f"{where!r} stacks two tuner layers; deltasync merges one LoRA layer", argument="model")
        for attr, param in base.named_parameters():
            merged = attr == "weight" or (attr == "bias" and any(layer.lora_bias.values()))
            path, _, leaf = attr.rpartition(".")
            source = _Lora(layer, attr) if merged else _Param(base.get_submodule(path), leaf)
            if merged:
                self.special[id(param)] = prefix + attr
            self._add(prefix + attr, source, param, alias=f"{prefix}base_layer.{attr}")

    def _saved(self, wrapper: Any, prefix: str) -> None:
        where = prefix.rstrip(".")
        if type(wrapper) is not self.saved:
            raise ConfigError(
                f"{where!r} is a {type(wrapper).__name__} (trainable_token_indices); deltasync publishes LoRA "
                "layers and modules_to_save only",
                argument="model",
            )
        if any(isinstance(m, self.tuner) for copy in wrapper.modules_to_save.values() for m in copy.modules()):
            raise ConfigError(f"{where!r}: a modules_to_save copy holds a tuner layer", argument="model")
        for attr, param in wrapper.original_module.named_parameters():
            self.special[id(param)] = prefix + attr
            self._add(prefix + attr, _Saved(wrapper, attr), param, alias=f"{prefix}original_module.{attr}")
            for adapter in wrapper.modules_to_save:
                self.aliases[f"{prefix}modules_to_save.{adapter}.{attr}"] = prefix + attr


def _check_variants(layer: Any, adapters: list[str], where: str) -> None:
    """Refuse LoRA variants (DoRA...) whose merge is not ``W + scale * (B @ A)``."""
    for adapter in adapters:
        variant = layer.lora_variant.get(adapter)
        if variant is not None:
            what = "DoRA" if layer.use_dora.get(adapter) else type(variant).__name__
            raise ConfigError(
                f"{where!r}: adapter {adapter!r} is a {what} adapter, whose merge is not W + scale * (B @ A); "
                "deltasync publishes plain LoRA",
                argument="model",
            )


def _checkpoint_names(base: torch.nn.Module, walk: _Walk) -> dict[str, _Source]:
    """The walk's tensors in the checkpoint's names: fused MoE experts as per-expert views.

    The plan comes from :func:`~deltasync.tensors.saved_layout.checkpoint_plan`, learned on the wrapped
    base model (PEFT's names) or, if it was asked before the adapters were added, on the bare one.
    """
    plan = checkpoint_plan(base)
    if plan is None:
        return walk.out
    out: dict[str, _Source] = {}
    for ckpt, view in plan.items():
        name = walk.aliases.get(view.source, view.source)
        source = walk.out.get(name)
        if source is None:
            continue  # an adapter tensor (lora_*): not published
        param = getattr(source.owner, source.attr) if isinstance(source, _Param) else None
        if param is not None and not _whole(view, param):
            out[ckpt] = _Param(source.owner, source.attr, view)
        elif param is None and (ckpt != view.source or view.offset or view.size != _shape(source)):
            raise ConfigError(
                f"{name!r} has a LoRA adapter or modules_to_save but its checkpoint stores it otherwise "
                f"({ckpt!r}, e.g. fused MoE experts split per expert): not supported; target other modules",
                argument="model",
            )
        else:
            out[name if ckpt == view.source else ckpt] = source
    missing = walk.out.keys() - {walk.aliases.get(v.source, v.source) for v in plan.values()}
    if missing:
        raise ConfigError(
            f"the checkpoint names of {sorted(missing)[:3]} are unknown (the model changed after deltasync "
            "first read it?): make the MergedWeights before any other deltasync object reads the model",
            argument="model",
        )
    return out


def _whole(view: View, param: torch.Tensor) -> bool:
    return view.offset == 0 and view.size == tuple(param.shape) and view.stride == tuple(param.stride())


def _shape(source: _Source) -> tuple[int, ...]:
    if isinstance(source, _Lora):
        return tuple(getattr(source.layer.get_base_layer(), source.attr).shape)
    assert isinstance(source, _Saved)
    return tuple(source.wrapper.original_module.get_parameter(source.path).shape)
