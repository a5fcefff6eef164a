"""pipeline/exporters/handoff.py: a build that runs export and lower in one process lowers the program export
holds in memory, and that gives the bytes lowering program.pt2 from the file gives."""
from __future__ import annotations

import shutil
import uuid

import pytest

from pipeline.paths import ROOT
from tests.helpers import build, stage_path


def test_a_program_is_handed_over_once_and_only_for_the_file_written(tmp_path):
    from pipeline.exporters import handoff
    written = tmp_path / "tmp-entry" / "program.pt2"
    written.parent.mkdir()
    written.write_bytes(b"program")
    other = tmp_path / "other.pt2"
    other.write_bytes(b"program")
    handoff.keep(written, "ep")
    published = tmp_path / "entry"
    written.parent.rename(published)  # the store publishes a stage's directory by renaming it
    assert handoff.take(other) is None and handoff.take(published / "program.pt2") is None  # other: the hold ends
    handoff.keep(published / "program.pt2", "ep")
    assert handoff.take(tmp_path / "missing.pt2") is None
    handoff.keep(published / "program.pt2", "ep")
    assert handoff.take(published / "program.pt2") == "ep"
    assert handoff.take(published / "program.pt2") is None


@pytest.fixture
def stores():
    """Private outputs/ subfolders (a store must stay inside outputs/), removed afterwards."""
    rel = f"outputs/tests/handoff-{uuid.uuid4().hex[:8]}"
    yield rel
    shutil.rmtree(ROOT / rel, ignore_errors=True)


@pytest.mark.parametrize("recipe,overrides", [
    ("tiny_llama_custom", ("quantize=8da4w",)),   # XNNPACK, fused projections, dynamic activations
    ("tiny_llama_mlx", ()),                       # the MLX partitioner (its constants' names hash the graph)
])
def test_the_handed_program_lowers_to_the_bytes_of_the_file(stores, recipe, overrides):
    """Two fresh stores: in one, export and lower run in one build (lower takes the program in memory); in the
    other, the build stops after export and the next one lowers program.pt2 from the file."""
    from pipeline.exporters import handoff
    from pipeline.exporters.native import PROGRAM
    from tests.exporters.test_lean_lowering import mlx_names
    up_to = ("download", "wrap", "quantize", "export")
    handed = handoff.STATS["handed"]
    one = build(recipe, *overrides, f"run.output_dir={stores}/one", stages=(*up_to, "lower"))
    assert handoff.STATS["handed"] == handed + 1
    build(recipe, *overrides, f"run.output_dir={stores}/two", stages=up_to)
    handoff._kept.clear()
    two = build(recipe, *overrides, f"run.output_dir={stores}/two", stages=(*up_to, "lower"))
    assert handoff.STATS["handed"] == handed + 1
    assert [s["cache"] for s in one["stages"]] == ["miss"] * 5
    assert [s["cache"] for s in two["stages"]] == ["hit"] * 4 + ["miss"]
    from_memory, loaded = ((stage_path(m, "lower") / PROGRAM).read_bytes() for m in (one, two))
    if recipe == "tiny_llama_mlx":
        from_memory, loaded = mlx_names(from_memory), mlx_names(loaded)
    assert from_memory == loaded
