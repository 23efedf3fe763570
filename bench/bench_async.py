"""Lockstep versus async GRPO, side by side in one run, on the embedded model on a CPU.

    python bench/bench_async.py                   # 6 steps each, a 0.3 s tool, long-tailed episodes
    python bench/bench_async.py --quick           # a smoke check (2 steps, short replies)
    python bench/bench_async.py --out runs/bench_async.json --figure runs/bench_async_timeline.html
    python bench/bench_async.py --stale-groups prevent requeue drop   # one async arm per rule

Workload, the issue's: every assistant reply goes to a review tool that takes ``--tool-latency``
seconds (0.3 s, as real API tools do) before the environment answers, and episode lengths are
long-tailed: a task asks for 1, 2, 4 or 8 replies (60, 20, 10 and 10 % of the tasks). The reward
(shorter replies score higher) always varies within a group, so every step trains and the
comparison is about scheduling, not about luck in finding signal.

Arms: the same config, tasks, seed and starting weights; only the scheduling differs:
  lockstep  ``max_steps_off_policy=None``: sample the batch, then train, then publish;
  async     ``max_steps_off_policy=2``, ``groups_in_flight=8`` (twice the batch): rollouts go on
            while the trainer trains; no trained group is older than two steps. One arm per
            ``--stale-groups`` rule (``prevent``, the default, ``requeue``, ``drop``), each named
            ``async-<rule>``.
Learning is compared on held-out tasks validated at step 0 and at the end (the training reward
of each step is over the groups that arm trained on).

Targets (issue 13), checked for each async arm and printed met / NOT met:
  - length mix: the share of trained episodes in each length bucket (assistant turns, the
    ``length/*`` metrics) within 5 points of lockstep's;
  - wall time at most 0.6x lockstep's over the same number of steps;
  - held-out validation at the end at least lockstep's minus 0.02;
  - no trained token older than ``max_steps_off_policy``, read from the per-token policy
    versions in the dumped episodes (as tests/test_grpo_async.py does).
The load average is printed at the start and the end: the wall-time ratio means nothing when
other jobs take the cores.
Wall time is the sum of the GRPO steps' times from step 2 on (model loading and step 1's one-time
costs excluded: they are the same for both; the JSON also has the total over all steps).
The ideal bound is the slower of rollout alone and training alone, both measured in the lockstep
run: no scheduling can beat it on the same work where rollout and training have compute of their
own. Where they share the cores (a CPU), a second bound applies: the bench measures the cores
lockstep keeps busy (process CPU seconds per wall second, steps 2 to the one before the last),
and the same CPU work cannot take less than ``cores used / cores`` of lockstep's wall time
("bound here"; it binds async as long as async's own cores-used figure, printed too, shows it
does the same work). Timings on a shared CPU are noisy: compare the
ratio of one run, not absolute numbers across runs.
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import json
import os
import platform
import random
import shutil
import tempfile
import time
from pathlib import Path
from typing import get_args

import torch

from cookbook_lib.display.length_mix_plots import length_mix_figure
from cookbook_lib.display.timeline_plots import idle_summary, timeline_figure
from cookbook_lib.envs import Env, StepResult, Task
from cookbook_lib.grpo.config import GRPOConfig, StaleGroups
from cookbook_lib.grpo.length_mix import length_mix_summary
from cookbook_lib.grpo.train import TIMELINE_FILE, train_multi_turn
from cookbook_lib.runtime.timeline import Timeline
from cookbook_lib.types import Message, ToolSpec

TOPICS = [
    "rivers", "owls", "bread", "bridges", "rain", "chess", "tea", "maps", "glaciers", "bees",
    "trains", "salt", "comets", "violins", "deserts", "ink", "lighthouses", "moss", "clocks", "kites",
]  # fmt: skip
REPLY_COUNTS, REPLY_WEIGHTS = (1, 2, 4, 8), (0.6, 0.2, 0.1, 0.1)
LONGEST_REPLY_CHARS = 160
MIX_TOLERANCE = 0.05  # the targets (see the module doc)
WALL_RATIO_TARGET = 0.6
VALIDATION_TOLERANCE = 0.02


def bench_tasks(count: int, seed: int) -> list[Task]:
    rng = random.Random(seed)
    return [
        Task(
            prompt=f"Tell me one fact about {rng.choice(TOPICS)}.",
            target=None,
            metadata={"replies": rng.choices(REPLY_COUNTS, REPLY_WEIGHTS)[0]},
        )
        for _ in range(count)
    ]


class ReviewedRepliesEnv(Env):
    """Each reply is sent to a review tool (``latency_s`` per call); the task sets how many replies.

    Reward: the mean over replies of ``1 - len(reply) / 160`` (at least 0): brevity, which varies
    within every group and which the model can learn.
    """

    def __init__(self, latency_s: float) -> None:
        self.latency_s = latency_s
        self._messages: list[Message] = []
        self._task: Task | None = None
        self._scores: list[float] = []

    async def reset(self, task: Task) -> list[Message]:
        self._task, self._scores = task, []
        self._messages = [
            Message(role="system", content="You are a helpful assistant. Answer briefly."),
            Message(role="user", content=task.prompt),
        ]
        return list(self._messages)

    async def review(self, reply: str) -> float:
        await asyncio.sleep(self.latency_s)  # the tool's round trip
        return max(0.0, 1.0 - len(reply) / LONGEST_REPLY_CHARS)

    async def step(self, message: Message) -> StepResult:
        assert self._task is not None
        self._messages.append(message)
        self._scores.append(await self.review(message.get("content", "")))
        if len(self._scores) >= self._task.metadata["replies"]:
            reward = sum(self._scores) / len(self._scores)
            return StepResult(terminated=True, truncated=False, messages=list(self._messages), reward=reward)
        self._messages.append(Message(role="user", content="Noted. One more fact, please."))
        return StepResult(terminated=False, truncated=False, messages=list(self._messages), reward=0.0)

    @property
    def tool_specs(self) -> list[ToolSpec]:
        return []

    @property
    def messages(self) -> list[Message]:
        return list(self._messages)


def oldest_trained_token_age(run_dir: Path, metrics: list[dict]) -> int:
    """The largest policy age of any token the run trained on, from the dumped per-token versions.

    A token's age at step ``s`` is the version the trainer held before the step minus the version
    that sampled it; it does not trust the loop's own ``async/policy_age_*`` bookkeeping.
    """
    version_before, oldest = 0, 0
    for record in sorted((m for m in metrics if m["step"] >= 1), key=lambda m: m["step"]):
        path = run_dir / "episodes" / f"step_{record['step']:06d}.jsonl"
        for line in path.read_text().splitlines() if path.exists() else []:
            versions = [v for turn in json.loads(line)["turns"] for v in turn["policy_versions"]]
            if versions:
                oldest = max(oldest, version_before - min(versions))
        version_before = int(record["policy_version"])
    return oldest


def cores_used(step_ends: dict[int, tuple[float, float]], last_step: int) -> float | None:
    """Mean cores busy (CPU seconds per wall second) from the end of step 1 to the end of step
    ``last_step - 1``: the timed steps without the last one, whose end also validates and saves.
    None when there is no such window (fewer than 3 steps)."""
    if 1 not in step_ends or last_step - 1 <= 1 or last_step - 1 not in step_ends:
        return None
    (wall_a, cpu_a), (wall_b, cpu_b) = step_ends[1], step_ends[last_step - 1]
    return (cpu_b - cpu_a) / (wall_b - wall_a)


def run_arm(
    name: str, config: GRPOConfig, tasks: list[Task], val_tasks: list[Task], latency_s: float
) -> dict:
    started, load_before = time.perf_counter(), os.getloadavg()
    step_ends: dict[int, tuple[float, float]] = {}  # step -> (wall, process CPU) when it ended

    def record_step_end(outcome) -> None:
        # process_time: CPU seconds of the whole process, every thread (user + system).
        step_ends[outcome.step] = (time.perf_counter(), time.process_time())

    result = train_multi_turn(
        config,
        tasks=tasks,
        env_factory=lambda task: ReviewedRepliesEnv(latency_s),
        val_tasks=val_tasks,
        on_step=record_step_end,
    )
    all_steps = [m for m in result.metrics if m["step"] >= 1]
    # Step 1 carries one-time costs (optimizer state, first allocations): timed from step 2 on.
    steps = all_steps[1:] if len(all_steps) > 1 else all_steps
    timeline = Timeline.load(result.run_dir / TIMELINE_FILE)
    # By assistant turns: buckets 1, 2, 3-4 and 5-8 are the tasks asking for 1, 2, 4 and 8 replies.
    mix = length_mix_summary(result.metrics)
    summary = {
        "arm": name,
        "load_average_before": load_before,
        "wall_s": sum(m["time/step_s"] for m in steps),
        "process_s": time.perf_counter() - started,
        "sampling_s": sum(m["time/sampling_s"] for m in steps),
        "training_s": sum(m["time/training_s"] + m["time/weight_sync_s"] for m in steps),
        "trainer_idle_fraction": sum(m["time/trainer_idle_fraction"] * m["time/step_s"] for m in steps)
        / sum(m["time/step_s"] for m in steps),
        "all_steps_wall_s": sum(m["time/step_s"] for m in all_steps),
        "cores_used": cores_used(step_ends, config.num_steps),
        "reward_per_step": [m["reward_mean"] for m in all_steps],
        "val_reward": [(m["step"], m["val/reward_mean"]) for m in result.metrics if "val/reward_mean" in m],
        "trained_mix": {bucket.bucket: bucket.trained_episodes_share for bucket in mix},
        "trained_token_mix": {bucket.bucket: bucket.trained_tokens_share for bucket in mix},
        "dropped_share_by_length": {bucket.bucket: bucket.dropped_share for bucket in mix},
        "oldest_trained_token_age": oldest_trained_token_age(result.run_dir, result.metrics),
        "max_steps_off_policy": config.max_steps_off_policy or 0,
        "dropped_stale_groups": sum(m.get("async/dropped_stale_groups", 0) for m in all_steps),
        "policy_age_mean": [m.get("async/policy_age_mean", 0.0) for m in all_steps],
        "timeline": idle_summary(timeline.spans()),
    }
    return summary | {
        "_timeline": timeline,
        "_metrics": result.metrics,
        "load_average_after": os.getloadavg(),
    }


def targets(arm: dict, lockstep: dict, bound_here: float | None = None) -> dict[str, tuple[bool, str]]:
    """Each target of the module doc for one async arm: (met, the figures behind it)."""
    buckets = sorted(set(arm["trained_mix"]) | set(lockstep["trained_mix"]), key=_bucket_start)
    gaps = {b: arm["trained_mix"].get(b, 0.0) - lockstep["trained_mix"].get(b, 0.0) for b in buckets}
    worst = max(gaps, key=lambda b: abs(gaps[b]))
    ratio = arm["wall_s"] / lockstep["wall_s"]
    val, lock_val = arm["val_reward"][-1][1], lockstep["val_reward"][-1][1]
    age, bound = arm["oldest_trained_token_age"], arm["max_steps_off_policy"]
    return {
        "length mix": (
            abs(gaps[worst]) <= MIX_TOLERANCE,
            f"largest gap {gaps[worst]:+.3f} ({worst}); allowed +-{MIX_TOLERANCE}",
        ),
        "wall time": (
            ratio <= WALL_RATIO_TARGET,
            f"{ratio:.2f}x lockstep; target <= {WALL_RATIO_TARGET}x"
            + ("" if bound_here is None else f" (bound on this machine {bound_here:.2f}x)"),
        ),
        "validation": (
            val >= lock_val - VALIDATION_TOLERANCE,
            f"{val:.3f} vs lockstep {lock_val:.3f}; target >= {lock_val - VALIDATION_TOLERANCE:.3f}",
        ),
        "token age": (age <= bound, f"oldest trained token {age} steps; bound {bound}"),
    }


def machine_bound(lockstep_cores_used: float | None, cores: int) -> float | None:
    """The least wall time, as a fraction of lockstep's, of any schedule doing lockstep's CPU work
    on ``cores`` cores: that work is ``cores_used * wall`` CPU seconds, and ``cores`` cores do at
    most ``cores`` CPU seconds a second. It holds for async only as far as async does the same
    CPU work (same tokens sampled and trained; the bench prints async's cores used to compare)."""
    return None if lockstep_cores_used is None else min(1.0, lockstep_cores_used / cores)


def _load() -> str:
    return " ".join(f"{value:.1f}" for value in os.getloadavg())


def _bucket_start(bucket: str) -> int:
    return int(bucket.removeprefix("turns_").split("-")[0])


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=6)
    parser.add_argument("--tool-latency", type=float, default=0.3)
    parser.add_argument("--max-steps-off-policy", type=int, default=2)
    parser.add_argument("--groups-in-flight", type=int, default=8)
    parser.add_argument(
        "--stale-groups",
        nargs="+",
        default=["prevent"],
        choices=get_args(StaleGroups),
        help="one async arm per rule (GRPOConfig.stale_groups)",
    )
    parser.add_argument("--mix-figure", default=None, help="write the length mix of every arm as HTML here")
    parser.add_argument("--val-tasks", type=int, default=16, help="held-out tasks (validated at 0, end)")
    parser.add_argument("--quick", action="store_true", help="2 steps, short replies: a smoke check")
    parser.add_argument("--out", default=None, help="write the figures as JSON here")
    parser.add_argument("--figure", default=None, help="write the two timelines as HTML here")
    args = parser.parse_args(argv)
    runs_dir = tempfile.mkdtemp(prefix="bench-async-")
    base = GRPOConfig(
        batch_size=4,
        episodes_per_task=4,
        num_steps=2 if args.quick else args.steps,
        validation_interval=0,  # validation at step 0 and at the end only
        val_episodes_per_task=2,
        sequential_validation=True,
        max_turns=8,
        max_model_length=1024,
        max_tokens_per_turn=12 if args.quick else 32,
        micro_batch_tokens=4096,
        learning_rate=2e-5,
        overlong_buffer_tokens=0,
        checkpoint_interval=0,
        runs_dir=runs_dir,
        run_name="lockstep",
        seed=0,
    )
    tasks, val_tasks = bench_tasks(200, seed=0), bench_tasks(args.val_tasks, seed=1)
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1
    print(
        f"torch {torch.__version__}, {torch.get_num_threads()} threads, {cores} cores, "
        f"{platform.processor() or 'cpu'}"
    )
    print(f"load average (1, 5, 15 min) at the start: {_load()}")
    try:
        arms = [run_arm("lockstep", base, tasks, val_tasks, args.tool_latency)]
        for rule in args.stale_groups:
            config = dataclasses.replace(
                base,
                run_name=f"async-{rule}",
                max_steps_off_policy=args.max_steps_off_policy,
                groups_in_flight=args.groups_in_flight,
                stale_groups=rule,
            )
            arms.append(run_arm(f"async-{rule}", config, tasks, val_tasks, args.tool_latency))
    finally:
        # Every arm leaves a final checkpoint of ~1.5 GB (weights and optimizer state); run_arm has
        # read what the report needs, so the runs go, finished or not.
        shutil.rmtree(runs_dir, ignore_errors=True)
    lockstep = arms[0]
    ideal_s = max(lockstep["sampling_s"], lockstep["training_s"])
    columns = ("wall s", "ratio", "trainer idle", "generator busy", "dropped", "cores used")
    widths = (8, 6, 13, 15, 8, 11)
    header = f"{'arm':16} " + " ".join(f"{c:>{w}}" for c, w in zip(columns, widths, strict=True))
    print("\n" + header)
    for arm in arms:
        busy = "" if arm["cores_used"] is None else f"{arm['cores_used']:.2f}"
        print(
            f"{arm['arm']:16} {arm['wall_s']:8.1f} {arm['wall_s'] / lockstep['wall_s']:6.2f} "
            f"{arm['trainer_idle_fraction']:13.2f} {arm['timeline']['generator_busy_fraction']:15.2f} "
            f"{arm['dropped_stale_groups']:8.0f} {busy:>11}"
        )
    print(
        f"{'ideal':16} {ideal_s:8.1f} {ideal_s / lockstep['wall_s']:6.2f}   "
        f"(max of lockstep's rollout {lockstep['sampling_s']:.1f} s "
        f"and training {lockstep['training_s']:.1f} s: rollout and training on separate compute)"
    )
    cpu_bound = machine_bound(lockstep["cores_used"], cores)
    if cpu_bound is not None:
        print(
            f"{'bound here':16} {cpu_bound * lockstep['wall_s']:8.1f} {cpu_bound:6.2f}   (lockstep kept "
            f"{lockstep['cores_used']:.2f} of this machine's {cores} cores busy: the same CPU work on "
            f"all {cores} cores at once takes at least this long; rollout and training share the cores)"
        )
    print("\ntraining reward per step (over the groups each arm trained on)")
    for arm in arms:
        print(f"  {arm['arm']:16} " + " ".join(f"{r:.3f}" for r in arm["reward_per_step"]))
    print("validation reward on the same held-out tasks (step: reward)")
    for arm in arms:
        print(f"  {arm['arm']:16} " + "  ".join(f"{step}: {r:.3f}" for step, r in arm["val_reward"]))
    for key, what in (
        ("trained_mix", "share of trained episodes"),
        ("trained_token_mix", "share of trained tokens"),
        ("dropped_share_by_length", "share of groups dropped as stale"),
    ):
        print(f"{what} by assistant turns (1, 2, 3-4, 5-8: tasks of 1, 2, 4, 8 replies)")
        for arm in arms:
            print(f"  {arm['arm']:16} " + " ".join(f"{share:.2f}" for share in arm[key].values()))
    report = {
        "tool_latency_s": args.tool_latency,
        "steps": base.num_steps,
        "cores": cores,
        "ideal_over_lockstep": ideal_s / lockstep["wall_s"],
        "machine_bound_over_lockstep": cpu_bound,
        "load_average_end": _load(),
        "arms": [{k: v for k, v in arm.items() if not k.startswith("_")} for arm in arms],
        "targets": {},
    }
    print(f"\ntargets (issue 13); load average (1, 5, 15 min) now: {_load()}")
    for arm in arms[1:]:
        report["targets"][arm["arm"]] = {}
        for target, (met, figures) in targets(arm, lockstep, cpu_bound).items():
            report["targets"][arm["arm"]][target] = {"met": met, "figures": figures}
            print(f"  {arm['arm']:16} {target:11} {'met' if met else 'NOT met':8} {figures}")
    if args.out:
        Path(args.out).write_text(json.dumps(report, indent=2))
    if args.figure:
        figure = timeline_figure([(arm["arm"], arm["_timeline"]) for arm in arms], title="bench_async")
        figure.write_html(args.figure, include_plotlyjs=True)
    if args.mix_figure:
        runs = [(arm["arm"], arm["_metrics"]) for arm in arms]
        length_mix_figure(runs, title="bench_async: length mix").write_html(
            args.mix_figure, include_plotlyjs=True
        )
    return report


if __name__ == "__main__":
    main()
