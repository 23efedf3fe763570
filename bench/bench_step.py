"""One lockstep GRPO step of the tool-use demo, and its training on padded rows against prefix trees.

    python bench/bench_step.py                 # sample one demo step (warm-start + rollouts), then A/B
    python bench/bench_step.py --episodes runs/RUN/episodes/step_000001.jsonl \
        --model runs/RUN/warm_start_model     # a step a run sampled, and its model
    python bench/bench_step.py --quick         # a smaller warm-start and one repeat
    python bench/bench_step.py --dtype auto    # train as a run does here (bf16 autocast where native)

1. Sampling: ``train_multi_turn`` runs the README demo's config for one step (expert warm-start,
   the step's rollouts, its training on prefix trees) and reports sampled tokens, sampling tok/s
   and the step's own training time. Skipped when ``--episodes`` names a step's episodes.
2. Training, side by side: the same step's samples (``build_samples`` exactly as the step built
   them) train on a fresh copy of the same model on padded rows with the CPU block cache suspended
   (the path issue 20 measured, the baseline), on padded rows with it
   (``shared_prefix_training`` off), with the tree's dense block mask alone, and with the tree's attention
   segments (:mod:`cookbook_lib.grpo.tree_attention`, the default on a CPU), in turn,
   ``--repeats`` times each. Per arm: micro-batches, tokens forwarded, trainer seconds, user and
   system CPU seconds, minor page faults, the peak resident size during the step, and the loss
   (the same on all). Then each tree arm's ratios against padded rows, and segments against the
   dense mask. Timings on a shared CPU are noisy: read the ratios of one run.
3. With ``--dtype auto`` on a CPU where that trains in bf16 (autocast), one more arm: the segments'
   attention in bf16, as before session 35 (:func:`cookbook_lib.grpo.tree_attention.segmented_attention`
   now attends in float32 there: bf16's backward compiled a oneDNN kernel for every block shape).
   The arms run in one process, so oneDNN's bounded kernel cache carries from one to the next, as
   it does from one step of a run to the next.
"""

from __future__ import annotations

import argparse
import contextlib
import copy
import dataclasses
import resource
import statistics
import tempfile
import time
from pathlib import Path

import torch

from cookbook_lib.grpo import tree_attention
from cookbook_lib.grpo.config import GRPOConfig
from cookbook_lib.grpo.lockstep import step_samples
from cookbook_lib.grpo.loss_settings import LossSettings
from cookbook_lib.grpo.train import make_trainer, train_multi_turn
from cookbook_lib.rollout.records import read_episodes
from cookbook_lib.runtime.block_cache import block_cache_suspended
from cookbook_lib.runtime.devices import resolve_precision
from cookbook_lib.runtime.memory import release_memory
from cookbook_lib.runtime.models import load_model, load_tokenizer
from envs.tool_use_game import ToolUseGameEnv
from recipes.grpo.tool_use_game import demo_config, demo_setup


def sample_one_step(config: GRPOConfig, warm_start_demos: int, warm_start_steps: int) -> tuple[Path, Path]:
    """Run the demo for one step in a scratch folder; the step's episodes and the warm-started model."""
    demo = demo_setup(
        val_tasks=0, warm_start_demos=warm_start_demos, warm_start_steps=warm_start_steps, seed=0
    )
    runs = Path(tempfile.mkdtemp(prefix="bench-step-"))
    run_config = dataclasses.replace(
        config,
        num_steps=1,
        runs_dir=str(runs),
        run_name="sample",
        validation_interval=0,
        checkpoint_interval=0,
        final_checkpoint="none",
        keep_warm_start_model=True,
    )
    started = time.perf_counter()
    result = train_multi_turn(
        run_config,
        tasks=demo.train_tasks,
        env_factory=lambda task: ToolUseGameEnv(),
        val_tasks=None,
        warm_start=demo.warm_start,
    )
    metrics = result.metrics[-1]
    sampled, sampling_s = metrics["sampled_tokens"], metrics["time/sampling_s"]
    print(
        f"one demo step: {time.perf_counter() - started:.0f} s with the warm-start | sampling "
        f"{sampling_s:.1f} s, {sampled:.0f} tokens, {sampled / sampling_s:.1f} tok/s | training "
        f"{metrics['time/training_s']:.1f} s on prefix trees"
    )
    return result.run_dir / "episodes" / "step_000001.jsonl", result.run_dir / "warm_start_model"


