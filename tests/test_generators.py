"""The generator interface and the batching transformers backend.

Every test runs twice, once per decode path of ``HFGenerator``: the growing cache (the CPU
default) and the fixed-shape slots (the CUDA default, ``slot_batch.py``; eager on a CPU, so what
is checked here is its cache layout, masks and bookkeeping, not the graphs).

Most tests use a tiny random model whose weights are redrawn with a larger spread: the default
initialisation gives near-uniform next-token distributions and greedy paths that repeat one
token, which would let wrong padding or positions go unnoticed.
"""

from __future__ import annotations

import asyncio
import copy
import math
import threading

import pytest
import torch
from reply_logprobs import chosen_logprobs, forward_logprobs

from cookbook_lib.generators import (
    GeneratorClosedError,
    HFGenerator,
    SampleResult,
    SamplingParams,
    StepInfo,
    kv_cache,
)
from cookbook_lib.generators import hf as hf_module
from cookbook_lib.generators.sampling import RowSampling, choose_tokens
from cookbook_lib.generators.slot_batch import fixed_shape_decode_supported as supported

TIMEOUT_S = 120  # only a guard against hangs; no test asserts how long anything takes


@pytest.fixture(autouse=True, params=["growing cache", "fixed-shape slots"])
def decode_path(request, monkeypatch):
    """Which decode path ``fixed_shape_decode=None`` picks in this test (a model that cannot use
    slots still gets the growing cache)."""
    fixed = request.param == "fixed-shape slots"
    monkeypatch.setattr(
        hf_module, "fixed_shape_by_default", lambda model, device: fixed and supported(model) is True
    )
    return request.param


@pytest.fixture(scope="module")
def model(sharp_model):
    return sharp_model


@pytest.fixture(scope="module")
def float64_model(sharp_model):
    """The same model in float64, for tests that compare seeded samples across batch compositions:
    in float32 a row's logits round differently in batches of different shapes (attention over
    caches laid out differently), and a draw within that rounding of a token boundary flips the
    token on rare runs (about 1 in 6 here). In float64 such a flip is some 1e9 times rarer."""
    return copy.deepcopy(sharp_model).double()


def run(coroutine):
    async def guarded():
        return await asyncio.wait_for(coroutine, TIMEOUT_S)

    return asyncio.run(guarded())


def generate_alone(model, prompt: list[int], max_new_tokens: int) -> list[int]:
    """The reference: transformers' own greedy generate on one unpadded prompt."""
    ids = torch.tensor([prompt])
    output = model.generate(
        ids,
        attention_mask=torch.ones_like(ids),
        max_new_tokens=max_new_tokens,
        do_sample=False,
        pad_token_id=2,
        eos_token_id=None,
    )
    return output[0, len(prompt) :].tolist()


# ---- SamplingParams and inputs -------------------------------------------------------------


@pytest.mark.parametrize(
    "kwargs",
    [
        {"temperature": -0.1},
        {"temperature": math.nan},
        {"top_p": 0.0},
        {"top_p": 1.5},
        {"max_tokens": 0},
        {"max_tokens": 2.5},
        {"stop_token_ids": [-1]},
        {"stop_token_ids": ["2"]},
        {"seed": "7"},
    ],
)
def test_bad_sampling_params_are_refused(kwargs):
    with pytest.raises(ValueError):
        SamplingParams(**kwargs)


def test_bad_prompts_and_results_are_refused(model):
    async def main():
        async with HFGenerator(model, pad_token_id=2) as generator:
            with pytest.raises(ValueError, match="empty"):
                await generator.sample([], SamplingParams())
            with pytest.raises(ValueError, match="vocabulary"):
                await generator.sample([10**7], SamplingParams())
            with pytest.raises(ValueError, match="does not have"):
                await generator.update_weights({"no.such.weight": torch.zeros(1)}, version=1)

    run(main())
    with pytest.raises(ValueError, match="misaligned"):
        SampleResult(tokens=[1, 2], logprobs=[0.0], finish_reason="length", policy_versions=[0, 0])


# ---- the sampler on its own ----------------------------------------------------------------


