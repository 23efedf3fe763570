"""Single-turn GRPO with ``train_single_turn``: answer arithmetic directly, no tools.

The reward is 1 when the reply is the right number (numbers compared after normalising, as the
environments do). It is GRPO's classic setting, and a baseline for what tools add.

    python -m recipes.grpo.single_turn [--steps N] [--run-name NAME] [--small]
"""

from __future__ import annotations

import argparse
import dataclasses

from cookbook_lib.envs import Task
from cookbook_lib.envs.scoring import numbers_match
from cookbook_lib.grpo.config import GRPOConfig
from cookbook_lib.grpo.train import TrainResult, train_single_turn
from envs.math_env import load_math_tasks
from recipes.device_flags import add_device_flags, device_overrides

SYSTEM_PROMPT = "Reply with only the final number."


def exact_number(task: Task, reply: str) -> float:
    return float(numbers_match(reply, task.target))


def main(argv: list[str] | None = None) -> TrainResult:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--run-name", default=None)
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--small", action="store_true", help="a tiny run, to check the recipe works")
    add_device_flags(parser)
    args = parser.parse_args(argv)
    config = GRPOConfig(
        batch_size=4,
        episodes_per_task=8,
        num_steps=args.steps,
        validation_interval=5,
        max_model_length=512,
        max_tokens_per_turn=16,
        micro_batch_tokens=2048,
        learning_rate=2e-5,
        max_sampling_attempts=2,
        **device_overrides(args),
    )
    if args.small:
        config = dataclasses.replace(config, batch_size=1, episodes_per_task=2, num_steps=1)
    if args.run_name:
        config = dataclasses.replace(config, run_name=args.run_name)
    # The easiest level: one operation the model might do in its head.
    tasks = [task for task in load_math_tasks("train") if task.metadata.get("level") == 1]
    val_tasks = [task for task in load_math_tasks("val") if task.metadata.get("level") == 1]
    return train_single_turn(
        config,
        tasks=tasks,
        reward_fn=exact_number,
        val_tasks=val_tasks[: 2 if args.small else 30],
        system_prompt=SYSTEM_PROMPT,
    )


if __name__ == "__main__":
    main()