def _peak_rss_reset() -> None:
    # Writing 5 to clear_refs resets the process's peak resident size (VmHWM), Linux >= 4.0.
    Path("/proc/self/clear_refs").write_text("5")


def _peak_rss_gb() -> float:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmHWM:"):
            return int(line.split()[1]) / 1e6
    return float("nan")


@contextlib.contextmanager
def attention_in_its_own_dtype():
    """The segments' attention in the dtype SDPA would use (bf16 under bf16 autocast), as before
    session 35's float32 attention on a CPU."""
    chosen = tree_attention._attention_dtypes

    def own_dtype(query):
        return (chosen(query)[1],) * 2

    tree_attention._attention_dtypes = own_dtype
    try:
        yield
    finally:
        tree_attention._attention_dtypes = chosen


def train_arm(model_dir: Path, samples, config: GRPOConfig, arm: str, dtype: str) -> dict[str, float]:
    """One training step of ``samples`` on a fresh copy of the model; its cost and loss."""
    if arm == BEFORE:  # the path issue 20 measured: padded rows, every large block faulted anew
        with block_cache_suspended():
            return train_arm(model_dir, samples, config, PADDED, dtype)
    if arm == TREES_BF16_ATTENTION:
        with attention_in_its_own_dtype():
            return train_arm(model_dir, samples, config, TREES_SEGMENTS, dtype)
    tokenizer = load_tokenizer(str(model_dir))
    precision = resolve_precision("cpu", dtype)
    model = load_model(str(model_dir), dtype=precision.master_dtype)
    shared = arm != PADDED
    trainer = make_trainer(
        dataclasses.replace(config, shared_prefix_training=shared),
        model,
        tokenizer,
        precision,
    )
    if arm == TREES_DENSE:  # the trees' dense block mask alone, as before tree_attention
        trainer.segmented_tree_attention = False
    # A run's steps after its first find AdamW's moments allocated: one warm-up step on one sample.
    trainer.grpo_step(samples[:1], LossSettings.from_config(config))
    release_memory()
    _peak_rss_reset()
    before, started = resource.getrusage(resource.RUSAGE_SELF), time.perf_counter()
    metrics = trainer.grpo_step(samples, LossSettings.from_config(config))
    elapsed, after = time.perf_counter() - started, resource.getrusage(resource.RUSAGE_SELF)
    peak = _peak_rss_gb()
    del trainer, model
    release_memory()
    return {
        "trainer_s": elapsed,
        "user_s": after.ru_utime - before.ru_utime,
        "system_s": after.ru_stime - before.ru_stime,
        "minor_faults": float(after.ru_minflt - before.ru_minflt),
        "peak_rss_gb": peak,
        "forwarded_tokens": metrics["forwarded_tokens"],
        "trained_tokens": metrics["trained_tokens"],
        "loss": metrics["loss"],
    }


BEFORE = "padded rows, no block cache"
PADDED, TREES_DENSE, TREES_SEGMENTS = "padded rows", "prefix trees, dense mask", "prefix trees, segments"
TREES_BF16_ATTENTION = "prefix trees, segments, attention in bf16 (session 34)"
ARMS = (BEFORE, PADDED, TREES_DENSE, TREES_SEGMENTS)


