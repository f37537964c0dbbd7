"""The suite's own set-up: .ci/run's second environment (vLLM's) runs tests without pytest-xdist,
so tests/conftest.py must load in a pytest that has no xdist plugin."""
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def test_conftest_loads_in_a_pytest_without_xdist():
    # -p no:xdist stands for an environment without pytest-xdist; an xdist hook in conftest.py
    # that is not optional stops collection there with "unknown hook" (exit 3)
    done = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-p", "no:xdist", "-p", "no:cacheprovider",
         "-o", "addopts=", "--collect-only", "tests/test_batch.py"],
        cwd=ROOT, capture_output=True, text=True, timeout=300,
    )
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-2000:]
    assert "unknown hook" not in done.stdout + done.stderr
