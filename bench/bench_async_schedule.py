"""Async scheduling rules side by side with simulated compute: the length bias on a loaded machine.

    python bench/bench_async_schedule.py                     # lockstep and the three stale_groups rules
    python bench/bench_async_schedule.py --groups-in-flight 4 8 16 --max-steps-off-policy 1 2
    python bench/bench_async_schedule.py --quick             # a smoke check

``bench_async.py`` measures the real thing, but its wall-time ratio needs free cores: sampling and
training share them, and other jobs on the machine change both. This bench runs the real
scheduling code (``make_loop``'s lockstep and async loops, ``GeneratorReplicas`` and
its weight-sync modes, ``run_group``, the codec, ``build_samples``) on ``bench_async.py``'s
workload (1/2/4/8-reply tasks, a review tool per reply) with the model replaced by a cost model
that *sleeps*: a generator that batches requests like ``HFGenerator`` (each decode step takes
``decode_s + row_s * rows``, each admitted request ``prefill_s``; replies of 8-32 tokens) and a
trainer that sleeps ``train_fixed_s + train_s_per_token * tokens``. Sleeping needs no CPU, so the
figures hold on a loaded machine. What they leave out: sampling and training competing for the
same cores (on a 2-core CPU they do; on GPUs they do not), which ``bench_async.py`` measures.

The costs are calibrated on ``bench_async.py``'s lockstep run on a quiet machine (about 33 s of
sampling and 40 s of training per step); ``--time-scale`` shrinks every cost, the tool's latency
included, so a run takes minutes. Reported per arm: the wall time of steps 2 to N against
lockstep's, the share of trained episodes by assistant turns (1, 2, 3-4, 5-8) and its largest gap
to lockstep's, the stale groups dropped, and the oldest trained token (from the per-token versions).
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import json
import os
import random
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, get_args

import torch

# bench_async.py is beside this file: Python puts a script's folder on sys.path.
from bench_async import ReviewedRepliesEnv, bench_tasks

from cookbook_lib.codecs import Codec, make_codec
from cookbook_lib.envs import Task
from cookbook_lib.generators import Generator, GeneratorClosedError, SampleResult, SamplingParams
from cookbook_lib.grpo.config import GRPOConfig, StaleGroups
from cookbook_lib.grpo.length_mix import length_mix_summary
from cookbook_lib.grpo.loops import make_loop
from cookbook_lib.grpo.step import RunContext
from cookbook_lib.grpo.weight_sync import GeneratorReplicas
from cookbook_lib.runtime.asyncio_utils import run_sync
from cookbook_lib.runtime.models import load_tokenizer
from cookbook_lib.runtime.timeline import Timeline


@dataclass(frozen=True)
class CostModel:
    """Seconds each simulated piece of work takes (before ``scaled``)."""

    decode_s: float = 0.15  # one decode step of the batch, plus per row:
    row_s: float = 0.013
    prefill_s: float = 0.13  # admitting one request (its new prompt tokens)
    load_s: float = 0.3  # a replica loading new weights
    tool_s: float = 0.3  # the review tool, per reply
    train_fixed_s: float = 2.0
    train_s_per_token: float = 0.023  # forward and backward, per token of the trained sequences
    reply_tokens: tuple[int, int] = (8, 32)  # sampled tokens per reply, uniform

    def scaled(self, factor: float) -> CostModel:
        fields = {f.name: getattr(self, f.name) for f in dataclasses.fields(self) if f.name != "reply_tokens"}
        return dataclasses.replace(self, **{name: value * factor for name, value in fields.items()})


@dataclass
class _Request:
    length: int  # tokens to sample, the stop token included
    future: asyncio.Future[SampleResult]
    versions: list[int] = field(default_factory=list)


class SimulatedGenerator(Generator):
    """Continuous batching on a clock: requests join between decode steps; nothing is computed.

    A reply is ``length - 1`` filler tokens and the codec's stop token, so the codec parses it into
    an assistant message of ``length - 1`` words (the bench's reward, brevity, varies with it).
    Weight updates follow the interface: between two decode steps, or with ``between_requests``
    after the running requests finish, admitting none meanwhile.
    """

    def __init__(self, cost: CostModel, codec: Codec, filler_token: int, rng: random.Random) -> None:
        self.cost, self.rng = cost, rng
        self.stop_token = codec.stop_token_ids[0]
        self.filler_token = filler_token
        self._version = 0
        self._waiting: list[_Request] = []
        self._active: list[_Request] = []
        self._updates: list[tuple[int, bool, asyncio.Future[None]]] = []
        self._wake = asyncio.Event()
        self._engine: asyncio.Task[None] | None = None
        self._closed = False

    @property
    def policy_version(self) -> int:
        return self._version

    async def sample(self, prompt_tokens: list[int], params: SamplingParams) -> SampleResult:
        if self._closed:
            raise GeneratorClosedError("the simulated generator is closed")
        low, high = self.cost.reply_tokens
        request = _Request(
            min(self.rng.randint(low, high), params.max_tokens), asyncio.get_running_loop().create_future()
        )
        self._waiting.append(request)
        self._start()
        return await request.future  # a cancelled caller's request is skipped by the engine

    async def update_weights(
        self, state_dict: Mapping[str, torch.Tensor], version: int, *, between_requests: bool = False
    ) -> None:
        done: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        self._updates.append((version, between_requests, done))
        self._start()
        await done

    async def close(self) -> None:
        self._closed = True
        if self._engine is not None:
            self._engine.cancel()
            await asyncio.gather(self._engine, return_exceptions=True)
        for request in self._waiting + self._active:
            if not request.future.done():
                request.future.set_exception(GeneratorClosedError("the simulated generator closed"))

    def _start(self) -> None:
        self._wake.set()
        if self._engine is None:
            self._engine = asyncio.create_task(self._run(), name="simulated-generator")

    async def _run(self) -> None:
        while True:
            self._active = [r for r in self._active if not r.future.done()]  # drop cancelled requests
            if self._updates and (not self._updates[0][1] or not self._active):
                version, _, done = self._updates.pop(0)
                await asyncio.sleep(self.cost.load_s)
                self._version = version
                done.set_result(None)
            elif self._waiting and not (self._updates and self._updates[0][1]):
                admitted, self._waiting = self._waiting, []
                await asyncio.sleep(self.cost.prefill_s * len(admitted))
                self._active += admitted
            elif self._active:
                await asyncio.sleep(self.cost.decode_s + self.cost.row_s * len(self._active))
                for request in self._active:
                    request.versions.append(self._version)
                    if len(request.versions) == request.length and not request.future.done():
                        tokens = [self.filler_token] * (request.length - 1) + [self.stop_token]
                        request.future.set_result(
                            SampleResult(tokens, [-1.0] * len(tokens), "stop", list(request.versions))
                        )
            else:
                self._wake.clear()
                await self._wake.wait()


class SimulatedTrainer:
    """``PolicyTrainer``'s two methods the loops call; an optimizer step sleeps for its tokens."""

    def __init__(self, cost: CostModel) -> None:
        self.cost = cost

    def grpo_step(self, samples: Sequence[Any], settings: Any) -> dict[str, float]:
        tokens = sum(len(sample) for sample in samples)
        time.sleep(self.cost.train_fixed_s + self.cost.train_s_per_token * tokens)
        return {"policy_loss": 0.0, "trained_tokens": float(tokens)}

    def export_weights(self, copy: bool = False) -> dict[str, torch.Tensor]:
        return {}


def oldest_token_age(steps: list[dict[str, Any]], episodes_by_step: dict[int, list]) -> int:
    version_before, oldest = 0, 0
    for record in steps:
        for episode in episodes_by_step[record["step"]]:
            versions = [v for turn in episode.turns for v in turn.policy_versions]
            if versions:
                oldest = max(oldest, version_before - min(versions))
        version_before = int(record["policy_version"])
    return oldest


async def _run(config: GRPOConfig, tasks: list[Task], codec: Codec, filler: int, cost: CostModel) -> dict:
    timeline = Timeline()
    generators = [
        SimulatedGenerator(cost, codec, filler, random.Random(f"{config.seed}/{i}"))
        for i in range(config.num_generator_replicas)
    ]
    replicas = GeneratorReplicas(generators, config.weight_sync_type, timeline)
    trainer = SimulatedTrainer(cost)
    env_factory = lambda task: ReviewedRepliesEnv(cost.tool_s)  # noqa: E731
    context = RunContext(config, tasks, env_factory, trainer, replicas, codec, timeline)  # type: ignore[arg-type]
    loop = make_loop(context)
    records, episodes = [], {}
    try:
        for step in range(1, config.num_steps + 1):
            outcome = await loop.step(step)
            records.append({"step": step} | outcome.metrics)
            episodes[step] = outcome.episodes
    finally:
        await loop.close()
        await replicas.close()
    return {"records": records, "oldest_token_age": oldest_token_age(records, episodes)}


def run_arm(
    name: str, config: GRPOConfig, tasks: list[Task], codec: Codec, filler: int, cost: CostModel
) -> dict:
    result = run_sync(_run(config, tasks, codec, filler, cost))
    records = result["records"]
    timed = records[1:] if len(records) > 1 else records  # step 1 fills the pipeline: not timed
    mix = length_mix_summary(records)
    return {
        "arm": name,
        "wall_s": sum(r["time/step_s"] for r in timed),
        "trained_mix": {bucket.bucket: bucket.trained_episodes_share for bucket in mix},
        "dropped_stale_groups": sum(r.get("async/dropped_stale_groups", 0.0) for r in records),
        "policy_age_mean": sum(r.get("async/policy_age_mean", 0.0) for r in records) / len(records),
        "trainer_idle_fraction": sum(r["time/trainer_idle_fraction"] * r["time/step_s"] for r in timed)
        / sum(r["time/step_s"] for r in timed),
        "oldest_token_age": result["oldest_token_age"],
        "max_steps_off_policy": config.max_steps_off_policy or 0,
    }


def main(argv: list[str] | None = None) -> list[dict]:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=12)
    parser.add_argument("--time-scale", type=float, default=0.2, help="multiplies every simulated cost")
    parser.add_argument(
        "--stale-groups",
        nargs="*",
        default=list(get_args(StaleGroups)),
        choices=get_args(StaleGroups),
        help="one async arm per rule (none: lockstep alone, to calibrate)",
    )
    parser.add_argument(
        "--cost", action="append", default=[], metavar="NAME=SECONDS", help="override a CostModel field"
    )
    parser.add_argument("--groups-in-flight", type=int, nargs="+", default=[8])
    parser.add_argument("--max-steps-off-policy", type=int, nargs="+", default=[2])
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--quick", action="store_true", help="3 steps at a tenth of the costs")
    parser.add_argument("--out", default=None, help="write the figures as JSON here")
    args = parser.parse_args(argv)
    os.environ.setdefault("COOKBOOK_PROGRESS", "0")  # no bars: one line per arm
    try:
        overrides = {name: float(value) for name, value in (item.split("=", 1) for item in args.cost)}
        cost = dataclasses.replace(CostModel(), **overrides).scaled(0.1 if args.quick else args.time_scale)
    except (ValueError, TypeError) as error:
        parser.error(f"--cost takes NAME=SECONDS with NAME a CostModel field ({error})")
    tokenizer = load_tokenizer()
    codec = make_codec(tokenizer)
    filler = tokenizer.encode(" fact", add_special_tokens=False)[0]
    base = GRPOConfig(
        batch_size=4,
        episodes_per_task=4,
        num_steps=3 if args.quick else args.steps,
        max_turns=8,
        max_model_length=1024,
        max_tokens_per_turn=32,
        micro_batch_tokens=4096,
        overlong_buffer_tokens=0,
        seed=args.seed,
        run_name="schedule",
    )
    tasks = bench_tasks(200, seed=args.seed)
    arms = [run_arm("lockstep", base, tasks, codec, filler, cost)]
    print(_row(arms[0], arms[0]), flush=True)
    for max_age in args.max_steps_off_policy:
        for in_flight in args.groups_in_flight:
            for rule in args.stale_groups:
                config = dataclasses.replace(
                    base, max_steps_off_policy=max_age, groups_in_flight=in_flight, stale_groups=rule
                )
                arms.append(
                    run_arm(f"{rule} age<={max_age} G={in_flight}", config, tasks, codec, filler, cost)
                )
                print(_row(arms[-1], arms[0]), flush=True)
    if args.out:
        Path(args.out).write_text(json.dumps(arms, indent=2))
    return arms


def _row(arm: dict, lockstep: dict) -> str:
    gaps = [arm["trained_mix"].get(b, 0.0) - share for b, share in lockstep["trained_mix"].items()]
    shares = " ".join(f"{share:.2f}" for share in arm["trained_mix"].values())
    return (
        f"{arm['arm']:24} wall {arm['wall_s']:7.1f} s  ratio {arm['wall_s'] / lockstep['wall_s']:.2f}  "
        f"mix {shares}  largest gap {max(gaps, key=abs):+.2f}  dropped {arm['dropped_stale_groups']:3.0f}  "
        f"age mean {arm['policy_age_mean']:.2f}  oldest token {arm['oldest_token_age']}  "
        f"trainer idle {arm['trainer_idle_fraction']:.2f}"
    )


if __name__ == "__main__":
    main()