def test_choose_tokens_draws_from_the_tempered_nucleus():
    logits = torch.tensor([2.0, 1.0, 0.5, 0.0, -1.0])
    draws = 20_000
    generator = torch.Generator().manual_seed(0)
    uniforms = torch.rand(draws, generator=generator, dtype=torch.float64)
    for temperature, top_p in [(1.0, 1.0), (0.7, 1.0), (1.3, 0.8)]:
        rows = RowSampling(
            temperatures_B=torch.full((draws,), temperature),
            top_ps_B=torch.full((draws,), top_p),
            uniforms_B=uniforms,
        )
        tokens, logprobs = choose_tokens(logits.expand(draws, -1), rows)
        expected = torch.softmax(logits.double() / temperature, dim=-1)
        before = expected.cumsum(0) - expected
        expected = torch.where(before < top_p, expected, 0.0)
        expected = expected / expected.sum()
        observed = torch.bincount(tokens, minlength=5).double() / draws
        assert torch.allclose(observed, expected, atol=0.015), (temperature, top_p, observed, expected)
        assert torch.allclose(logprobs.double(), expected.log()[tokens], atol=1e-5)


@pytest.mark.parametrize("spread", [0.1, 4.0])  # flat: the nucleus needs the full sort; peaked: top-k
def test_nucleus_sampling_over_a_large_vocabulary(spread):
    rows, vocab, top_p = 32, 5000, 0.9
    generator = torch.Generator().manual_seed(1)
    logits = torch.randn(rows, vocab, generator=generator) * spread
    settings = RowSampling(
        temperatures_B=torch.full((rows,), 0.8),
        top_ps_B=torch.full((rows,), top_p),
        uniforms_B=torch.rand(rows, generator=generator, dtype=torch.float64),
    )
    tokens, logprobs = choose_tokens(logits, settings)
    reference = torch.log_softmax(logits.double() / 0.8, dim=-1)
    for row in range(rows):
        probs, order = reference[row].exp().sort(descending=True)
        inside = (probs.cumsum(0) - probs) < top_p
        assert tokens[row].item() in order[inside].tolist()
        expected = reference[row, tokens[row]] - probs[inside].sum().log()
        assert logprobs[row].item() == pytest.approx(expected.item(), abs=1e-4)


# ---- batching is invisible in the results --------------------------------------------------


def test_greedy_batched_equals_greedy_alone_for_prompts_of_different_lengths(model, prompts):
    params = SamplingParams(temperature=0, max_tokens=12)

    async def main():
        async with HFGenerator(model, pad_token_id=2) as generator:
            results = await asyncio.gather(*(generator.sample(p, params) for p in prompts))
            return results, generator.stats

    results, stats = run(main())
    assert stats.max_rows > 1  # they did share a batch
    for prompt, result in zip(prompts, results, strict=True):
        assert result.tokens == generate_alone(model, prompt, 12)
        assert result.finish_reason == "length"
        assert result.policy_versions == [0] * 12
        expected = forward_logprobs(model, prompt, result.tokens).max(dim=-1).values
        assert torch.allclose(torch.tensor(result.logprobs, dtype=torch.float64), expected, atol=1e-4)


def test_requests_admitted_into_a_running_batch_give_the_same_greedy_tokens(model, prompts):
    """Continuous batching: later requests are prefilled and merged while the first one decodes."""
    params = SamplingParams(temperature=0, max_tokens=16)
    reached, release = threading.Event(), threading.Event()

    def hold_at_step_four(info: StepInfo) -> None:
        if info.kind == "decode" and generator.stats.decode_steps == 4:
            reached.set()
            release.wait(TIMEOUT_S)

    async def main():
        first = asyncio.create_task(generator.sample(prompts[2], params))
        await asyncio.to_thread(reached.wait, TIMEOUT_S)
        later = [
            asyncio.create_task(generator.sample(p, params)) for p in (prompts[0], prompts[1], prompts[3])
        ]
        while generator.num_pending < 3:  # all three queued before the worker goes on
            await asyncio.sleep(0.001)
        release.set()
        results = await asyncio.gather(first, *later)
        await generator.close()
        return results

    generator = HFGenerator(model, pad_token_id=2, step_callback=hold_at_step_four)
    results = run(main())
    assert generator.stats.prefill_calls == 2 and generator.stats.max_rows == 4
    for prompt, result in zip([prompts[2], prompts[0], prompts[1], prompts[3]], results, strict=True):
        assert result.tokens == generate_alone(model, prompt, 16)


