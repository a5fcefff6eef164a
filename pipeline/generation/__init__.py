"""Generation from a built program in Python: the runner (runner.py), which build it runs (builds.py), prompt-lookup
speculation (speculate.py), schema- and grammar-constrained output (constrain.py). The command is `python -m pipeline
generate` (pipeline/commands/generate.py)."""
