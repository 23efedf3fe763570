"""Step metrics: what a batch of episodes says, and where it is written (JSONL always, W&B optionally).

``runs/<run_name>/metrics.jsonl`` is the record of a run that needs no account and survives a kill:
each line is flushed and fsync-ed as it is logged. On resume the trainer calls
:func:`truncate_metrics` with the checkpoint's step before opening a new :class:`MetricsLogger`, so
steps logged after that checkpoint (and replayed now) appear once, not twice.

Following nanochat, :class:`NullLogger` has the same methods and does nothing, so code that logs
needs no ``if``.
"""

from __future__ import annotations

import hashlib
import json
import os
import statistics
from collections.abc import Iterable, Sequence
from pathlib import Path
from typing import Any, Protocol

from cookbook_lib.rollout.episode import EndCause, Episode
from cookbook_lib.rollout.records import write_episodes
from cookbook_lib.runtime.jsonl import json_line, write_atomically

METRICS_FILE = "metrics.jsonl"
EPISODES_DIR = "episodes"

# Ratio name -> the end causes it counts. The first four are the seed's names.
_CAUSE_RATIOS: dict[str, frozenset[EndCause]] = {
    "terminated_ratio": frozenset({EndCause.TERMINATED}),
    "truncated_ratio": frozenset(cause for cause in EndCause if cause.is_truncation),
    "context_overflow_ratio": frozenset({EndCause.CONTEXT_OVERFLOW}),
    "parse_failure_ratio": frozenset({EndCause.PARSE_FAILURE}),
    "max_turns_ratio": frozenset({EndCause.MAX_TURNS}),
    "env_truncated_ratio": frozenset({EndCause.ENV}),
    "error_ratio": frozenset({EndCause.ERROR}),
}


def episode_stats(episodes: Sequence[Episode], prefix: str = "") -> dict[str, float]:
    """The multi-turn metrics of a batch of episodes, each key prefixed with ``prefix`` (e.g. ``"val/"``).

    End-cause ratios are fractions of all episodes (``ERROR`` counts in no truncation ratio).
    ``reward_std`` is the population standard deviation. ``sampled_tokens`` is the total number of
    tokens the model sampled; ``episode_tokens_mean`` the mean length of an episode's training
    sequences (prompt, tool and sampled tokens; an episode split by a history rewrite counts each
    sequence). ``env/<name>`` is the mean of a numeric environment metric over the episodes that
    report it: episodes ended by an error usually report none, and counting them as 0 would lie.
    """
    if not episodes:
        raise ValueError("episode_stats needs at least one episode; got none (did every rollout fail?)")
    count = len(episodes)
    stats: dict[str, float] = {
        name: sum(episode.end_cause in causes for episode in episodes) / count
        for name, causes in _CAUSE_RATIOS.items()
    }
    rewards = [float(episode.reward) for episode in episodes]
    stats["reward_mean"] = statistics.fmean(rewards)
    stats["reward_std"] = statistics.pstdev(rewards)
    stats["turns_mean"] = statistics.fmean(episode.num_turns for episode in episodes)
    stats["sampled_tokens"] = float(
        sum(len(turn.sampled_tokens) for episode in episodes for turn in episode.turns)
    )
    stats["episode_tokens_mean"] = statistics.fmean(
        sum(len(sequence) for sequence in episode.token_sequences()) for episode in episodes
    )
    env_values: dict[str, list[float]] = {}
    for episode in episodes:
        for name, value in episode.metrics.items():
            if isinstance(value, int | float):  # bool is an int: a flag's mean is its rate
                env_values.setdefault(name, []).append(float(value))
    for name, values in sorted(env_values.items()):
        stats[f"env/{name}"] = statistics.fmean(values)
    return {f"{prefix}{name}": value for name, value in stats.items()}


class Logger(Protocol):
    """What the training loop logs to: :class:`MetricsLogger` or :class:`NullLogger`."""

    def log(self, step: int, metrics: dict[str, Any]) -> None: ...

    def close(self) -> None: ...


class NullLogger:
    """A logger that drops everything, so code that logs needs no ``if`` (nanochat's DummyWandb)."""

    def log(self, step: int, metrics: dict[str, Any]) -> None:
        pass

    def close(self) -> None:
        pass

    def __enter__(self) -> NullLogger:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()


