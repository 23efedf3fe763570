"""Episodes on disk: one strict JSON line per episode (``Episode.to_dict``, tokens included),
written atomically. Evaluation's ``episodes.jsonl`` and a run's ``episodes/step_*.jsonl`` are both
written here, so both read back the same way and neither is ever left half-written."""

from __future__ import annotations

import json
from collections.abc import Sequence
from pathlib import Path

from cookbook_lib.rollout.episode import Episode
from cookbook_lib.runtime.jsonl import json_line, write_atomically


def write_episodes(episodes: Sequence[Episode], path: str | Path) -> Path:
    """Write ``episodes`` to ``path``, replacing what was there; non-finite numbers become null."""
    path = Path(path)
    write_atomically(path, "".join(json_line(episode.to_dict()) for episode in episodes))
    return path


def read_episodes(path: str | Path) -> list[Episode]:
    with Path(path).open(encoding="utf-8") as handle:
        return [Episode.from_dict(json.loads(line)) for line in handle if line.strip()]
