"""GRPO on MathEnv: the calculator environment of notebook 01, with an expert warm-start.

python -m recipes.grpo.math_env [--steps N] [--run-name NAME] [--small]
"""

from __future__ import annotations

import argparse
import dataclasses

from cookbook_lib.grpo.config import GRPOConfig
from cookbook_lib.grpo.sft import expert_warm_start
from cookbook_lib.grpo.train import TrainResult, train_multi_turn
from envs.experts import math_expert
from envs.math_env import MathEnv, load_math_tasks
from recipes.device_flags import add_device_flags, device_overrides


def math_config(**overrides) -> GRPOConfig:
    settings = dict(
        batch_size=4,
        episodes_per_task=8,
        num_steps=10,
        validation_interval=5,
        max_turns=3,
        max_model_length=1024,
        max_tokens_per_turn=48,
        micro_batch_tokens=4096,
        learning_rate=2e-5,
        max_sampling_attempts=2,
        checkpoint_interval=5,
    )
    settings.update(overrides)
    return GRPOConfig(**settings)


def main(argv: list[str] | None = None) -> TrainResult:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--run-name", default=None)
    parser.add_argument("--steps", type=int, default=None)
    parser.add_argument("--small", action="store_true", help="a tiny run, to check the recipe works")
    add_device_flags(parser)
    args = parser.parse_args(argv)
    config = math_config(**device_overrides(args))
    if args.small:
        config = dataclasses.replace(
            config, batch_size=1, episodes_per_task=2, num_steps=1, max_tokens_per_turn=16, max_turns=2
        )
    if args.run_name:
        config = dataclasses.replace(config, run_name=args.run_name)
    if args.steps is not None:
        config = dataclasses.replace(config, num_steps=args.steps)
    config.validate()
    train_tasks, val_tasks = load_math_tasks("train"), load_math_tasks("val")
    warm_start = expert_warm_start(
        train_tasks,
        lambda task: MathEnv(),
        lambda task: math_expert,
        num_demonstrations=2 if args.small else 48,
        steps=1 if args.small else 4,
        seed=config.seed,
    )
    return train_multi_turn(
        config,
        tasks=train_tasks,
        env_factory=lambda task: MathEnv(),
        val_tasks=val_tasks[: 2 if args.small else 30],
        warm_start=warm_start,
    )


if __name__ == "__main__":
    main()
