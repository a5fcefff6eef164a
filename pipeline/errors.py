"""Exceptions the CLI turns into clean messages (no traceback)."""
from __future__ import annotations


class PipelineError(Exception):
    exit_code = 1


class ConfigError(PipelineError):
    """Every problem found in a config, reported at once."""
    exit_code = 2

    def __init__(self, problems: list[tuple[str, object, str]]):
        self.problems = problems
        lines = [f"{len(problems)} problem(s) in the config:"]
        lines += [f"  - {key}={value!r}: {why}" for key, value, why in problems]
        super().__init__("\n".join(lines))


class StageError(PipelineError):
    def __init__(self, stage: str, message: str, manifest: str | None = None):
        self.stage, self.manifest = stage, manifest
        where = f" (manifest: {manifest})" if manifest else ""
        super().__init__(f"stage {stage} failed: {message}{where}")
