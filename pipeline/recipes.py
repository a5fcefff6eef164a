"""Named recipes: YAML files under recipes/ (the users') and tests/recipes/ (the tests' tiny ones), recursively,
registered as the Hydra group `recipe`.

Hydra looks groups up as <searchpath>/<group>/<name>.yaml; recipes live in top-level folders instead, so each file is
stored in the ConfigStore under group `recipe` with its path relative to its folder (without .yaml) as the name:
`recipe=smollm2_xnnpack`, `recipe=mlx/llama_mlx`, `recipe=tiny_llama_xnnpack`.
"""
from __future__ import annotations

from pathlib import Path
from typing import Optional

from hydra.core.config_store import ConfigStore
from omegaconf import OmegaConf

from pipeline.paths import RECIPES_DIR, TEST_RECIPES_DIR


def recipe_files(root: Optional[Path] = None) -> dict[str, Path]:
    """name -> file, of one folder, or (None) of recipes/ and tests/recipes/ (where the checkout has it)."""
    roots = [root] if root is not None else [d for d in (RECIPES_DIR, TEST_RECIPES_DIR) if d.is_dir()]
    out: dict[str, Path] = {}
    for folder in roots:
        for p in sorted(folder.rglob("*.yaml")):
            name = p.relative_to(folder).with_suffix("").as_posix()
            if name in out:
                raise ValueError(f"recipe {name!r} is defined twice: {out[name]} and {p}")
            out[name] = p
    return out


def register_recipes(root: Optional[Path] = None) -> list[str]:
    cs = ConfigStore.instance()
    names = []
    for name, path in recipe_files(root).items():
        node = OmegaConf.load(path)
        # recipes are `# @package _global_` files: they override groups and top-level scalars
        cs.store(group="recipe", name=name, node=node, package="_global_")
        names.append(name)
    return names
