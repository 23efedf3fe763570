"""GRPO on the bundled tool-use game: a short expert warm-start, then lockstep GRPO.

The config has the seed page's shape, sized for a 2-core CPU and the embedded 135M model:

    python -m recipes.grpo.tool_use_game                 # the demo the README runs
    python -m recipes.grpo.tool_use_game --steps 40 --run-name longer
    python -m recipes.grpo.tool_use_game --config my.yaml   # any GRPOConfig field, from YAML

It prints one line per step and writes runs/<run_name>/ (metrics.jsonl, episodes, checkpoints,
training_curves.html). Rerun with the same --run-name to resume an interrupted run.
``recipes.grpo.tool_use_game_async`` is the same demo with async GRPO; it shares this ``main``.
"""

from __future__ import annotations

import argparse
import dataclasses
from collections.abc import Callable

from cookbook_lib.envs.base import Task
from cookbook_lib.grpo.config import GRPOConfig
from cookbook_lib.grpo.sft import WarmStart, expert_warm_start
from cookbook_lib.grpo.train import TrainResult, train_multi_turn
from envs.tool_use_game import ToolUseGameEnv, load_tool_use_game_tasks, make_tool_use_game_expert
from recipes.device_flags import add_device_flags

# Tier 1 (look a fact up by its key, answer with it): after the warm-start the embedded model
# solves about a third of these, so GRPO has signal in most groups and room to climb. Tiers 2-3
# start near 0 and give a CPU run almost no signal (docs/benchmarks.md has both measurements).
DEMO_TIERS = "1"


def demo_config(**overrides) -> GRPOConfig:
    """The seed's example config, sized for a CPU (the seed's 200 steps are hours here)."""
    settings = dict(
        batch_size=4,
        episodes_per_task=4,
        num_steps=10,
        validation_interval=5,
        val_episodes_per_task=1,
        max_turns=6,
        max_model_length=1536,
        max_tokens_per_turn=48,
        # With activation checkpointing (the default) 2048 trains as fast here as 4096, in less memory.
        micro_batch_tokens=2048,
        learning_rate=5e-5,
        # 1/3, 2/3, then all of it: a smaller first AdamW update (sign-like, ~lr a weight). Over 20
        # seeds of bench_trl.py's 5 steps, 0.773 a step against 0.746 without (docs/benchmarks.md).
        warmup_steps=3,
        wandb_project=None,
        sequential_validation=True,
        max_sampling_attempts=2,
        checkpoint_interval=5,
        keep_last_checkpoints=1,  # ~1.6 GB each (weights and AdamW's moments); a resume needs one
        # A finished run keeps its trained model (~0.54 GB), not the optimizer state or the
        # warm-started model: ~0.55 GB of disk instead of ~2.2 GB (docs/benchmarks.md).
        final_checkpoint="model",
        keep_warm_start_model=False,
    )
    settings.update(overrides)
    return GRPOConfig(**settings)


SMALL_OVERRIDES = dict(batch_size=1, episodes_per_task=2, num_steps=1, max_tokens_per_turn=16, max_turns=2)


@dataclasses.dataclass
class DemoSetup:
    """The demo's tasks and warm-start, as the recipe and notebooks 03 and 04 use them."""

    train_tasks: list[Task]
    val_tasks: list[Task]
    warm_start: WarmStart


def demo_setup(
    tiers: str = DEMO_TIERS, *, val_tasks: int, warm_start_demos: int, warm_start_steps: int, seed: int
) -> DemoSetup:
    """GRPO trains and validates on the task tiers ``tiers`` ("1", "1,2"; at most ``val_tasks``
    validation tasks), after a warm-start on ``warm_start_demos`` expert episodes drawn from every
    tier: it shows the whole format (``list_fact_keys`` included), whatever GRPO trains on."""
    wanted = {int(tier) for tier in tiers.split(",")}
    all_train_tasks = load_tool_use_game_tasks("train")
    warm_start = expert_warm_start(
        all_train_tasks,
        lambda task: ToolUseGameEnv(),
        make_tool_use_game_expert,
        num_demonstrations=warm_start_demos,
        steps=warm_start_steps,
        seed=seed,
    )
    return DemoSetup(
        train_tasks=[t for t in all_train_tasks if t.metadata["tier"] in wanted],
        val_tasks=[t for t in load_tool_use_game_tasks("val") if t.metadata["tier"] in wanted][:val_tasks],
        warm_start=warm_start,
    )


