"""The notebooks' one format: each ``notebooks/NN_*.py`` (jupytext's percent format) is the source
people edit and review; ``notebooks/NN_*.ipynb`` is built from it, without outputs.

    python scripts/sync_notebooks.py           write every notebook (and the README's badges) from its source
    python scripts/sync_notebooks.py --check   only report what differs (exit status 1 if anything does)

A build reads the source, puts the Colab badge in the first cell and the Colab set-up cell after it
(from pyproject.toml's repository URL, ``scripts/colab_cells.py``), gives every cell an id derived
from its position and text (so an unchanged source builds the same notebook), and pairs the two
files for jupytext (``ipynb,py:percent``), so JupyterLab with jupytext saves both. A source whose
Colab cells are out of date (a new URL) is rewritten too. The test suite runs ``--check``: a
notebook edited without its source, or the other way round, fails it.
"""

from __future__ import annotations

import argparse
import hashlib
import re
import sys
from pathlib import Path

import jupytext
import nbformat
from colab_cells import BADGE_PATTERN, PYPROJECT, ROOT, add_colab_cells, badge_markdown, repository_url

NOTEBOOKS_DIR = ROOT / "notebooks"
README = ROOT / "README.md"
FORMAT = "py:percent"
METADATA = {
    "jupytext": {"formats": "ipynb,py:percent"},
    "kernelspec": {"display_name": "Python 3 (ipykernel)", "language": "python", "name": "python3"},
    "language_info": {"name": "python"},
}
# A row of the README's notebook table: "| `01_name.ipynb` | what you do |", possibly with a badge.
_README_ROW = re.compile(rf"^\| `(?P<name>\d\d_\w+\.ipynb)`(?: {BADGE_PATTERN.pattern})? \|", re.MULTILINE)


def source_paths(notebooks_dir: Path = NOTEBOOKS_DIR) -> list[Path]:
    return sorted(notebooks_dir.glob("[0-9][0-9]_*.py"))


def cell_id(index: int, kind: str, text: str) -> str:
    return hashlib.sha1(f"{index}/{kind}/{text}".encode()).hexdigest()[:8]


def build(source: Path, repo_url: str) -> tuple[str, str]:
    """``(source text, notebook text)`` for the source at ``source``: the source itself unless its
    Colab cells were out of date, and the notebook built from it."""
    text = source.read_text(encoding="utf-8")
    notebook = jupytext.reads(text, fmt=FORMAT)
    before = [(cell.cell_type, cell.source) for cell in notebook.cells]
    add_colab_cells(notebook, source.with_suffix(".ipynb").name, repo_url)
    if [(cell.cell_type, cell.source) for cell in notebook.cells] != before:
        notebook.metadata = {**notebook.metadata, **METADATA}
        text = jupytext.writes(notebook, fmt=FORMAT)
    built = nbformat.v4.new_notebook(metadata=METADATA)
    for index, cell in enumerate(notebook.cells):
        kind = cell.cell_type
        made = (
            nbformat.v4.new_markdown_cell(cell.source)
            if kind == "markdown"
            else nbformat.v4.new_code_cell(cell.source)
        )
        made.id = "colab-setup" if index == 1 and kind == "code" else cell_id(index, kind, cell.source)
        if cell.metadata.get("tags"):  # the parameters cell's tag; jupytext's own layout keys stay out
            made.metadata["tags"] = list(cell.metadata["tags"])
        built.cells.append(made)
    nbformat.validate(built)
    return text, nbformat.writes(built) + "\n"


def synced_readme(text: str, repo_url: str, notebook_names: list[str]) -> str:
    """``text`` with each notebook's row of the table showing its current badge."""
    missing = sorted(set(notebook_names) - {m["name"] for m in _README_ROW.finditer(text)})
    if missing:
        raise ValueError(f"README.md's notebook table has no row for {', '.join(missing)}; add one")
    return _README_ROW.sub(lambda m: f"| `{m['name']}` {badge_markdown(repo_url, m['name'])} |", text)


def sync(
    *, write: bool, notebooks_dir: Path = NOTEBOOKS_DIR, readme: Path = README, pyproject: Path = PYPROJECT
) -> list[Path]:
    """The files whose text differs from what the sources and the URL give; rewritten if ``write``."""
    repo_url = repository_url(pyproject)
    wanted: dict[Path, str] = {}
    for source in source_paths(notebooks_dir):
        wanted[source], wanted[source.with_suffix(".ipynb")] = build(source, repo_url)
    names = [path.name for path in wanted if path.suffix == ".ipynb"]
    orphans = sorted(set(notebooks_dir.glob("[0-9][0-9]_*.ipynb")) - set(wanted))
    if orphans:
        raise ValueError(
            f"{', '.join(p.name for p in orphans)} have no source: write notebooks/NN_name.py first"
        )
    wanted[readme] = synced_readme(readme.read_text(), repo_url, names)
    stale = [
        path for path, text in wanted.items() if not path.exists() or path.read_text(encoding="utf-8") != text
    ]
    if write:
        for path in stale:
            path.write_text(wanted[path], encoding="utf-8")
    return stale


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--check", action="store_true", help="report what differs, change nothing")
    args = parser.parse_args(argv)
    stale = sync(write=not args.check)
    for path in stale:
        print(f"{path.relative_to(ROOT)}: {'differs from its source' if args.check else 'rewritten'}")
    if args.check and stale:
        print("run: python scripts/sync_notebooks.py", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