@pytest.mark.parametrize("temperature,top_p", [(1.0, 1.0), (0.6, 1.0), (1.5, 0.7)])
def test_logprobs_match_a_forward_pass_under_the_sampling_distribution(model, prompts, temperature, top_p):
    params = SamplingParams(temperature=temperature, top_p=top_p, max_tokens=20, seed=3)

    async def main():
        async with HFGenerator(model, pad_token_id=2) as generator:
            return await asyncio.gather(*(generator.sample(p, params) for p in prompts))

    for prompt, result in zip(prompts, run(main()), strict=True):
        logprobs = forward_logprobs(model, prompt, result.tokens, temperature)
        for step, (token, logprob) in enumerate(zip(result.tokens, result.logprobs, strict=True)):
            sorted_probs, order = logprobs[step].exp().sort(descending=True)
            before = sorted_probs.cumsum(0) - sorted_probs
            nucleus = order[before < top_p + 1e-6]
            assert token in nucleus.tolist()  # top-p never samples outside the nucleus
            nucleus_mass = sorted_probs[before < top_p].sum()
            assert logprob == pytest.approx((logprobs[step, token] - nucleus_mass.log()).item(), abs=1e-4)


def test_batched_and_single_sampling_agree_in_distribution(model, prompts):
    """First-token frequencies, sampled alone and sampled in padded batches, against exact probabilities."""
    prompt, count = prompts[1], 400
    params = SamplingParams(temperature=1.0, max_tokens=1)
    exact = forward_logprobs(model, prompt, [0])[0].exp()

    async def main():
        async with HFGenerator(model, pad_token_id=2, max_batch_size=64) as generator:
            alone = [(await generator.sample(prompt, params)).tokens[0] for _ in range(count)]
            # Interleaved with other prompts so that this one is padded to their lengths.
            mixed = [prompts[i % len(prompts)] if i % 2 else prompt for i in range(2 * count)]
            results = await asyncio.gather(*(generator.sample(p, params) for p in mixed))
            batched = [r.tokens[0] for r, p in zip(results, mixed, strict=True) if p is prompt]
            return alone, batched, generator.stats

    alone, batched, stats = run(main())
    assert stats.max_rows == 64
    top = exact.topk(3)
    for samples in (alone, batched):
        frequencies = torch.bincount(torch.tensor(samples), minlength=exact.numel()).double() / count
        for p, token in zip(top.values.tolist(), top.indices.tolist(), strict=True):
            tolerance = 4.5 * math.sqrt(p * (1 - p) / count)
            assert abs(frequencies[token].item() - p) < tolerance, (token, frequencies[token].item(), p)


def test_a_seed_gives_the_same_sample_alone_and_in_any_batch(model, prompts):
    params = SamplingParams(temperature=1.0, top_p=0.95, max_tokens=10, seed=1234)
    noise = SamplingParams(temperature=1.0, max_tokens=6)

    async def main():
        async with HFGenerator(model, pad_token_id=2) as generator:
            alone = await generator.sample(prompts[0], params)
            crowd = await asyncio.gather(
                generator.sample(prompts[0], params), *(generator.sample(p, noise) for p in prompts)
            )
            return alone, crowd[0]

    alone, in_batch = run(main())
    assert alone.tokens == in_batch.tokens


def test_identical_prompts_are_prefilled_once_and_sampled_independently(model, prompts):
    """A GRPO group's episodes share their first prompt: one prefill row serves all of them."""
    prefill_rows: list[int] = []
    forward = model.forward

    def spy(*args, **kwargs):
        ids = kwargs.get("input_ids")
        if ids is not None and ids.shape[1] > 1:  # a prefill, not a one-token decode step
            prefill_rows.append(ids.shape[0])
        return forward(*args, **kwargs)

    seeded = [SamplingParams(temperature=1.0, max_tokens=8, seed=seed) for seed in range(6)]

    async def main():
        async with HFGenerator(model, pad_token_id=2, prefix_cache_entries=0) as generator:
            alone = [await generator.sample(prompts[1], params) for params in seeded]
            model.forward = spy
            try:
                together = await asyncio.gather(*(generator.sample(prompts[1], p) for p in seeded))
            finally:
                model.forward = forward
            return alone, together

    alone, together = run(main())
    assert prefill_rows and max(prefill_rows) == 1  # six requests, one row prefilled
    # Each copy samples with its own stream: the same tokens as alone, and not all alike.
    assert [r.tokens for r in together] == [r.tokens for r in alone]
    assert len({tuple(r.tokens) for r in together}) > 1
    for result in together:
        table = forward_logprobs(model, prompts[1], result.tokens)
        expected = table.gather(1, torch.tensor(result.tokens)[:, None])[:, 0]
        assert torch.allclose(torch.tensor(result.logprobs, dtype=expected.dtype), expected, atol=1e-4)


