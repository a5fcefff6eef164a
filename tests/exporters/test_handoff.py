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
    ("tiny_llama_custom", ("quantize=8da4w",)),   # dynamic activations: torchao tensor subclasses in the program
    ("tiny_llama_xnnpack", ()),                   # HF's static cache, fp32
])
def test_the_handed_program_lowers_to_the_bytes_of_the_file(stores, recipe, overrides):
    """XNNPACK builds (the other backends load program.pt2: LOWERS_PROGRAM_IN_MEMORY). Two fresh stores: in one, export and lower run in one build (lower takes the program in memory); in the
    other, the build stops after export and the next one lowers program.pt2 from the file."""
    from pipeline.exporters import handoff
    from pipeline.exporters.native import PROGRAM
    up_to = ("download", "wrap", "quantize", "export")
    handed = handoff.STATS["handed"]
    one = build(recipe, *overrides, f"run.output_dir={stores}/one", stages=(*up_to, "lower"))
    assert handoff.STATS["handed"] == handed + 1
    build(recipe, *overrides, f"run.output_dir={stores}/two", stages=up_to)
    handoff._kept.clear()
    two = build(recipe, *overrides, f"run.output_dir={stores}/two", stages=(*up_to, "lower"))
    assert handoff.STATS["handed"] == handed + 1
    assert [s["cache"] for s in one["stages"]] == ["miss"] * 6  # calibrate included
    assert [s["cache"] for s in two["stages"]] == ["hit"] * 5 + ["miss"]
    from_memory, loaded = ((stage_path(m, "lower") / PROGRAM).read_bytes() for m in (one, two))
    assert from_memory == loaded


def test_an_mlx_build_lowers_the_file(stores):
    """MLX's lowering cannot type the tensor subclasses of an in-memory program (int4 weights): export keeps none."""
    from pipeline.exporters import handoff
    handed = handoff.STATS["handed"]
    m = build("tiny_llama_mlx_int4", f"run.output_dir={stores}", stages=("download", "wrap", "quantize", "export",
                                                                        "lower"))
    # calibrate runs too (with_prerequisites), measuring nothing for this recipe
    assert [s["cache"] for s in m["stages"]] == ["miss"] * 6 and handoff.STATS["handed"] == handed and not handoff._kept
