"""Images of what a training run produces, for readers who do not run the notebooks.

GitHub shows a notebook's markdown but none of the widgets and plotly figures a run draws, and a
full run takes half an hour on a CPU. This script draws the key figures of a finished run as PNG
files under ``docs/images/``, which the notebooks' markdown and the README show:

- ``<name>_training_curves.png``: the run's training curves (reward and validation reward, how
  episodes ended, loss, entropy; an async run's own panels when the run was async);
- ``<name>_episodes.png``: the best episode of the first step and of the last, side by side, as the
  episode viewer shows them (the system prompt left out);
- ``<name>_timeline.png``: when the trainer and the generators were busy (``--timeline`` draws
  several runs one above the other).

    python scripts/make_result_images.py runs/<03 run> --name 03 --figures curves episodes
    python scripts/make_result_images.py runs/<04 run>-async --name 04 --figures curves timeline \\
        --timeline lockstep=runs/<04 run>-lockstep --timeline async=runs/<04 run>-async

Needs kaleido (``pip install -e ".[images]"``) and Chrome or Chromium (``apt-get install chromium``;
``BROWSER_PATH`` names another binary): kaleido drives it to export the plotly figures, and the
episodes image is a headless screenshot of the viewer's HTML.
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import re
import shutil
import subprocess
import tempfile
from collections.abc import Sequence
from html import escape
from pathlib import Path

import plotly.graph_objects as go

from cookbook_lib.display.timeline_plots import timeline_figure
from cookbook_lib.display.training_plots import ASYNC_PANELS, TRAINING_PANELS, training_curves_figure
from cookbook_lib.display.viewer import episode_html
from cookbook_lib.grpo.config import GRPOConfig
from cookbook_lib.grpo.train import TIMELINE_FILE
from cookbook_lib.rollout.episode import Episode
from cookbook_lib.rollout.records import read_episodes
from cookbook_lib.runtime.metrics import read_metrics
from cookbook_lib.runtime.timeline import Timeline

ROOT = Path(__file__).resolve().parents[1]
IMAGES_DIR = ROOT / "docs" / "images"
WIDTH_PX = 1000  # GitHub shows images at most ~880 px wide: crisp there, small in git
BROWSERS = ("chromium", "chromium-browser", "google-chrome", "google-chrome-stable", "chrome")


class RunFolderError(ValueError):
    """The folder given is not a finished training run's folder; the message says what is missing."""


def find_browser() -> str:
    """The Chrome/Chromium binary: ``$BROWSER_PATH``, else the first of ``BROWSERS`` on the PATH."""
    named = os.environ.get("BROWSER_PATH")
    if named:
        if not Path(named).is_file():
            raise FileNotFoundError(
                f"BROWSER_PATH={named} is not a file; point it at a Chrome/Chromium binary"
            )
        return named
    for name in BROWSERS:
        found = shutil.which(name)
        if found:
            return found
    raise FileNotFoundError(
        "no Chrome or Chromium found (looked for " + ", ".join(BROWSERS) + "); install one "
        "(apt-get install chromium) or set BROWSER_PATH to its binary"
    )


def run_config(run_dir: Path) -> GRPOConfig | None:
    path = run_dir / "config.yaml"
    return GRPOConfig.from_yaml(path) if path.is_file() else None


def curves_figure(run_dir: Path) -> go.Figure:
    """The run's training curves, with the async panels when the run was async."""
    metrics = read_metrics(run_dir)
    if not metrics:
        raise RunFolderError(
            f"{run_dir} has no metrics.jsonl: pass a training run's folder (runs/<run_name>/)"
        )
    config = run_config(run_dir)
    is_async = config is not None and config.is_async
    num_steps = config.num_steps if config is not None else None
    last_step = max(int(record["step"]) for record in metrics)
    title = f"{'Async' if is_async else 'Lockstep'} GRPO: {run_dir.name}, {last_step} steps"
    return training_curves_figure(
        metrics, title, panels=ASYNC_PANELS if is_async else TRAINING_PANELS, num_steps=num_steps
    )


