"""Registries: a config choice -> the module that implements it (the module's file name is the key)."""
from __future__ import annotations

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
