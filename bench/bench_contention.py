"""An evaluation beside a training process: its time per sampled token, alone and with a busy neighbour.

    python bench/bench_contention.py                    # fixed threads, two OpenMP waits, fitted threads
    python bench/bench_contention.py --quick            # fewer tokens, one round
    python bench/bench_contention.py --settings "COOKBOOK_FIT_THREADS=0" "defaults"
    python bench/bench_contention.py --neighbour fixed  # beside a process that never yields a core

A workshop laptop or a Colab VM has two cores, and a second job often runs on them: a training
run beside an evaluation, a browser beside the kernel. A fair share of two cores for each of two
busy processes is half, so a process beside another should take about 2x its time alone. torch's
OpenMP (libgomp) spin-waits between parallel regions: a thread that finishes its half of a matmul
spins, holding its core, until its partner (descheduled for the neighbour) finishes too, so both
processes lose far more than their share.

The library's answer (``runtime.cpu_share``): the compute threads fit torch's team to the cores
other processes leave free, re-read once a second. Each arm is one setting of the environment
(``defaults``: none set, so the library fits its threads; ``COOKBOOK_FIT_THREADS=0``: torch's
fixed team, the library before session 19; OpenMP's own waits beside that), given to fresh
processes because libgomp reads it when torch loads. For each arm the bench
starts a fresh evaluation process alone, then beside a neighbour process that trains the embedded
model (forward and backward of a fixed batch, in a loop, fitting its threads between steps as the
library's trainer does) under the same setting, and prints the
seconds per sampled token of both, their ratio, and each arm's time alone over the first arm's.
The evaluation samples 16 seeded chat prompts with ``HFGenerator`` (every row the same length).
Timings on a shared machine are noisy: compare the ratios of one run.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
READY = "neighbour ready"


def evaluation(prompts: int, new_tokens: int) -> None:
    """Sample ``prompts`` chat prompts of ``new_tokens`` each; print seconds and tokens as JSON."""
    from cookbook_lib.generators import HFGenerator, SamplingParams
    from cookbook_lib.runtime.models import load_model, load_tokenizer

    model, tokenizer = load_model(), load_tokenizer()
    questions = [f"Question {i}: what is {i} times {i + 7}? Answer in a sentence." for i in range(prompts)]
    texts = [
        tokenizer.apply_chat_template(
            [{"role": "user", "content": q}], add_generation_prompt=True, tokenize=False
        )
        for q in questions
    ]
    token_lists = [tokenizer(text, add_special_tokens=False)["input_ids"] for text in texts]

    async def sample(tokens: int) -> tuple[float, int]:
        params = [SamplingParams(temperature=1.0, max_tokens=tokens, seed=i) for i in range(prompts)]
        async with HFGenerator(model, pad_token_id=tokenizer.pad_token_id) as generator:
            started = time.perf_counter()
            results = await asyncio.gather(
                *(generator.sample(p, s) for p, s in zip(token_lists, params, strict=True))
            )
            return time.perf_counter() - started, sum(len(r.tokens) for r in results)

    asyncio.run(sample(4))  # warm-up: kernel choice, the oneDNN probe, first allocations
    seconds, sampled = asyncio.run(sample(new_tokens))
    print(json.dumps({"seconds": seconds, "tokens": sampled}), flush=True)


def neighbour() -> None:
    """Train the embedded model on a fixed batch until killed: a busy process using every core."""
    import torch

    from cookbook_lib.runtime.cpu_share import fit_threads
    from cookbook_lib.runtime.models import load_model

    model = load_model()
    model.train()
    optimizer = torch.optim.SGD(model.parameters(), lr=1e-6)
    batch = torch.randint(0, 1000, (2, 256), generator=torch.Generator().manual_seed(0))
    announced = False
    while True:
        fit_threads(torch.device("cpu"))  # as the trainer does before each micro-batch
        loss = model(input_ids=batch, labels=batch).loss
        loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        if not announced:
            print(READY, flush=True)
            announced = True


def _environment(setting: str) -> dict[str, str]:
    settings = ("OMP_WAIT_POLICY", "GOMP_SPINCOUNT", "COOKBOOK_FIT_THREADS")
    env = {k: v for k, v in os.environ.items() if k not in settings}
    env["PYTHONPATH"] = str(REPO) + os.pathsep + env.get("PYTHONPATH", "")
    env["TQDM_DISABLE"] = "1"
    if setting != "defaults":
        for assignment in setting.split(","):
            name, _, value = assignment.partition("=")
            env[name.strip()] = value.strip()
    return env


def _run_evaluation(env: dict[str, str], prompts: int, new_tokens: int) -> float:
    """Seconds per sampled token of one fresh evaluation process."""
    command = [sys.executable, __file__, "--role", "evaluation", "--prompts", str(prompts)]
    command += ["--new-tokens", str(new_tokens)]
    out = subprocess.run(command, env=env, capture_output=True, text=True, check=True).stdout
    result = json.loads(out.strip().splitlines()[-1])
    return result["seconds"] / result["tokens"]


def _beside_neighbour(env: dict[str, str], prompts: int, new_tokens: int, neighbour_fits: bool) -> float:
    command = [sys.executable, __file__, "--role", "neighbour"]
    neighbour_env = env if neighbour_fits else {**env, "COOKBOOK_FIT_THREADS": "0"}
    process = subprocess.Popen(
        command, env=neighbour_env, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True
    )
    try:
        assert process.stdout is not None
        line = process.stdout.readline()
        if READY not in line:
            raise RuntimeError(f"the neighbour process did not start: {line!r}")
        return _run_evaluation(env, prompts, new_tokens)
    finally:
        process.kill()
        process.wait()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--role", choices=["bench", "evaluation", "neighbour"], default="bench")
    parser.add_argument("--prompts", type=int, default=16)
    parser.add_argument("--new-tokens", type=int, default=48)
    parser.add_argument("--rounds", type=int, default=2, help="alone/beside pairs per arm (the best is kept)")
    parser.add_argument("--quick", action="store_true", help="24 tokens a row, one round")
    parser.add_argument(
        "--settings",
        nargs="*",
        default=[
            "COOKBOOK_FIT_THREADS=0",
            "COOKBOOK_FIT_THREADS=0,GOMP_SPINCOUNT=10000",
            "COOKBOOK_FIT_THREADS=0,OMP_WAIT_POLICY=PASSIVE",
            "defaults",
        ],
        help="arms: defaults (none set) or NAME=VALUE,...; the first is the baseline",
    )
    parser.add_argument(
        "--neighbour",
        choices=["same", "fixed"],
        default="same",
        help="the neighbour's setting: the arm's (same), or torch's fixed team whatever the arm (fixed:"
        " a process that never yields a core)",
    )
    args = parser.parse_args()
    if args.role == "evaluation":
        return evaluation(args.prompts, args.new_tokens)
    if args.role == "neighbour":
        return neighbour()
    if args.quick:
        args.new_tokens, args.rounds = 24, 1

    print(
        f"{args.prompts} prompts x {args.new_tokens} sampled tokens, {os.cpu_count()} CPUs,"
        f" best of {args.rounds}, the neighbour's threads: {args.neighbour}"
    )
    print(
        f"{'setting':<46} {'alone ms/tok':>12} {'beside ms/tok':>14} {'beside/alone':>13} {'alone/first':>15}"
    )
    baseline_alone: float | None = None
    for setting in args.settings:
        env = _environment(setting)
        alone = min(_run_evaluation(env, args.prompts, args.new_tokens) for _ in range(args.rounds))
        beside = min(
            _beside_neighbour(env, args.prompts, args.new_tokens, args.neighbour == "same")
            for _ in range(args.rounds)
        )
        baseline_alone = baseline_alone or alone
        print(
            f"{setting:<46} {1000 * alone:>12.1f} {1000 * beside:>14.1f} {beside / alone:>12.2f}x"
            f" {alone / baseline_alone:>14.2f}x",
            flush=True,
        )


if __name__ == "__main__":
    main()
