"""``--help`` answers before torch is imported, and shows every option's default."""

from __future__ import annotations

import re

import pytest
from conftest import run_python

SCRIPTS = ["examples/tp_mlp.py", "examples/linear_tp.py", "examples/dp_tp_mlp.py", "benchmarks/startup.py"]


@pytest.mark.parametrize("script", SCRIPTS)
def test_help_imports_no_torch(script):
    proc = run_python("-X", "importtime", script, "--help", timeout=60)
    assert proc.returncode == 0, proc.stderr
    imported = re.findall(r"^import time:\s+\d+ \|\s+\d+ \|\s*(\S+)$", proc.stderr, re.MULTILINE)
    assert imported and "torch" not in imported, f"{script} --help imports torch"
    assert "(default:" in proc.stdout
