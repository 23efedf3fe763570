"""The main job of `bash setup.sh`: watch the embedded model learn to use tools, on a CPU.

1. The scripted experts solve every bundled task (a check of the environments, a few seconds).
2. A short warm-start on expert traces teaches the 135M model the tool-call format it lacks.
3. Lockstep GRPO on the tool-use game, one line per step; validation before and after.

Everything lands in runs/<run_name>/ (metrics.jsonl, episodes, checkpoints, training_curves.html).

    python -m recipes.demo [--run-name NAME] [--steps N]
"""

from __future__ import annotations

import argparse

from recipes import experts
from recipes.grpo import tool_use_game


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--run-name", default=None)
    parser.add_argument("--steps", type=int, default=None)
    args, rest = parser.parse_known_args(argv)
    experts.main([])
    print()
    forwarded = list(rest)
    if args.run_name:
        forwarded += ["--run-name", args.run_name]
    if args.steps is not None:
        forwarded += ["--steps", str(args.steps)]
    tool_use_game.main(forwarded)


if __name__ == "__main__":
    main()
