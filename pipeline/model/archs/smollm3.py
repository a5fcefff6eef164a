"""SmolLM3: Llama's layout; every fourth layer has no rotary embedding (NoPE)."""
from pipeline.model.archs import Arch

ARCH = Arch(family="SmolLM3", rotary="rope; NoPE layers (no_rope_layers)")
