"""Quantization: the schemes' table (schemes.py), which (scheme, group) each weight takes (resolve.py), torchao's
application (apply.py), the target-bits allocator, GPTQ, smoothing, the source file's grid."""
