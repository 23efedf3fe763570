"""Evaluate a model on a bundled environment from the command line.

    python -m recipes.evaluate                       # the embedded model on both environments
    python -m recipes.evaluate --env tool_use_game --model path/to/checkpoint --num-tasks 20

Each run writes runs/<run_name>/episodes.jsonl, which notebook 02's viewer can open.
"""

from __future__ import annotations

import argparse
from collections.abc import Callable

import torch

from cookbook_lib.envs import Env, Task
from cookbook_lib.generators import SamplingParams
from cookbook_lib.rollout.evaluate import EvalReport, default_run_name, evaluate
from envs.math_env import MathEnv, load_math_tasks
from envs.tool_use_game import ToolUseGameEnv, load_tool_use_game_tasks
from recipes.device_flags import add_device_flags
from recipes.experts import format_table

ENVIRONMENTS: dict[str, tuple[Callable[[str], list[Task]], Callable[[Task], Env]]] = {
    "math": (load_math_tasks, lambda task: MathEnv()),
    "tool_use_game": (load_tool_use_game_tasks, lambda task: ToolUseGameEnv()),
}


def main(argv: list[str] | None = None) -> list[tuple[str, EvalReport]]:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default=None, help="a name or directory; default: the embedded model")
    parser.add_argument("--env", choices=[*ENVIRONMENTS, "all"], default="all")
    parser.add_argument("--split", choices=["train", "val"], default="val")
    parser.add_argument("--num-tasks", type=int, default=8, help="the first N tasks of the split")
    parser.add_argument("--episodes-per-task", type=int, default=4)
    parser.add_argument("--max-turns", type=int, default=6)
    parser.add_argument("--max-model-length", type=int, default=2048)
    parser.add_argument("--max-tokens-per-turn", type=int, default=96)
    parser.add_argument("--temperature", type=float, default=1.0)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--runs-dir", default="runs")
    add_device_flags(parser)
    args = parser.parse_args(argv)
    names = list(ENVIRONMENTS) if args.env == "all" else [args.env]
    # One seed for the whole run: the generator draws each request's stream from torch's RNG.
    torch.manual_seed(args.seed)
    sampling = SamplingParams(temperature=args.temperature, max_tokens=args.max_tokens_per_turn)
    rows = []
    for name in names:
        load_tasks, env_factory = ENVIRONMENTS[name]
        tasks = load_tasks(args.split)[: args.num_tasks]
        report = evaluate(
            args.model,
            tasks,
            env_factory,
            episodes_per_task=args.episodes_per_task,
            max_turns=args.max_turns,
            max_model_length=args.max_model_length,
            sampling=sampling,
            run_name=default_run_name(f"eval-{name}"),
            runs_dir=args.runs_dir,
            device=args.device or "auto",
            dtype=args.dtype or "auto",
        )
        print(f"{name}: episodes written to {report.episodes_path}")
        rows.append((f"{name}/{args.split}", report))
    print(format_table(rows))
    return rows


if __name__ == "__main__":
    main()