# ---- stopping ------------------------------------------------------------------------------


def test_max_tokens_and_stop_tokens_end_a_sample(model, prompts):
    async def main():
        async with HFGenerator(model, pad_token_id=2) as generator:
            free = await generator.sample(prompts[1], SamplingParams(temperature=0, max_tokens=10))
            # Stop on the first token whose first occurrence is after position 2.
            k = next(i for i, t in enumerate(free.tokens) if i > 2 and t not in free.tokens[:i])
            params = SamplingParams(temperature=0, max_tokens=10, stop_token_ids=[free.tokens[k], 999_999])
            stopped = await generator.sample(prompts[1], params)
            return free, stopped, k

    free, stopped, k = run(main())
    assert free.finish_reason == "length" and len(free.tokens) == 10
    assert stopped.finish_reason == "stop"
    assert stopped.tokens == free.tokens[: k + 1]  # the stop token is included
    assert stopped.logprobs == pytest.approx(free.logprobs[: k + 1], abs=1e-5)


# ---- concurrency ---------------------------------------------------------------------------


def test_many_concurrent_requests_all_complete_in_few_forward_passes(model, prompts):
    params = SamplingParams(max_tokens=8)
    count = 20

    async def main():
        async with HFGenerator(model, pad_token_id=2, max_batch_size=8) as generator:
            results = await asyncio.gather(*(generator.sample(prompts[i % 4], params) for i in range(count)))
            return results, generator.stats

    results, stats = run(main())
    assert all(len(r.tokens) == 8 and r.finish_reason == "length" for r in results)
    assert stats.max_rows == 8  # never more than max_batch_size
    assert stats.forward_calls < count * 8 / 3  # one at a time would take count * 8 forwards
    assert stats.tokens_sampled == count * 8


def test_the_event_loop_runs_while_the_model_decodes(model, prompts):
    """Compute runs on a worker thread: the loop answers while a decode step is held open."""
    loop_ran, worker_threads = threading.Event(), set()

    def hold(info: StepInfo) -> None:
        worker_threads.add(threading.get_ident())
        if info.kind == "decode" and not loop_ran.is_set():
            loop_ran.wait(TIMEOUT_S)

    async def main():
        generator = HFGenerator(model, pad_token_id=2, step_callback=hold)
        task = asyncio.create_task(generator.sample(prompts[0], SamplingParams(max_tokens=5)))
        while generator.stats.prefill_calls == 0:
            await asyncio.sleep(0.001)
        loop_ran.set()  # only reachable if the loop is not blocked by the model
        result = await task
        await generator.close()
        return result

    assert len(run(main()).tokens) == 5
    assert threading.get_ident() not in worker_threads


def test_cancelling_a_request_drops_it_and_the_others_go_on(model, prompts):
    async def main():
        async with HFGenerator(model, pad_token_id=2) as generator:
            long = asyncio.create_task(
                generator.sample(prompts[0], SamplingParams(max_tokens=2000, stop_token_ids=[]))
            )
            short = asyncio.create_task(generator.sample(prompts[1], SamplingParams(max_tokens=30)))
            while generator.stats.decode_steps < 3:
                await asyncio.sleep(0.001)
            long.cancel()
            result = await short
            while generator.num_running:
                await asyncio.sleep(0.001)
            with pytest.raises(asyncio.CancelledError):
                await long
            return result, generator.stats

    result, stats = run(main())
    assert len(result.tokens) == 30
    assert stats.tokens_sampled < 2000


# ---- weights and shutdown ------------------------------------------------------------------


