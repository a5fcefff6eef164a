"""`python -m pipeline [OVERRIDES]`: compose a build with Hydra, check it, run the stages, print the summary (`-m`: a
sweep)."""
from __future__ import annotations

import contextlib
import dataclasses
import logging
import os
import re
import sys
import warnings

import hydra
from hydra.experimental.callback import Callback
from omegaconf import DictConfig, OmegaConf

from pipeline.paths import CONF_DIR, project_path
import pipeline.compose  # noqa: F401,E402  (registers the schemas, the recipes and the project_path resolver)

log = logging.getLogger(__name__)

# known-harmless noise from the toolchain; everything else still shows
warnings.filterwarnings("ignore", category=FutureWarning)
warnings.filterwarnings("ignore", category=DeprecationWarning)
warnings.filterwarnings("ignore", message=".*(side effects happened|Mutation on a buffer|is an Enum subclass).*")


class ConfigGate(Callback):
    """Preflight before Hydra creates the run directory: a rejected config leaves nothing behind in outputs/.

    (Sweep jobs are checked in their job, whose directory carries the failure into the sweep report.)"""

    def on_run_start(self, config: DictConfig, **kwargs) -> None:
        from pipeline import preflight
        from pipeline.errors import PipelineError
        from pipeline.paths import OUTPUTS_ROOT, is_inside_outputs
        task = OmegaConf.masked_copy(config, [k for k in config if k != "hydra"])
        try:
            preflight.check(task)
        except PipelineError as e:
            _refuse(str(e), e.exit_code)
        if not is_inside_outputs(config.hydra.run.dir):  # e.g. hydra.run.dir=/elsewhere, or set by a recipe
            _refuse(f"hydra.run.dir={config.hydra.run.dir!r}: must be inside {OUTPUTS_ROOT}", 2)
        _refuse_unwritable(project_path(task.run.output_dir))

    def on_multirun_start(self, config: DictConfig, **kwargs) -> None:
        from pipeline.paths import OUTPUTS_ROOT, is_inside_outputs
        if not is_inside_outputs(config.hydra.sweep.dir):
            _refuse(f"hydra.sweep.dir={config.hydra.sweep.dir!r}: must be inside {OUTPUTS_ROOT}", 2)
        _refuse_unwritable(project_path(config.run.output_dir))


def _refuse_unwritable(out) -> None:
    """A read-only outputs/ is said before Hydra tries to make the run directory in it."""
    import os
    existing = next(p for p in (out, *out.parents) if p.exists())
    if not os.access(existing, os.W_OK):
        _refuse(f"run.output_dir={str(out)!r}: {existing} is not writable "
                f"({'read-only file system' if os.statvfs(existing).f_flag & os.ST_RDONLY else 'permission denied'})", 1)


def _refuse(message: str, exit_code: int):
    print(f"error: {message}", file=sys.stderr)
    sys.exit(exit_code)


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
        if _in_multirun():
            # one failed job must not end the sweep: its manifest carries the error into the report
            _record_job_failure(cfg, e)
            return
        sys.exit(e.exit_code)


def _in_multirun() -> bool:
    from hydra.core.hydra_config import HydraConfig
    from hydra.types import RunMode
    return HydraConfig.get().mode == RunMode.MULTIRUN


def _record_job_failure(cfg: DictConfig, err: Exception) -> None:
    """A job that failed before its build wrote a manifest (a rejected config) still gets one."""
    from pathlib import Path

    from hydra.core.hydra_config import HydraConfig

    from pipeline.session import hydra_overrides
    from pipeline.store.files import write_json_atomic
    path = Path(HydraConfig.get().runtime.output_dir) / "manifest.json"
    if not path.exists():
        write_json_atomic(path, {"status": "failed", "error": str(err), "overrides": hydra_overrides(),
                                 "recipe": HydraConfig.get().runtime.choices.get("recipe"), "stages": []})


def composition_error(e: Exception) -> str:
    """One line for a config Hydra refused while composing it, naming the override or option, and why."""
    from hydra.errors import MissingConfigException, OverrideParseException
    if isinstance(e, MissingConfigException) and e.missing_cfg_file and e.options is not None:
        group, _, name = e.missing_cfg_file.rpartition("/")
        where = re.match(r"In '([^']+)'", str(e))
        named_in = f" (named in {where.group(1)})" if where and where.group(1) not in ("config", "hydra/config") else ""
        return f"{group}={name}: no such option{named_in} (allowed: {', '.join(e.options)})"
    if isinstance(e, OverrideParseException):
        return f"{e.override}: cannot parse the override: {str(e).splitlines()[0]}"
    cause = e.__cause__ or e.__context__
    lines = [ln.strip() for ln in str(e).splitlines() if ln.strip()]
    first = lines[0] if lines else ""
    merged = re.match(r"Error merging override (.+)", first)
    unknown = re.search(r"To append to your config use \+(.+)", str(e))
    composing = re.match(r"In '([^']+)': \w+ raised while composing config", first)
    if cause is not None and (merged or unknown or composing):
        where = (merged or unknown).group(1) if (merged or unknown) else composing.group(1)
        return f"{where}: {_omegaconf_why(cause, where)}"
    detail = ("full_key:", "reference_type=", "object_type=", "See https://")
    return " ".join(ln for ln in lines if not ln.startswith(detail)) or type(e).__name__


def _omegaconf_why(err: Exception, where: str) -> str:
    """An OmegaConf error's first line; for a key the schema lacks, the keys it has (and the key, unless `where`
    names it)."""
    from omegaconf.errors import ConfigAttributeError, ConfigKeyError
    schema = getattr(err, "object_type", None)
    if isinstance(err, (ConfigAttributeError, ConfigKeyError)) and dataclasses.is_dataclass(schema):
        allowed = ", ".join(sorted(f.name for f in dataclasses.fields(schema)))
        key = "" if err.full_key in where else f"{err.full_key}: "
        return f"{key}unknown key (allowed here: {allowed})"
    return str(err).splitlines()[0]


@contextlib.contextmanager
def _config_errors_exit_2():
    """Hydra composes the config inside its own `run_and_report`, which prints a refused override with Hydra's
    advice and exits 1; a config refused there is a rejected config like any other: one line, exit 2."""
    import hydra._internal.utils as hydra_utils
    from hydra.errors import ConfigCompositionException, OverrideParseException
    stock = hydra_utils.run_and_report

    def run_and_report(func):
        def composing():
            try:
                return func()
            except (ConfigCompositionException, OverrideParseException) as e:
                if os.environ.get("HYDRA_FULL_ERROR") == "1":
                    raise
                _refuse(composition_error(e), 2)
        return stock(composing)

    hydra_utils.run_and_report = run_and_report
    try:
        yield
    finally:
        hydra_utils.run_and_report = stock


def main() -> None:
    with _config_errors_exit_2():
        _hydra_main()
    from pipeline.report.sweep import SweepReport
    if SweepReport.failed_jobs:  # a sweep with failed jobs still writes its report, then says so
        sys.exit(1)
