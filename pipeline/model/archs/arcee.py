"""Arcee (AFM): Llama's layout with an ungated MLP, down(relu(up(x))^2)."""
from pipeline.model.archs import Arch, Mlp

ARCH = Arch(family="Arcee AFM", mlp=Mlp(gate=None))
