"""Markers, the tier rule, the slow tier's rotation and record, and the shared real-model builds of the CI tier
(tests/helpers.py CI_BUILDS).

Tiers: `python3 -m pytest` runs the CI tier (everything not marked slow) and this commit's share of the slow tier
(tests/rotation.py); `python3 -m pytest -m slow` the whole slow tier; `-m "slow or not slow"` everything.
"""
from __future__ import annotations

import os

import pytest

from tests import helpers, rotation

# xdist's workers share the machine's cores: each worker's torch, and every build it starts, takes its share of them.
# OpenMP pools that together ask for more threads than there are cores spin against each other (the default build's
# GPTQ quantize stage: 17 s alone, 277 s beside another worker's two threads on two cores).
if os.environ.get("PYTEST_XDIST_WORKER_COUNT"):
    _THREADS = str(max(1, (os.cpu_count() or 1) // int(os.environ["PYTEST_XDIST_WORKER_COUNT"])))
    os.environ.setdefault("OMP_NUM_THREADS", _THREADS)
    import torch
    torch.set_num_threads(int(os.environ["OMP_NUM_THREADS"]))

_SESSION = {"slow": None, "passed": []}


@pytest.hookimpl(tryfirst=True)  # before the -m deselection, which reads the rotation marker set here
def pytest_collection_modifyitems(config, items):
    """Marks this run's share of the slow tier `rotation` (pyproject's `-m 'not slow or rotation'` keeps it), and
    puts the files with real-model tests first (in their order, then the rest in theirs): with a worker per file
    (pyproject's -n 2 --dist loadfile), the long builds start at once and the short files fill in behind them."""
    share = rotation.current_share()
    slow = [item for item in items if item.get_closest_marker("slow")]
    units: dict[str, bool] = {}
    for item in slow:
        units[rotation.item_unit(item)] = units.get(rotation.item_unit(item), False) or rotation.item_heavy(item)
    planned = rotation.shares(units)
    for item in slow:
        if share is not None and planned[rotation.item_unit(item)] == share:
            item.add_marker("rotation")
    if not config.args or [str(a) for a in config.args] == config.getini("testpaths"):  # the whole suite
        _SESSION["slow"] = [item.nodeid for item in slow]
    real = {item.path for item in items if item.get_closest_marker("real_model")}
    items.sort(key=lambda item: item.path not in real)


def pytest_report_header(config):
    share = rotation.current_share()
    return f"slow-tier rotation: share {share} of {rotation.SHARES}" if share is not None else \
        "slow-tier rotation: none"


def pytest_runtest_logreport(report):
    if report.when == "call" and report.passed and "slow" in report.keywords:
        _SESSION["passed"].append(report.nodeid)


def pytest_sessionfinish(session):
    if not hasattr(session.config, "workerinput"):  # the controller sees every worker's reports
        rotation.update_record(_SESSION["passed"], _SESSION["slow"])


def pytest_runtest_setup(item):
    # before the test's fixtures run, so a build in a module or session fixture is judged by its test's tier
    helpers.CURRENT.update(test=item.nodeid, slow=item.get_closest_marker("slow") is not None)


def _ci_build(name: str) -> dict:
    b = helpers.CI_BUILDS[name]
    if b.get("stages"):
        return helpers.build(b["recipe"], *b.get("overrides", ()), stages=b["stages"])
    return helpers.build_cli(b["recipe"], *b.get("overrides", ()))


@pytest.fixture(scope="session")
def smollm2_model_dir() -> str:
    return _ci_build("smollm2_model_dir")["model_dir"]


@pytest.fixture(scope="session")
def gemma3_model_dir() -> str:
    return _ci_build("gemma3_model_dir")["model_dir"]


@pytest.fixture(scope="session")
def smollm2_default() -> dict:
    """The default build (`python -m pipeline`, no recipe: SmolLM2-135M on XNNPACK), verified; its run manifest."""
    return _ci_build("smollm2_default")


@pytest.fixture(scope="session")
def gemma3_offgraph() -> dict:
    """gemma-3-270m with the off-graph cache at chunk 128: rings of 512 + 128 - 1 = 639 slots, so a 700-token
    prompt wraps them (at the recipe's chunk 512 a ring of 1023 slots never wraps within the 1024 context)."""
    return _ci_build("gemma3_offgraph")


@pytest.fixture(scope="session")
def gemma3_mlx_offgraph() -> dict:
    """gemma-3-270m through the MLX delegate, off-graph cache, chunk 128 (rings of 639 slots): the slow tier's
    (CI covers the MLX route on tiny models, tests/backends/test_mlx.py)."""
    return helpers.build_cli("gemma3_mlx_offgraph", "export.prefill_chunk=128")
