"""Write the tool-use game's bundled tasks, data/tool_use_game/{train,val}.jsonl.

Deterministic: the same seed gives byte-identical files, so the committed data can be checked by
regenerating it (a test does). Usage: ``python scripts/make_tool_use_game_data.py [--out-dir DIR]``.
"""

from __future__ import annotations

import argparse
from collections import Counter
from pathlib import Path

from envs.tool_use_game.generate import DEFAULT_SEED, write_splits
from envs.tool_use_game.tasks import DATA_DIR, load_tool_use_game_tasks


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out-dir", type=Path, default=DATA_DIR, help=f"default: {DATA_DIR}")
    parser.add_argument("--seed", type=int, default=DEFAULT_SEED)
    args = parser.parse_args(argv)
    for split, path in write_splits(args.out_dir, seed=args.seed).items():
        tiers = Counter(task.metadata["tier"] for task in load_tool_use_game_tasks(split, args.out_dir))
        print(f"{path}: {sum(tiers.values())} tasks, by tier {dict(sorted(tiers.items()))}")


if __name__ == "__main__":
    main()
