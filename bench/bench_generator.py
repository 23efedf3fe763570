"""Generation throughput on the embedded model: ways to sample the same prompts, side by side in one run.

    python bench/bench_generator.py                  # 16 chat prompts x 64 new tokens, then (f)
    python bench/bench_generator.py --quick          # 8 prompts x 16 new tokens, then a smaller (f)
    python bench/bench_generator.py --prefix-only    # (f) alone

Methods (sampling at temperature 1, no early stop, so every method produces the same number of
tokens and tokens/s compare directly):
  (a) one ``model.generate`` call per prompt, one after another: what a naive rollout loop does;
  (b) one left-padded batched ``model.generate`` of all prompts;
  (c) transformers' continuous batching, ``model.generate_batch``;
  (d) ``HFGenerator`` with every prompt as a concurrent asyncio request;
  (e) a multi-turn-shaped load: each prompt is a client sending two requests in a row with
      long-tailed lengths, served by ``HFGenerator`` with continuous batching (finished rows are
      replaced mid-batch) and with static batching (new requests wait for the batch to end).
Then (f), prefix reuse: concurrent multi-turn clients, each turn's prompt the previous prompt +
its 16 sampled tokens + ~35 tokens of tool result (~450 tokens at the first turn), served by
``HFGenerator`` with the prefix cache off and on. Seeded, so both arms sample the same tokens;
it prints wall time, prefill tokens fed and reused, and the ratios.
Timings on a shared CPU are noisy: compare the ratios of one run, not numbers across runs.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import random
import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass

import torch
from transformers import GenerationConfig

from cookbook_lib.generators import HFGenerator, SamplingParams
from cookbook_lib.runtime.devices import resolve_precision, sampling_copy
from cookbook_lib.runtime.models import load_model, load_tokenizer
from cookbook_lib.runtime.packed_linear import SWITCH_VARIABLE

QUESTIONS = [
    "What is the capital of France?",
    "Give me three tips for sleeping well.",
    "Explain photosynthesis in one sentence.",
    "What is 17 times 23?",
    "Write a haiku about autumn.",
    "Why is the sky blue?",
    "Name two prime numbers greater than 50.",
    "How do I boil an egg?",
    "Translate 'good morning' into Spanish.",
    "What does a CPU do?",
    "Suggest a name for a grey cat.",
    "Summarise the plot of Cinderella.",
    "What is the boiling point of water in Fahrenheit?",
    "List three fruits that are red.",
    "How many legs does a spider have?",
    "What is a good first programming language?",
]


def chat_prompts(tokenizer, count: int) -> list[list[int]]:
    prompts = []
    for question in (QUESTIONS * 2)[:count]:
        ids = tokenizer.apply_chat_template(
            [{"role": "user", "content": question}], add_generation_prompt=True, tokenize=True
        )
        prompts.append(list(ids["input_ids"]) if hasattr(ids, "keys") else list(ids))
    return prompts


def sampling_config(new_tokens: int, pad_token_id: int) -> GenerationConfig:
    # eos_token_id=None: no early stop, so each method samples exactly new_tokens per prompt.
    return GenerationConfig(
        do_sample=True,
        temperature=1.0,
        top_p=1.0,
        top_k=0,
        max_new_tokens=new_tokens,
        min_new_tokens=new_tokens,
        eos_token_id=None,
        pad_token_id=pad_token_id,
    )


def one_at_a_time(model, prompts: list[list[int]], config: GenerationConfig) -> int:
    tokens = 0
    for prompt in prompts:
        ids = torch.tensor([prompt])
        output = model.generate(ids, attention_mask=torch.ones_like(ids), generation_config=config)
        tokens += output.shape[1] - ids.shape[1]
    return tokens


def padded_batch(model, prompts: list[list[int]], config: GenerationConfig) -> int:
    width = max(map(len, prompts))
    ids = torch.full((len(prompts), width), config.pad_token_id)
    mask = torch.zeros_like(ids)
    for i, prompt in enumerate(prompts):
        ids[i, width - len(prompt) :] = torch.tensor(prompt)
        mask[i, width - len(prompt) :] = 1
    output = model.generate(ids, attention_mask=mask, generation_config=config)
    return (output.shape[1] - width) * len(prompts)


def transformers_generate_batch(model, prompts: list[list[int]], config: GenerationConfig) -> int:
    outputs = model.generate_batch(inputs=prompts, generation_config=config, progress_bar=False)
    return sum(len(output.generated_tokens) for output in outputs.values())


def hf_generator(
    model, prompts: list[list[int]], new_tokens: int, pad_token_id: int, *, pack_weights: bool = False
) -> int:
    params = SamplingParams(temperature=1.0, max_tokens=new_tokens)

    async def main() -> int:
        async with HFGenerator(model, pad_token_id=pad_token_id, pack_weights=pack_weights) as generator:
            results = await asyncio.gather(*(generator.sample(prompt, params) for prompt in prompts))
        return sum(len(result.tokens) for result in results)

    return asyncio.run(main())


def unpacked(run: Callable[[], int]) -> int:
    """``run`` with packing off (``COOKBOOK_PACK_LINEARS=0``): a shared model's routed layers then
    call oneDNN on the plain weights, as before they were packed while sampling."""
    before = os.environ.get(SWITCH_VARIABLE)
    os.environ[SWITCH_VARIABLE] = "0"
    try:
        return run()
    finally:
        if before is None:
            del os.environ[SWITCH_VARIABLE]
        else:
            os.environ[SWITCH_VARIABLE] = before


def decode_target(model, prompts: list[list[int]], new_tokens: int, pad_token_id: int, rounds: int) -> None:
    """Issue 20's decode target: what a run samples with now against a float32 padded ``generate``.

    The run's sampling copy is ``devices.sampling_copy`` in the dtype ``dtype="auto"`` picks on this
    CPU (bf16 where its bf16 matmuls measure >= 2x float32), with its linears packed as a run's own
    copy is; a fresh copy each round, since packing replaces its layers.
    """
    precision = resolve_precision("cpu", "auto")
    dtype = str(precision.sample_dtype).removeprefix("torch.")
    config = sampling_config(new_tokens, pad_token_id)
    arms: dict[str, Callable[[], int]] = {
        "generate, padded batch, float32 (baseline)": lambda: padded_batch(model, prompts, config),
        "HFGenerator, float32, shared model, plain weights": lambda: unpacked(
            lambda: hf_generator(model, prompts, new_tokens, pad_token_id)
        ),
        "HFGenerator, float32, shared model": lambda: hf_generator(model, prompts, new_tokens, pad_token_id),
        f"HFGenerator, sampling copy ({dtype}), packed": lambda: hf_generator(
            sampling_copy(model, precision), prompts, new_tokens, pad_token_id, pack_weights=True
        ),
    }
    print(f"\n(g) decode target: {len(prompts)} prompts x {new_tokens} new tokens, {rounds} rounds")
    rates: dict[str, list[float]] = {name: [] for name in arms}
    for _ in range(rounds):
        for name, run in arms.items():
            seconds, tokens = timed(run)
            rates[name].append(tokens / seconds)
        print("  " + " | ".join(f"{rate[-1]:.1f}" for rate in rates.values()))
    base = statistics.median(next(iter(rates.values())))
    for name, rate in rates.items():
        median = statistics.median(rate)
        print(f"{name:58} {median:7.1f} tok/s  {median / base:5.2f}x")


def two_turn_clients(
    model, prompts: list[list[int]], new_tokens: int, pad_token_id: int, continuous: bool
) -> int:
    """Each client samples a turn, then a second one from its prompt + first answer (lengths long-tailed)."""
    lengths = random.Random(0).choices(range(new_tokens // 4, new_tokens + 1), k=2 * len(prompts))

    async def client(generator: HFGenerator, index: int, prompt: list[int]) -> int:
        first = await generator.sample(prompt, SamplingParams(max_tokens=lengths[2 * index]))
        second = await generator.sample(
            prompt + first.tokens, SamplingParams(max_tokens=lengths[2 * index + 1])
        )
        return len(first.tokens) + len(second.tokens)

    async def main() -> int:
        async with HFGenerator(model, pad_token_id=pad_token_id, continuous_batching=continuous) as generator:
            counts = await asyncio.gather(*(client(generator, i, p) for i, p in enumerate(prompts)))
        return sum(counts)

    return asyncio.run(main())


TOOLS = ["calculator", "weather", "search", "calendar", "translate", "convert_units", "stock_price"]


def tool_use_prompts(tokenizer, count: int) -> list[list[int]]:
    """First-turn prompts of a tool-use agent: a long shared system prompt, then one question each."""
    lines = [
        "You are a careful assistant that solves tasks by calling tools. Call one tool at a time, read "
        "its result, then either call another tool or give the final answer. Available tools:"
    ]
    for i, name in enumerate(TOOLS):
        lines.append(
            f"- {name}(query: string, limit: integer = {i + 3}): looks up {name.replace('_', ' ')} "
            "information for the query and returns at most `limit` results as a JSON list of objects "
            "with the fields `title`, `value` and `source`."
        )
    lines.append("Answer in one short sentence once you know the answer.")
    system = "\n".join(lines)
    prompts = []
    for question in (QUESTIONS * 2)[:count]:
        messages = [{"role": "system", "content": system}, {"role": "user", "content": question}]
        ids = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True)
        prompts.append(list(ids["input_ids"]) if hasattr(ids, "keys") else list(ids))
    return prompts


def tool_result(tokenizer, client: int, turn: int) -> list[int]:
    """What a multi-turn prompt appends after the sampled tokens: end of turn, tool result, next turn."""
    value = 391 * (client + 1) + turn
    return tokenizer.encode(
        f'<|im_end|>\n<|im_start|>user\n<tool_response>{{"title": "result {turn}", "value": {value}}}'
        "</tool_response><|im_end|>\n<|im_start|>assistant\n"
    )


@dataclass
class MultiTurnRun:
    seconds: float
    sampled_tokens: int
    prefill_tokens: int
    reused_tokens: int
    samples: list[list[list[int]]]  # client -> turn -> sampled tokens


def multi_turn_clients(
    model, tokenizer, prompts: list[list[int]], turns: int, new_tokens: int, prefix_cache: bool
) -> MultiTurnRun:
    """Each client plays ``turns`` turns token-exactly; every sample seeded, no early stop."""

    async def client(generator: HFGenerator, index: int, prompt: list[int]) -> list[list[int]]:
        sampled = []
        for turn in range(turns):
            params = SamplingParams(temperature=1.0, max_tokens=new_tokens, seed=1000 * index + turn)
            result = await generator.sample(prompt, params)
            sampled.append(result.tokens)
            prompt = prompt + result.tokens + tool_result(tokenizer, index, turn)
        return sampled

    async def main() -> MultiTurnRun:
        entries = 64 if prefix_cache else 0
        start = time.perf_counter()
        async with HFGenerator(
            model, pad_token_id=tokenizer.pad_token_id, prefix_cache_entries=entries
        ) as generator:
            samples = await asyncio.gather(*(client(generator, i, p) for i, p in enumerate(prompts)))
        stats = generator.stats
        seconds = time.perf_counter() - start
        return MultiTurnRun(seconds, stats.tokens_sampled, stats.prefill_tokens, stats.reused_tokens, samples)

    return asyncio.run(main())


def prefix_reuse(model, tokenizer, clients: int, turns: int, new_tokens: int, repeats: int) -> None:
    prompts = tool_use_prompts(tokenizer, clients)
    print(
        f"\n(f) prefix reuse: {clients} clients x {turns} turns, first prompts "
        f"{min(map(len, prompts))}-{max(map(len, prompts))} tokens, +{new_tokens} sampled "
        f"+~{len(tool_result(tokenizer, 0, 0))} tool-result tokens per turn"
    )
    print(f"{'prefix cache':14} {'seconds':>8} {'prefill tokens':>15} {'reused tokens':>14} {'sampled':>8}")
    runs: dict[bool, list[MultiTurnRun]] = {False: [], True: []}
    for _ in range(repeats):
        for enabled in (False, True):  # alternated, so drifting machine load hits both arms alike
            result = multi_turn_clients(model, tokenizer, prompts, turns, new_tokens, enabled)
            runs[enabled].append(result)
            print(
                f"{'on' if enabled else 'off':14} {result.seconds:8.2f} {result.prefill_tokens:15d} "
                f"{result.reused_tokens:14d} {result.sampled_tokens:8d}"
            )
    off, on = runs[False][-1], runs[True][-1]
    best_off, best_on = min(r.seconds for r in runs[False]), min(r.seconds for r in runs[True])
    print(
        f"best wall time off/on: {best_off / best_on:.2f}x; prefill tokens off/on: "
        f"{off.prefill_tokens / on.prefill_tokens:.2f}x"
    )
    # Seeded samples agree unless float rounding (which differs with each batch's make-up, cache
    # or not) moves a token boundary past the row's uniform draw; a flipped turn changes the
    # prompts of that client's later turns. Repeats show the same noise between two "off" runs.
    print(f"turns sampled identically, off vs on: {_same_turns(off, on)}/{clients * turns}", end="")
    if repeats > 1:
        print(f"; off vs off: {_same_turns(runs[False][0], runs[False][1])}/{clients * turns}", end="")
    print()


def _same_turns(first: MultiTurnRun, second: MultiTurnRun) -> int:
    pairs = zip(first.samples, second.samples, strict=True)
    return sum(a == b for x, y in pairs for a, b in zip(x, y, strict=True))


def timed(run: Callable[[], int]) -> tuple[float, int]:
    torch.manual_seed(0)
    start = time.perf_counter()
    tokens = run()
    return time.perf_counter() - start, tokens


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument(
        "--quick", action="store_true", help="8 prompts x 16 new tokens; (f) 8 clients x 3 turns"
    )
    parser.add_argument("--prefix-only", action="store_true", help="run (f), prefix reuse, alone")
    parser.add_argument("--repeats", type=int, default=1, help="times to run each arm of (f)")
    parser.add_argument("--decode-only", action="store_true", help="run (g), the decode target, alone")
    parser.add_argument("--rounds", type=int, default=3, help="rounds of (g)")
    args = parser.parse_args()
    count, new_tokens = (8, 16) if args.quick else (16, 64)

    model, tokenizer = load_model(), load_tokenizer()
    if args.decode_only:
        prompts = chat_prompts(tokenizer, count)
        one_at_a_time(model, prompts[:1], sampling_config(4, tokenizer.pad_token_id))
        decode_target(model, prompts, new_tokens, tokenizer.pad_token_id, args.rounds)
        return
    if args.prefix_only:
        one_at_a_time(model, chat_prompts(tokenizer, 1), sampling_config(4, tokenizer.pad_token_id))
        prefix_reuse(model, tokenizer, 8 if args.quick else 16, 3 if args.quick else 4, 16, args.repeats)
        return
    pad = tokenizer.pad_token_id
    prompts = chat_prompts(tokenizer, count)
    config = sampling_config(new_tokens, pad)
    print(
        f"{count} prompts ({min(map(len, prompts))}-{max(map(len, prompts))} tokens), "
        f"{new_tokens} new tokens, "
        f"torch threads {torch.get_num_threads()}"
    )
    one_at_a_time(model, prompts[:1], sampling_config(4, pad))  # warm-up: first calls pay one-off costs

    methods: list[tuple[str, Callable[[], int]]] = [
        ("(a) generate, one prompt at a time", lambda: one_at_a_time(model, prompts, config)),
        ("(b) generate, one padded batch", lambda: padded_batch(model, prompts, config)),
        ("(c) transformers generate_batch", lambda: transformers_generate_batch(model, prompts, config)),
        ("(d) HFGenerator, concurrent requests", lambda: hf_generator(model, prompts, new_tokens, pad)),
        (
            "(e) HFGenerator two-turn clients, continuous",
            lambda: two_turn_clients(model, prompts, new_tokens, pad, continuous=True),
        ),
        (
            "(e) HFGenerator two-turn clients, static",
            lambda: two_turn_clients(model, prompts, new_tokens, pad, continuous=False),
        ),
    ]
    baseline = None
    print(f"{'method':48} {'tokens':>7} {'seconds':>8} {'tokens/s':>9} {'vs (a)':>7}")
    for name, run in methods:
        try:
            seconds, tokens = timed(run)
        except Exception as exc:  # generate_batch may not run on every setup; say so and go on
            print(f"{name:48} failed: {type(exc).__name__}: {exc}")
            continue
        rate = tokens / seconds
        baseline = baseline or rate
        print(f"{name:48} {tokens:7d} {seconds:8.2f} {rate:9.1f} {rate / baseline:6.2f}x")
    prefix_reuse(model, tokenizer, 8 if args.quick else 16, 3 if args.quick else 4, 16, args.repeats)
    decode_target(model, prompts, new_tokens, pad, args.rounds)


if __name__ == "__main__":
    main()
