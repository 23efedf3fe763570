"""scripts/make_result_images.py draws a run's figures, and every image the docs show exists."""

from __future__ import annotations

import importlib
import json
import re
import struct
from pathlib import Path

import pytest

from cookbook_lib.envs import Task
from cookbook_lib.grpo.config import GRPOConfig
from cookbook_lib.rollout.episode import EndCause, Episode
from cookbook_lib.runtime.metrics import MetricsLogger, dump_episodes
from cookbook_lib.runtime.timeline import SAMPLING, TRAINER_LANE, TRAINING, Timeline, replica_lane
from cookbook_lib.types import Message

ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture
def images(monkeypatch):
    """The script as a module (scripts/ is a folder of scripts, not a package)."""
    monkeypatch.syspath_prepend(str(ROOT / "scripts"))
    return importlib.import_module("make_result_images")


def _episode(prompt: str, reward: float, turns: int) -> Episode:
    return Episode(
        task=Task(prompt=prompt, target=7),
        messages=[
            Message(role="system", content="SYSTEM PROMPT WITH TOOL SPECS"),
            Message(role="user", content=prompt),
            Message(role="assistant", content="7" if reward else "no idea"),
        ],
        reward=reward,
        end_cause=EndCause.TERMINATED,
        num_turns=turns,
    )


def make_run(run_dir: Path, *, is_async: bool = False) -> Path:
    """A finished run's folder as train_multi_turn leaves it, without training anything."""
    run_dir.mkdir(parents=True)
    config = GRPOConfig(run_name=run_dir.name, num_steps=4, max_steps_off_policy=1 if is_async else None)
    config.to_yaml(run_dir / "config.yaml")
    with MetricsLogger(run_dir, wandb_project=None, run_name=run_dir.name) as log:
        log.log(0, {"val/reward_mean": 0.25})
        log.log(1, {"reward_mean": 0.25, "train/policy_loss": 0.01, "async/train_wait_s": 3.0})
        log.log(2, {"reward_mean": 0.5, "val/reward_mean": 0.5})
    dump_episodes(
        run_dir, 1, [_episode("first step, solved slowly", 1.0, 4), _episode("first, failed", 0.0, 1)]
    )
    dump_episodes(
        run_dir, 2, [_episode("last step, solved fast", 1.0, 2), _episode("last, solved slowly", 1.0, 5)]
    )
    timeline = Timeline(origin=0.0)
    timeline.add(replica_lane(0), SAMPLING, 0.0, 2.0)
    timeline.add(TRAINER_LANE, TRAINING, 2.0, 3.0)
    timeline.save(run_dir / "timeline.jsonl")
    return run_dir


def test_the_curves_are_the_runs_with_its_panels_and_steps(images, tmp_path):
    lockstep = images.curves_figure(make_run(tmp_path / "lockstep"))
    assert lockstep.layout.title.text == "Lockstep GRPO: lockstep, 2 steps"
    assert {trace.name for trace in lockstep.data} >= {"train reward", "validation reward", "policy loss"}
    assert lockstep.layout.xaxis.range[1] > 4  # the config's num_steps, not just the steps logged
    async_run = images.curves_figure(make_run(tmp_path / "async", is_async=True))
    assert "trainer waiting for groups" in {trace.name for trace in async_run.data}


def test_the_episodes_page_puts_the_best_of_the_first_and_last_step_side_by_side(images, tmp_path):
    page = images.episodes_page(make_run(tmp_path / "run"))
    first, last = page.index("Step 1 (first step)"), page.index("Step 2 (last step)")
    assert first < page.index("first step, solved slowly") < last < page.index("last step, solved fast")
    assert "last, solved slowly" not in page and "first, failed" not in page  # only the best ones
    assert "SYSTEM PROMPT" not in page  # the tool specs would fill the image
    assert "mean reward 0.50" in page and "mean reward 1.00" in page
    assert '"data-height"' in page  # the probe the screenshot reads the page's height from


def test_a_folder_that_is_not_a_run_says_what_is_missing(images, tmp_path):
    with pytest.raises(images.RunFolderError, match=r"no metrics\.jsonl"):
        images.curves_figure(tmp_path)
    with pytest.raises(images.RunFolderError, match="no episodes"):
        images.episodes_page(tmp_path)
    with pytest.raises(images.RunFolderError, match="is not a folder"):
        images.make_images(tmp_path / "missing", "03", tmp_path / "out")
    with pytest.raises(ValueError, match="--name"):
        images.make_images(make_run(tmp_path / "run"), "03 curves", tmp_path / "out")
    with pytest.raises(ValueError, match="choose from curves, episodes, timeline"):
        images.make_images(tmp_path / "run", "03", tmp_path / "out", figures=["histogram"])
    with pytest.raises(SystemExit):
        images.main([str(tmp_path / "run"), "--name", "03", "--timeline", "no-equals-sign"])


def test_timelines_are_drawn_in_the_order_given(images, tmp_path):
    one, two = make_run(tmp_path / "one"), make_run(tmp_path / "two", is_async=True)
    figure = images.timeline_of([("lockstep", one), ("async", two)])
    titles = [annotation.text for annotation in figure.layout.annotations]
    assert titles[0].startswith("lockstep:") and titles[1].startswith("async:")


def _png_size(path: Path) -> tuple[int, int]:
    header = path.read_bytes()[:24]
    assert header[:8] == b"\x89PNG\r\n\x1a\n", f"{path} is not a PNG"
    return struct.unpack(">II", header[16:24])


def test_the_script_writes_the_pngs(images, tmp_path):
    try:
        images.find_browser()
        import kaleido  # noqa: F401
    except (FileNotFoundError, ImportError) as missing:
        pytest.skip(f"needs Chrome/Chromium and kaleido (pip install -e '.[images]'): {missing}")
    run_dir = make_run(tmp_path / "run")
    written = images.main([str(run_dir), "--name", "t", "--out", str(tmp_path / "out")])
    assert [path.name for path in written] == ["t_training_curves.png", "t_episodes.png", "t_timeline.png"]
    for path in written:
        width, height = _png_size(path)
        assert width == images.WIDTH_PX and height > 200, path.name


def _image_links() -> list[tuple[Path, str]]:
    """(document, link) for every image the README and the notebooks' markdown show."""
    links = [
        (ROOT / "README.md", link)
        for link in re.findall(r"!\[[^\]]*\]\(([^)]+)\)", (ROOT / "README.md").read_text())
    ]
    for notebook in sorted((ROOT / "notebooks").glob("*.ipynb")):
        for cell in json.loads(notebook.read_text())["cells"]:
            if cell["cell_type"] == "markdown":
                text = "".join(cell["source"])
                links += [(notebook, link) for link in re.findall(r"!\[[^\]]*\]\(([^)]+)\)", text)]
    return [(document, link) for document, link in links if not link.startswith("http")]


def test_every_image_the_docs_show_exists_under_docs_images():
    links = _image_links()
    assert links, "the README and the notebooks show result images from docs/images/"
    for document, link in links:
        target = (document.parent / link).resolve()
        assert target.is_file(), f"{document.name} shows {link}, which does not exist"
        assert target.parent == ROOT / "docs" / "images", f"{document.name}: keep images in docs/images/"


def test_the_images_folder_says_how_to_remake_them():
    text = (ROOT / "docs" / "images" / "README.md").read_text()
    assert "python scripts/make_result_images.py" in text