def samples_of_step(episodes_path: Path, config: GRPOConfig):
    """The samples the step trained: its groups are consecutive ``episodes_per_task`` episodes."""
    episodes = read_episodes(episodes_path)
    size = config.episodes_per_task
    groups = [episodes[i : i + size] for i in range(0, len(episodes), size)]
    _, samples, keep = step_samples(config, groups)
    return samples, len(keep)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--episodes", type=Path, help="a step's episodes (skips the sampling part)")
    parser.add_argument("--model", type=Path, help="the model that sampled them (with --episodes)")
    parser.add_argument("--repeats", type=int, default=2, help="training runs of each arm")
    parser.add_argument("--quick", action="store_true", help="a 16-demo, 2-step warm-start, one repeat")
    parser.add_argument(
        "--dtype",
        default="float32",
        choices=("float32", "auto"),
        help="the trainer's precision: float32 (issue 20's comparison) or what dtype='auto' picks here",
    )
    args = parser.parse_args()
    torch.manual_seed(0)
    config = demo_config()
    if args.episodes is None:
        demos, steps = (16, 2) if args.quick else (64, 8)
        episodes_path, model_dir = sample_one_step(config, demos, steps)
    else:
        if args.model is None:
            parser.error("--episodes needs --model: the model that sampled them")
        episodes_path, model_dir = args.episodes, args.model
    repeats = 1 if args.quick else args.repeats
    samples, groups = samples_of_step(episodes_path, config)
    if not samples:
        raise SystemExit(f"{episodes_path}: no group had signal, so nothing trains; sample another step")
    lengths = [len(s) for s in samples]
    print(
        f"training {len(samples)} samples of {groups} groups ({min(lengths)}-{max(lengths)} tokens, "
        f"{sum(lengths)} in all), micro_batch_tokens={config.micro_batch_tokens}, "
        f"activation checkpointing {'on' if config.activation_checkpointing else 'off'}"
    )
    precision = resolve_precision("cpu", args.dtype)
    bf16_training = precision.compute_dtype == torch.bfloat16
    arms = ARMS + ((TREES_BF16_ATTENTION,) if bf16_training else ())
    print(f"trainer: {precision.describe()}")
    runs: dict[str, list[dict[str, float]]] = {arm: [] for arm in arms}
    for _ in range(repeats):
        for arm in arms:
            runs[arm].append(train_arm(model_dir, copy.copy(samples), config, arm, args.dtype))
    fields = ("forwarded_tokens", "trainer_s", "user_s", "system_s", "minor_faults", "peak_rss_gb", "loss")
    medians = {arm: {f: statistics.median(r[f] for r in runs[arm]) for f in fields} for arm in arms}
    print(f"\n| arm | {' | '.join(fields)} |\n| --- |{' ---: |' * len(fields)}")
    for arm in arms:
        print(f"| {arm} | " + " | ".join(f"{medians[arm][f]:.4g}" for f in fields) + " |")
    old = medians[BEFORE]
    for arm in (PADDED, TREES_DENSE, TREES_SEGMENTS):
        new = medians[arm]
        print(
            f"\n{arm} / {BEFORE}: tokens forwarded "
            f"{new['forwarded_tokens'] / old['forwarded_tokens']:.2f}x, "
            f"trainer time {new['trainer_s'] / old['trainer_s']:.2f}x, "
            f"system time {new['system_s'] / max(old['system_s'], 1e-9):.2f}x, "
            f"page faults {new['minor_faults'] / max(old['minor_faults'], 1):.2f}x; system / user time "
            f"{old['system_s'] / old['user_s']:.1%} -> {new['system_s'] / new['user_s']:.1%}; "
            f"loss difference {abs(new['loss'] - old['loss']):.2e}"
        )
    dense, segments = medians[TREES_DENSE], medians[TREES_SEGMENTS]
    print(f"\nsegments / dense mask: trainer time {segments['trainer_s'] / dense['trainer_s']:.2f}x")
    if bf16_training:
        bf16 = medians[TREES_BF16_ATTENTION]
        print(
            "segments' attention in float32 / in bf16: trainer time "
            f"{segments['trainer_s'] / bf16['trainer_s']:.2f}x, "
            f"system time {segments['system_s'] / max(bf16['system_s'], 1e-9):.2f}x, peak "
            f"{segments['peak_rss_gb']:.2f} against {bf16['peak_rss_gb']:.2f} GB, loss difference "
            f"{abs(segments['loss'] - bf16['loss']):.2e}"
        )


if __name__ == "__main__":
    main()