def test_update_weights_mid_flight_changes_versions_within_one_sample(model, prompts, sharpen):
    old_model = copy.deepcopy(model)
    new_model = sharpen(model, seed=2)
    reached, submitted = threading.Event(), threading.Event()

    def hold_at_step_five(info: StepInfo) -> None:
        if info.kind == "decode" and generator.stats.decode_steps == 5:
            reached.set()
            submitted.wait(TIMEOUT_S)

    async def main():
        sample = asyncio.create_task(generator.sample(prompts[1], SamplingParams(max_tokens=12, seed=0)))
        await asyncio.to_thread(reached.wait, TIMEOUT_S)
        update = asyncio.create_task(generator.update_weights(new_model.state_dict(), version=7))
        while not generator._controls:  # queued before the worker takes its next step
            await asyncio.sleep(0.001)
        submitted.set()
        await update
        assert generator.policy_version == 7
        result = await sample
        await generator.close()
        return result

    generator = HFGenerator(copy.deepcopy(model), pad_token_id=2, step_callback=hold_at_step_five)
    result = run(main())
    # The prefill and five decode steps ran under version 0, the rest under version 7.
    assert result.policy_versions == [0] * 6 + [7] * 6
    # What PIPELINE really samples from: the new weights read the cache the old weights wrote
    # for the prompt and the first five tokens; token 5 is the first one the new weights read.
    prompt, tokens = prompts[1], result.tokens
    with torch.no_grad():
        cache = {kv_cache.cache_keyword(old_model): kv_cache.new_cache(old_model)}
        first = old_model(torch.tensor([prompt + tokens[:5]]), use_cache=True, **cache)
        rest = new_model(torch.tensor([tokens[5:-1]]), use_cache=True, **cache)
    logits = torch.cat([first.logits[0, len(prompt) - 1 :], rest.logits[0]])
    expected = torch.log_softmax(logits.double(), dim=-1).gather(1, torch.tensor(tokens)[:, None]).squeeze(1)
    assert torch.allclose(torch.tensor(result.logprobs, dtype=torch.float64), expected, atol=1e-4)
    # And the switch mattered: the old weights alone give other log-probs after it.
    old_only = forward_logprobs(old_model, prompt, tokens).gather(1, torch.tensor(tokens)[:, None]).squeeze(1)
    assert torch.allclose(old_only[:6], expected[:6], atol=1e-4)
    assert not torch.allclose(old_only[6:], expected[6:], atol=1e-2)


def test_update_between_requests_lets_running_samples_finish_and_holds_new_ones(model, prompts, sharpen):
    new_model = sharpen(model, seed=2)
    reached, submitted = threading.Event(), threading.Event()

    def hold_at_step_three(info: StepInfo) -> None:
        if info.kind == "decode" and generator.stats.decode_steps == 3:
            reached.set()
            submitted.wait(TIMEOUT_S)

    async def main():
        running = asyncio.create_task(generator.sample(prompts[1], SamplingParams(max_tokens=10, seed=0)))
        await asyncio.to_thread(reached.wait, TIMEOUT_S)
        update = asyncio.create_task(
            generator.update_weights(new_model.state_dict(), version=3, between_requests=True)
        )
        while not generator._controls:
            await asyncio.sleep(0.001)
        # Arrives while the update waits: it must not start under the old weights.
        later = asyncio.create_task(generator.sample(prompts[0], SamplingParams(max_tokens=4, seed=1)))
        while not generator._queue:
            await asyncio.sleep(0.001)
        submitted.set()
        await update
        results = await running, await later
        await generator.close()
        return results

    generator = HFGenerator(copy.deepcopy(model), pad_token_id=2, step_callback=hold_at_step_three)
    first, second = run(main())
    assert first.policy_versions == [0] * 10  # finished under the weights it started with
    assert second.policy_versions == [3] * 4  # started only once the new weights were in


def test_close_fails_pending_and_running_requests_and_stops_the_thread(model, prompts):
    endless = SamplingParams(max_tokens=100_000, stop_token_ids=[])

    async def main():
        generator = HFGenerator(model, pad_token_id=2, max_batch_size=1)
        tasks = [asyncio.create_task(generator.sample(p, endless)) for p in prompts[:3]]
        while generator.stats.decode_steps < 2:
            await asyncio.sleep(0.001)
        assert generator.num_running == 1 and generator.num_pending == 2
        thread = generator._thread
        await generator.close()
        outcomes = await asyncio.gather(*tasks, return_exceptions=True)
        with pytest.raises(GeneratorClosedError):
            await generator.sample(prompts[0], endless)
        await generator.close()  # closing twice is harmless
        return outcomes, thread

    outcomes, thread = run(main())
    assert all(isinstance(outcome, GeneratorClosedError) for outcome in outcomes)
    assert thread is not None and not thread.is_alive()
    assert not any(t.name == "HFGenerator" and t.is_alive() for t in threading.enumerate())


# ---- the real model ------------------------------------------------------------------------


