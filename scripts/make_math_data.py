"""Write MathEnv's bundled tasks, ``data/math/train.jsonl`` and ``data/math/val.jsonl``.

Deterministic: a fixed seed and a fixed output format, so running it again reproduces the files
byte for byte (a test checks this). Each line is one task::

    {"prompt": "What is 37 * (12 + 5)?", "target": 629,
     "metadata": {"expression": "37 * (12 + 5)", "level": 2}}

(one line in the file).

Three levels of difficulty: one operation; two or three operations with parentheses; four
operands with ``**``, ``//``, ``%`` or an exact division. Train and val share no expression.

Usage: ``python scripts/make_math_data.py [--out-dir DIR] [--seed N]``.
"""

from __future__ import annotations

import argparse
import json
import random
from collections.abc import Callable
from pathlib import Path
from typing import Any

from envs.math_env import safe_eval

DEFAULT_OUT_DIR = Path(__file__).resolve().parent.parent / "data" / "math"
DEFAULT_SEED = 1234
NUM_TRAIN = 200
NUM_VAL = 50


def _level_1(rng: random.Random) -> str:
    a, b = rng.randint(2, 99), rng.randint(2, 99)
    return f"{a} {rng.choice('+-*')} {b}"


def _level_2(rng: random.Random) -> str:
    a, b, c, d = (rng.randint(2, 60) for _ in range(4))
    return rng.choice(
        [
            f"{a} * ({b} + {c})",
            f"({a} - {b}) * {c}",
            f"{a} + {b} * {c}",
            f"{a} * {b} - {c}",
            f"({a} + {b}) * ({c} - {d})",
        ]
    )


def _level_3(rng: random.Random) -> str:
    a, b, c, d = (rng.randint(2, 40) for _ in range(4))
    pattern = rng.randrange(4)
    if pattern == 0:
        return f"{a} ** {rng.randint(2, 3)} - {b} * {c}"
    if pattern == 1:
        return f"({a} * {b} + {c}) // {d}"
    if pattern == 2:
        return f"({a} * {b} - {c}) % {d} + {rng.randint(100, 999)}"
    # An exact division: the numerator is a multiple of the divisor, so the answer is a whole
    # number (as a float, 56.0, which "56" matches) and needs no rounding.
    return f"({d * a} + {d * b}) / {d}"


LEVELS: dict[int, Callable[[random.Random], str]] = {1: _level_1, 2: _level_2, 3: _level_3}


def generate_records(seed: int = DEFAULT_SEED, count: int = NUM_TRAIN + NUM_VAL) -> list[dict[str, Any]]:
    """``count`` distinct tasks, levels cycling 1, 2, 3, in a fixed order for ``seed``."""
    rng = random.Random(seed)
    records: list[dict[str, Any]] = []
    seen: set[str] = set()
    while len(records) < count:
        level = len(records) % len(LEVELS) + 1
        expression = LEVELS[level](rng)
        if expression in seen:
            continue
        seen.add(expression)
        records.append(
            {
                "prompt": f"What is {expression}?",
                "target": safe_eval(expression),
                "metadata": {"expression": expression, "level": level},
            }
        )
    return records


def write_jsonl(path: Path, records: list[dict[str, Any]]) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    # newline="\n": the same bytes on every platform.
    with path.open("w", encoding="utf-8", newline="\n") as file:
        for record in records:
            file.write(json.dumps(record, ensure_ascii=True) + "\n")


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out-dir", type=Path, default=DEFAULT_OUT_DIR)
    parser.add_argument("--seed", type=int, default=DEFAULT_SEED)
    args = parser.parse_args(argv)
    records = generate_records(args.seed)
    write_jsonl(args.out_dir / "train.jsonl", records[:NUM_TRAIN])
    write_jsonl(args.out_dir / "val.jsonl", records[NUM_TRAIN:])
    print(f"wrote {NUM_TRAIN} train and {len(records) - NUM_TRAIN} val tasks to {args.out_dir}")


if __name__ == "__main__":
    main()
