"""LoRA runs published as whichever is smaller per version: merged weights, or the adapter itself.

The policy a LoRA run trains is ``W + s * B @ A``. :class:`LoraWeights` publishes
one fixed set of tensors that holds it in either of two exact forms
(:mod:`deltasync.publish.forms`):

- ``"merged"``: the base model's names carry the merged weights (as
  :class:`~deltasync.publish.peft.MergedWeights` computes them, in the published dtype)
  and the adapter's factors are zero. Any replica that loaded the base
  checkpoint serves the policy by applying deltas in place, as for full
  fine-tuning. Cheap at small learning rates, when few bf16 elements of the
  merged weights move per step.
- ``"adapter"``: the base names carry the frozen base weights and the factors
  carry the live adapter, bit for bit in its own dtype (fp32, not cast), in the
  names PEFT's ``save_pretrained`` writes (``base_model.model.<module>.lora_A.weight``).
  A vLLM replica loads them as a LoRA adapter (:func:`write_adapter`, and
  :class:`~deltasync.appliers.vllm.follower.VLLMFollower`'s ``lora=``). Cheap at
  LoRA learning rates (1e-4 and up), where the adapter is smaller than the
  merged weights' sparse delta.

``mode="auto"`` (the default) lets the :class:`~deltasync.Publisher` diff both
forms at every publish and commit the one estimated smaller on the wire, so a
run with a warm-up schedule starts merged and switches to the adapter as the
learning rate grows. Switching costs one larger delta (the base names move back
to, or away from, the base weights); the tie goes to the previous version's
form, and each form is judged on what it costs per version once adopted, not on
the switch (:mod:`deltasync.publish.forms`); leaving the adapter form is judged on its
whole way back (the merged weights' distance from the base weights), so a run
that reached it stays there unless that becomes cheaper than the adapter.
``"merged"`` or ``"adapter"`` forces one form (and one diff per publish).
In every form the same identity holds for a replica's tensors ``T``: the
served weights are ``T[base names] + s * T[B] @ T[A]``.

``modules_to_save`` copies are ordinary tensors under the base module's name
in both forms (they are applied in place, never part of the adapter).

Limitations (refused with :class:`~deltasync.errors.ConfigError`): those of
:class:`~deltasync.publish.peft.MergedWeights`; and in the adapter form one active
adapter, without ``lora_bias`` (vLLM's LoRA layers have no bias).
"""

from __future__ import annotations

import copy
from collections.abc import ItemsView, Iterator, Mapping
from pathlib import Path
from typing import Any, Literal

import torch

from ..errors import ConfigError, require
from ..tensors import TensorSpec
from .peft import MergedWeights, is_peft_model

__all__ = [
    "LORA_NAME", "LoraWeights", "LoraMode", "adapter_active", "adapter_specs", "load_config", "publishable",
    "write_adapter",
]

LoraMode = Literal["auto", "merged", "adapter"]
MODES: tuple[LoraMode, ...] = ("auto", "merged", "adapter")
LORA_NAME = "deltasync"
"""The name a vLLM server serves a run's adapter under (clients ask for ``model="deltasync"``)."""
CONFIG_NAME = "adapter_config.json"
WEIGHTS_NAME = "adapter_model.safetensors"


def publishable(
    model: Any, *, sharded: bool = False, options: Mapping[str, Any] | None = None, lora: LoraMode = "merged"
) -> Any:
    """What a trainer publishes for ``model``: the model itself, or for a PEFT model its LoRA policy.

    Args:
        model: the trainer's model.
        sharded (`bool`, *optional*): the parameters are sharded (FSDP, ZeRO-3): refused for PEFT models
            (the TRL callback publishes a ZeRO-3 PEFT model inside a gather, where they are whole).
        options (`Mapping`, *optional*): the publisher's options; their ``dtype`` is the base names' dtype.
        lora (`str`, *optional*, defaults to ``"merged"``): ``"merged"`` publishes
            :class:`~deltasync.publish.peft.MergedWeights` (base names only: any replica of the base model follows);
            ``"auto"`` or ``"adapter"`` publish :class:`LoraWeights` (replicas need the adapter's config).

    Raises:
        `ConfigError`: a PEFT model that cannot be published so (see the modules' docs).
    """
    if lora not in MODES:
        raise ConfigError(f"lora must be one of {MODES}, not {lora!r}", argument="lora")
    if not is_peft_model(model):
        return model
    if sharded:
        raise ConfigError(
            "a PEFT model is published from its whole base weights, and these are sharded parameters: under "
            "DeepSpeed ZeRO-3 publish it through DeltaSyncCallback (every rank gathers around each publish); "
            "under FSDP train the LoRA model with ZeRO-3, data parallel or unsharded",
            argument="model",
        )
    dtype = (options or {}).get("dtype", torch.bfloat16)
    if lora == "merged":
        return MergedWeights(model, dtype=dtype)
    return LoraWeights(model, mode=lora, dtype=dtype)


