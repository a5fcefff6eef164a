"""The layers an HF model is rewritten into before export: attention's shared parts, experts, fused projections, the
recurrent layers, the row-gathering embedding, the tied head, the logits rows; exportable.py applies the rewrites a
model needs, faults.py the deliberate breakages the gate tests use."""
