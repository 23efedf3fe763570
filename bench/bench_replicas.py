"""Sampling throughput of 1 vs 2 generator replicas, local vs Ray actors, side by side in one run.

    python bench/bench_replicas.py            # embedded model, 16 prompts x 48 new tokens, 2 rounds
    python bench/bench_replicas.py --quick    # 8 prompts x 16 new tokens, 1 round
    python bench/bench_replicas.py --ray-threads 1   # every Ray actor on 1 core (default: cores / replicas)

Arms (the same seeded requests, spread round-robin over the replicas, all in flight at once):
  local x1  one ``HFGenerator`` in this process (the baseline);
  local x2  two ``HFGenerator`` copies in this process, sharing its torch threads;
  ray x1    one Ray actor (``generator_placement="ray"``) with all the machine's cores;
  ray x2    two Ray actors, the cores split between them (``ray_cpus_per_replica``).
Each arm also publishes the weights once (what ``GeneratorReplicas.publish`` does after each step):
for Ray that is one ``ray.put`` of the state dict and a load from the object store in every actor.
Start-up (model copies, actors) is excluded; every replica serves one warm-up request first.
Timings on a shared CPU are noisy: compare the ratios of one run, not numbers across runs.
"""

from __future__ import annotations

import argparse
import asyncio
import copy
import os
import time
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from cookbook_lib.generators import Generator, HFGenerator, SamplingParams
from cookbook_lib.generators.ray_replicas import RayReplicaPool, import_ray, model_bytes
from cookbook_lib.runtime.models import load_model, load_tokenizer

QUESTIONS = [
    "What is the capital of France?",
    "Give me three tips for sleeping well.",
    "Explain photosynthesis in one sentence.",
    "What is 17 times 23?",
    "Write a haiku about autumn.",
    "Why is the sky blue?",
    "Name two prime numbers greater than 50.",
    "How do I boil an egg?",
]


@dataclass
class Arm:
    name: str
    tokens_per_s: float
    publish_s: float


def prompts_for(tokenizer, count: int) -> list[list[int]]:
    out = []
    for question in (QUESTIONS * 4)[:count]:
        ids = tokenizer.apply_chat_template(
            [{"role": "user", "content": question}], add_generation_prompt=True, tokenize=True
        )
        out.append(list(ids["input_ids"]) if hasattr(ids, "keys") else list(ids))
    return out


async def measure(
    name: str,
    generators: Sequence[Generator],
    prompts: list[list[int]],
    new_tokens: int,
    rounds: int,
    weights: dict[str, torch.Tensor],
) -> Arm:
    # No stop tokens: every request samples exactly new_tokens, so tokens/s compare directly.
    params = [SamplingParams(max_tokens=new_tokens, seed=i) for i in range(len(prompts))]
    await asyncio.gather(*(g.sample(prompts[0], SamplingParams(max_tokens=2, seed=0)) for g in generators))
    started = time.perf_counter()
    tokens = 0
    for _ in range(rounds):
        results = await asyncio.gather(
            *(generators[i % len(generators)].sample(p, params[i]) for i, p in enumerate(prompts))
        )
        tokens += sum(len(r.tokens) for r in results)
    elapsed = time.perf_counter() - started
    started = time.perf_counter()
    await asyncio.gather(*(g.update_weights(weights, 1) for g in generators))
    return Arm(name, tokens / elapsed, time.perf_counter() - started)


async def local_arm(model, pad: int, count: int, prompts, new_tokens: int, rounds: int, weights) -> Arm:
    generators = [HFGenerator(copy.deepcopy(model), pad_token_id=pad) for _ in range(count)]
    try:
        return await measure(f"local x{count}", generators, prompts, new_tokens, rounds, weights)
    finally:
        await asyncio.gather(*(g.close() for g in generators))


async def ray_arm(
    model, pad: int, count: int, prompts, new_tokens: int, rounds: int, weights, threads: int | None
) -> Arm:
    threads = threads or max(1, (os.cpu_count() or 1) // count)
    pool = RayReplicaPool(copy.deepcopy(model), pad, count, cpus_per_replica=threads)
    generators = pool.generators()
    try:
        return await measure(f"ray x{count} ({threads}t)", generators, prompts, new_tokens, rounds, weights)
    finally:
        await asyncio.gather(*(g.close() for g in generators))
        pool.shutdown()


async def run(args: argparse.Namespace) -> list[Arm]:
    model, tokenizer = load_model(), load_tokenizer()
    model.eval()
    prompts = prompts_for(tokenizer, args.prompts)
    weights = {k: v.detach().clone() for k, v in model.state_dict().items()}
    pad = tokenizer.pad_token_id
    ray = import_ray()
    cores = os.cpu_count() or 1
    # One Ray for both Ray arms (each pool joins it), sized like the one a run starts.
    ray.init(
        num_cpus=max(cores, 2),
        include_dashboard=False,
        object_store_memory=3 * model_bytes(model) + 64 * 1024**2,
        log_to_driver=False,
        logging_level="ERROR",
    )
    try:
        arms = []
        for count in (1, 2):
            arms.append(await local_arm(model, pad, count, prompts, args.new_tokens, args.rounds, weights))
        for count in (1, 2):
            arms.append(
                await ray_arm(
                    model, pad, count, prompts, args.new_tokens, args.rounds, weights, args.ray_threads
                )
            )
        return arms
    finally:
        ray.shutdown()


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--ray-threads", type=int, default=None, help="cores (torch threads) per Ray actor")
    args = parser.parse_args()
    args.prompts, args.new_tokens, args.rounds = (8, 16, 1) if args.quick else (16, 48, 2)
    print(
        f"{os.cpu_count()} cores, torch threads {torch.get_num_threads()}; {args.prompts} prompts x "
        f"{args.new_tokens} new tokens x {args.rounds} rounds, all in flight at once"
    )
    arms = asyncio.run(run(args))
    baseline = arms[0].tokens_per_s
    print(f"{'arm':<14} {'tokens/s':>9} {'vs local x1':>12} {'publish s':>10}")
    for arm in arms:
        ratio = arm.tokens_per_s / baseline
        print(f"{arm.name:<14} {arm.tokens_per_s:>9.1f} {ratio:>11.2f}x {arm.publish_s:>10.3f}")


if __name__ == "__main__":
    main()
