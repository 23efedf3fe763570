"""Rollout throughput: a GRPO group of episodes on the tool-use game, one at a time versus concurrently.

    python bench/bench_rollout.py                       # 16 episodes, 64 tokens a turn, 4 turns max
    python bench/bench_rollout.py --quick               # a smoke check (4 episodes, 16 tokens, 2 turns)
    python bench/bench_rollout.py --out runs/bench_rollout.json

Both arms play the same task with the embedded model through the same code (``ModelPolicy`` and
``run_episode``: render, sample, parse, ``Env.step``); only the generator and the scheduling differ:
  (A) the episodes one after another, each turn one plain ``model.generate`` call
      (``SequentialHFGenerator``): what a naive rollout loop does;
  (B) the episodes concurrently with ``run_group``, sharing one batching ``HFGenerator``.

Scenarios (each arm runs --repeats times, alternating A B, B A, ..., and keeps its fastest run):
  natural      the tool-use game as it is: a turn ends at the model's end-of-turn token, an episode at
               its first reply without a tool call. The base model rarely calls tools, so nearly every
               episode is one turn. This is the issue's figure, and the headline.
  fixed        the same, with stop tokens ignored and one turn per episode: every episode samples
               exactly --max-tokens tokens, so both arms do identical work and the ratio measures the
               generator alone, free of the luck of sampled lengths.
  multi-turn   an environment that answers a reply without tool calls by asking the model to check with
               a tool, until the last allowed turn: every episode samples --max-turns turns, each
               prompt extending the previous one token-exactly (the shape of a real tool-use episode).
Timings on a shared CPU are noisy: compare the ratios of one run, not numbers across runs. The table
also splits B's forward time into prefill and decode: that split says where the time goes.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import platform
import subprocess
import time
from collections import Counter
from collections.abc import Mapping
from dataclasses import asdict, dataclass, field, replace
from datetime import UTC, datetime
from pathlib import Path

import torch
import transformers
from transformers import PreTrainedModel

from cookbook_lib.codecs import Codec, make_codec
from cookbook_lib.envs import StepResult, Task
from cookbook_lib.generators import Generator, HFGenerator, SampleResult, SamplingParams, StepInfo
from cookbook_lib.generators.sequential import SequentialHFGenerator
from cookbook_lib.rollout.episode import Episode
from cookbook_lib.rollout.model_policy import ModelPolicy
from cookbook_lib.rollout.play import EnvFactory, run_episode, run_group
from cookbook_lib.runtime.models import load_model, load_tokenizer
from cookbook_lib.types import Message
from envs.tool_use_game import ToolUseGameEnv, load_tool_use_game_tasks

MAX_MODEL_LENGTH = 2048
SCENARIOS = ("natural", "fixed", "multi-turn")
NUDGE = "Check that with one of the tools before you answer."


class IgnoreStopTokens(Generator):
    """Wraps a generator so every sample runs to ``max_tokens``: equal work in both arms.

    ``ModelPolicy`` always adds the codec's end-of-turn token to the stop tokens, so the only way
    to switch early stopping off without touching the rollout code is below it, here.
    """

    def __init__(self, inner: Generator) -> None:
        self.inner = inner

    async def sample(self, prompt_tokens: list[int], params: SamplingParams) -> SampleResult:
        return await self.inner.sample(prompt_tokens, replace(params, stop_token_ids=[]))

    async def update_weights(self, state_dict: Mapping[str, torch.Tensor], version: int) -> None:
        await self.inner.update_weights(state_dict, version)

    @property
    def policy_version(self) -> int:
        return self.inner.policy_version

    async def close(self) -> None:
        await self.inner.close()


class NudgedToolUseGameEnv(ToolUseGameEnv):
    """The tool-use game where a reply without tool calls is sent back until the ``turns``-th one.

    The base model rarely calls a tool on its own, so without this nearly every episode is one
    turn; with it, every episode has ``turns`` sampled turns (tool calls it does make run as usual).
    """

    def __init__(self, turns: int) -> None:
        super().__init__()
        self._turns_left = turns

    async def step(self, message: Message) -> StepResult:
        self._turns_left -= 1
        if self._turns_left > 0 and not message.get("tool_calls"):
            self._messages += [message, Message(role="user", content=NUDGE)]
            return StepResult(False, False, list(self._messages), 0.0, self.episode_metrics())
        return await super().step(message)


@dataclass(frozen=True)
class Scenario:
    name: str
    env_factory: EnvFactory
    max_turns: int
    ignore_stop: bool = False


@dataclass
class ArmResult:
    """What one arm did and how long it took; the rates are what the table compares."""

    arm: str
    episodes: int
    turns: int
    prompt_tokens: int  # summed over turns: the prefill work
    sampled_tokens: int
    wall_s: float
    cpu_s: float  # CPU time of this process, all threads: less sensitive to other processes than wall_s
    end_causes: dict[str, int]
    mean_reward: float
    prefill_s: float | None = None  # forward time by kind, from HFGenerator's step callback (arm B)
    decode_s: float | None = None
    mean_decode_batch: float | None = None
    wall_s_all: list[float] = field(default_factory=list)  # every repeat; wall_s is the fastest

    @property
    def episodes_per_s(self) -> float:
        return self.episodes / self.wall_s

    @property
    def tokens_per_s(self) -> float:
        return self.sampled_tokens / self.wall_s

    def to_dict(self) -> dict[str, object]:
        return {**asdict(self), "episodes_per_s": self.episodes_per_s, "tokens_per_s": self.tokens_per_s}


@dataclass
class ForwardTimes:
    """Sums HFGenerator's forward time by kind (prefill or decode), from its step callback."""

    seconds: Counter[str] = field(default_factory=Counter)

    def __call__(self, step: StepInfo) -> None:
        self.seconds[step.kind] += step.end_s - step.start_s


