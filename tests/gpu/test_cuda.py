"""The library on a CUDA GPU: device "auto" picks it, every model of a run lives there, sampling and
weight updates work across devices, and fresh samples have importance ratio 1 in each dtype.

Skipped without CUDA. ``python -m cookbook_lib.gpu_check`` runs these with the demo and the bench.
"""

from __future__ import annotations

import asyncio
import gc

import pytest
import torch
from transformers import PreTrainedModel

from cookbook_lib.codecs import make_codec
from cookbook_lib.envs import Task
from cookbook_lib.generators import HFGenerator, SamplingParams
from cookbook_lib.grpo.config import GRPOConfig
from cookbook_lib.grpo.samples import TrainingSample
from cookbook_lib.grpo.train import train_single_turn
from cookbook_lib.grpo.trainer import PolicyTrainer
from cookbook_lib.rollout.episode import EndCause
from cookbook_lib.runtime.asyncio_utils import run_sync
from cookbook_lib.runtime.devices import resolve_precision, sampling_copy

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU"),
]
# (mean |log ratio|, max |ratio - 1|) of fresh samples, as in tests/test_precision.py.
RATIO_TOLERANCE = {"float32": (1e-3, 2e-2), "bfloat16": (0.15, 1.0)}


def test_auto_picks_cuda_and_bf16_where_supported():
    precision = resolve_precision(GRPOConfig().device, GRPOConfig().dtype)
    assert precision.device.type == "cuda"
    expected = torch.bfloat16 if torch.cuda.is_bf16_supported() else torch.float16
    assert precision.sample_dtype == expected
    assert precision.master_dtype == torch.float32


def _live_models() -> list[PreTrainedModel]:
    return [obj for obj in gc.get_objects() if issubclass(type(obj), PreTrainedModel)]


@pytest.mark.parametrize("kl_coef", [0.0, 0.05])
def test_every_model_of_a_run_is_on_the_gpu(tiny_model_dir, tmp_path, kl_coef):
    config = GRPOConfig(
        model=tiny_model_dir,
        batch_size=1,
        episodes_per_task=2,
        num_steps=1,
        max_turns=1,
        max_model_length=256,
        max_tokens_per_turn=8,
        micro_batch_tokens=512,
        learning_rate=1e-3,
        overlong_buffer_tokens=16,
        kl_coef=kl_coef,
        runs_dir=str(tmp_path),
        run_name=f"cuda-{kl_coef}",
    )  # device and dtype "auto"
    before = {id(model) for model in _live_models()}
    devices: set[torch.device] = set()

    def inspect_models(outcome) -> None:
        for model in _live_models():
            if id(model) not in before:
                devices.update(parameter.device.type for parameter in model.parameters())

    train_single_turn(
        config,
        tasks=[Task(prompt="Say a word.", target=None)],
        reward_fn=lambda task, reply: float(len(reply) % 2),
        on_step=inspect_models,
    )
    assert devices == {"cuda"}


