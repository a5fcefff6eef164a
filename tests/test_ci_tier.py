"""The rule that keeps CI inside its budget: a CI-tier test may build a real model only as one of the shared
builds (tests/helpers.py CI_BUILDS, each made once per session through its fixture); any other real-model build
fails its test unless the test is marked slow."""
from __future__ import annotations

import pytest

from tests import helpers


def test_an_unlisted_real_build_fails_a_ci_tier_test(monkeypatch):
    monkeypatch.setitem(helpers.CURRENT, "slow", False)
    with pytest.raises(pytest.fail.Exception, match="a real-model build .* in the CI tier"):
        helpers.guard("smollm2_xnnpack", ("quantize=8w",))
    with pytest.raises(pytest.fail.Exception, match="mark the test slow"):
        helpers.guard("gemma3_custom", ("export.prefill_chunk=128",))
    with pytest.raises(pytest.fail.Exception, match=r"\(default\) quantize=none"):
        helpers.guard(None, ("quantize=none",))                      # the default build, changed, is another build


def test_the_shared_builds_and_the_slow_tier_may(monkeypatch):
    monkeypatch.setitem(helpers.CURRENT, "slow", False)
    for b in helpers.CI_BUILDS.values():
        helpers.guard(b["recipe"], tuple(b.get("overrides", ())), b.get("stages"))
    helpers.guard("smollm2_xnnpack", (), ("download",))           # the first stages of a shared build
    helpers.guard("tiny_llama_xnnpack", ("quantize=8w",))          # tiny random models are not real-model builds
    monkeypatch.setitem(helpers.CURRENT, "slow", True)
    helpers.guard("gemma3_custom", ("export.prefill_chunk=128",))


def test_every_shared_build_has_its_fixture(request):
    for name in helpers.CI_BUILDS:
        assert request.session._fixturemanager.getfixturedefs(name, request.node), name


def test_the_rotation_deals_heavy_units_one_to_a_share_and_hashes_the_rest():
    from tests import rotation
    units = {f"tests/e2e/test_heavy_{i}.py": True for i in range(rotation.SHARES)}
    units.update({f"tests/e2e/test_light.py::test_cell[{i}]": False for i in range(200)})
    plan = rotation.shares(units)
    assert sorted(plan[u] for u, heavy in units.items() if heavy) == list(range(rotation.SHARES))
    light = [plan[u] for u, heavy in units.items() if not heavy]
    assert set(light) == set(range(rotation.SHARES))  # 200 cells reach every share
    assert rotation.shares(dict(list(units.items())[::-1])) == plan  # the order they were collected in does not matter


def test_a_run_takes_exactly_its_share_of_the_slow_tier():
    """pytest's own selection (-m 'not slow or rotation') against the plan, for one share."""
    import os
    import subprocess
    import sys

    from tests import rotation

    def collect(*args, share):
        r = subprocess.run([sys.executable, "-m", "pytest", "--collect-only", "-q", "-n", "0", "-p", "no:cacheprovider",
                            *args], cwd=rotation.ROOT, capture_output=True, text=True, timeout=600,
                           env={**os.environ, rotation.ENV: share})
        return {line for line in r.stdout.splitlines() if "::" in line}

    every_slow = collect("-m", "slow", share="none")
    chosen = collect(share="3") - collect(share="none")
    assert chosen and chosen <= every_slow, "share 3 is a part of the slow tier"
    units: dict[str, set] = {}
    for n in every_slow:
        each = "\nROTATE_EACH_TEST = True" in (rotation.ROOT / n.split("::")[0]).read_text()
        units.setdefault(rotation.unit(n, each), set()).add(n)
    # whole units: a unit is in the share with all its tests or not at all
    assert all(tests <= chosen or not tests & chosen for tests in units.values())
