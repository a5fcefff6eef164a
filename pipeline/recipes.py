"""Named recipes: YAML files under recipes/ (recursively), registered as the Hydra group `recipe`.

Hydra looks groups up as <searchpath>/<group>/<name>.yaml; recipes live in a top-level folder
instead, so each file is stored in the ConfigStore under group `recipe` with its relative path
(without .yaml) as the name: `recipe=smollm2_xnnpack`, `recipe=mlx/llama_mlx`.
"""
from __future__ import annotations

from pathlib import Path

from hydra.core.config_store import ConfigStore
from omegaconf import OmegaConf

from pipeline.paths import RECIPES_DIR


def recipe_files(root: Path = RECIPES_DIR) -> dict[str, Path]:
    return {p.relative_to(root).with_suffix("").as_posix(): p
            for p in sorted(root.rglob("*.yaml"))}


def register_recipes(root: Path = RECIPES_DIR) -> list[str]:
    cs = ConfigStore.instance()
    names = []
    for name, path in recipe_files(root).items():
        node = OmegaConf.load(path)
        # recipes are `# @package _global_` files: they override groups and top-level scalars
        cs.store(group="recipe", name=name, node=node, package="_global_")
        names.append(name)
    return names
