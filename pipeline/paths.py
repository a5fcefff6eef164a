"""Project paths, all derived from one root (never from the current directory)."""
from __future__ import annotations

import os
from pathlib import Path

ROOT = Path(os.environ.get("PIPELINE_ROOT", Path(__file__).resolve().parent.parent)).resolve()
CONF_DIR = ROOT / "conf"
RECIPES_DIR = ROOT / "recipes"
# the tests' recipes (tiny random models of each kind), registered beside the users' under their own names
TEST_RECIPES_DIR = ROOT / "tests" / "recipes"
OUTPUTS_ROOT = ROOT / "outputs"


def project_path(p: str | os.PathLike) -> Path:
    """Resolve a path from the config against the project root."""
    path = Path(p).expanduser()
    return (path if path.is_absolute() else ROOT / path).resolve()


def is_inside_outputs(p: str | os.PathLike) -> bool:
    path = project_path(p)
    return path == OUTPUTS_ROOT or OUTPUTS_ROOT in path.parents