@dataclass(frozen=True)
class Setup:
    """What every arm of every scenario shares."""

    model: PreTrainedModel
    codec: Codec
    pad_token_id: int
    task: Task
    episodes: int
    sampling: SamplingParams
    seed: int

    def policy(self, generator: Generator) -> ModelPolicy:
        return ModelPolicy(generator, self.codec, self.sampling, MAX_MODEL_LENGTH)


ARM_LABELS = {"A": "A one at a time, generate", "B": "B run_group, HFGenerator"}


def run_arm(arm: str, scenario: Scenario, setup: Setup) -> ArmResult:
    """Play one arm from the fixed seed and time it (generator start and close included)."""
    times = ForwardTimes()
    generator: Generator
    if arm == "A":
        generator = SequentialHFGenerator(setup.model, pad_token_id=setup.pad_token_id)
    else:
        generator = HFGenerator(setup.model, pad_token_id=setup.pad_token_id, step_callback=times)
    batching = generator if isinstance(generator, HFGenerator) else None
    if scenario.ignore_stop:
        generator = IgnoreStopTokens(generator)

    async def play() -> list[Episode]:
        async with generator:
            if arm == "A":
                return [
                    await run_episode(
                        scenario.env_factory,
                        setup.task,
                        setup.policy(generator),
                        max_turns=scenario.max_turns,
                    )
                    for _ in range(setup.episodes)
                ]
            return await run_group(
                scenario.env_factory,
                setup.task,
                lambda: setup.policy(generator),
                setup.episodes,
                max_turns=scenario.max_turns,
            )

    torch.manual_seed(setup.seed)
    start, start_cpu = time.perf_counter(), time.process_time()
    episodes = asyncio.run(play())
    wall_s, cpu_s = time.perf_counter() - start, time.process_time() - start_cpu
    turns = [turn for episode in episodes for turn in episode.turns]
    result = ArmResult(
        arm=ARM_LABELS[arm],
        episodes=len(episodes),
        turns=len(turns),
        prompt_tokens=sum(len(turn.prompt_tokens) for turn in turns),
        sampled_tokens=sum(len(turn.sampled_tokens) for turn in turns),
        wall_s=wall_s,
        cpu_s=cpu_s,
        end_causes=dict(Counter(episode.end_cause.value for episode in episodes)),
        mean_reward=sum(episode.reward for episode in episodes) / len(episodes),
    )
    if batching is not None:
        result.prefill_s, result.decode_s = times.seconds["prefill"], times.seconds["decode"]
        result.mean_decode_batch = batching.stats.mean_decode_batch
    return result


