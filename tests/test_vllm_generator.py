"""VLLMGenerator against a fake vLLM (``tests/fake_vllm.py``) that samples from the tiny random model.

vLLM cannot be installed here (it needs torch 2.14 and CUDA), so the adapter's whole path runs
against a fake with vLLM 0.33's offline API and a real model behind it: the tokens, log-probs,
versions and stop handling checked here come from the model, not from canned outputs. The real
engine is exercised by ``tests/gpu/test_vllm_gpu.py`` where vllm and a GPU exist.
"""

from __future__ import annotations

import asyncio
import sys
from pathlib import Path

import fake_vllm
import pytest
import torch

from cookbook_lib.codecs import make_codec
from cookbook_lib.envs import Env, StepResult, Task
from cookbook_lib.generators import GeneratorClosedError, HFGenerator, SamplingParams
from cookbook_lib.generators.factory import make_generator
from cookbook_lib.generators.vllm import (
    VLLMGenerator,
    VLLMUnavailableError,
    check_vllm_available,
)
from cookbook_lib.grpo import train as train_module
from cookbook_lib.grpo.config import ConfigError, GRPOConfig, WeightSyncType
from cookbook_lib.grpo.trainer import PolicyTrainer
from cookbook_lib.rollout.model_policy import ModelPolicy
from cookbook_lib.rollout.play import run_group
from cookbook_lib.types import Message, ToolSpec

TIMEOUT_S = 120  # a guard against hangs only


@pytest.fixture(autouse=True)
def _restore_vllm_environment(monkeypatch):
    """import_vllm sets these for the process; put them back after each test."""
    monkeypatch.setenv("VLLM_ENABLE_V1_MULTIPROCESSING", "1")
    monkeypatch.setenv("VLLM_LOGGING_LEVEL", "INFO")


@pytest.fixture
def vllm(monkeypatch):
    return fake_vllm.install(monkeypatch)


@pytest.fixture
def model(sharp_model):
    return sharp_model


@pytest.fixture
def prompt(tokenizer) -> list[int]:
    return tokenizer.encode("Tell me a story about a dog and a ball, please.")


def run(coroutine):
    async def guarded():
        return await asyncio.wait_for(coroutine, TIMEOUT_S)

    return asyncio.run(guarded())


def build(model, tokenizer, **kwargs) -> tuple[VLLMGenerator, fake_vllm.LLM]:
    generator = VLLMGenerator.from_model(model, tokenizer, **kwargs)
    return generator, generator.llm


def reference_logprobs(model, prompt: list[int], tokens: list[int], temperature: float, top_p: float = 1.0):
    """log-probs of ``tokens`` under the model's tempered, nucleus-renormalised next-token distributions."""
    with torch.no_grad():
        logits = model(torch.tensor([prompt + tokens])).logits[0, len(prompt) - 1 : -1].double()
    out = []
    for position, token in enumerate(tokens):
        probs = torch.softmax(logits[position] / temperature, dim=-1)
        if top_p == 1.0:
            out.append(float(torch.log(probs[token])))
            continue
        ordered, order = probs.sort(descending=True)
        # the smallest set of most likely tokens whose probability reaches top_p
        nucleus = order[: int((ordered.cumsum(0) < top_p).sum()) + 1]
        assert token in nucleus.tolist(), "sampled a token outside the nucleus"
        out.append(float(torch.log(probs[token] / probs[nucleus].sum())))
    return out


# ---- availability and config checks --------------------------------------------------------------


def test_without_vllm_the_check_says_how_to_install_it(monkeypatch):
    monkeypatch.setitem(sys.modules, "vllm", None)  # import vllm -> ImportError
    with pytest.raises(VLLMUnavailableError, match=r'pip install -e "\.\[vllm\]"'):
        check_vllm_available()


