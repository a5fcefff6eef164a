"""Qwen3: Llama's layout with per-head q/k norms."""
from pipeline.model.archs import Arch, Attention

ARCH = Arch(family="Qwen3", attention=Attention(qk_norm="head"))
