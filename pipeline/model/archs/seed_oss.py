"""Seed-OSS: Llama's layout with biased q/k/v projections."""
from pipeline.model.archs import Arch

ARCH = Arch(family="Seed-OSS")
