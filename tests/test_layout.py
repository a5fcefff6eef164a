"""The house's rules, checked on the code itself: no import cycles, small modules, each variation axis in its
registry (the file name is the key, a wrong name lists the choices), no axis if-chains outside the registries."""
from __future__ import annotations

import re

import pytest

from pipeline import paths
from pipeline.backends import BACKENDS
from pipeline.config import BackendName, CacheMode, Exporter
from pipeline.exporters import EXPORTERS
from pipeline.model.cache_modes import CACHE_MODES
from pipeline.registry import UnknownChoice
from pipeline.runtimes import RUNTIMES
from pipeline.store import code

MAX_LINES = 500
# where a backend's, route's, cache mode's or runtime's name may be compared: its own registry folder
REGISTRY_DIRS = ("pipeline/backends/", "pipeline/exporters/", "pipeline/model/cache_modes/", "pipeline/runtimes/")
AXIS_NAMES = "mlx|xnnpack|portable|transformers|native|static|custom|offgraph|stock|executorch"
COMPARISON = re.compile(rf"""[=!]=\s*["']({AXIS_NAMES})["']""")


# pipeline/'s layers, lowest first: a module imports its own layer or lower ones only (a module belongs to the longest
# prefix named here). docs/layout.md draws the same.
LAYERS = [
    ("pipeline.errors", "pipeline.paths", "pipeline.registry", "pipeline.abi"),
    ("pipeline.model.archs",),
    ("pipeline.model",),  # reading a model: its sources, geometry, checkpoint, loading
    ("pipeline.model.kv", "pipeline.model.quant"),
    ("pipeline.model.layers",),
    ("pipeline.model.cache_modes",),
    ("pipeline.config", "pipeline.recipes", "pipeline.fidelity", "pipeline.corpus"),
    ("pipeline.compose", "pipeline.store", "pipeline.native"),
    ("pipeline.ops",),
    ("pipeline.backends",),
    ("pipeline.runtimes", "pipeline.report"),
    ("pipeline.exporters", "pipeline.support"),
    ("pipeline.stages", "pipeline.memory_estimate"),
    ("pipeline.preflight",),
    ("pipeline.session",),
    ("pipeline.generation",),
    ("pipeline.serve",),
    ("pipeline.commands", "pipeline.__main__"),
]


def layer(module: str) -> int:
    best = max(((len(p), i) for i, names in enumerate(LAYERS) for p in names
                if module == p or module.startswith(p + ".")), default=None)
    assert best is not None, f"{module} is in no layer of tests/test_layout.py LAYERS: place it"
    return best[1]


def test_no_import_cycles():
    assert code.cycles() == []


def test_no_import_runs_back_up():
    """An import from a lower layer to a higher one is an arrow back up: the lower module then depends on what
    depends on it."""
    up = [f"{m} (layer {layer(m)}) -> {i} (layer {layer(i)})" for m in code.all_modules() for i in code.imports(m)
          if layer(i) > layer(m)]
    assert not up, "\n".join(up)


def test_the_graph_sees_lazy_imports():
    # the key of a stage must change with code it only imports inside a function
    assert "pipeline.native" in code.imports("pipeline.stages.verify")
    assert "pipeline.runtimes.pair" in code.closure("pipeline.stages.verify")


@pytest.mark.parametrize("path", sorted((paths.ROOT / "pipeline").rglob("*.py")), ids=lambda p: str(p.name))
def test_no_module_over_the_limit(path):
    n = len(path.read_text().splitlines())
    assert n <= MAX_LINES, f"{path.relative_to(paths.ROOT)} has {n} lines (limit {MAX_LINES}): split it by concern"


def test_no_axis_comparisons_outside_the_registries():
    found = []
    for path in sorted((paths.ROOT / "pipeline").rglob("*.py")):
        rel = path.relative_to(paths.ROOT).as_posix()
        if rel.startswith(REGISTRY_DIRS):
            continue
        for i, line in enumerate(path.read_text().splitlines(), 1):
            if COMPARISON.search(line):
                found.append(f"{rel}:{i}: {line.strip()}")
    assert not found, "ask the registry instead:\n" + "\n".join(found)


@pytest.mark.parametrize("registry,choices,folder", [
    (BACKENDS, BackendName, "backends"), (EXPORTERS, Exporter, "exporters"),
    (CACHE_MODES, CacheMode, "model/cache_modes"), (RUNTIMES, None, "runtimes")])
def test_registry_keys_are_the_schema_choices_and_the_file_names(registry, choices, folder):
    if choices is not None:
        assert sorted(registry) == sorted(c.value for c in choices)
    for name, module in registry.items():
        assert module.__name__ == f"pipeline.{folder.replace('/', '.')}.{name}"


