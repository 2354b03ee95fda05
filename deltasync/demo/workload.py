"""A synthetic training workload: random sparse updates with special values.

Used by the soak test and the long soak benchmark, where a real optimizer would
only slow things down: every step changes a random 0.05-1 % of each tensor,
every 13th step rewrites a small tensor densely (so it travels as ``dense``),
and every 29th plants the bit patterns float comparisons get wrong (+-0, NaN,
+-inf).
"""

from __future__ import annotations

import torch

__all__ = ["make_weights", "train_step"]


def make_weights(scale: int = 1, seed: int = 0) -> dict[str, torch.Tensor]:
    """About ``scale`` million elements: fp32 masters and bf16 tensors, one small dense-changing tensor."""
    g = torch.Generator().manual_seed(seed)
    return {
        "embed.weight": torch.randn(1024 * scale, 512, generator=g),
        "layers.0.proj.weight": torch.randn(512 * scale, 768, generator=g).to(torch.bfloat16),
        "layers.0.norm.weight": torch.ones(768),
        "head.weight": torch.randn(64 * scale, 1024, generator=g).to(torch.bfloat16),
    }


def train_step(weights: dict[str, torch.Tensor], step: int, g: torch.Generator) -> None:
    """A random sparse update; every 13th step rewrites the norm, every 29th plants special values."""
    for name, tensor in weights.items():
        flat = tensor.view(-1)
        if name.endswith("norm.weight") and step % 13 == 0:
            flat.add_(torch.randn(flat.numel(), generator=g).to(flat.dtype) * 0.01)
            continue
        density = float(torch.empty(1).uniform_(0.0005, 0.01, generator=g))
        idx = torch.randint(0, flat.numel(), (max(1, int(flat.numel() * density)),), generator=g)
        flat[idx] = (flat[idx].float() + torch.randn(idx.numel(), generator=g) * 0.01).to(flat.dtype)
        if step % 29 == 0:
            specials = torch.tensor([0.0, -0.0, float("nan"), float("inf"), -float("inf")])
            spots = torch.randint(0, flat.numel(), (5,), generator=g)
            flat[spots] = specials.to(flat.dtype)