def _best(episodes: Sequence[Episode]) -> Episode:
    """The highest reward, then the fewest turns (as notebook 03's "before and after")."""
    return max(episodes, key=lambda episode: (episode.reward, -episode.num_turns))


def _without_system_prompt(episode: Episode) -> Episode:
    """The tool-use game's system prompt is ~470 tokens of tool specs: it would fill the image."""
    messages = [message for message in episode.messages if message.get("role") != "system"]
    return dataclasses.replace(episode, messages=messages)


def step_files(run_dir: Path) -> list[tuple[int, Path]]:
    """``(step, path)`` of each ``episodes/step_*.jsonl``, in step order."""
    found = []
    for path in (run_dir / "episodes").glob("step_*.jsonl"):
        match = re.fullmatch(r"step_(\d+)\.jsonl", path.name)
        if match:
            found.append((int(match.group(1)), path))
    return sorted(found)


def episodes_page(run_dir: Path) -> str:
    """An HTML page: the best episode of the first step and of the last, side by side."""
    steps = [(step, read_episodes(path)) for step, path in step_files(run_dir)]
    steps = [(step, episodes) for step, episodes in steps if episodes]
    if not steps:
        raise RunFolderError(f"{run_dir} has no episodes/step_*.jsonl with episodes: is the run finished?")
    columns = []
    for label, (step, episodes) in (("first step", steps[0]), ("last step", steps[-1])):
        mean = sum(episode.reward for episode in episodes) / len(episodes)
        heading = f"Step {step} ({label}): the best of {len(episodes)} episodes, mean reward {mean:.2f}"
        columns.append(
            '<div style="flex:1;min-width:0;padding:0 10px">'
            f'<h3 style="font-family:system-ui,sans-serif;font-size:16px;margin:8px 0">{escape(heading)}</h3>'
            f"{episode_html(_without_system_prompt(_best(episodes)))}</div>"
        )
    return (
        '<!DOCTYPE html><html><head><meta charset="utf-8"></head>'
        '<body style="margin:0;padding:10px 0;background:#fff">'
        f'<div id="page" style="display:flex;align-items:flex-start">{"".join(columns)}</div>'
        # Read by the first headless pass: how tall the screenshot must be to hold the content
        # (not the window's scroll height, which is never less than the window).
        "<script>const bottom = document.getElementById('page').getBoundingClientRect().bottom;"
        'document.body.setAttribute("data-height", String(Math.ceil(bottom) + 10));</script>'
        "</body></html>"
    )


def timeline_of(runs: Sequence[tuple[str, Path]]) -> go.Figure | None:
    """The timelines of ``runs`` (label, folder), one above the other; None if none was recorded."""
    loaded = [(label, Timeline.load(folder / TIMELINE_FILE)) for label, folder in runs]
    if not any(timeline.spans() for _, timeline in loaded):
        return None
    return timeline_figure(loaded, title="Where the time went")


def write_png(figure: go.Figure, path: Path, width: int = WIDTH_PX) -> Path:
    """Export a plotly figure with kaleido, which drives the Chrome that ``find_browser`` finds."""
    os.environ.setdefault("BROWSER_PATH", find_browser())  # kaleido reads it
    figure.write_image(path, width=width, height=figure.layout.height or 500, scale=1)
    return path


def screenshot(html: str, path: Path, width: int = WIDTH_PX, browser: str | None = None) -> Path:
    """A PNG of ``html`` as headless Chrome draws it at ``width`` px, as tall as the page."""
    browser = browser or find_browser()
    flags = [
        "--headless",
        "--no-sandbox",
        "--disable-gpu",
        "--hide-scrollbars",
        "--force-device-scale-factor=1",
    ]
    with tempfile.TemporaryDirectory() as scratch:
        page = Path(scratch) / "page.html"
        page.write_text(html, encoding="utf-8")
        dom = _run([browser, *flags, f"--window-size={width},100", "--dump-dom", page.as_uri()])
        match = re.search(r'data-height="(\d+)"', dom)
        if match is None:
            raise RuntimeError(f"{browser} did not run the page's script; its output began: {dom[:200]!r}")
        height = int(match.group(1))
        _run([browser, *flags, f"--window-size={width},{height}", f"--screenshot={path}", page.as_uri()])
    if not path.is_file():
        raise RuntimeError(f"{browser} wrote no screenshot to {path}")
    return path


