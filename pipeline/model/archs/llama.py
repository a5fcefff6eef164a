"""Llama (Llama 2/3, Llama 3.2 with llama3 rope scaling; SmolLM2): the plain decoder every other entry departs from."""
from pipeline.model.archs import Arch

ARCH = Arch(family="Llama / SmolLM2", rotary="rope (llama3 scaling)", gguf_arch="llama",
            tiny={"rope_parameters": {"rope_type": "llama3", "rope_theta": 10000.0, "factor": 8.0,
                                      "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                                      "original_max_position_embeddings": 256}})
