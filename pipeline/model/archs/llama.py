"""Llama (Llama 2/3, Llama 3.2 with llama3 rope scaling; SmolLM2): the plain decoder every other entry departs from."""
from pipeline.model.archs import Arch

ARCH = Arch(family="Llama / SmolLM2", rotary="rope (llama3 scaling)", gguf_arch="llama")
