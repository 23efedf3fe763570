"""A trainer's first update on the embedded model: weights left in their mapped file against copied out.

    python bench/bench_first_update.py               # 3 rounds of both arms, a fresh process each
    python bench/bench_first_update.py --rounds 1

transformers maps the safetensors file and the loaded weights point into it; the first optimizer
step writes every weight, and each page then faults as copy-on-write with a TLB flush on every CPU
(``cookbook_lib/runtime/file_mapped.py``). ``PolicyTrainer`` now copies its trainable weights out
first. Each arm loads the model, builds the trainer in the precision ``dtype="auto"`` picks here and
takes one SFT step of four 300-token sequences, in a fresh process (a process maps the file once);
the bench prints the trainer's construction and that step's system time, minor faults and wall
time, their medians and the ratios. Timings on a shared CPU are noisy: compare the ratios of one run.
"""

from __future__ import annotations

import argparse
import json
import resource
import statistics
import subprocess
import sys
import time

ARMS = {"left in the file (before)": "left", "copied out (now)": "copied"}


def one_arm(arm: str) -> dict[str, float]:
    """Runs in the child process: the trainer's construction and first step, measured."""
    import cookbook_lib.grpo.trainer as trainer_module
    from cookbook_lib.rollout.episode import TokenSequence
    from cookbook_lib.runtime.devices import resolve_precision
    from cookbook_lib.runtime.models import load_model, load_tokenizer

    if arm == "left":
        trainer_module.copy_file_mapped_parameters = lambda model: 0
    tokenizer = load_tokenizer()
    precision = resolve_precision("cpu", "auto")
    model = load_model(dtype=precision.master_dtype)
    sequences = [
        TokenSequence(
            tokens_T=list(range(100 + i, 400 + i)),
            assistant_mask_T=[False] * 200 + [True] * 100,
            sampling_logprobs_T=[0.0] * 300,
            policy_versions_T=[0] * 300,
        )
        for i in range(4)
    ]
    before, started = resource.getrusage(resource.RUSAGE_SELF), time.perf_counter()
    trainer = trainer_module.PolicyTrainer(
        model,
        pad_token_id=tokenizer.pad_token_id,
        learning_rate=1e-5,
        precision=precision,
        activation_checkpointing=True,
    )
    trainer.sft_step(sequences)
    after, elapsed = resource.getrusage(resource.RUSAGE_SELF), time.perf_counter() - started
    return {
        "wall_s": elapsed,
        "system_s": after.ru_stime - before.ru_stime,
        "user_s": after.ru_utime - before.ru_utime,
        "minor_faults": float(after.ru_minflt - before.ru_minflt),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--arm", choices=sorted(ARMS.values()), help=argparse.SUPPRESS)  # the child's
    args = parser.parse_args()
    if args.arm:
        print(json.dumps(one_arm(args.arm)))
        return
    results: dict[str, list[dict[str, float]]] = {name: [] for name in ARMS}
    for _ in range(args.rounds):
        for name, arm in ARMS.items():
            child = subprocess.run(
                [sys.executable, __file__, "--arm", arm], capture_output=True, text=True, check=True
            )
            results[name].append(json.loads(child.stdout.strip().splitlines()[-1]))
            row = results[name][-1]
            print(f"  {name}: system {row['system_s']:.2f} s, wall {row['wall_s']:.2f} s", flush=True)
    fields = ("wall_s", "user_s", "system_s", "minor_faults")
    medians = {
        name: {field: statistics.median(row[field] for row in rows) for field in fields}
        for name, rows in results.items()
    }
    print(f"\n| arm | {' | '.join(fields)} |\n| --- |{' ---: |' * len(fields)}")
    for name, row in medians.items():
        print(f"| {name} | " + " | ".join(f"{row[f]:.4g}" for f in fields) + " |")
    old, new = (medians[name] for name in ARMS)
    print(
        f"\ncopied out / left in the file: system time {new['system_s'] / old['system_s']:.2f}x, "
        f"wall {new['wall_s'] / old['wall_s']:.2f}x, "
        f"minor faults {new['minor_faults'] / old['minor_faults']:.2f}x"
    )


if __name__ == "__main__":
    main()
