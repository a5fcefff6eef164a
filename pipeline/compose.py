"""The config `python -m pipeline OVERRIDES` builds, composed in this process. Importing this module registers what
composing needs: the schemas (pipeline/config.py), the recipes (pipeline/recipes.py), the project_path resolver."""
from __future__ import annotations

from omegaconf import DictConfig, OmegaConf

from pipeline.config import register_configs
from pipeline.paths import CONF_DIR, project_path
from pipeline.recipes import register_recipes

OmegaConf.register_new_resolver("project_path", lambda p: str(project_path(p)), replace=True)
register_configs()
register_recipes()


def compose(overrides: list[str]) -> DictConfig:
    """The config `python -m pipeline OVERRIDES` would build, composed in this process (no run directory, no job).
    Raises Hydra's and OmegaConf's errors (an unknown recipe or group option, a bad value)."""
    from hydra import compose as hydra_compose, initialize_config_dir
    with initialize_config_dir(config_dir=str(CONF_DIR), version_base="1.3"):
        return hydra_compose("config", overrides=list(overrides))
