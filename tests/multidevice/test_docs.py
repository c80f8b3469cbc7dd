"""Every code block of docs/guide.md runs, and the output it shows is what the library prints; so does
every ```python block of README.md (its ```bash blocks are the set-up, not run here).

Conventions (stated at the top of the guide): each ```python block is a complete program, run from
the repository root in a fresh process; a ```text block right after it is its exact stdout. Each
line of a ```bash block is run from the repository root unless it ends with
``# not run by tests: <reason>``, or with ``# run by tests/<file>.py`` where that test file runs the
same command (checked here: it names the script and every option of the line).
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
GUIDE = ROOT / "docs" / "guide.md"
README = ROOT / "README.md"
FENCE = re.compile(r"^```(\w*)\n(.*?)^```$", re.MULTILINE | re.DOTALL)
SKIP = re.compile(r"#\s*not run by tests:")
RUN_BY = re.compile(r"#\s*run by (tests/\S+\.py)")


@dataclass(frozen=True)
class Block:
    lang: str
    code: str
    line: int
    end: int  # offset just after the closing fence


def _blocks(doc: Path = GUIDE) -> list[Block]:
    text = doc.read_text()
    return [Block(m.group(1), m.group(2), text.count("\n", 0, m.start()) + 1, m.end()) for m in FENCE.finditer(text)]


def _python_cases(doc: Path = GUIDE) -> list[tuple[Block, str | None]]:
    text, blocks, cases = doc.read_text(), _blocks(doc), []
    for i, b in enumerate(blocks):
        if b.lang != "python":
            continue
        nxt = blocks[i + 1] if i + 1 < len(blocks) else None
        follows = nxt is not None and nxt.lang == "text" and not text[b.end:text.index("```", b.end + 1)].strip()
        cases.append((b, nxt.code if follows else None))
    return cases


def _bash_lines() -> list[tuple[int, str]]:
    out = []
    for b in _blocks():
        if b.lang == "bash":
            for k, line in enumerate(b.code.splitlines()):
                if line.strip() and not line.lstrip().startswith("#") and not SKIP.search(line) \
                        and not RUN_BY.search(line):
                    out.append((b.line + 1 + k, line.strip()))
    return out


def _lines_run_by_tests() -> list[tuple[str, str]]:
    return [(line.split("#")[0].split(), RUN_BY.search(line).group(1))
            for b in _blocks() if b.lang == "bash" for line in b.code.splitlines() if RUN_BY.search(line)]


def _env() -> dict:
    return {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")]))}


def _clean(out: str) -> str:
    """Drop the profiler's USDT lines; strip trailing spaces."""
    return "\n".join(ln.rstrip() for ln in out.strip().splitlines() if not ln.startswith("USDT:"))


def test_guide_has_blocks_and_every_text_block_is_an_output():
    blocks = _blocks()
    assert sum(b.lang == "python" for b in blocks) >= 5 and _bash_lines()
    assert {b.lang for b in blocks} <= {"python", "text", "bash"}
    shown = [b for b in blocks if b.lang == "text"]
    assert len(shown) == len([1 for _, exp in _python_cases() if exp is not None]), (
        "a ```text block must directly follow the ```python block whose output it shows")


def test_readme_links_the_guide():
    assert "docs/guide.md" in (ROOT / "README.md").read_text()


def _doc_cases() -> list[tuple[str, Block, str | None]]:
    return [(doc.name, *case) for doc in (GUIDE, README) for case in _python_cases(doc)]


def test_readme_has_a_python_block():
    assert _python_cases(README)


@pytest.mark.parametrize("case", _doc_cases(), ids=lambda c: f"{c[0]}:{c[1].line}")
def test_python_block(case, tmp_path):
    doc, block, expected = case
    script = tmp_path / f"{Path(doc).stem}_line{block.line}.py"
    script.write_text(block.code)
    proc = subprocess.run([sys.executable, str(script)], cwd=ROOT, env=_env(), capture_output=True, text=True,
                          timeout=300)
    assert proc.returncode == 0, f"{doc} line {block.line} failed:\n{proc.stdout}\n{proc.stderr}"
    if expected is not None:
        assert _clean(proc.stdout) == _clean(expected), f"{doc} line {block.line}: output differs"


def test_lines_run_by_other_tests_are():
    for words, test_file in _lines_run_by_tests():
        source = (ROOT / test_file).read_text()
        script = next(w for w in words if w.endswith(".py"))
        options = [w for w in words if w.startswith("--")]
        missing = [w for w in [script, *options] if w.split("/")[-1] not in source]
        assert not missing, f"{test_file} does not run {' '.join(words)}: {missing} not in it"


@pytest.mark.parametrize("case", _bash_lines(), ids=lambda c: f"guide.md:{c[0]}")
def test_bash_line(case):
    line_no, command = case
    proc = subprocess.run(["bash", "-c", command], cwd=ROOT, env=_env(), capture_output=True, text=True,
                          timeout=300)
    assert proc.returncode == 0, f"guide.md line {line_no}: {command}\n{proc.stdout}\n{proc.stderr}"
