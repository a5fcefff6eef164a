"""The C++ runners' greedy argmax (vectorized) keeps torch.argmax's rule: native/build/sampler_test."""
import subprocess
from pathlib import Path


def test_the_vectorized_argmax_picks_torchs_index(native_bins):
    proc = subprocess.run([str(Path(native_bins[0]).parent / "sampler_test")], capture_output=True, text=True,
                          timeout=120)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "ALL PASS" in proc.stdout and "FAIL" not in proc.stdout.replace("ALL PASS", "")
