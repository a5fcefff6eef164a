"""Hydra entry point: compose, validate, run the stages, print the summary."""
from __future__ import annotations

import logging
import sys
import warnings

import hydra
from omegaconf import DictConfig, OmegaConf

from pipeline.config import register_configs
from pipeline.paths import CONF_DIR, project_path
from pipeline.recipes import register_recipes

log = logging.getLogger(__name__)

# known-harmless noise from the toolchain; everything else still shows
warnings.filterwarnings("ignore", category=FutureWarning)
warnings.filterwarnings("ignore", category=DeprecationWarning)
warnings.filterwarnings("ignore", message=".*(side effects happened|Mutation on a buffer|is an Enum subclass).*")

OmegaConf.register_new_resolver("project_path", lambda p: str(project_path(p)), replace=True)
register_configs()
register_recipes()


@hydra.main(config_path=str(CONF_DIR), config_name="config", version_base="1.3")
def _hydra_main(cfg: DictConfig) -> None:
    from pipeline.errors import PipelineError
    from pipeline.session import build

    # torchao warns at import about CUDA-only extensions this CPU build cannot load
    for noisy in ("torchao", "torch.utils._pytree"):
        logging.getLogger(noisy).setLevel(logging.ERROR)
    try:
        build(cfg)
    except KeyboardInterrupt:
        print("interrupted: nothing half-built was published; rerun to continue", file=sys.stderr)
        sys.exit(130)
    except PipelineError as e:
        # a clean message, no traceback: the error names what went wrong and where
        print(f"error: {e}", file=sys.stderr)
        sys.exit(e.exit_code)


def main() -> None:
    _hydra_main()