def adapter_factors(model: Any) -> Mapping[str, torch.Tensor]:
    """The active LoRA adapter's factors in PEFT's saved names, as the model's live parameters (no copies,
    each read when it is asked for: under DeepSpeed ZeRO-3 a parameter's data is replaced at every gather).

    Raises:
        `ConfigError`: not exactly one active adapter, or an adapter with ``lora_bias``.
    """
    from peft.utils import get_peft_model_state_dict

    active = _active_adapters(model)
    if len(active) != 1:
        raise ConfigError(
            f"the adapter form carries one LoRA adapter, and {active} are active: activate one, or publish "
            "the merged weights (lora='merged')",
            argument="model",
        )
    config = model.peft_config[active[0]]
    if getattr(config, "lora_bias", False):
        raise ConfigError(
            f"adapter {active[0]!r} trains a LoRA bias (lora_bias=True), which vLLM's LoRA layers do not load: "
            "publish the merged weights (lora='merged')",
            argument="model",
        )
    # save_pretrained's names drop the adapter's name from the parameters' (PEFT's own renaming).
    params = {n.replace(f".{active[0]}", ""): p for n, p in model.named_parameters() if ".lora_" in n}
    saved = [n for n in get_peft_model_state_dict(model, adapter_name=active[0]) if ".lora_" in n]
    unknown = [n for n in saved if n not in params]
    if unknown:
        raise ConfigError(f"adapter tensors {unknown[:3]} match no parameter of the model", argument="model")
    return _LiveParameters({n: params[n] for n in saved})


class _LiveParameters(Mapping[str, torch.Tensor]):
    """Parameters by name, each detached when read: a tensor detached once would keep the storage its
    parameter had then (under ZeRO-3, a gathered buffer that is later freed) instead of the live one."""

    def __init__(self, params: dict[str, torch.Tensor]) -> None:
        self._params = params

    def __getitem__(self, name: str) -> torch.Tensor:
        return self._params[name].detach()

    def __iter__(self) -> Iterator[str]:
        return iter(self._params)

    def __len__(self) -> int:
        return len(self._params)


class LoraWeights(Mapping[str, torch.Tensor]):
    """A PEFT LoRA model published in merged or adapter form, whichever is smaller (see the module doc).

    As a mapping it is its first allowed form (merged, unless ``mode="adapter"``):
    what the first version, an anchor, carries.

    Args:
        model: a ``peft.PeftModel`` with one active LoRA adapter.
        mode (`str`, *optional*, defaults to ``"auto"``): ``"auto"``, ``"merged"`` or ``"adapter"``.
        dtype (`torch.dtype`, *optional*, defaults to `torch.bfloat16`): the published dtype of the base
            names (the :class:`~deltasync.Publisher`'s ``dtype``); the factors keep their own.

    Raises:
        `ConfigError`: a model or adapter that this cannot publish (see the module doc).

    Example:
        ```python
        >>> model = peft.get_peft_model(base, peft.LoraConfig(r=16, target_modules="all-linear"))
        >>> publisher = Publisher(LoraWeights(model), "./run1")
        >>> publisher.publish(step)          # PublishInfo.form says which form was sent
        ```
    """

    def __init__(self, model: Any, *, mode: LoraMode = "auto", dtype: torch.dtype | None = torch.bfloat16) -> None:
        if mode not in MODES:
            raise ConfigError(f"lora mode must be one of {MODES}, not {mode!r}", argument="lora")
        require("peft", "peft")
        if not is_peft_model(model):
            raise ConfigError(f"{type(model).__name__} has no PEFT adapters: publish it directly", argument="model")
        self.mode = mode
        self.merged = MergedWeights(model, dtype=dtype)
        self.factors = adapter_factors(model)
        self.base = MergedWeights(model, dtype=dtype, merge=False)
        self._adapted = frozenset(self.merged.merged_names)  # the base weights the adapter form holds constant
        self.own_dtype = frozenset(self.factors)
        """Factors are published in their own dtype (their exact bits), whatever the publisher's ``dtype``."""
        self.config = _saved_config(model)
        """The adapter's ``LoraConfig`` as a replica's engine should load it (see :func:`write_adapter`)."""
        # Allocated once: a merged form's factors are zeros at every publish.
        self._zeros = {n: torch.zeros(t.shape, dtype=t.dtype, device=t.device) for n, t in self.factors.items()}

    def forms(self) -> dict[str, Mapping[str, torch.Tensor]]:
        """The allowed forms, by name, the default first (:class:`deltasync.publish.forms.Forms`)."""
        out: dict[str, Mapping[str, torch.Tensor]] = {}
        if self.mode != "adapter":
            out["merged"] = _Form(self.merged, self._zeros, self.own_dtype, fixed=self.own_dtype)
        if self.mode != "merged":
            out["adapter"] = _Form(self.base, self.factors, self.own_dtype, fixed=self._adapted)
        return out

    def _first(self) -> Mapping[str, torch.Tensor]:
        return next(iter(self.forms().values()))

    def __getitem__(self, name: str) -> torch.Tensor:
        return self._first()[name]

    def __iter__(self) -> Iterator[str]:
        return iter(self._first())

    def __len__(self) -> int:
        return len(self.merged) + len(self.factors)

    def __contains__(self, name: object) -> bool:
        return name in self.factors or name in self.merged

    def items(self) -> ItemsView[str, torch.Tensor]:
        return self._first().items()


