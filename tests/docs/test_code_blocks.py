"""Every ```python block of README.md and docs/*.md runs, page by page, on small sizes.

The blocks of one page share one namespace and run in page order, so a page can define a
model once and use it in later blocks: the test of the block at line N first runs (or has
already run, in this process) the page's earlier blocks. A block preceded by the line
`<!-- skip: reason -->` is not run and is reported as skipped with that reason (it needs a
GPU, several machines or a download). ```bash blocks are not run; the README's first two are
the setup commands CI runs, checked below.
"""
from __future__ import annotations

import os
import re
from dataclasses import dataclass
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
FENCE = re.compile(r"^```(\w*)\s*$")
SKIP = re.compile(r"^<!--\s*skip:\s*(.+?)\s*-->\s*$")


@dataclass(frozen=True)
class CodeBlock:
    page: Path
    line: int          # 1-based line of the opening fence
    language: str
    code: str
    skip: str | None   # the reason from a `<!-- skip: ... -->` line just before the fence


def code_blocks(page: Path) -> list[CodeBlock]:
    """The fenced blocks of a Markdown page, in order."""
    blocks, lines = [], page.read_text().splitlines()
    i = 0
    while i < len(lines):
        opening = FENCE.match(lines[i])
        if not opening:
            i += 1
            continue
        end = next(j for j in range(i + 1, len(lines)) if lines[j].startswith("```"))
        skip = SKIP.match(lines[i - 1]) if i else None
        blocks.append(CodeBlock(page, i + 1, opening.group(1), "\n".join(lines[i + 1:end]),
                                skip.group(1) if skip else None))
        i = end + 1
    return blocks


def _python_blocks() -> list[CodeBlock]:
    return [b for page in PAGES for b in code_blocks(page) if b.language == "python"]


PYTHON_BLOCKS = _python_blocks()


class _PageRun:
    """One page's namespace and how many of its blocks have run in it (this process)."""

    def __init__(self, page: Path) -> None:
        self.page, self.done, self.namespace = page, 0, {"__name__": "__docs__"}

    def close(self) -> None:
        # Stop the worker processes of any wrapped model the page left running.
        for value in list(self.namespace.values()):
            destroy = getattr(value, "destroy", None)
            if callable(destroy) and type(value).__name__ == "PoplarExecutor":
                destroy()
        self.namespace.clear()


_current: list[_PageRun] = []


def _run(block: CodeBlock, namespace: dict) -> None:
    # The file name in a traceback is the page and the fence's line.
    code = compile(block.code, f"{block.page.relative_to(ROOT)}:{block.line}", "exec")
    exec(code, namespace)  # noqa: S102 - documentation code, run as a reader would


@pytest.fixture(scope="module", autouse=True)
def _close_pages():
    yield
    while _current:
        _current.pop().close()


@pytest.mark.parametrize(
    "block", PYTHON_BLOCKS,
    ids=[f"{b.page.relative_to(ROOT)}:{b.line}" for b in PYTHON_BLOCKS])
def test_code_block_runs(block: CodeBlock, tmp_path_factory, monkeypatch) -> None:
    if block.skip:
        pytest.skip(block.skip)
    page_blocks = [b for b in PYTHON_BLOCKS if b.page == block.page and not b.skip]
    index = page_blocks.index(block)
    run = _current[0] if _current and _current[0].page == block.page else None
    if run is None or run.done > index:  # another page, or this page's blocks out of order
        while _current:
            _current.pop().close()
        run = _PageRun(block.page)
        run.namespace["__file__"] = str(tmp_path_factory.mktemp("page") / "docs_page.py")
        _current.append(run)
    # Files a block writes (reports, checkpoints) land in a temporary folder.
    monkeypatch.chdir(Path(run.namespace["__file__"]).parent)
    for earlier in page_blocks[run.done:index + 1]:
        try:
            _run(earlier, run.namespace)
        finally:
            run.done = page_blocks.index(earlier) + 1


def test_readme_starts_with_the_setup_commands() -> None:
    """CI (.ci/run) runs the second command verbatim; a reader copies the first."""
    first, second = code_blocks(ROOT / "README.md")[:2]
    assert (first.language, first.code) == (
        "bash", "./scripts/setup.sh && .venv/bin/python examples/mnist_pipeline.py")
    assert (second.language, second.code) == (
        "bash", "./scripts/setup.sh && .venv/bin/python -m pytest -q -n auto")
    assert second.code in (ROOT / ".ci" / "run").read_text()


def test_skipped_blocks_say_why() -> None:
    marked = [b for page in PAGES for b in code_blocks(page) if b.skip is not None]
    assert all(b.skip.strip() for b in marked)
    assert all(b.language == "python" for b in marked), "only python blocks run; skip marks belong there"


def test_collector_finds_the_blocks() -> None:
    assert len(PAGES) > 5 and len(PYTHON_BLOCKS) > 10
    assert os.path.exists(ROOT / "mkdocs.yml")
