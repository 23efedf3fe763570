"""Episodes on disk: one strict JSON line per episode (``Episode.to_dict``, tokens included),
written atomically. Evaluation's ``episodes.jsonl`` and a run's ``episodes/step_*.jsonl`` are both
written here, so both read back the same way and neither is ever left half-written."""

from __future__ import annotations

import json
import logging
from collections.abc import Sequence
from pathlib import Path

from cookbook_lib.rollout.episode import Episode
from cookbook_lib.runtime.jsonl import json_line, write_atomically

logger = logging.getLogger(__name__)


def write_episodes(episodes: Sequence[Episode], path: str | Path) -> Path:
    """Write ``episodes`` to ``path``, replacing what was there; non-finite numbers become null.

    An episode holding a value JSON cannot hold (an env's metrics or messages, say; tasks are
    checked before a run) is written with that value as its ``repr`` string, and a warning says
    so: one bad record never loses the others.
    """
    path = Path(path)
    lines = []
    for index, episode in enumerate(episodes):
        record = episode.to_dict()
        try:
            lines.append(json_line(record))
        except (TypeError, ValueError) as exc:
            logger.warning(
                "episode %d of %s holds a value JSON cannot hold (%s); written as its repr", index, path, exc
            )
            lines.append(json_line(record, fallback=True))
    write_atomically(path, "".join(lines))
    return path


def read_episodes(path: str | Path) -> list[Episode]:
    with Path(path).open(encoding="utf-8") as handle:
        return [Episode.from_dict(json.loads(line)) for line in handle if line.strip()]