class _Form(Mapping[str, torch.Tensor]):
    """One form: the base names' tensors, then the factors' (the same names in every form)."""

    def __init__(
        self,
        weights: Mapping[str, torch.Tensor],
        factors: Mapping[str, torch.Tensor],
        own_dtype: frozenset[str],
        *,
        fixed: frozenset[str],
    ) -> None:
        self.weights, self.factors, self.own_dtype = weights, factors, own_dtype
        self.fixed = fixed
        """Names this form holds constant: changing them is the one-time cost of switching to it."""

    def __getitem__(self, name: str) -> torch.Tensor:
        return self.factors[name] if name in self.factors else self.weights[name]

    def __iter__(self) -> Iterator[str]:
        yield from self.weights
        yield from self.factors

    def __len__(self) -> int:
        return len(self.weights) + len(self.factors)

    def __contains__(self, name: object) -> bool:
        return name in self.factors or name in self.weights

    def items(self) -> ItemsView[str, torch.Tensor]:
        return _FormItems(self)


class _FormItems(ItemsView[str, torch.Tensor]):
    """The base names' pass (which keeps its merged tensors alive until it ends), then the factors."""

    _mapping: _Form

    def __iter__(self) -> Iterator[tuple[str, torch.Tensor]]:
        yield from self._mapping.weights.items()
        yield from self._mapping.factors.items()


def _active_adapters(model: Any) -> list[str]:
    return list(getattr(model, "active_adapters", None) or [getattr(model, "active_adapter", "default")])


def _saved_config(model: Any) -> Any:
    """The active adapter's config for a replica: inference mode, ``modules_to_save`` left to the base names."""
    config = copy.deepcopy(model.peft_config[_active_adapters(model)[0]])
    config.inference_mode = True
    config.modules_to_save = None  # published as ordinary tensors under the base names
    return config


# ---------------------------------------------------------------------------------------------- replica side


def load_config(source: Any) -> Any:
    """A ``LoraConfig`` from itself, an adapter directory or an ``adapter_config.json`` path."""
    peft = require("peft", "peft")
    if isinstance(source, peft.LoraConfig):
        return source
    path = Path(source)
    if path.is_file():
        path = path.parent
    if not (path / CONFIG_NAME).is_file():
        raise ConfigError(f"no {CONFIG_NAME} in {path}: pass a LoraConfig or an adapter directory", argument="lora")
    return peft.LoraConfig.from_pretrained(str(path))


def adapter_specs(model_dir: str | Path, config: Any, *, dtype: torch.dtype = torch.float32) -> list[TensorSpec]:
    """The factors a LoRA run publishes for the base model in ``model_dir``: names, shapes, ``dtype``.

    Built by wrapping the base model's architecture in ``config`` on the meta
    device (no weights are read or allocated), so the names and shapes are
    PEFT's own. ``dtype`` is the trainer's adapter dtype (PEFT keeps adapters in
    fp32 by default, even on a bf16 base).
    """
    peft = require("peft", "peft")
    transformers = require("transformers", "transformers")
    config = load_config(config)
    with torch.device("meta"):
        base = transformers.AutoModelForCausalLM.from_config(transformers.AutoConfig.from_pretrained(model_dir))
        wrapped = peft.get_peft_model(base, copy.deepcopy(config))
    return [TensorSpec.of(n, t, dtype) for n, t in adapter_factors(wrapped).items()]


def adapter_active(factors: Mapping[str, torch.Tensor]) -> bool:
    """Whether the factors add anything: some ``lora_B`` (or ``lora_embedding_B``) is non-zero."""
    return any(bool(t.any()) for n, t in factors.items() if ".lora_B" in n or ".lora_embedding_B" in n)


def write_adapter(factors: Mapping[str, torch.Tensor], config: Any, directory: str | Path) -> Path:
    """Write ``factors`` as a PEFT adapter directory (what ``save_pretrained`` writes; vLLM and PEFT load it).

    Returns:
        `Path`: the directory.
    """
    from safetensors.torch import save_file

    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    load_config(config).save_pretrained(str(directory))
    save_file({n: t.detach().contiguous().cpu() for n, t in factors.items()}, str(directory / WEIGHTS_NAME))
    return directory
