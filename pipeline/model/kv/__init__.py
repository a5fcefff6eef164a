"""What the KV-cache modes share: which caches a model needs (layout.py), the runtime-owned cache in Python
(runtime_cache.py), HF's static cache held in a program (hf_static_cache.py)."""