def test_generator_on_cuda_samples_and_takes_weights_from_the_cpu(tiny_model_and_tokenizer):
    model, tokenizer = tiny_model_and_tokenizer
    precision = resolve_precision("cuda", "auto")
    copy = sampling_copy(model, precision).to(precision.device)
    codec = make_codec(tokenizer)
    prompt = codec.render_prompt([{"role": "user", "content": "Hello"}], [])

    async def go():
        async with HFGenerator(copy, pad_token_id=tokenizer.pad_token_id) as generator:
            first = await generator.sample(prompt, SamplingParams(max_tokens=8))
            await generator.update_weights(model.state_dict(), version=1)  # CPU tensors
            second = await generator.sample(prompt, SamplingParams(max_tokens=8))
        return first, second

    first, second = run_sync(go())
    assert len(first.tokens) == len(second.tokens) == 8
    assert second.policy_versions == [1] * 8


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_fresh_samples_have_ratio_one_on_cuda(tiny_model_and_tokenizer, sharpen, dtype):
    if dtype == "bfloat16" and not torch.cuda.is_bf16_supported():
        pytest.skip("this GPU has no bf16")
    model, tokenizer = tiny_model_and_tokenizer
    master = sharpen(model, seed=3).to("cuda")
    precision = resolve_precision("cuda", dtype)
    codec = make_codec(tokenizer)
    prompts = [codec.render_prompt([{"role": "user", "content": f"About {w}."}], []) for w in ("a", "b", "c")]

    async def sample_all():
        async with HFGenerator(sampling_copy(master, precision), pad_token_id=tokenizer.pad_token_id) as g:
            return [await g.sample(p, SamplingParams(max_tokens=24)) for p in prompts]

    torch.manual_seed(0)
    results = run_sync(sample_all())
    samples = [
        TrainingSample(
            tokens_T=p + r.tokens,
            loss_mask_T=[False] * len(p) + [True] * len(r.tokens),
            sampling_logprobs_T=[0.0] * len(p) + list(r.logprobs),
            policy_versions_T=[0] * (len(p) + len(r.tokens)),
            advantage=0.0,
            group_index=0,
            episode_index=i,
            end_cause=EndCause.TERMINATED,
            reward=0.0,
        )
        for i, (p, r) in enumerate(zip(prompts, results, strict=True))
    ]
    trainer = PolicyTrainer(
        master, pad_token_id=tokenizer.pad_token_id, learning_rate=1e-3, precision=precision
    )
    batch = trainer._collate(samples)
    with torch.no_grad():
        logprobs_BT, _ = trainer._token_logprobs(trainer.model, batch)
    log_ratio = (logprobs_BT - batch["sampling_logprobs"])[batch["loss_mask"]]
    mean_bound, worst_bound = RATIO_TOLERANCE[dtype]
    assert float(log_ratio.abs().mean()) < mean_bound
    assert float(log_ratio.abs().max().exp() - 1) < worst_bound


def test_fixed_shape_decoding_replays_cuda_graphs_and_samples_what_the_growing_cache_does(
    tiny_model_and_tokenizer, sharpen
):
    """Greedy two-turn episodes (the second turn reuses the first's cache), 20 of them so the
    steps run over several buckets of slots: the CUDA graphs give the growing cache's tokens."""
    model, tokenizer = tiny_model_and_tokenizer
    master = sharpen(model, seed=4).to("cuda")  # float32: greedy paths are then the same in both
    codec = make_codec(tokenizer)
    prompts = [
        codec.render_prompt([{"role": "user", "content": f"Tell me about {i} {'cats ' * (i % 5)}."}], [])
        for i in range(20)
    ]
    turn_end = tokenizer.encode("<|im_end|>\n<|im_start|>user\nmore<|im_end|>\n<|im_start|>assistant\n")
    params = SamplingParams(temperature=0, max_tokens=16)

    async def episodes(fixed: bool):
        async with HFGenerator(master, pad_token_id=tokenizer.pad_token_id, fixed_shape_decode=fixed) as g:

            async def episode(prompt: list[int]) -> list[int]:
                first = await g.sample(prompt, params)
                second = await g.sample(prompt + first.tokens + turn_end, params)
                return first.tokens + second.tokens

            tokens = await asyncio.gather(*(episode(p) for p in prompts))
            graphs = g._batch.num_graphs if fixed else 0
            return tokens, graphs, g._batch.use_cuda_graphs if fixed else False

    growing, _, _ = run_sync(episodes(False))
    assert HFGenerator(master, pad_token_id=tokenizer.pad_token_id).fixed_shape_decode  # the CUDA default
    fixed, graphs, still_on = run_sync(episodes(True))
    assert still_on and graphs >= 2  # captured (no fallback) and more than one bucket
    agree = sum(a == b for a, b in zip(fixed, growing, strict=True))
    assert agree >= 18, f"{agree}/20 greedy episodes agree"  # kernels of other shapes round differently
