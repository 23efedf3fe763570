"""Play the scripted experts on both bundled environments (no model): a check of the envs.

It proves the environments and their bundled tasks work end to end on this machine, without a
model: every task should be solved (mean reward 1.0, every episode TERMINATED).

    python -m recipes.experts [--episodes-per-task N] [--max-turns N]
"""

from __future__ import annotations

import argparse
from collections.abc import Callable

from cookbook_lib.envs import Env, Task
from cookbook_lib.rollout.evaluate import EvalReport, evaluate_policy
from cookbook_lib.rollout.play import Policy
from envs.experts import math_expert, tool_use_game_expert
from envs.math_env import MathEnv, load_math_tasks
from envs.tool_use_game import ToolUseGameEnv, load_tool_use_game_tasks

COLUMNS = ["mean_reward", "pass@1", "episodes", "terminated", "max_turns", "error", "wall_time_s"]


def expert_suites() -> list[tuple[str, list[Task], Callable[[Task], Env], Policy]]:
    suites = []
    for split in ("train", "val"):
        suites.append((f"math/{split}", load_math_tasks(split), lambda task: MathEnv(), math_expert))
        suites.append(
            (
                f"tool_use_game/{split}",
                load_tool_use_game_tasks(split),
                lambda task: ToolUseGameEnv(),
                tool_use_game_expert,
            )
        )
    return suites


def format_table(rows: list[tuple[str, EvalReport]]) -> str:
    header = ["suite", *COLUMNS]
    lines = [[name, *(str(report.summary().get(column, "")) for column in COLUMNS)] for name, report in rows]
    widths = [max(len(row[i]) for row in [header, *lines]) for i in range(len(header))]
    render = lambda row: "  ".join(cell.ljust(width) for cell, width in zip(row, widths, strict=True))  # noqa: E731
    return "\n".join([render(header), render(["-" * w for w in widths]), *map(render, lines)])


def main(argv: list[str] | None = None) -> list[tuple[str, EvalReport]]:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--episodes-per-task", type=int, default=1)
    parser.add_argument("--max-turns", type=int, default=8)
    args = parser.parse_args(argv)
    rows = []
    for name, tasks, env_factory, policy in expert_suites():
        report = evaluate_policy(
            lambda policy=policy: policy,
            tasks,
            env_factory,
            episodes_per_task=args.episodes_per_task,
            max_turns=args.max_turns,
        )
        rows.append((name, report))
    print("Scripted experts on the bundled tasks (no model):\n")
    print(format_table(rows))
    return rows


if __name__ == "__main__":
    main()
