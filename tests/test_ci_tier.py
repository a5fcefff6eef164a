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