def make_parser(doc: str = __doc__) -> argparse.ArgumentParser:
    """The recipe's flags; a flag whose ``dest`` is a GRPOConfig field overrides that field when given.

    ``recipes.grpo.tool_use_game_async`` adds its own flags to this parser the same way.
    """
    parser = argparse.ArgumentParser(description=doc.splitlines()[0])
    parser.add_argument("--config", help="a GRPOConfig YAML file; flags below override it")
    parser.add_argument("--run-name", dest="run_name", default=None)
    parser.add_argument("--model", default=None, help="a model name or folder; default: the embedded model")
    parser.add_argument(
        "--steps", dest="num_steps", metavar="STEPS", type=int, default=None, help="GRPO steps"
    )
    parser.add_argument("--val-tasks", type=int, default=20, help="validation tasks (from the val split)")
    parser.add_argument("--warm-start-demos", type=int, default=64)
    parser.add_argument("--warm-start-steps", type=int, default=8)
    parser.add_argument("--tiers", default=DEMO_TIERS, help="task tiers to train and validate on, e.g. 1,2")
    parser.add_argument(
        "--lr", dest="learning_rate", metavar="LR", type=float, default=None, help="GRPO learning rate"
    )
    parser.add_argument("--seed", type=int, default=None, help="seeds the warm-start, sampling and training")
    parser.add_argument("--small", action="store_true", help="a tiny run, to check the recipe works")
    add_device_flags(parser)  # dest = the GRPOConfig fields device, dtype
    return parser


def parse_config(
    argv: list[str] | None = None,
    *,
    base_config: Callable[..., GRPOConfig] = demo_config,
    parser: argparse.ArgumentParser | None = None,
) -> tuple[GRPOConfig, argparse.Namespace]:
    """The run's config and the parsed flags, checked; nothing is loaded.

    Without ``--config`` the config is ``base_config(**overrides)``, so a base config may derive
    fields from others (the async recipe sizes ``groups_in_flight`` from ``batch_size``). A YAML
    file given with ``--config`` is the whole config, and the flags override it.
    """
    args = (parser or make_parser()).parse_args(argv)
    names = {f.name for f in dataclasses.fields(GRPOConfig)}
    overrides: dict[str, object] = {
        name: value for name, value in vars(args).items() if name in names and value not in (None, "")
    }
    if args.small:
        overrides |= SMALL_OVERRIDES
        args.val_tasks, args.warm_start_demos, args.warm_start_steps = 2, 2, 1
    if args.config:
        config = dataclasses.replace(GRPOConfig.from_yaml(args.config), **overrides)
    else:
        config = base_config(**overrides)
    config.validate()  # before anything slow
    return config, args


def main(
    argv: list[str] | None = None,
    *,
    base_config: Callable[..., GRPOConfig] = demo_config,
    parser: argparse.ArgumentParser | None = None,
) -> TrainResult:
    """Parse the flags, warm-start on expert episodes, train; the lockstep and async recipes share it."""
    config, args = parse_config(argv, base_config=base_config, parser=parser)
    demo = demo_setup(
        args.tiers,
        val_tasks=args.val_tasks,
        warm_start_demos=args.warm_start_demos,
        warm_start_steps=args.warm_start_steps,
        seed=config.seed,
    )
    result = train_multi_turn(
        config,
        tasks=demo.train_tasks,
        env_factory=lambda task: ToolUseGameEnv(),
        val_tasks=demo.val_tasks,
        warm_start=demo.warm_start,
    )
    rewards = result.validation_rewards()
    if len(rewards) >= 2:
        (_, before), (_, after) = rewards[0], rewards[-1]
        print(f"validation reward: {before:.3f} after the warm-start -> {after:.3f} after GRPO")
    print(f"metrics, episodes and training_curves.html are in {result.run_dir}")
    return result


if __name__ == "__main__":
    main()
