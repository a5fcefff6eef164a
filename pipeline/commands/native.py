"""`python -m pipeline native`: the native runners' paths, a forced rebuild, or a runner run as it is (x86-64, or
ARM64 under QEMU with --target aarch64); pipeline/native.py builds and calls them."""
from __future__ import annotations

import os
import sys
from pathlib import Path
from typing import Sequence

from pipeline.native import (AARCH64_BUILD_DIR, BUILD_DIR, NativeError, _stale, aarch64_binary, aarch64_build,
                             build_native, qemu_command, runner_path, tokenizer_cli_path)


USAGE = ("usage: python -m pipeline native [path|build|tokenizer-cli]\n"
         "       python -m pipeline native path|build --target aarch64\n"
         "       python -m pipeline native run [--target aarch64] BINARY [ARGS...]")


def _exec(binary: Path, cmd: list[str]) -> int:
    """Replaces this process with cmd: stdin/stdout/stderr, signals and the exit status are the binary's own."""
    if not binary.is_file():
        names = sorted(p.name for p in binary.parent.iterdir() if p.is_file() and os.access(p, os.X_OK))
        raise NativeError(f"no binary {binary.name} in {binary.parent} (there: {', '.join(names)})")
    sys.stdout.flush()
    sys.stderr.flush()
    os.execvp(cmd[0], cmd)
    return 127  # not reached


def main(argv: Sequence[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    cmd = argv[0] if argv else "path"
    rest = argv[1:]
    target = None
    if rest[:1] == ["--target"] and len(rest) > 1:  # before BINARY only: what follows it is the binary's
        target, rest = rest[1], rest[2:]
    elif rest[:1] and rest[0].startswith("--target="):
        target, rest = rest[0].split("=", 1)[1], rest[1:]
    if target not in (None, "aarch64") or (cmd == "run" and not rest) or (cmd == "tokenizer-cli" and target):
        print(USAGE, file=sys.stderr)
        return 2
    try:
        if cmd == "path":
            print(aarch64_binary("llm_runner") if target else runner_path())
        elif cmd == "build":
            print(aarch64_build(force=True) if target else build_native(force=True))
        elif cmd == "tokenizer-cli":
            print(tokenizer_cli_path())
        elif cmd == "run":
            name, args = rest[0], rest[1:]
            if target:
                aarch64_build()  # if any binary is missing or stale
                return _exec(AARCH64_BUILD_DIR / name, qemu_command(name, args))
            binary = BUILD_DIR / name
            build_native(force=_stale(binary))
            return _exec(binary, [str(binary), *args])
        else:
            print(USAGE, file=sys.stderr)
            return 2
    except NativeError as e:
        print(f"error: {e}", file=sys.stderr)
        return 1
    return 0