@pytest.mark.slow
def test_the_embedded_model_batched_greedy_equals_generate_alone():
    from cookbook_lib.runtime.models import load_model, load_tokenizer

    model, tokenizer = load_model(), load_tokenizer()
    questions = ["What is 2+2?", "Name a color.", "Write one sentence about the sea and the sky at night."]
    prompts = [
        tokenizer.apply_chat_template(
            [{"role": "user", "content": q}], add_generation_prompt=True, tokenize=True
        )
        for q in questions
    ]
    prompts = [list(p["input_ids"]) if hasattr(p, "keys") else list(p) for p in prompts]
    params = SamplingParams(temperature=0, max_tokens=16, stop_token_ids=[tokenizer.eos_token_id])

    async def main():
        async with HFGenerator(model, pad_token_id=tokenizer.pad_token_id) as generator:
            return await asyncio.gather(*(generator.sample(p, params) for p in prompts))

    for prompt, result in zip(prompts, run(main()), strict=True):
        reference = generate_alone(model, prompt, 16)
        if tokenizer.eos_token_id in reference:
            reference = reference[: reference.index(tokenizer.eos_token_id) + 1]
        assert result.tokens == reference


def test_a_failing_forward_fails_its_requests_and_the_generator_goes_on(model, prompts, monkeypatch):
    async def main():
        async with HFGenerator(model, pad_token_id=2) as generator:

            def broken(version: int):
                raise RuntimeError("boom")

            monkeypatch.setattr(generator._batch, "step", broken)
            with pytest.raises(RuntimeError, match="boom"):
                await generator.sample(prompts[0], SamplingParams(max_tokens=4))
            monkeypatch.undo()
            assert generator.num_running == 0
            return await generator.sample(prompts[0], SamplingParams(max_tokens=4))

    assert len(run(main()).tokens) == 4


# ---- prefix reuse --------------------------------------------------------------------------


def _turn_extra(tokenizer, turn: int, episode: int = 0) -> list[int]:
    """What a multi-turn prompt appends after the sampled tokens: end of turn, tool result, next turn."""
    result = "7" * (1 + (turn + episode) % 5)  # different lengths, so the prefill is padded
    return tokenizer.encode(
        f"<|im_end|>\n<|im_start|>user\nresult: {result}<|im_end|>\n<|im_start|>assistant\n"
    )


async def _episode(generator, tokenizer, prompt: list[int], turns: int, params_for, episode: int = 0):
    """Plays ``turns`` turns token-exactly: each prompt is the last prompt + its sample + new tokens."""
    played = []
    for turn in range(turns):
        result = await generator.sample(prompt, params_for(turn))
        played.append((prompt, result))
        prompt = prompt + result.tokens + _turn_extra(tokenizer, turn, episode)
    return played


def _reused_by(played) -> int:
    """Tokens a prefix cache saves on these turns: every later turn reuses the previous one's cache,
    which holds that turn's prompt and all its sampled tokens but the last."""
    return sum(len(prompt) + len(result.tokens) - 1 for prompt, result in played[:-1])


def test_prefix_reuse_gives_the_same_greedy_tokens_and_logprobs_over_three_turns(model, tokenizer, prompts):
    params = SamplingParams(temperature=0, max_tokens=8)

    async def play(entries: int):
        async with HFGenerator(model, pad_token_id=2, prefix_cache_entries=entries) as generator:
            played = await _episode(generator, tokenizer, prompts[2], 3, lambda turn: params)
            return played, generator.stats

    (off, off_stats), (on, on_stats) = run(play(0)), run(play(64))
    assert [r.tokens for _, r in on] == [r.tokens for _, r in off]
    for (prompt, result), (_, reference) in zip(on, off, strict=True):
        assert result.tokens == generate_alone(model, prompt, 8)
        assert result.logprobs == pytest.approx(reference.logprobs, abs=1e-4)
        expected = forward_logprobs(model, prompt, result.tokens).max(dim=-1).values
        assert torch.allclose(torch.tensor(result.logprobs, dtype=torch.float64), expected, atol=1e-4)
    total = sum(len(prompt) for prompt, _ in on)
    assert off_stats.reused_tokens == 0 and off_stats.prefill_tokens == total
    assert on_stats.reused_tokens == _reused_by(on) > 0
    assert on_stats.prefill_tokens == total - on_stats.reused_tokens
    assert on_stats.prefill_tokens == len(on[0][0]) + sum(len(_turn_extra(tokenizer, t)) + 1 for t in (0, 1))


