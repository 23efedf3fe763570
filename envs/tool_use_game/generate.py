"""Generating the bundled tasks of the tool-use game from a fixed seed.

Tiers (``metadata["tier"]``), from easy to hard, so that a warm-started small model is good at
the first and far from perfect at the last, leaving GRPO room to learn:

1. one fact named by its key: lookup, then answer;
2. arithmetic over one or two facts named by key: lookups, calculator, answer;
3. the same, or a single fact, described in words: list_fact_keys to find the keys (look-alike
   facts are always in the list), then lookups, calculator, answer.

Each task holds 3 to 6 facts with fresh small values, the rest being distractors. Numbers stay
small and every answer is a non-negative integer (a subtraction always takes the smaller value
from the larger). ``metadata`` also carries the plan the scripted expert follows: ``keys`` (the
facts needed, in the order the question mentions them) and ``expression``, a template such as
``"{apple_count} - {n_pears}"`` over those keys.

Prompts are unique across both splits, so no validation question is ever seen in training.
Only ``random.Random(seed)`` draws, over lists in a fixed order: the output is byte-identical on
every run and Python version.
"""

from __future__ import annotations

import json
import operator
import random
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from cookbook_lib.envs import Task
from envs.tool_use_game import phrasings
from envs.tool_use_game.facts import FACT_CATALOG, FactSpec

DEFAULT_SEED = 2024
SPLIT_TIER_SIZES: dict[str, dict[int, int]] = {
    "train": {1: 100, 2: 100, 3: 100},
    "val": {1: 20, 2: 20, 3: 20},
}
MIN_FACTS, MAX_FACTS = 3, 6
OPS: dict[str, Callable[[int, int], int]] = {"+": operator.add, "-": operator.sub, "*": operator.mul}


@dataclass(frozen=True)
class _Question:
    prompt: str
    specs: tuple[FactSpec, ...]  # the facts needed, in the order the question mentions them
    values: tuple[int, ...]  # their values, drawn to fit the operation
    expression: str
    target: int


def _pair_values(rng: random.Random, op: str) -> tuple[int, int]:
    if op == "*":
        return rng.randint(2, 12), rng.randint(2, 12)
    if op == "-":
        first = rng.randint(3, 20)
        return first, rng.randint(2, first - 1)
    return rng.randint(2, 20), rng.randint(2, 20)


def _const_values(rng: random.Random, op: str) -> tuple[int, int]:
    """(fact value, constant)."""
    if op == "*":
        return rng.randint(2, 15), rng.randint(2, 5)
    if op == "-":
        constant = rng.randint(2, 9)
        return rng.randint(constant + 1, 20), constant
    return rng.randint(2, 20), rng.randint(2, 9)


def _phrase(spec: FactSpec) -> str:
    return f"the {spec.description}"


def _single(rng: random.Random, in_words: bool) -> _Question:
    spec = rng.choice(FACT_CATALOG)
    value = rng.randint(2, 20)
    prompt = spec.question if in_words else rng.choice(phrasings.TIER1).format(a=spec.key)
    return _Question(prompt, (spec,), (value,), f"{{{spec.key}}}", value)


def _with_constant(rng: random.Random, in_words: bool) -> _Question:
    spec, op = rng.choice(FACT_CATALOG), rng.choice(list(OPS))
    value, constant = _const_values(rng, op)
    templates = phrasings.TIER3_CONST if in_words else phrasings.TIER2_CONST
    prompt = rng.choice(templates[op]).format(a=spec.key, A=_phrase(spec), c=constant)
    expression = f"{{{spec.key}}} {op} {constant}"
    return _Question(prompt, (spec,), (value,), expression, OPS[op](value, constant))


def _pair(rng: random.Random, in_words: bool) -> _Question:
    first, second = rng.sample(FACT_CATALOG, 2)
    op = rng.choice(list(OPS))
    values = _pair_values(rng, op)
    templates = phrasings.TIER3_PAIR if in_words else phrasings.TIER2_PAIR
    prompt = rng.choice(templates[op]).format(a=first.key, b=second.key, A=_phrase(first), B=_phrase(second))
    expression = f"{{{first.key}}} {op} {{{second.key}}}"
    return _Question(prompt, (first, second), values, expression, OPS[op](*values))


def _question(rng: random.Random, tier: int) -> _Question:
    if tier == 1:
        return _single(rng, in_words=False)
    draw = rng.random()
    if tier == 2:
        return _with_constant(rng, in_words=False) if draw < 0.4 else _pair(rng, in_words=False)
    if tier == 3:
        if draw < 0.1:
            return _single(rng, in_words=True)
        return _with_constant(rng, in_words=True) if draw < 0.3 else _pair(rng, in_words=True)
    raise ValueError(f"tier must be 1, 2 or 3, got {tier}")


def _facts(rng: random.Random, question: _Question) -> dict[str, dict[str, int | str]]:
    """The needed facts, every look-alike sibling of them, and random distractors; shuffled."""
    needed = list(question.specs)
    siblings = [
        spec
        for spec in FACT_CATALOG
        if spec not in needed and any(spec.family == need.family for need in needed)
    ]
    size = max(rng.randint(MIN_FACTS, MAX_FACTS), len(needed) + len(siblings))
    others = [spec for spec in FACT_CATALOG if spec not in needed and spec not in siblings]
    distractors = siblings + rng.sample(others, size - len(needed) - len(siblings))
    values = dict(zip([spec.key for spec in needed], question.values, strict=True))
    chosen = needed + distractors
    rng.shuffle(chosen)
    return {
        spec.key: {"value": values.get(spec.key, rng.randint(2, 20)), "description": spec.description}
        for spec in chosen
    }


def make_task(rng: random.Random, tier: int) -> Task:
    """One task of ``tier``, drawn from ``rng``."""
    question = _question(rng, tier)
    metadata = {
        "tier": tier,
        "keys": [spec.key for spec in question.specs],
        "expression": question.expression,
        "facts": _facts(rng, question),
    }
    return Task(prompt=question.prompt, target=question.target, metadata=metadata)


def generate_splits(seed: int = DEFAULT_SEED) -> dict[str, list[Task]]:
    """Every split of :data:`SPLIT_TIER_SIZES`, with prompts unique across all of them."""
    rng = random.Random(seed)
    seen: set[str] = set()
    splits: dict[str, list[Task]] = {}
    for split, tier_sizes in SPLIT_TIER_SIZES.items():
        tasks: list[Task] = []
        for tier, count in tier_sizes.items():
            made, attempts = 0, 0
            while made < count:
                attempts += 1
                if attempts > 100 * count:
                    raise RuntimeError(f"too few distinct tier-{tier} prompts for {count} tasks")
                task = make_task(rng, tier)
                if task.prompt not in seen:
                    seen.add(task.prompt)
                    tasks.append(task)
                    made += 1
        rng.shuffle(tasks)  # mixed tiers, so any prefix of a split covers all of them
        splits[split] = tasks
    return splits


def task_to_json(task: Task) -> str:
    return json.dumps({"prompt": task.prompt, "target": task.target, "metadata": task.metadata})


def write_splits(out_dir: Path, seed: int = DEFAULT_SEED) -> dict[str, Path]:
    """Write ``<split>.jsonl`` for every split into ``out_dir``; returns the paths written."""
    out_dir.mkdir(parents=True, exist_ok=True)
    paths: dict[str, Path] = {}
    for split, tasks in generate_splits(seed).items():
        path = out_dir / f"{split}.jsonl"
        path.write_text("".join(task_to_json(task) + "\n" for task in tasks), encoding="utf-8")
        paths[split] = path
    return paths
