"""What each side's policy did, step by step: the episodes of ``bench_trl.py``'s runs side by side.

    python bench/episode_stats.py [--work-dir runs/bench_trl] [--ours-variant trl_errors]

Reads our side's episodes files (``ours-seedN/episodes/step_*.jsonl``) and TRL's recorded
completions (``trl-seedN/completions.jsonl``, written by ``bench_trl.recorded``) and prints, per
side and step, averaged over every seed found: the reward, the replies and tool calls an episode
took, the share of tool results that were errors, and the shares of episodes that called
``lookup`` without a key, repeated a call they had already made (the loops a collapsing policy
falls into), ended at the turn limit, or ended on a reply without a tool call ("answered"; a reply
that could not be read as a call counts, as both sides score it as a final answer, ~always 0).
Reward alone says that one side learned less; these say what its policy did instead.

Both sides' conversations are read the same way: the messages after the prompt, an assistant
message's ``tool_calls`` with their arguments (a JSON string on our side, a dict on TRL's), and a
tool result counted as an error by its side's error form (ours ``tool_error: ...``, TRL's
``{'error': ...}``).
"""

from __future__ import annotations

import argparse
import json
import statistics
from collections import defaultdict
from collections.abc import Iterator
from pathlib import Path

from bench_trl import COMPLETIONS_FILE, MAX_TURNS

from cookbook_lib.envs.tools import TOOL_ERROR_PREFIX

COLUMNS = (
    ("reward", "reward"),
    ("replies", "replies"),
    ("calls", "calls"),
    ("error_share", "errors/result"),
    ("keyless_lookup", "lookup no key"),
    ("repeated_call", "repeats a call"),
    ("turn_limit", "turn limit"),
    ("answered", "answered"),
)
TRL_ERROR_PREFIX = "{'error'"  # TRL 1.16's tool loop turns a failing call into str({"error": ...})


def call_arguments(call: dict) -> dict | None:
    """A call's arguments as a dict, or None where they are not a JSON object."""
    arguments = (call.get("function") or {}).get("arguments")
    if isinstance(arguments, str):
        try:
            arguments = json.loads(arguments) if arguments.strip() else {}
        except json.JSONDecodeError:
            return None
    return arguments if isinstance(arguments, dict) else None


def conversation_stats(messages: list[dict], reward: float, max_turns: int) -> dict[str, float]:
    """One episode's figures from the messages after its prompt."""
    replies = [m for m in messages if m.get("role") == "assistant"]
    results = [m for m in messages if m.get("role") == "tool"]
    calls = [call for reply in replies for call in reply.get("tool_calls") or []]
    errors = sum(
        str(m.get("content") or "").startswith((TOOL_ERROR_PREFIX, TRL_ERROR_PREFIX)) for m in results
    )
    seen: set[str] = set()
    repeated = keyless = False
    for call in calls:
        name = str((call.get("function") or {}).get("name", ""))
        arguments = call_arguments(call)
        keyless |= name == "lookup" and not (arguments or {}).get("key")
        signature = name + json.dumps(arguments, sort_keys=True, default=str)
        repeated |= signature in seen
        seen.add(signature)
    answered = bool(replies) and not replies[-1].get("tool_calls") and messages[-1] is replies[-1]
    return {
        "reward": float(reward),
        "replies": float(len(replies)),
        "calls": float(len(calls)),
        "error_share": errors / len(results) if results else 0.0,
        "keyless_lookup": float(keyless),
        "repeated_call": float(repeated),
        "turn_limit": float(not answered and len(replies) >= max_turns),
        "answered": float(answered),
    }


def after_prompt(messages: list[dict]) -> list[dict]:
    """The messages from the first assistant reply on (ours keep the system and user messages)."""
    for index, message in enumerate(messages):
        if message.get("role") == "assistant":
            return messages[index:]
    return []


def our_episodes(run_dir: Path) -> Iterator[tuple[int, list[dict], float]]:
    """(step, messages after the prompt, reward) of each episode our side sampled."""
    for path in sorted((run_dir / "episodes").glob("step_*.jsonl")):
        step = int(path.stem.split("_")[-1])
        for line in path.read_text().splitlines():
            record = json.loads(line)
            yield step, after_prompt(record["messages"]), float(record["reward"])


def trl_episodes(run_dir: Path) -> Iterator[tuple[int, list[dict], float]]:
    """(step, completion messages, reward) of each episode TRL sampled."""
    path = run_dir / COMPLETIONS_FILE
    for line in path.read_text().splitlines() if path.is_file() else []:
        record = json.loads(line)
        for episode in record["episodes"]:
            yield int(record["step"]), episode["messages"], float(episode["reward"])


def side_table(
    episodes: Iterator[tuple[int, list[dict], float]], max_turns: int
) -> dict[int, dict[str, float]]:
    """Per step, the mean of each column over the episodes given."""
    by_step: dict[int, list[dict[str, float]]] = defaultdict(list)
    for step, messages, reward in episodes:
        by_step[step].append(conversation_stats(messages, reward, max_turns))
    return {
        step: {key: statistics.mean(row[key] for row in rows) for key, _ in COLUMNS} | {"n": len(rows)}
        for step, rows in sorted(by_step.items())
    }


def print_tables(work_dir: Path, max_turns: int, ours_variant: str = "") -> None:
    ours_prefix = f"ours-{ours_variant}-seed" if ours_variant else "ours-seed"
    for side, prefix, reader in (("ours", ours_prefix, our_episodes), ("TRL", "trl-seed", trl_episodes)):
        runs = sorted(
            (p for p in work_dir.glob(f"{prefix}*") if p.name[len(prefix) :].isdigit()),
            key=lambda p: int(p.name[len(prefix) :]),
        )
        table = side_table((item for run in runs for item in reader(run)), max_turns)
        if not table:
            print(f"{side}: no episodes under {work_dir}/{prefix}N")
            continue
        seeds = ", ".join(p.name[len(prefix) :] for p in runs)
        print(f"\n{side} (seeds {seeds}): per step, the mean over its episodes")
        header = f"{'step':>4} {'episodes':>8} " + " ".join(f"{title:>14}" for _, title in COLUMNS)
        print(header)
        for step, row in table.items():
            print(f"{step:>4} {row['n']:>8} " + " ".join(f"{row[key]:>14.3f}" for key, _ in COLUMNS))


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--work-dir", type=Path, default=Path(__file__).resolve().parents[1] / "runs" / "bench_trl"
    )
    parser.add_argument(
        "--max-turns", type=int, default=MAX_TURNS, help="the runs' turn limit (bench_trl's MAX_TURNS)"
    )
    parser.add_argument(
        "--ours-variant", default="",
        help="read our side's runs of a variant, ours-VARIANT-seedN (e.g. trl_errors)",
    )  # fmt: skip
    args = parser.parse_args(argv)
    print_tables(args.work_dir, args.max_turns, args.ours_variant)


if __name__ == "__main__":
    main()
