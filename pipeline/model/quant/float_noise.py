"""The numerics floor of a dynamic-activation reference: how far last-bit float differences alone move it.

A backend's own float kernels (rsqrt, sigmoid, softmax) differ from torch's in the last bit. Where the next
linear rounds its activations to int8, a last-bit difference at a rounding tie becomes a whole step, and the
steps compound over the layers. So no eager reference can match such a program exactly. Verify's `dynamic`
gate therefore measures this build's floor: the reference against itself with +-2 ulp of random
relative error on every norm, activation and attention output. It then holds the program to a multiple of that
floor (`verify.dynamic.same_quant.max_kld_over_floor`). The noise model was checked against XNNPACK:
SmolLM2-135M 8da4w, the program vs the reference gives KLD 0.056 and the floor gives 0.054 (README).
"""
from __future__ import annotations

import contextlib
import copy

import torch
from torch import nn

from pipeline.model import archs

ULPS = 2


def _noisy(t: torch.Tensor, g: torch.Generator) -> torch.Tensor:
    if not t.is_floating_point():
        return t
    steps = torch.randint(-ULPS, ULPS + 1, t.shape, generator=g).to(t.dtype)
    return t * (1 + steps * torch.finfo(t.dtype).eps / 2)


def _add_noise(module: nn.Module, g: torch.Generator) -> list:
    """Hooks giving the wrapped model's norms' and activations' outputs and the attention output projection's input
    +-2 ulp of random relative error, drawn from g; returns their handles."""
    handles = []
    for m in module.model.modules():
        kind = type(m).__name__
        if kind.endswith(("RMSNorm", "LayerNorm")) or type(m).__module__ == "transformers.activations":
            handles.append(m.register_forward_hook(lambda _, args, out: _noisy(out, g)))
    a = archs.of_model(module.model)
    for _, layer in a.attention_layers(module.model):
        o = getattr(a.attention_module(layer), a.attention.o)
        handles.append(o.register_forward_pre_hook(lambda _, args: (_noisy(args[0], g), *args[1:])))
    return handles


@contextlib.contextmanager
def float_noise(module: nn.Module, g: torch.Generator):
    """For the span, the module itself carries the noise (no copy of its weights; verify's floor runs this way)."""
    handles = _add_noise(module, g)
    try:
        yield module
    finally:
        for h in handles:
            h.remove()


def with_float_noise(module: nn.Module, seed: int = 123) -> nn.Module:
    """A deep copy of a wrapped module that carries the noise for good (the same seed gives the same noise)."""
    noisy = copy.deepcopy(module)
    _add_noise(noisy, torch.Generator().manual_seed(seed))
    return noisy
