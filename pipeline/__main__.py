"""Build a recipe: `python -m pipeline recipe=smollm2_xnnpack_8da4w [overrides...]`.

With no recipe it builds the embedded default (SmolLM2-135M-Instruct, XNNPACK, 8da4w).
`-m` runs a Hydra multirun sweep; `--cfg job` prints the composed config.
"""
from pipeline.cli import main

if __name__ == "__main__":
    main()
