"""Registries: a config choice -> the module that implements it (the module's file name is the key)."""
from __future__ import annotations

import inspect
from enum import Enum

from pipeline.errors import PipelineError


class UnknownChoice(PipelineError):
    exit_code = 2


class Registry(dict):
    """A plain dict whose lookups take an Enum member or its value and fail with the choices."""

    def __init__(self, key: str, entries: dict):
        super().__init__(entries)
        self.key = key

    def __getitem__(self, name):
        name = name.value if isinstance(name, Enum) else name
        try:
            return super().__getitem__(name)
        except KeyError:
            raise UnknownChoice(f"{self.key}={name!r}: not supported. Supported: {sorted(self)}") from None


def v(x):
    """The plain value of a config field (Enum members become their string): the layers below the schema (model/)
    take it from here."""
    return x.value if isinstance(x, Enum) else x


def check_contract(registry: dict, protocol: type) -> None:
    """Every module of a registry declares the protocol's members: its constants (the annotated names) and its
    functions, with the protocol's parameters by name and order. Called at import: a module that breaks its registry's
    contract fails there, naming what it lacks, not in the middle of a build."""
    functions = {n: f for n, f in vars(protocol).items() if inspect.isfunction(f) and not n.startswith("_")}
    for key, module in registry.items():
        missing = [n for n in protocol.__annotations__ if not hasattr(module, n)]
        for name, f in functions.items():
            got = getattr(module, name, None)
            want = list(inspect.signature(f).parameters)[1:]  # without self
            if not callable(got):
                missing.append(f"{name}()")
            elif list(inspect.signature(got).parameters) != want:
                missing.append(f"{name}({', '.join(want)})")
        if missing:
            raise TypeError(f"{module.__name__} ({registry.key}={key}) breaks its registry's contract "
                            f"({protocol.__module__}.{protocol.__name__}): it lacks {', '.join(missing)}")
