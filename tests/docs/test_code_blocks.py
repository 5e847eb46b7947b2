"""Every ```python block of README.md and docs/*.md runs, page by page, on small sizes.

The blocks of one page run in page order in one namespace (one test per page), so a page
can define a model once and use it in later blocks; a failure's traceback names the page and
the line of the block's opening fence (`docs/batching.md:42`). A block preceded by the line
`<!-- skip: reason -->` is not run and is reported as skipped with that reason (it needs a
GPU or a download). A block preceded by `<!-- file: path -->` shows a script of the repository
(one torchrun starts on several machines): it must equal that file, which a test of its own
runs (tests/test_example_torchrun.py). ```bash blocks are not run; the README's first two are
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
FILE = re.compile(r"^<!--\s*file:\s*(\S+)\s*-->\s*$")


@dataclass(frozen=True)
class CodeBlock:
    page: Path
    line: int          # 1-based line of the opening fence
    language: str
    code: str
    skip: str | None   # the reason from a `<!-- skip: ... -->` line just before the fence
    file: str | None = None  # the path from a `<!-- file: ... -->` line just before the fence


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
        file = FILE.match(lines[i - 1]) if i else None
        blocks.append(CodeBlock(page, i + 1, opening.group(1), "\n".join(lines[i + 1:end]),
                                skip.group(1) if skip else None, file.group(1) if file else None))
        i = end + 1
    return blocks


def _python_blocks() -> list[CodeBlock]:
    return [b for page in PAGES for b in code_blocks(page) if b.language == "python"]


PYTHON_BLOCKS = _python_blocks()


def _run(block: CodeBlock, namespace: dict) -> None:
    # The file name in a traceback is the page and the fence's line.
    code = compile(block.code, f"{block.page.relative_to(ROOT)}:{block.line}", "exec")
    exec(code, namespace)  # noqa: S102 - documentation code, run as a reader would


def _destroy_wrappers(namespace: dict) -> None:
    """Stop the worker processes of any wrapped model the page left running."""
    for value in list(namespace.values()):
        if type(value).__name__ == "PoplarExecutor":
            value.destroy()


RUN_PAGES = sorted({b.page for b in PYTHON_BLOCKS if not b.skip and not b.file})
SKIPPED = [b for b in PYTHON_BLOCKS if b.skip]
FILES = [b for b in PYTHON_BLOCKS if b.file]


# One test per page, not per block: a page's blocks share a namespace, and pytest-xdist would
# hand a page's blocks to different processes, each re-running the blocks before its own.
@pytest.mark.parametrize("page", RUN_PAGES, ids=[str(p.relative_to(ROOT)) for p in RUN_PAGES])
def test_page_code_runs(page: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.chdir(tmp_path)  # files a block writes (reports) land in a temporary folder
    namespace: dict = {"__name__": "__docs__"}
    try:
        for block in PYTHON_BLOCKS:
            if block.page == page and not block.skip and not block.file:
                _run(block, namespace)
    finally:
        _destroy_wrappers(namespace)


@pytest.mark.parametrize("block", SKIPPED,
                         ids=[f"{b.page.relative_to(ROOT)}:{b.line}" for b in SKIPPED])
def test_marked_block_is_skipped(block: CodeBlock) -> None:
    pytest.skip(f"{block.page.relative_to(ROOT)}:{block.line}: {block.skip}")


@pytest.mark.parametrize("block", FILES,
                         ids=[f"{b.page.relative_to(ROOT)}:{b.line}" for b in FILES])
def test_a_file_block_shows_its_file(block: CodeBlock) -> None:
    """The page shows the script as it is in the repository (where its own test runs it)."""
    assert block.code + "\n" == (ROOT / block.file).read_text(), (
        f"{block.page.relative_to(ROOT)}:{block.line} differs from {block.file}")
    runners = [t for t in (ROOT / "tests").rglob("test_*.py")
               if t.name != Path(__file__).name and block.file in t.read_text()]
    assert runners, f"no test names {block.file}, so none runs it"


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


def test_machines_page_skips_only_what_needs_a_gpu() -> None:
    """Its torchrun scripts are files a test runs (`<!-- file: -->`), not skipped blocks."""
    marked = [b for b in code_blocks(ROOT / "docs" / "machines.md") if b.skip is not None]
    assert all("GPU" in b.skip for b in marked), [(b.line, b.skip) for b in marked]


def test_collector_finds_the_blocks() -> None:
    assert len(PAGES) > 5 and len(PYTHON_BLOCKS) > 10
    assert os.path.exists(ROOT / "mkdocs.yml")
