"""Runs triton_cases.py in a child process with TRITON_INTERPRET=1 (set before Triton is imported),
so that the Triton kernels are checked on CPU without slowing or polluting this process."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("triton")

HERE = Path(__file__).resolve().parent


def test_triton_kernels_under_the_interpreter_equal_the_torch_reference():
    env = {**os.environ, "TRITON_INTERPRET": "1"}
    env.pop("ACELORA_KERNELS_BACKEND", None)
    cmd = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", str(HERE / "triton_cases.py")]
    proc = subprocess.run(cmd, env=env, cwd=HERE.parents[1], capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-2000:]
    assert " passed" in proc.stdout and "skipped" not in proc.stdout
