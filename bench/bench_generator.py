"""Generation throughput on the embedded model: ways to sample the same prompts, side by side in one run.

    python bench/bench_generator.py            # 16 chat prompts x 64 new tokens
    python bench/bench_generator.py --quick    # 8 prompts x 16 new tokens

Methods (sampling at temperature 1, no early stop, so every method produces the same number of
tokens and tokens/s compare directly):
  (a) one ``model.generate`` call per prompt, one after another: what a naive rollout loop does;
  (b) one left-padded batched ``model.generate`` of all prompts;
  (c) transformers' continuous batching, ``model.generate_batch``;
  (d) ``HFGenerator`` with every prompt as a concurrent asyncio request;
  (e) a multi-turn-shaped load: each prompt is a client sending two requests in a row with
      long-tailed lengths, served by ``HFGenerator`` with continuous batching (finished rows are
      replaced mid-batch) and with static batching (new requests wait for the batch to end).
Timings on a shared CPU are noisy: compare the ratios of one run, not numbers across runs.
"""

from __future__ import annotations

import argparse
import asyncio
import random
import time
from collections.abc import Callable

import torch
from transformers import GenerationConfig

from cookbook_lib.generators import HFGenerator, SamplingParams
from cookbook_lib.models import load_model, load_tokenizer

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


def hf_generator(model, prompts: list[list[int]], new_tokens: int, pad_token_id: int) -> int:
    params = SamplingParams(temperature=1.0, max_tokens=new_tokens)

    async def main() -> int:
        async with HFGenerator(model, pad_token_id=pad_token_id) as generator:
            results = await asyncio.gather(*(generator.sample(prompt, params) for prompt in prompts))
        return sum(len(result.tokens) for result in results)

    return asyncio.run(main())


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


def timed(run: Callable[[], int]) -> tuple[float, int]:
    torch.manual_seed(0)
    start = time.perf_counter()
    tokens = run()
    return time.perf_counter() - start, tokens


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--quick", action="store_true", help="8 prompts x 16 new tokens")
    args = parser.parse_args()
    count, new_tokens = (8, 16) if args.quick else (16, 64)

    model, tokenizer = load_model(), load_tokenizer()
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


if __name__ == "__main__":
    main()
