"""Granite 3: Llama's layout scaled by the config's multipliers (embedding, residual, attention, logits)."""
from pipeline.model.archs import Arch

ARCH = Arch(family="Granite", embedding_scale="embedding_multiplier", logits="logits_scaling",
            tiny={"embedding_multiplier": 12.0, "residual_multiplier": 0.22, "attention_multiplier": 0.0625,
                  "logits_scaling": 8.0})