def test_many_episodes_in_flight_reuse_their_prefixes_and_sample_the_same(float64_model, tokenizer, prompts):
    """Episodes out of step with each other: reusing rows join running batches of other lengths."""
    model, count, turns = float64_model, 10, 3

    def params_for(episode: int):
        # Different lengths per episode and turn (one finishes on its first token), seeded sampling.
        return lambda turn: SamplingParams(
            max_tokens=1 + (3 * episode + 5 * turn) % 11, seed=100 * episode + turn
        )

    async def play(entries: int):
        async with HFGenerator(model, pad_token_id=2, prefix_cache_entries=entries) as generator:
            played = await asyncio.gather(
                *(
                    _episode(generator, tokenizer, prompts[i % 4] + [40 + i], turns, params_for(i), i)
                    for i in range(count)
                )
            )
            return played, generator.stats

    (off, _), (on, stats) = run(play(0)), run(play(64))
    assert stats.max_rows > 1 and stats.prefill_calls > turns  # batched, and admitted at many times
    assert stats.reused_tokens == sum(_reused_by(episode) for episode in on)
    for episode_on, episode_off in zip(on, off, strict=True):
        assert [r.tokens for _, r in episode_on] == [r.tokens for _, r in episode_off]
        for prompt, result in episode_on:
            chosen = chosen_logprobs(model, prompt, result.tokens)
            assert torch.allclose(torch.tensor(result.logprobs, dtype=torch.float64), chosen, atol=1e-4)


def test_prompts_that_extend_no_kept_sequence_are_prefilled_whole(model, prompts):
    params = SamplingParams(temperature=0, max_tokens=6)

    async def main():
        async with HFGenerator(model, pad_token_id=2) as generator:
            first = await generator.sample(prompts[1], params)
            covered = prompts[1] + first.tokens[:-1]  # what the kept cache of `first` holds
            # Unrelated; diverging inside the kept sequence; exactly the kept tokens (none left to feed).
            misses = [prompts[3], prompts[1] + [first.tokens[0] + 1, 5], covered]
            results = [await generator.sample(prompt, params) for prompt in misses]
            missed = generator.stats.reused_tokens
            # The whole first sequence, nothing appended: only its last sampled token is fed.
            extended = await generator.sample(prompts[1] + first.tokens, params)
            return first, misses, results, missed, extended, generator.stats

    first, misses, results, missed, extended, stats = run(main())
    assert missed == 0
    for prompt, result in zip(misses, results, strict=True):
        assert result.tokens == generate_alone(model, prompt, 6)
    assert stats.reused_tokens == len(prompts[1]) + 5
    assert extended.tokens == generate_alone(model, prompts[1] + first.tokens, 6)


def test_dropped_prefixes_are_gone_and_the_next_turn_prefills_in_full(model, prompts):
    params = SamplingParams(temperature=0, max_tokens=6)

    async def main():
        async with HFGenerator(model, pad_token_id=2) as generator:
            await generator.drop_kept_prefixes()  # nothing kept, no worker yet: nothing to do
            assert generator._thread is None
            first = await generator.sample(prompts[1], params)
            kept_before = generator.num_cached_prefixes
            await generator.drop_kept_prefixes()
            turn = await generator.sample(prompts[1] + first.tokens + [5, 6], params)
            return first, kept_before, turn, generator.stats

    first, kept_before, turn, stats = run(main())
    assert kept_before == 1 and stats.reused_tokens == 0
    assert stats.prefill_tokens == len(prompts[1]) + len(prompts[1]) + len(first.tokens) + 2
    assert turn.tokens == generate_alone(model, prompts[1] + first.tokens + [5, 6], 6)


def test_update_weights_drops_kept_prefixes_and_a_sample_spanning_it_is_not_kept(model, prompts, sharpen):
    new_model = sharpen(model, seed=2)
    params = SamplingParams(temperature=0, max_tokens=6)
    reached, submitted = threading.Event(), threading.Event()
    hold_at: list[int] = []  # the decode step to hold at, set once the first sample is done

    def hold(info: StepInfo) -> None:
        if info.kind == "decode" and hold_at and generator.stats.decode_steps == hold_at[0]:
            reached.set()
            submitted.wait(TIMEOUT_S)

    async def main():
        first = await generator.sample(prompts[1], params)
        kept_before = generator.num_cached_prefixes
        hold_at.append(generator.stats.decode_steps + 2)  # after the prefill and two decode steps
        # A second sample is in flight when the weights change: its cache mixes both versions.
        spanning = asyncio.create_task(generator.sample(prompts[0], params))
        await asyncio.to_thread(reached.wait, TIMEOUT_S)
        update = asyncio.create_task(generator.update_weights(new_model.state_dict(), version=1))
        while not generator._controls:
            await asyncio.sleep(0.001)
        submitted.set()
        await update
        kept_after_update = generator.num_cached_prefixes
        spanned = await spanning
        kept_after_spanning = generator.num_cached_prefixes
        # The next turn of `first` finds nothing to reuse, and is sampled by the new weights alone.
        turn = await generator.sample(prompts[1] + first.tokens + [5, 6], params)
        await generator.close()
        return first, kept_before, kept_after_update, spanned, kept_after_spanning, turn

    generator = HFGenerator(copy.deepcopy(model), pad_token_id=2, step_callback=hold)
    first, kept_before, kept_after_update, spanned, kept_after_spanning, turn = run(main())
    assert kept_before == 1 and kept_after_update == 0
    assert spanned.policy_versions == [0] * 3 + [1] * 3 and kept_after_spanning == 0
    assert generator.stats.reused_tokens == 0
    assert turn.tokens == generate_alone(new_model, prompts[1] + first.tokens + [5, 6], 6)


