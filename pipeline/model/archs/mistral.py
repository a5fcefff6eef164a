"""Mistral: Llama's layout; a sliding window over every layer when the config sets one."""
from pipeline.model.archs import Arch

ARCH = Arch(family="Mistral", tiny={"sliding_window": 24})