class MetricsLogger:
    """Append one JSON line per step to ``run_dir/metrics.jsonl``, and log the same to W&B if asked.

    The W&B run id is derived from ``run_name``, so a resumed run (``resume="allow"``) continues the
    same W&B run instead of starting a second one. ``WANDB_MODE=offline`` writes the W&B run under
    ``run_dir/wandb`` for ``wandb sync`` later.
    """

    def __init__(
        self,
        run_dir: Path,
        *,
        wandb_project: str | None,
        run_name: str,
        config: dict[str, Any] | None = None,
    ) -> None:
        self.run_dir = Path(run_dir)
        self.run_dir.mkdir(parents=True, exist_ok=True)
        self.path = self.run_dir / METRICS_FILE
        _drop_partial_last_line(self.path)
        self._handle = self.path.open("a", encoding="utf-8")
        self._wandb_run: Any = None
        if wandb_project is not None:
            import wandb  # lazily: importing wandb costs a second and most runs do without it

            self._wandb_run = wandb.init(
                project=wandb_project,
                name=run_name,
                id=wandb_run_id(run_name),
                config=config,
                dir=str(self.run_dir),
                resume="allow",
                # Each logger owns its run; the default would hand back a run still open in this
                # process (a notebook that trains twice) and log into it.
                reinit="create_new",
            )

    def log(self, step: int, metrics: dict[str, Any]) -> None:
        """Write ``{"step": step, **metrics}`` as one line and make it durable before returning."""
        if "step" in metrics:
            raise ValueError("'step' is the logger's own key; pass the step as the first argument")
        record = {"step": step, **metrics}
        self._handle.write(json_line(record))
        self._handle.flush()
        os.fsync(self._handle.fileno())
        if self._wandb_run is not None:
            self._wandb_run.log(metrics, step=step)

    def close(self) -> None:
        """Close the file and finish the W&B run (which uploads it, online). Safe to call twice."""
        if not self._handle.closed:
            self._handle.close()
        if self._wandb_run is not None:
            self._wandb_run.finish()
            self._wandb_run = None

    def __enter__(self) -> MetricsLogger:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()


def wandb_run_id(run_name: str) -> str:
    """A W&B run id that is the same for every process of ``run_name`` (W&B ids allow [a-z0-9])."""
    return hashlib.sha256(run_name.encode("utf-8")).hexdigest()[:16]


def _complete_lines(path: Path) -> Iterable[str]:
    """The lines of ``path`` that end in a newline: a line cut short by a kill is not a record."""
    with path.open(encoding="utf-8") as handle:
        for line in handle:
            if line.endswith("\n") and line.strip():
                yield line


def _drop_partial_last_line(path: Path) -> None:
    """Cut a last line that a kill left without its newline, so the next record starts a line."""
    if not path.exists() or path.stat().st_size == 0:
        return
    data = path.read_bytes()
    if not data.endswith(b"\n"):
        os.truncate(path, data.rfind(b"\n") + 1)


def read_metrics(run_dir: Path) -> list[dict[str, Any]]:
    """Every logged record of a run, in order (an empty list when nothing was logged yet)."""
    path = Path(run_dir) / METRICS_FILE
    if not path.exists():
        return []
    return [json.loads(line) for line in _complete_lines(path)]


def truncate_metrics(run_dir: Path, after_step: int) -> None:
    """Drop the records with ``step > after_step`` (and a trailing half line), atomically.

    Called on resume with the checkpoint's step: the steps after it are trained again and would
    otherwise be logged twice. The new file is written beside the old one and swapped in with
    ``os.replace``, so a kill during this call leaves either the old file or the new one.
    """
    path = Path(run_dir) / METRICS_FILE
    if not path.exists():
        return
    kept = [line for line in _complete_lines(path) if json.loads(line)["step"] <= after_step]
    write_atomically(path, "".join(kept))


def dump_episodes(run_dir: Path, step: int, episodes: Sequence[Episode]) -> Path:
    """Write a step's episodes to ``run_dir/episodes/step_000123.jsonl``, one ``to_dict()`` a line.

    Replaces the file of a step that is trained again after a resume.
    """
    return write_episodes(episodes, Path(run_dir) / EPISODES_DIR / f"step_{step:06d}.jsonl")