def test_the_prefix_cache_is_a_bounded_lru_of_proper_prefixes():
    from cookbook_lib.generators.prefix_cache import CachedPrefix, PrefixCache

    def entry(*tokens: int) -> CachedPrefix:
        return CachedPrefix(tokens, [(torch.zeros(1, 1, len(tokens), 2), torch.zeros(1, 1, len(tokens), 2))])

    cache = PrefixCache(max_entries=3)
    for first in range(5):
        cache.put(entry(first, 1, 2))
    assert len(cache) == 3 and cache.num_tokens == 9
    assert cache.take([0, 1, 2, 3]) is None and cache.take([1, 1, 2, 3]) is None  # the oldest went first
    assert cache.take([4, 1, 2]) is None  # the prompt's last token must be left to feed
    assert cache.take([4, 1, 2, 3]).tokens == (4, 1, 2)
    assert cache.take([4, 1, 2, 3]) is None and len(cache) == 2  # used once, then dropped

    cache.put(entry(2, 1))
    assert cache.take([2, 1, 2, 9]).tokens == (2, 1, 2)  # the longest of several prefixes
    assert cache.take([2, 1, 2, 9]).tokens == (2, 1)

    by_tokens = PrefixCache(max_entries=10, max_tokens=5)
    by_tokens.put(entry(1, 2))
    by_tokens.put(entry(3, 4))
    by_tokens.put(entry(5, 6))  # 6 tokens > 5: the oldest goes
    by_tokens.put(entry(*range(6)))  # longer than the whole budget: not kept, nothing evicted
    assert by_tokens.num_tokens == 4 and by_tokens.take([1, 2, 0]) is None
    assert by_tokens.take([5, 6, 0]) is not None
    with pytest.raises(ValueError):
        PrefixCache(max_entries=-1)


def test_the_generator_keeps_at_most_its_bound_and_frees_everything_on_close(model, prompts):
    import gc
    import weakref

    params = SamplingParams(max_tokens=4)

    async def main(entries: int):
        generator = HFGenerator(model, pad_token_id=2, prefix_cache_entries=entries)
        await asyncio.gather(*(generator.sample(prompts[i % 4] + [30 + i], params) for i in range(6)))
        kept = generator.num_cached_prefixes
        tensors = [
            weakref.ref(k) for prefix in generator._prefixes._entries.values() for k, _ in prefix.layers
        ]
        await generator.close()
        return kept, generator.num_cached_prefixes, tensors

    kept, after_close, tensors = run(main(2))
    gc.collect()
    assert kept == 2 and after_close == 0
    assert tensors and all(ref() is None for ref in tensors)  # no cache outlives close()
    assert run(main(0))[0] == 0


def test_a_sliding_window_model_samples_without_prefix_reuse(sliding_model):
    """Sliding-window layers keep only their last keys: a kept row could not be stacked back."""
    model = sliding_model
    params = SamplingParams(temperature=0, max_tokens=5)

    async def main():
        async with HFGenerator(model, pad_token_id=0) as generator:
            first = await generator.sample(list(range(10, 22)), params)
            second = await generator.sample(list(range(10, 22)) + first.tokens + [7], params)
            return first, second, generator.num_cached_prefixes, generator.stats

    first, second, kept, stats = run(main())
    assert kept == 0 and stats.reused_tokens == 0
    assert second.tokens == generate_alone(model, list(range(10, 22)) + first.tokens + [7], 5)
