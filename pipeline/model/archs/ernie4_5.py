"""ERNIE 4.5 (dense): Llama's layout; HF's forward applies its interleaved rotary."""
from pipeline.model.archs import Arch

ARCH = Arch(family="ERNIE 4.5", rotary="rope, interleaved")