def test_without_a_gpu_the_check_says_so(vllm, monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    with pytest.raises(VLLMUnavailableError, match="needs a CUDA GPU"):
        check_vllm_available()


def test_pipeline_needs_vllms_pause_and_version_api(vllm, monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    check_vllm_available(in_flight_updates=True)  # the 0.33 API is all there

    class OldLLM:  # sleep without a pause mode, no weight versions
        def sleep(self, level: int = 1) -> None: ...

        def reset_prefix_cache(self) -> bool: ...

    monkeypatch.setattr(vllm, "LLM", OldLLM)
    check_vllm_available()  # the between-requests modes need none of it
    with pytest.raises(VLLMUnavailableError, match="WEIGHT_SYNC_TYPE_SYNCHRONOUS") as caught:
        check_vllm_available(in_flight_updates=True)
    assert "reset_running_requests" in str(caught.value) and "update_weight_version" in str(caught.value)


@pytest.mark.parametrize(
    ("overrides", "fix"),
    [
        ({"num_generator_replicas": 2}, "set num_generator_replicas=1"),
        ({"device": "cpu"}, "set device='auto' or 'cuda'"),
        ({"device": "cuda:1"}, "CUDA_VISIBLE_DEVICES=1"),
    ],
)
def test_config_refuses_what_the_engine_cannot_do(overrides, fix):
    config = GRPOConfig(generator_backend="vllm", **overrides)
    with pytest.raises(ConfigError, match="generator_backend='vllm'") as caught:
        config.validate(environ={})
    assert fix in str(caught.value)
    GRPOConfig(generator_backend="hf", **overrides).validate(environ={})  # fine for the hf backend


def test_config_accepts_lora_and_every_sync_mode_with_vllm():
    GRPOConfig(generator_backend="vllm", use_lora=True).validate(environ={})
    for sync in WeightSyncType:
        GRPOConfig(generator_backend="vllm", weight_sync_type=sync, max_steps_off_policy=1).validate(
            environ={}
        )
    with pytest.raises(ConfigError, match="generator_backend='sglang' is not one of 'hf', 'vllm'"):
        GRPOConfig(generator_backend="sglang").validate(environ={})


def test_a_vllm_run_fails_before_any_model_loads_without_vllm(tiny_model_dir, tmp_path, monkeypatch):
    monkeypatch.setitem(sys.modules, "vllm", None)

    def no_loading(*args, **kwargs):
        raise AssertionError("a model was loaded before the vllm check")

    monkeypatch.setattr(train_module, "load_model", no_loading)
    config = GRPOConfig(model=tiny_model_dir, generator_backend="vllm", runs_dir=str(tmp_path))
    with pytest.raises(VLLMUnavailableError, match="pip install"):
        train_module.train_single_turn(
            config, tasks=[Task(prompt="hi", target=None)], reward_fn=lambda t, r: 0.0
        )


# ---- building the engine -----------------------------------------------------------------------


def test_the_engine_is_in_process_with_processed_logprobs_and_the_models_weights(vllm, model, tokenizer):
    generator, llm = build(model, tokenizer, seed=3, max_model_length=128)
    assert llm.in_process  # VLLM_ENABLE_V1_MULTIPROCESSING=0: weights are handed over by reference
    assert llm.kwargs["seed"] == 3 and llm.kwargs["logprobs_mode"] == "processed_logprobs"
    assert llm.kwargs["load_format"] == "dummy" and llm.kwargs["enable_sleep_mode"]
    assert llm.kwargs["max_model_len"] == 128 and llm.kwargs["dtype"] == "float32"
    for name, tensor in model.state_dict().items():  # version 0 is the model's own weights
        assert torch.equal(llm.model.state_dict()[name], tensor), name
    assert llm.events == ["update_weight_version(0)", "load_weights"]
    engine_dir = Path(llm.kwargs["model"])
    assert (engine_dir / "config.json").is_file()  # the engine reads the config and tokenizer only
    run(generator.close())
    assert not engine_dir.exists()


def test_the_factory_builds_either_backend(vllm, model, tokenizer):
    assert isinstance(make_generator("hf", model, tokenizer), HFGenerator)
    generator = make_generator("vllm", model, tokenizer)
    assert isinstance(generator, VLLMGenerator)
    run(generator.close())
    with pytest.raises(ValueError, match="'tgi' is not one of"):
        make_generator("tgi", model, tokenizer)


# ---- sampling -------------------------------------------------------------------------------------


@pytest.mark.parametrize(("temperature", "top_p"), [(1.0, 1.0), (0.7, 1.0), (1.0, 0.8)])
def test_logprobs_are_those_of_the_tempered_nucleus_distribution(
    vllm, model, tokenizer, prompt, temperature, top_p
):
    generator, _ = build(model, tokenizer)
    params = SamplingParams(temperature=temperature, top_p=top_p, max_tokens=12, seed=5)

    async def go():
        async with generator:
            return await generator.sample(prompt, params)

    result = run(go())
    assert result.finish_reason == "length" and len(result.tokens) == 12
    expected = reference_logprobs(model, prompt, result.tokens, temperature, top_p)
    assert result.logprobs == pytest.approx(expected, abs=1e-4)
    assert result.policy_versions == [0] * 12


def test_greedy_follows_the_argmax_with_temperature_one_logprobs(vllm, model, tokenizer, prompt):
    generator, _ = build(model, tokenizer)

    async def go():
        async with generator:
            return await generator.sample(prompt, SamplingParams(temperature=0.0, max_tokens=8))

    result = run(go())
    with torch.no_grad():
        logits = model(torch.tensor([prompt + result.tokens])).logits[0, len(prompt) - 1 : -1]
    assert result.tokens == logits.argmax(-1).tolist()
    assert result.logprobs == pytest.approx(reference_logprobs(model, prompt, result.tokens, 1.0), abs=1e-4)


def test_the_stop_token_ends_the_result_and_requests_mean_what_ours_do(
    vllm, model, tokenizer, prompt, monkeypatch
):
    generator, llm = build(model, tokenizer)
    seen = []
    add_request = llm.llm_engine.add_request
    monkeypatch.setattr(
        llm.llm_engine, "add_request", lambda *a, **k: seen.append(a[2]) or add_request(*a, **k)
    )
    free = SamplingParams(max_tokens=40, seed=1)

    async def go():
        async with generator:
            unstopped = await generator.sample(prompt, free)
            stop = unstopped.tokens[5]  # a token this seed samples at position 5
            stopped = await generator.sample(
                prompt, SamplingParams(max_tokens=40, seed=1, stop_token_ids=[stop])
            )
            return unstopped, stopped, stop

    unstopped, stopped, stop = run(go())
    assert stopped.finish_reason == "stop"
    assert stopped.tokens == unstopped.tokens[: unstopped.tokens.index(stop) + 1]  # stop token included
    assert stopped.logprobs == unstopped.logprobs[: len(stopped.tokens)]
    vllm_params = seen[-1]
    assert vllm_params.ignore_eos and vllm_params.logprobs == 0 and not vllm_params.detokenize
    assert vllm_params.output_kind is vllm.sampling_params.RequestOutputKind.FINAL_ONLY
    assert vllm_params.stop_token_ids == [stop]


def test_concurrent_requests_are_batched_and_seeds_reproduce(vllm, model, tokenizer, prompt):
    generator, llm = build(model, tokenizer)
    params = [SamplingParams(max_tokens=10, seed=seed) for seed in (1, 2, 1)]

    async def go():
        async with generator:
            return await asyncio.gather(*(generator.sample(prompt, p) for p in params))

    first, second, again = run(go())
    assert first.tokens == again.tokens and first.logprobs == again.logprobs
    assert first.tokens != second.tokens
    assert generator.stats.max_rows == 3  # the three requests shared engine steps
    assert llm.llm_engine.steps < 30


def test_bad_inputs_fail_in_the_caller(vllm, model, tokenizer, prompt):
    generator, _ = build(model, tokenizer, max_model_length=64)

    async def go():
        async with generator:
            with pytest.raises(ValueError, match=r"temperature >= 0\.01"):
                await generator.sample(prompt, SamplingParams(temperature=0.005))
            with pytest.raises(ValueError, match="outside the vocabulary"):
                await generator.sample([10**7], SamplingParams())
            with pytest.raises(ValueError, match="maximum model length"):  # the engine's own refusal
                await generator.sample(prompt * 10, SamplingParams())
            return await generator.sample(prompt, SamplingParams(max_tokens=2))  # still serving

    assert len(run(go()).tokens) == 2


def test_a_cancelled_request_is_aborted_in_the_engine(vllm, model, tokenizer, prompt):
    generator, llm = build(model, tokenizer)

    async def go():
        async with generator:
            task = asyncio.create_task(generator.sample(prompt, SamplingParams(max_tokens=500)))
            while llm.llm_engine.steps < 2:
                await asyncio.sleep(0.005)
            task.cancel()
            with pytest.raises(asyncio.CancelledError):
                await task
            return await generator.sample(prompt, SamplingParams(max_tokens=3))

    assert len(run(go()).tokens) == 3
    assert not llm.llm_engine.has_unfinished_requests()  # the 500-token request was aborted


def test_close_fails_running_and_waiting_requests(vllm, model, tokenizer, prompt):
    generator, llm = build(model, tokenizer)
    engine_dir = Path(llm.kwargs["model"])

    async def go():
        task = asyncio.create_task(generator.sample(prompt, SamplingParams(max_tokens=500)))
        while llm.llm_engine.steps < 1:
            await asyncio.sleep(0.005)
        await generator.close()
        with pytest.raises(GeneratorClosedError):
            await task
        with pytest.raises(GeneratorClosedError):
            await generator.sample(prompt, SamplingParams())

    run(go())
    assert not llm.llm_engine.has_unfinished_requests() and not engine_dir.exists()


# ---- weights, versions, sleep ----------------------------------------------------------------------


def test_update_weights_loads_them_and_resets_the_prefix_cache(vllm, model, tokenizer, prompt, sharpen):
    generator, llm = build(model, tokenizer)
    new = sharpen(model, seed=2)
    params = SamplingParams(max_tokens=6, seed=4)

    async def go():
        async with generator:
            await generator.sample(prompt, params)
            cached = len(llm.llm_engine.prefix_cache)
            await generator.update_weights(new.state_dict(), 7, between_requests=True)
            return cached, len(llm.llm_engine.prefix_cache), await generator.sample(prompt, params)

    cached, cached_after_update, after = run(go())
    assert cached > 0 and cached_after_update == 0 and generator.policy_version == 7
    label = llm.events.index("update_weight_version(7)")
    assert llm.events[label - 1 : label + 2] == [
        "load_weights",
        "update_weight_version(7)",
        "reset_prefix_cache(reset_running_requests=False)",
    ]
    assert after.policy_versions == [7] * 6
    assert after.logprobs == pytest.approx(reference_logprobs(new, prompt, after.tokens, 1.0), abs=1e-4)


def test_a_partial_state_dict_is_refused_with_the_names_missing(vllm, model, tokenizer):
    generator, _ = build(model, tokenizer)
    partial = {k: v for k, v in model.state_dict().items() if "layers.1." not in k}

    async def go():
        async with generator:
            with pytest.raises(ValueError, match=r"got no weights.*layers\.1\."):
                await generator.update_weights(partial, 1, between_requests=True)

    run(go())


def test_between_requests_updates_wait_for_running_samples(vllm, model, tokenizer, prompt, sharpen):
    generator, llm = build(model, tokenizer)
    new = sharpen(model, seed=2)

    async def go():
        async with generator:
            running = asyncio.create_task(generator.sample(prompt, SamplingParams(max_tokens=30, seed=1)))
            while llm.llm_engine.steps < 3:
                await asyncio.sleep(0.005)
            update = asyncio.create_task(generator.update_weights(new.state_dict(), 1, between_requests=True))
            await asyncio.sleep(0)
            later = asyncio.create_task(generator.sample(prompt, SamplingParams(max_tokens=5, seed=2)))
            return await asyncio.gather(running, update, later)

    running, _, later = run(go())
    assert running.policy_versions == [0] * 30 and later.policy_versions == [1] * 5
    events = llm.events
    load = events.index("load_weights", 2)  # after the initial load
    assert events[:load].count("step") >= 30  # the running sample finished first
    assert events[:load].count("add_request") == 1  # and the later one waited for the new weights
    assert later.logprobs == pytest.approx(reference_logprobs(new, prompt, later.tokens, 1.0), abs=1e-4)


def test_pipeline_updates_switch_under_a_running_sample(vllm, model, tokenizer, prompt, sharpen):
    generator, llm = build(model, tokenizer)
    new = sharpen(model, seed=2)

    async def go():
        async with generator:
            running = asyncio.create_task(generator.sample(prompt, SamplingParams(max_tokens=30, seed=1)))
            while llm.llm_engine.steps < 5:
                await asyncio.sleep(0.005)
            await generator.update_weights(new.state_dict(), 1)
            return await running

    result = run(go())
    switch = result.policy_versions.index(1)
    assert 0 < switch < 30 and result.policy_versions == [0] * switch + [1] * (30 - switch)
    # Each token's log-prob is the distribution that sampled it: old weights, then new ones.
    old_part = reference_logprobs(model, prompt, result.tokens[:switch], 1.0)
    new_part = reference_logprobs(new, prompt, result.tokens, 1.0)[switch:]
    assert result.logprobs == pytest.approx(old_part + new_part, abs=1e-4)
    load = llm.events.index("load_weights", 2)
    assert llm.events[load - 1 : load + 4] == [
        "sleep(0,keep)",
        "load_weights",
        "update_weight_version(1)",
        "reset_prefix_cache(reset_running_requests=True)",
        "wake_up(['scheduling'])",
    ]


def test_sleep_frees_the_engine_and_sampling_or_loading_wakes_it(vllm, model, tokenizer, prompt, sharpen):
    generator, llm = build(model, tokenizer)
    new = sharpen(model, seed=2)
    params = SamplingParams(max_tokens=4, seed=3)

    async def go():
        async with generator:
            before = await generator.sample(prompt, params)
            await generator.sleep()
            asleep = llm.is_sleeping() and generator.is_sleeping
            again = await generator.sample(prompt, params)  # wakes it, weights restored from CPU
            await generator.sleep()
            await generator.update_weights(new.state_dict(), 1, between_requests=True)
            return before, asleep, again, llm.is_sleeping()

    before, asleep, again, asleep_after_update = run(go())
    assert asleep and not asleep_after_update
    assert again.tokens == before.tokens and again.logprobs == before.logprobs
    wakes = [e for e in llm.events if e.startswith(("sleep", "wake_up", "load_weights"))]
    assert wakes[1:] == [
        "sleep(1,abort)",
        "wake_up(None)",
        "sleep(1,abort)",
        "wake_up(['weights'])",  # the weights' memory first, loaded, then the KV cache
        "load_weights",
        "wake_up(['kv_cache'])",
    ]


# ---- rollouts and training on the fake engine -----------------------------------------------------


class NudgeEnv(Env):
    """Answers every reply with a user nudge; truncates after three turns: multi-turn prompts."""

    def __init__(self) -> None:
        self._messages: list[Message] = []

    async def reset(self, task: Task) -> list[Message]:
        self._messages = [Message(role="user", content=task.prompt)]
        return list(self._messages)

    async def step(self, message: Message) -> StepResult:
        self._messages += [message, Message(role="user", content="Go on.")]
        turns = sum(m["role"] == "assistant" for m in self._messages)
        return StepResult(terminated=False, truncated=turns >= 3, messages=list(self._messages), reward=0.0)

    @property
    def tool_specs(self) -> list[ToolSpec]:
        return []

    @property
    def messages(self) -> list[Message]:
        return list(self._messages)


def test_multi_turn_rollouts_through_model_policy(vllm, model, tokenizer):
    generator, _ = build(model, tokenizer)
    codec = make_codec(tokenizer)
    sampling = SamplingParams(temperature=1.0, max_tokens=8, stop_token_ids=list(codec.stop_token_ids))

    async def go():
        async with generator:
            return await run_group(
                lambda task: NudgeEnv(),
                Task(prompt="Count to three.", target=None),
                lambda: ModelPolicy(generator, codec, sampling, max_model_length=512),
                3,
                max_turns=5,
            )

    episodes = run(go())
    assert len(episodes) == 3
    for episode in episodes:
        assert episode.num_turns == 3
        for earlier, later in zip(episode.turns, episode.turns[1:], strict=False):
            grown = earlier.prompt_tokens + earlier.sampled_tokens
            assert later.prompt_tokens[: len(grown)] == grown  # token-exact continuation
        for turn in episode.turns:
            expected = reference_logprobs(model, turn.prompt_tokens, turn.sampled_tokens, 1.0)
            assert turn.logprobs == pytest.approx(expected, abs=1e-4)
            assert turn.policy_versions == [0] * len(turn.sampled_tokens)
            if turn.finish_reason == "stop":
                assert turn.sampled_tokens[-1] in codec.stop_token_ids


def test_lockstep_training_sleeps_the_engine_for_each_optimizer_step(
    vllm, tiny_model_dir, tmp_path, monkeypatch
):
    # The fake engine runs on the CPU: the GPU side of the availability check is not this test's.
    monkeypatch.setattr(train_module, "check_vllm_available", lambda **kwargs: None)
    asleep_while_training = []
    grpo_step = PolicyTrainer.grpo_step

    def spy(self, *args, **kwargs):
        asleep_while_training.append(fake_vllm.LLM.instances[-1].is_sleeping())
        return grpo_step(self, *args, **kwargs)

    monkeypatch.setattr(PolicyTrainer, "grpo_step", spy)
    config = GRPOConfig(
        model=tiny_model_dir,
        generator_backend="vllm",
        dtype="float32",
        batch_size=2,
        episodes_per_task=4,
        num_steps=2,
        validation_interval=1,
        max_turns=1,
        max_model_length=256,
        max_tokens_per_turn=8,
        micro_batch_tokens=512,
        learning_rate=1e-3,
        overlong_buffer_tokens=16,
        runs_dir=str(tmp_path),
        run_name="vllm-fake",
        max_sampling_attempts=3,
    )
    tasks = [Task(prompt=f"Say something about {w}.", target=None) for w in ("cats", "rain", "tea", "maps")]
    result = train_module.train_single_turn(
        config, tasks=tasks, reward_fn=lambda task, reply: float(len(reply) % 2), val_tasks=tasks[:2]
    )
    assert [m["step"] for m in result.metrics] == [0, 1, 2]
    assert asleep_while_training and all(asleep_while_training)
    llm = fake_vllm.LLM.instances[-1]
    trained = sum(m.get("trained_groups", 0) > 0 and not m.get("train/skipped_step") for m in result.metrics)
    assert llm.events.count("load_weights") == 1 + trained  # version 0, then one load per optimizer step
    assert result.metrics[-1]["policy_version"] == trained