def test_a_wrong_name_lists_the_choices():
    with pytest.raises(UnknownChoice, match=r"backend.name='tpu': not supported. Supported: \['mlx', 'portable'"):
        BACKENDS["tpu"]
    with pytest.raises(UnknownChoice, match="cache.mode='paged'"):
        CACHE_MODES["paged"]


@pytest.mark.parametrize("name", sorted(CACHE_MODES))
def test_cache_modes_declare_their_interface(name):
    m = CACHE_MODES[name]
    assert m.FLAGS and all(set(f) == {"custom_sdpa", "custom_kv_cache"} for f in m.FLAGS) and m.FLAGS_WHY
    assert isinstance(m.RUNTIME_OWNED, bool) and isinstance(m.KERNELS, tuple) and isinstance(m.EXECUTORCH_OPS_ONLY, bool)
    assert all(isinstance(m.rings(f), bool) and isinstance(m.exports_non_strict(f), bool) for f in m.FLAGS)
    assert callable(m.wrap) and callable(m.constant_methods)


@pytest.mark.parametrize("name", sorted(BACKENDS))
def test_backends_declare_their_interface(name):
    b = BACKENDS[name]
    assert b.RUNTIME in RUNTIMES and isinstance(b.NATIVE_RUNNER, bool) and isinstance(b.ASYMMETRIC_WEIGHTS, bool) \
        and isinstance(b.LOWERS_PROGRAM_IN_MEMORY, bool) and isinstance(b.LOWERS_NON_STRICT, bool)
    for fn in ("refuses", "refuses_cache", "reference", "setup", "prepare", "pack_experts", "partition", "executorch_config", "handover", "cross_check_runtime", "reference_extra_bytes"):
        assert callable(getattr(b, fn)), fn


@pytest.mark.parametrize("name", sorted(EXPORTERS))
def test_exporters_declare_their_interface(name):
    e = EXPORTERS[name]
    assert set(e.STAGE_PEAK) == {"export", "lower"}
    assert all(set(f) <= {"weights", "module", "embedding", "layers", "float"} and min(f.values()) > 0
               for f in e.STAGE_PEAK.values())
    for fn in ("problems", "geometry_problems", "export", "lower", "artifacts"):
        assert callable(getattr(e, fn)), fn


# native/src's folders, lowest first: a source includes headers of its own folder or lower ones only
NATIVE_LAYERS = ("platform", "tokenizer", "kernels", "runtime", "runner", "batched")
INCLUDE = re.compile(r'^#include "(\w+)/', re.M)


def test_no_native_include_runs_back_up():
    src = paths.ROOT / "native" / "src"
    assert sorted(p.name for p in src.iterdir() if p.is_dir()) == sorted(NATIVE_LAYERS), "place the new folder"
    up = []
    for path in sorted(src.rglob("*")):
        if path.suffix not in (".h", ".cpp"):
            continue
        folder = path.relative_to(src).parts[0]
        for target in INCLUDE.findall(path.read_text()):
            if NATIVE_LAYERS.index(target) > NATIVE_LAYERS.index(folder):
                up.append(f"{path.relative_to(paths.ROOT)} includes {target}/")
    assert not up, "\n".join(up)


def test_a_module_that_breaks_its_registrys_contract_is_named_at_import():
    import types

    from pipeline.backends import xnnpack
    from pipeline.backends.contract import Backend
    from pipeline.registry import Registry, check_contract

    fake = types.ModuleType("pipeline.backends.fake")
    fake.__dict__.update({k: v for k, v in vars(xnnpack).items() if not k.startswith("__")})
    del fake.PLAN_CANDIDATES
    fake.refuses = lambda scheme, group: None  # the protocol's dtype and gemm missing
    with pytest.raises(TypeError, match=r"backend.name=fake.*lacks PLAN_CANDIDATES, refuses\(scheme, group, dtype, "
                                        r"gemm\)"):
        check_contract(Registry("backend.name", {"fake": fake}), Backend)
    check_contract(Registry("backend.name", {"xnnpack": xnnpack}), Backend)


def test_every_command_is_a_module_of_commands_and_a_misspelled_one_is_named():
    import subprocess
    import sys

    from pipeline.commands import COMMANDS
    files = {p.stem for p in (paths.ROOT / "pipeline" / "commands").glob("*.py")} - {"__init__", "build"}
    assert set(COMMANDS) == files
    r = subprocess.run([sys.executable, "-m", "pipeline", "generat"], capture_output=True, text=True, cwd=paths.ROOT,
                       timeout=120)
    assert r.returncode == 2 and "'generat' is no command (commands: generate," in r.stderr
    r = subprocess.run([sys.executable, "-m", "pipeline", "support", "--markdown"], capture_output=True, text=True,
                       cwd=paths.ROOT, timeout=120)
    assert r.returncode == 0 and r.stdout.startswith("|")
