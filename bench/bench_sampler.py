"""Whole replies from our sampler against ``transformers``' ``generate``: the same distribution?

    python bench/bench_sampler.py [--model runs/bench_trl/prepare/warm_start_model] [--replies 256]

Our generator's per-token checks (log-probs equal the trainer's; first-token frequencies equal the
softmax: ``tests/test_generators.py``) do not show that a whole reply, sampled token after token
through its KV cache, prefix cache and batching, comes from the model's distribution. This bench
samples ``--replies`` first replies of the tool-use game's tier-1 tasks (``bench_trl.py``'s work) at
temperature 1 from the same model on both samplers, ours (``HFGenerator``, as a GRPO step samples)
and ``transformers``' ``generate`` (as TRL 1.16 samples: ``do_sample``, temperature 1, top-k and top-p
off), each task's prompt rendered by our codec, and prints, for each side:

- the reply's log-prob under the model, scored afresh by one forward of prompt and reply: samplers of
  one distribution give the same mean (Welch's t, normal approximation);
- what the reply does: its first tool call (``lookup`` by whether its key is one of the task's facts),
  an answer, or a reply that does not parse; the two sides' shares compared by their total variation
  distance, with a permutation test (the sides' labels shuffled 2,000 times) for how often chance
  gives a distance as large.

Ours runs first, then ``generate``; each prints its time (not a benchmark of either: ``generate``
pads a batch of 16 and runs it to its longest reply).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import copy
import json
import math
import random
import statistics
import sys
import time
from collections import Counter
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "bench"))
from bench_trl import MAX_TOKENS_PER_TURN, WORK_DIR, tier1_tasks  # noqa: E402

BATCH = 16  # generate's batch; ours takes every request at once and batches them itself
PERMUTATIONS = 2_000


def first_prompts(codec, tasks: list) -> list[list[int]]:
    """Each task's first prompt as our rollout renders it."""
    from envs.tool_use_game import ToolUseGameEnv

    async def render(task) -> list[int]:
        env = ToolUseGameEnv()
        messages = await env.reset(task)
        return codec.render_prompt(messages, env.tool_specs)

    return [asyncio.run(render(task)) for task in tasks]


def sample_ours(
    model, pad_token_id: int, prompts: list[list[int]], stop: list[int], seed: int
) -> list[list[int]]:
    from cookbook_lib.generators import HFGenerator, SamplingParams

    generator = HFGenerator(copy.deepcopy(model), pad_token_id=pad_token_id)

    async def run() -> list[list[int]]:
        async with generator:
            requests = [
                generator.sample(
                    prompt,
                    SamplingParams(
                        temperature=1.0, max_tokens=MAX_TOKENS_PER_TURN, stop_token_ids=stop, seed=seed + i
                    ),
                )
                for i, prompt in enumerate(prompts)
            ]
            return [result.tokens for result in await asyncio.gather(*requests)]

    return asyncio.run(run())


def sample_generate(
    model, pad_token_id: int, prompts: list[list[int]], stop: list[int], seed: int
) -> list[list[int]]:
    """``generate`` as TRL calls it, a batch of 16 left-padded prompts at a time; each reply cut after
    its first stop token."""
    torch.manual_seed(seed)
    replies: list[list[int]] = []
    for start in range(0, len(prompts), BATCH):
        batch = prompts[start : start + BATCH]
        width = max(map(len, batch))
        ids = torch.tensor([[pad_token_id] * (width - len(p)) + p for p in batch])
        mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in batch])
        with torch.inference_mode():
            out = model.generate(
                input_ids=ids, attention_mask=mask, do_sample=True, temperature=1.0, top_k=0, top_p=1.0,
                max_new_tokens=MAX_TOKENS_PER_TURN, eos_token_id=stop, pad_token_id=pad_token_id,
                disable_compile=True,
            )  # fmt: skip
        for row in out[:, width:].tolist():
            cut = next((i + 1 for i, token in enumerate(row) if token in stop), len(row))
            replies.append(row[:cut])
    return replies


def reply_logprob(model, prompt: list[int], reply: list[int]) -> float:
    with torch.inference_mode():
        logits = model(input_ids=torch.tensor([prompt + reply])).logits[0, len(prompt) - 1 : -1].float()
    logprobs = torch.log_softmax(logits, -1).gather(-1, torch.tensor(reply)[:, None])
    return float(logprobs.sum())


