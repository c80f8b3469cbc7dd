"""``--help`` of every example and benchmark script answers at once: it imports no torch (what made it
take ~1.7 s; checked by what is imported, not by a clock, which a busy machine stalls), and shows every
option's default. A script is any ``examples/*.py`` or ``benchmarks/*.py`` with a
``__main__`` block, so new scripts are covered without being listed here."""

from __future__ import annotations

import re

import pytest
from conftest import ROOT, run_python

SCRIPTS = sorted(str(p.relative_to(ROOT)) for d in ("examples", "benchmarks") for p in (ROOT / d).glob("*.py")
                 if 'if __name__ == "__main__"' in p.read_text())


def test_the_scripts_are_found():
    assert {"examples/tp_mlp.py", "benchmarks/tp_mlp.py", "benchmarks/startup.py"} <= set(SCRIPTS)
    assert "examples/cli.py" not in SCRIPTS


@pytest.mark.parametrize("script", SCRIPTS)
def test_help_imports_no_torch(script):
    proc = run_python("-X", "importtime", script, "--help", timeout=60)
    assert proc.returncode == 0, proc.stderr
    imported = re.findall(r"^import time:\s+\d+ \|\s+\d+ \|\s*(\S+)$", proc.stderr, re.MULTILINE)
    assert imported and "torch" not in imported, f"{script} --help imports torch"
    assert "(default:" in proc.stdout