@dataclass
class ScenarioResult:
    a: ArmResult
    b: ArmResult

    @property
    def ratio_episodes_per_s(self) -> float:
        return self.b.episodes_per_s / self.a.episodes_per_s

    @property
    def ratio_tokens_per_s(self) -> float:
        return self.b.tokens_per_s / self.a.tokens_per_s

    @property
    def ratio_cpu_per_episode(self) -> float:
        """A's CPU seconds per episode over B's: the episodes/s ratio as a busy machine skews it least."""
        return (self.a.cpu_s / self.a.episodes) / (self.b.cpu_s / self.b.episodes)

    def to_dict(self) -> dict[str, object]:
        return {
            "A": self.a.to_dict(),
            "B": self.b.to_dict(),
            "ratio_episodes_per_s": self.ratio_episodes_per_s,
            "ratio_tokens_per_s": self.ratio_tokens_per_s,
            "ratio_cpu_per_episode": self.ratio_cpu_per_episode,
        }


def run_scenario(scenario: Scenario, setup: Setup, repeats: int) -> ScenarioResult:
    """Each arm ``repeats`` times, in the order A B, B A, A B...; each arm keeps its fastest run.

    Other processes only ever add time, so the fastest of a few runs is the best estimate of
    what an arm costs; alternating the order spreads slow phases of the machine over both arms.
    The seed is the same every time, so the repeats of an arm sample the same tokens.
    """
    best: dict[str, ArmResult] = {}
    walls: dict[str, list[float]] = {"A": [], "B": []}
    for repeat in range(repeats):
        for arm in "AB" if repeat % 2 == 0 else "BA":
            result = run_arm(arm, scenario, setup)
            walls[arm].append(round(result.wall_s, 2))
            if arm not in best or result.wall_s < best[arm].wall_s:
                best[arm] = result
    for arm, result in best.items():
        result.wall_s_all = walls[arm]
    return ScenarioResult(best["A"], best["B"])


def print_header() -> None:
    print(
        f"{'scenario':11} {'arm':27} {'eps':>4} {'turns':>5} {'prompt t':>8} {'sampled':>7} {'wall s':>7} "
        f"{'episodes/s':>10} {'tokens/s':>8}"
    )


def print_rows(name: str, result: ScenarioResult) -> None:
    for row in (result.a, result.b):
        print(
            f"{name:11} {row.arm:27} {row.episodes:4d} {row.turns:5d} {row.prompt_tokens:8d} "
            f"{row.sampled_tokens:7d} {row.wall_s:7.1f} {row.episodes_per_s:10.3f} {row.tokens_per_s:8.1f}"
        )
    print(
        f"{'':11} {'B/A':27} {'':4} {'':5} {'':8} {'':7} {'':7} "
        f"{result.ratio_episodes_per_s:9.2f}x {result.ratio_tokens_per_s:7.2f}x"
    )
    b = result.b
    print(
        f"{'':11} B's forwards: prefill {b.prefill_s:.1f} s, decode {b.decode_s:.1f} s, mean decode "
        f"batch {b.mean_decode_batch:.1f}. End causes: A {result.a.end_causes}, B {b.end_causes}"
    )
    print(
        f"{'':11} wall s of every run: A {result.a.wall_s_all}, B {b.wall_s_all}. CPU s of the fastest: "
        f"A {result.a.cpu_s:.0f}, B {b.cpu_s:.0f} (per episode A/B {result.ratio_cpu_per_episode:.2f}x)"
    )


def warm_up(model: PreTrainedModel, pad_token_id: int, prompt: list[int]) -> None:
    """First calls pay one-off costs (kernel selection, thread pools); pay them before timing."""

    async def main() -> None:
        short = SamplingParams(max_tokens=2)
        async with SequentialHFGenerator(model, pad_token_id=pad_token_id) as generator:
            await generator.sample(prompt, short)
        async with HFGenerator(model, pad_token_id=pad_token_id) as generator:
            await asyncio.gather(generator.sample(prompt, short), generator.sample(prompt, short))

    asyncio.run(main())


