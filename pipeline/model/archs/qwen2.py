"""Qwen2 / Qwen2.5: Llama's layout with biased q/k/v projections."""
from pipeline.model.archs import Arch

ARCH = Arch(family="Qwen2 / Qwen2.5", tiny={"use_sliding_window": True, "sliding_window": 24, "max_window_layers": 1})