def _run(command: list[str]) -> str:
    result = subprocess.run(command, capture_output=True, text=True, timeout=120)
    if result.returncode != 0:
        raise RuntimeError(f"{command[0]} failed ({result.returncode}): {result.stderr[-2000:]}")
    return result.stdout


def parse_timeline(value: str) -> tuple[str, Path]:
    label, sep, folder = value.partition("=")
    if not sep or not label or not folder:
        raise argparse.ArgumentTypeError(
            f"--timeline takes LABEL=RUN_DIR (e.g. async=runs/x-async), got {value!r}"
        )
    path = Path(folder)
    if not (path / TIMELINE_FILE).is_file():
        raise argparse.ArgumentTypeError(f"{path / TIMELINE_FILE} does not exist: is {path} a run's folder?")
    return label, path


FIGURES = ("curves", "episodes", "timeline")


def make_images(
    run_dir: Path,
    name: str,
    out_dir: Path = IMAGES_DIR,
    timeline_runs: Sequence[tuple[str, Path]] = (),
    figures: Sequence[str] = FIGURES,
) -> list[Path]:
    """Write the run's ``figures`` as ``out_dir/<name>_*.png``; returns the files written.

    The timeline is skipped, not an error, when no run of it recorded one.
    """
    run_dir = Path(run_dir)
    if not run_dir.is_dir():
        raise RunFolderError(f"{run_dir} is not a folder: pass a training run's folder (runs/<run_name>/)")
    if not re.fullmatch(r"[A-Za-z0-9_-]+", name):
        raise ValueError(f"--name {name!r}: use letters, digits, - and _ (it starts each file's name)")
    unknown = sorted(set(figures) - set(FIGURES))
    if unknown or not figures:
        raise ValueError(f"--figures {unknown or '(none)'}: choose from {', '.join(FIGURES)}")
    out_dir.mkdir(parents=True, exist_ok=True)
    written = []
    if "curves" in figures:
        written.append(write_png(curves_figure(run_dir), out_dir / f"{name}_training_curves.png"))
    if "episodes" in figures:
        written.append(screenshot(episodes_page(run_dir), out_dir / f"{name}_episodes.png"))
    if "timeline" in figures:
        if not timeline_runs and (run_dir / TIMELINE_FILE).is_file():
            timeline_runs = [(run_dir.name, run_dir)]
        timeline = timeline_of(timeline_runs) if timeline_runs else None
        if timeline is not None:
            written.append(write_png(timeline, out_dir / f"{name}_timeline.png"))
    return written


def main(argv: list[str] | None = None) -> list[Path]:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("run_dir", type=Path, help="a finished run's folder, runs/<run_name>/")
    parser.add_argument("--name", required=True, help="the files' prefix, e.g. the notebook's number: 03")
    parser.add_argument(
        "--out", type=Path, default=IMAGES_DIR, help=f"default: {IMAGES_DIR.relative_to(ROOT)}"
    )
    parser.add_argument(
        "--timeline",
        action="append",
        type=parse_timeline,
        default=[],
        metavar="LABEL=RUN_DIR",
        help="draw these runs' timelines one above the other, in order (default: the run's own)",
    )
    parser.add_argument(
        "--figures", nargs="+", choices=FIGURES, default=list(FIGURES), help="which images (default: all)"
    )
    args = parser.parse_args(argv)
    try:
        written = make_images(args.run_dir, args.name, args.out, args.timeline, args.figures)
    except (RunFolderError, FileNotFoundError, ValueError) as error:
        parser.exit(2, f"error: {error}\n")
    for path in written:
        print(path)
    return written


if __name__ == "__main__":
    main()