def what_it_does(codec, reply: list[int], tool_specs, facts: dict) -> str:
    """The reply's kind: its first tool call (``lookup`` by whether its key is one of the task's
    facts), an answer, or a reply that does not parse; ``+`` when it makes more than one call."""
    parsed = codec.parse(reply, tool_specs)
    if not parsed.ok:
        return "does not parse"
    calls = parsed.message.get("tool_calls") or []
    if not calls:
        return "answers"
    function = calls[0]["function"]
    name = str(function.get("name"))
    if name == "lookup":
        arguments = function.get("arguments", "")
        with contextlib.suppress(json.JSONDecodeError, TypeError):
            arguments = json.loads(arguments) if isinstance(arguments, str) else arguments
        key = arguments.get("key") if isinstance(arguments, dict) else None
        name = "lookup, no key" if key is None else f"lookup, {'a' if key in facts else 'an unknown'} key"
    return name + (" +" if len(calls) > 1 else "")


def total_variation(a: list[str], b: list[str]) -> float:
    ca, cb = Counter(a), Counter(b)
    return 0.5 * sum(abs(ca[k] / len(a) - cb[k] / len(b)) for k in set(ca) | set(cb))


def permutation_p(a: list[str], b: list[str], rng: random.Random) -> float:
    observed = total_variation(a, b)
    pooled = a + b
    hits = 0
    for _ in range(PERMUTATIONS):
        rng.shuffle(pooled)
        hits += total_variation(pooled[: len(a)], pooled[len(a) :]) >= observed - 1e-12
    return (hits + 1) / (PERMUTATIONS + 1)


def welch(a: list[float], b: list[float]) -> tuple[float, float]:
    """Welch's t and its two-sided p (normal approximation: hundreds of replies a side)."""
    se = math.sqrt(statistics.variance(a) / len(a) + statistics.variance(b) / len(b))
    t = (statistics.mean(a) - statistics.mean(b)) / se
    return t, math.erfc(abs(t) / math.sqrt(2))


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", type=Path, default=WORK_DIR / "prepare" / "warm_start_model")
    parser.add_argument("--replies", type=int, default=256)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)
    if not (args.model / "config.json").is_file():
        raise SystemExit(f"no model in {args.model}: run `python bench/bench_trl.py --side=prepare` first")
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from cookbook_lib.codecs import make_codec
    from cookbook_lib.runtime.quiet import quiet_libraries
    from envs.tool_use_game import ToolUseGameEnv

    with quiet_libraries():
        tokenizer = AutoTokenizer.from_pretrained(args.model)
        model = AutoModelForCausalLM.from_pretrained(args.model, dtype=torch.float32).eval()
        codec = make_codec(tokenizer)
        tasks = tier1_tasks()
        prompts = first_prompts(codec, tasks)
        which = [random.Random(args.seed + i).randrange(len(prompts)) for i in range(args.replies)]
        asked = [prompts[i] for i in which]
        stop = list(codec.stop_token_ids)
        tool_specs = ToolUseGameEnv().tool_specs
        pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else stop[0]
        print(
            f"{args.replies} first replies over {len(tasks)} tier-1 tasks, at most {MAX_TOKENS_PER_TURN} "
            f"tokens, temperature 1, {args.model.name}",
            flush=True,
        )
        sides: dict[str, list[list[int]]] = {}
        for name, sampler in (("ours", sample_ours), ("generate", sample_generate)):
            started = time.perf_counter()
            sides[name] = sampler(model, pad, asked, stop, args.seed)
            print(f"  {name}: sampled in {time.perf_counter() - started:.0f} s", flush=True)
        scores = {
            name: [reply_logprob(model, p, r) for p, r in zip(asked, replies, strict=True)]
            for name, replies in sides.items()
        }
    facts = [tasks[i].metadata["facts"] for i in which]
    kinds = {
        name: [what_it_does(codec, r, tool_specs, f) for r, f in zip(replies, facts, strict=True)]
        for name, replies in sides.items()
    }
    for name in sides:
        lengths = [len(r) for r in sides[name]]
        cut = sum(1 for r in sides[name] if r[-1] not in stop)
        mean, sd = statistics.mean(scores[name]), statistics.stdev(scores[name])
        tokens = statistics.mean(lengths)
        print(f"\n{name}: reply log-prob mean {mean:.3f} (sd {sd:.3f}), {tokens:.1f} tokens, {cut} cut")
        for kind, count in Counter(kinds[name]).most_common(8):
            print(f"  {count / len(kinds[name]):6.3f}  {kind}")
    t, p = welch(scores["ours"], scores["generate"])
    difference = statistics.mean(scores["ours"]) - statistics.mean(scores["generate"])
    tv = total_variation(kinds["ours"], kinds["generate"])
    p_tv = permutation_p(kinds["ours"], kinds["generate"], random.Random(args.seed))
    print(f"\nreply log-prob, ours - generate: {difference:+.3f} (Welch t {t:+.2f}, p {p:.2f})")
    print(f"what the replies do: total variation {tv:.3f} between the sides (permutation p {p_tv:.3f})")


if __name__ == "__main__":
    main()
