"""The numerics floor of a dynamic-activation reference: how far last-bit float differences alone move it.

A backend's own float kernels (rsqrt, sigmoid, softmax) differ from torch's in the last bit. Where the next
linear rounds its activations to int8, a last-bit difference at a rounding tie becomes a whole step, and the
steps compound over the layers. So no eager reference can match such a program exactly. Verify's `dynamic`
gate therefore measures this build's floor: the reference against a copy of itself with +-2 ulp of random
relative error on every norm, activation and attention output. It then holds the program to a multiple of that
floor (`verify.dynamic.same_quant.max_kld_over_floor`). The noise model was checked against XNNPACK:
SmolLM2-135M 8da4w, the program vs the reference gives KLD 0.056 and the floor gives 0.054 (README).
"""
from __future__ import annotations

import copy

import torch
from torch import nn

ULPS = 2


def _noisy(t: torch.Tensor, g: torch.Generator) -> torch.Tensor:
    if not t.is_floating_point():
        return t
    steps = torch.randint(-ULPS, ULPS + 1, t.shape, generator=g).to(t.dtype)
    return t * (1 + steps * torch.finfo(t.dtype).eps / 2)


def with_float_noise(module: nn.Module, seed: int = 123) -> nn.Module:
    """A deep copy of a wrapped module whose norms' and activations' outputs and o_proj's input carry +-2 ulp of
    random relative error (the same seed gives the same noise)."""
    noisy = copy.deepcopy(module)
    g = torch.Generator().manual_seed(seed)
    for name, m in noisy.model.named_modules():
        kind = type(m).__name__
        if kind.endswith("RMSNorm") or type(m).__module__ == "transformers.activations":
            m.register_forward_hook(lambda _, args, out: _noisy(out, g))
        if name.endswith("o_proj"):
            m.register_forward_pre_hook(lambda _, args: (_noisy(args[0], g), *args[1:]))
    return noisy