def code_version() -> str:
    """The git commit measured, marked "+ local changes" when the working tree differs from it."""
    try:
        commit = subprocess.run(
            ["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True, check=True
        )
        dirty = subprocess.run(["git", "status", "--porcelain"], capture_output=True, text=True, check=True)
    except (OSError, subprocess.CalledProcessError):
        return "unknown"
    return commit.stdout.strip() + (" + local changes" if dirty.stdout.strip() else "")


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--quick", action="store_true", help="4 episodes, 16 tokens a turn, 2 turns")
    parser.add_argument("--episodes", type=int, help="episodes in the group (default 16)")
    parser.add_argument("--max-tokens", type=int, help="sampled tokens per turn at most (default 64)")
    parser.add_argument("--max-turns", type=int, help="turns per episode at most (default 4)")
    parser.add_argument("--repeats", type=int, help="runs of each arm, the fastest kept (default 2; quick 1)")
    parser.add_argument(
        "--scenarios",
        nargs="+",
        choices=SCENARIOS,
        default=list(SCENARIOS),
        help="which to run (default all)",
    )
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out", type=Path, help="write the figures to this JSON file")
    args = parser.parse_args()
    quick = args.quick
    args.episodes = args.episodes or (4 if quick else 16)
    args.max_tokens = args.max_tokens or (16 if quick else 64)
    args.max_turns = args.max_turns or (2 if quick else 4)
    args.repeats = args.repeats or (1 if quick else 2)

    code = code_version()  # now, before the run: the tree may change while it runs
    model, tokenizer = load_model(), load_tokenizer()
    codec, pad = make_codec(tokenizer), tokenizer.pad_token_id
    task = load_tool_use_game_tasks("train")[0]
    scenarios = {
        "natural": Scenario("natural", lambda _task: ToolUseGameEnv(), args.max_turns),
        "fixed": Scenario("fixed", lambda _task: ToolUseGameEnv(), max_turns=1, ignore_stop=True),
        "multi-turn": Scenario(
            "multi-turn", lambda _task: NudgedToolUseGameEnv(args.max_turns), args.max_turns
        ),
    }
    setup = Setup(
        model,
        codec,
        pad,
        task,
        args.episodes,
        SamplingParams(temperature=1.0, max_tokens=args.max_tokens),
        args.seed,
    )
    env = ToolUseGameEnv()
    first_prompt = codec.render_prompt(asyncio.run(env.reset(task)), env.tool_specs)
    print(
        f"group of {args.episodes} episodes of one tool-use game task "
        f"(first prompt {len(first_prompt)} tokens), temperature 1.0, <= {args.max_tokens} tokens a turn, "
        f"<= {args.max_turns} turns, max_model_length {MAX_MODEL_LENGTH}, "
        f"torch threads {torch.get_num_threads()}, fastest of {args.repeats} run(s) per arm"
    )
    warm_up(model, pad, first_prompt)

    results: dict[str, ScenarioResult] = {}
    print_header()
    for name in args.scenarios:
        results[name] = run_scenario(scenarios[name], setup, args.repeats)
        print_rows(name, results[name])
    if "natural" in results:
        headline = results["natural"]
        print(
            f"headline (natural): B/A episodes/s {headline.ratio_episodes_per_s:.2f}x, "
            f"tokens/s {headline.ratio_tokens_per_s:.2f}x (target: >= 4x episodes/s)"
        )
    if args.out is not None:
        report = {
            "date": datetime.now(UTC).isoformat(timespec="seconds"),
            "code": code,
            "machine": {
                "cpus": os.cpu_count(),
                "torch_threads": torch.get_num_threads(),
                "processor": platform.processor() or platform.machine(),
                "torch": torch.__version__,
                "transformers": transformers.__version__,
            },
            "settings": {
                "episodes": args.episodes,
                "max_tokens": args.max_tokens,
                "max_turns": args.max_turns,
                "temperature": 1.0,
                "max_model_length": MAX_MODEL_LENGTH,
                "seed": args.seed,
                "repeats": args.repeats,
                "task": task.prompt,
                "first_prompt_tokens": len(first_prompt),
            },
            "scenarios": {name: result.to_dict() for name, result in results.items()},
        }
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps(report, indent=2) + "\n")
        print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
