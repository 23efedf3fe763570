"""``SequentialHFGenerator``, the one-``generate``-per-request baseline of the rollout benchmark.

It must sample what ``HFGenerator`` samples (same distribution, same log-prob semantics), or the
benchmark would compare two different things. The tiny random model's weights are redrawn with a
larger spread so that greedy paths do not just repeat one token.
"""

from __future__ import annotations

import asyncio

import pytest
import torch
from reply_logprobs import forward_logprobs

from cookbook_lib.generators import GeneratorClosedError, HFGenerator, SamplingParams
from cookbook_lib.generators.sequential import SequentialHFGenerator

TIMEOUT_S = 120  # a guard against hangs only


@pytest.fixture(scope="module")
def model(sharp_model):
    return sharp_model


@pytest.fixture(scope="module")
def prompts(tokenizer) -> list[list[int]]:
    texts = ["Hi", "What is two plus two?", "Tell me a story about a dog and a ball, please."]
    return [tokenizer.encode(text) for text in texts]


def run(coroutine):
    async def guarded():
        return await asyncio.wait_for(coroutine, TIMEOUT_S)

    return asyncio.run(guarded())


def test_greedy_output_equals_the_batching_generator(model, prompts):
    params = SamplingParams(temperature=0, max_tokens=12)

    async def main():
        async with SequentialHFGenerator(model, pad_token_id=2) as sequential:
            alone = await asyncio.gather(*(sequential.sample(p, params) for p in prompts))
        async with HFGenerator(model, pad_token_id=2) as batching:
            batched = await asyncio.gather(*(batching.sample(p, params) for p in prompts))
        return alone, batched

    alone, batched = run(main())
    for prompt, one, other in zip(prompts, alone, batched, strict=True):
        assert one.tokens == other.tokens
        assert one.finish_reason == "length" and one.policy_versions == [0] * 12
        assert one.logprobs == pytest.approx(other.logprobs, abs=1e-4)
        # Greedy results carry the temperature-1 log-prob of the chosen (most likely) token.
        expected = forward_logprobs(model, prompt, one.tokens).max(dim=-1).values
        assert one.logprobs == pytest.approx(expected.tolist(), abs=1e-4)


@pytest.mark.parametrize("temperature,top_p", [(1.0, 1.0), (0.6, 1.0), (1.5, 0.7)])
def test_logprobs_match_a_forward_pass_under_the_sampling_distribution(model, prompts, temperature, top_p):
    params = SamplingParams(temperature=temperature, top_p=top_p, max_tokens=16, seed=3)

    async def main():
        async with SequentialHFGenerator(model, pad_token_id=2) as generator:
            return [await generator.sample(p, params) for p in prompts]

    for prompt, result in zip(prompts, run(main()), strict=True):
        assert len(result.tokens) == 16
        logprobs = forward_logprobs(model, prompt, result.tokens, temperature)
        for step, (token, logprob) in enumerate(zip(result.tokens, result.logprobs, strict=True)):
            sorted_probs, order = logprobs[step].exp().sort(descending=True)
            before = sorted_probs.cumsum(0) - sorted_probs
            assert token in order[before < top_p + 1e-6].tolist()  # never outside the nucleus
            nucleus_mass = sorted_probs[before < top_p].sum()
            assert logprob == pytest.approx((logprobs[step, token] - nucleus_mass.log()).item(), abs=1e-4)


def test_stop_tokens_end_a_sample_and_no_stop_tokens_means_none(model, prompts, monkeypatch):
    async def main():
        async with SequentialHFGenerator(model, pad_token_id=2) as generator:
            free = await generator.sample(prompts[1], SamplingParams(temperature=0, max_tokens=10))
            k = next(i for i, t in enumerate(free.tokens) if i > 2 and t not in free.tokens[:i])
            stop = SamplingParams(temperature=0, max_tokens=10, stop_token_ids=[free.tokens[k]])
            stopped = await generator.sample(prompts[1], stop)
            # generate() fills an unset EOS from the model's generation config; an empty stop
            # list must still mean "no stop token".
            monkeypatch.setattr(model.generation_config, "eos_token_id", free.tokens[k])
            unstopped = await generator.sample(prompts[1], SamplingParams(temperature=0, max_tokens=10))
            return free, stopped, unstopped, k

    free, stopped, unstopped, k = run(main())
    assert free.finish_reason == "length" and len(free.tokens) == 10
    assert stopped.finish_reason == "stop" and stopped.tokens == free.tokens[: k + 1]
    assert unstopped.tokens == free.tokens and unstopped.finish_reason == "length"


def test_a_seed_repeats_a_sample_and_leaves_the_global_stream_alone(model, prompts):
    seeded = SamplingParams(temperature=1.0, max_tokens=8, seed=7)
    unseeded = SamplingParams(temperature=1.0, max_tokens=8)

    async def main():
        async with SequentialHFGenerator(model, pad_token_id=2) as generator:
            torch.manual_seed(0)
            first = await generator.sample(prompts[0], unseeded)
            torch.manual_seed(0)
            a = await generator.sample(prompts[0], seeded)
            again = await generator.sample(prompts[0], unseeded)
            b = await generator.sample(prompts[0], seeded)
            return first, again, a, b

    first, again, a, b = run(main())
    assert a.tokens == b.tokens
    assert first.tokens == again.tokens  # the seeded call in between did not consume global draws


def test_weight_updates_and_close(model, prompts):
    params = SamplingParams(temperature=0, max_tokens=4)
    state = {name: tensor.clone() for name, tensor in model.state_dict().items()}

    async def main():
        generator = SequentialHFGenerator(model, pad_token_id=2)
        with pytest.raises(ValueError, match="does not have"):
            await generator.update_weights({"no.such.weight": torch.zeros(1)}, version=1)
        await generator.update_weights(state, version=3)
        result = await generator.sample(prompts[0], params)
        await generator.close()
        with pytest.raises(GeneratorClosedError):
            await generator.sample(prompts[0], params)
        return generator.policy_version, result

    version, result = run(main())
    assert version == 3 and result.policy_versions == [3] * 4
