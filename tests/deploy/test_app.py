"""docs/deploy.md's app, built as the page gives it: its CMakeLists.txt and main.cpp blocks against the installed
llmpipe_ops package (`cmake --install native/build`) and the wheel's ExecuTorch, once with the static archive and once
with the shared library; its greedy tokens on a program of ours equal llm_runner's on the same prompt ids."""
from __future__ import annotations

import re
import subprocess

import pytest

from pipeline import native
from pipeline.paths import ROOT
from tests.helpers import build

DOC = ROOT / "docs" / "deploy.md"
PROMPT = [319, 407, 306, 308, 299, 65, 41, 200, 17, 33, 5, 90, 64, 12, 77, 3, 45, 101, 8, 60]  # past a chunk of 16
N_NEW = 12


def blocks(lang: str) -> list[str]:
    return re.findall(rf"```{lang}\n(.*?)```", DOC.read_text(), re.S)


def cmake() -> str:
    import cmake as cm  # the pip CMake (>= 3.28), as native/build.sh takes it
    import os
    return os.path.join(cm.CMAKE_BIN_DIR, "cmake")


@pytest.fixture(scope="module")
def installed(tmp_path_factory):
    native.runner_path(build=True)  # native/build/ up to date
    prefix = tmp_path_factory.mktemp("llmpipe_prefix")
    r = subprocess.run([cmake(), "--install", str(native.BUILD_DIR), "--prefix", str(prefix)], capture_output=True,
                       text=True, timeout=300)
    assert r.returncode == 0, r.stdout + r.stderr
    assert (prefix / "lib" / "cmake" / "llmpipe_ops" / "llmpipe_opsConfig.cmake").is_file()
    return prefix


@pytest.fixture(scope="module")
def program() -> dict:
    return build("tiny_llama_custom", "verify.enabled=false")  # llmpipe::cached_attention, logits `tail`


@pytest.mark.parametrize("library", ["llmpipe::ops", "llmpipe::ops_shared"])
def test_the_documented_app_builds_and_answers_as_llm_runner(library, installed, program, tmp_path):
    (cmakelists,), cpp = blocks("cmake"), blocks("cpp")
    assert len(cpp) == 1
    src = tmp_path / "app"
    src.mkdir()
    (src / "CMakeLists.txt").write_text(cmakelists)
    (src / "main.cpp").write_text(cpp[0])
    import executorch
    prefix_path = f"{executorch.__path__[0]};{installed}"
    for cmd in ([cmake(), "-S", str(src), "-B", str(src / "build"), f"-DCMAKE_PREFIX_PATH={prefix_path}",
                 f"-DLLMPIPE_OPS={library}", "-DCMAKE_BUILD_TYPE=Release"],
                [cmake(), "--build", str(src / "build"), "-j", "2"]):
        r = subprocess.run(cmd, capture_output=True, text=True, timeout=600)
        assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    app = subprocess.run([str(src / "build" / "greedy_app"), program["pte"], str(N_NEW), ",".join(map(str, PROMPT))],
                         capture_output=True, text=True, timeout=120)
    assert app.returncode == 0, app.stderr[-2000:]
    ours = native.run(program["pte"], None, prompt_ids=PROMPT, max_new_tokens=N_NEW, extra_args=["--ignore-eos"])
    assert [int(x) for x in app.stdout.split()] == ours["generated_ids"]
    if library == "llmpipe::ops_shared":  # the app loads our kernels from the shared library, not its own copy
        needed = subprocess.run(["readelf", "-d", str(src / "build" / "greedy_app")], capture_output=True,
                                text=True).stdout
        assert "libllmpipe_ops.so" in needed
