"""The commands: `python -m pipeline COMMAND [ARGS]`, one module each (the file name is the command); with no command,
`python -m pipeline [OVERRIDES]` is a build (build.py). Each module's `main(argv)` returns the exit status."""
from __future__ import annotations

import importlib

# command -> what it does (its module is pipeline/commands/<command>.py)
COMMANDS = {
    "generate": "token-by-token generation from a built program, in Python",
    "validate": "check every recipe (composition, rules, preflight, memory) without building",
    "gc": "drop stage-cache entries no build can reach (--verify: check every entry against its manifest)",
    "support": "the support table: architectures by backend, cache mode and scheme",
    "sweep_report": "write a sweep's report again from its folder",
    "export_llm_hf": "the reference's export command line over a build",
    "native": "the native runners: their paths, a rebuild, a run (ARM64 under QEMU with --target aarch64)",
    "ops": "the operators a .pte calls and the library that provides each",
    "mlx_interpreter": "list an MLX program's instructions",
    "constrain_sidecar": "the grammar for the C++ runner's constrained output (llm_runner starts it)",
}


def run(name: str, argv: list[str]) -> int:
    """Runs command `name` with its arguments; its exit status."""
    status = importlib.import_module(f"pipeline.commands.{name}").main(argv)
    return int(status or 0)
