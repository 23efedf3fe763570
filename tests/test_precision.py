"""Device and dtype: the config fields, the precision policy, where each model of a run lives, and
the importance ratio of freshly sampled tokens in each dtype."""

from __future__ import annotations

import gc

import pytest
import torch
from transformers import PreTrainedModel

from cookbook_lib.codecs import make_codec
from cookbook_lib.envs import Task
from cookbook_lib.generators import HFGenerator, SamplingParams
from cookbook_lib.grpo.config import ConfigError, GRPOConfig
from cookbook_lib.grpo.samples import TrainingSample
from cookbook_lib.grpo.train import train_single_turn
from cookbook_lib.grpo.trainer import PolicyTrainer
from cookbook_lib.rollout.episode import EndCause
from cookbook_lib.runtime.asyncio_utils import run_sync
from cookbook_lib.runtime.devices import Precision, precision_problems, resolve_precision, sampling_copy

# The importance ratio of freshly sampled tokens: the sampler and the trainer compute the same
# distribution in different kernels (a cached decode step against one full forward), so the ratio
# is 1 up to each dtype's rounding. Stated per dtype as (mean |log ratio|, max |ratio - 1|). In
# float32 it is 1 to ~1e-5. In bf16 (8 bits of mantissa) the two forwards round differently, and
# the tiny test model's large random weights make that worse than a trained model's: measured
# (0.07, 0.37) here and (0.034, 0.43) on the embedded model, which dtype="auto" accepts on a CPU
# only where bf16 is several times faster (cookbook_lib/runtime/devices.py).
RATIO_TOLERANCE = {torch.float32: (1e-4, 1e-3), torch.bfloat16: (0.15, 1.0)}
EMBEDDED_RATIO_TOLERANCE = {torch.float32: (1e-4, 1e-3), torch.bfloat16: (0.07, 0.8)}


# --- the config fields and the policy ---------------------------------------------------------


def test_config_rejects_misspelt_device_and_dtype_before_anything_loads():
    with pytest.raises(ConfigError) as error:
        GRPOConfig(device="gpu", dtype="fp16").validate()
    message = str(error.value)
    assert "device='gpu'" in message and "'cuda:N'" in message
    assert "dtype='fp16'" in message and "'bfloat16'" in message
    GRPOConfig(device="cuda:1", dtype="float16").validate()  # spelling only: no GPU needed here


def test_defaults_are_auto():
    config = GRPOConfig()
    assert (config.device, config.dtype) == ("auto", "auto")


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the message on a machine without CUDA")
def test_cuda_without_a_gpu_is_refused_with_the_fix():
    [problem] = precision_problems("cuda", "auto")
    assert "no CUDA GPU" in problem and "device='auto'" in problem


def test_float16_on_the_cpu_is_refused_with_the_fix():
    [problem] = precision_problems("cpu", "float16")
    assert "dtype='auto'" in problem


def test_auto_on_the_cpu_is_float32_when_switched_off(monkeypatch):
    monkeypatch.setenv("COOKBOOK_CPU_BF16", "0")
    precision = resolve_precision("cpu", "auto")
    assert precision.sample_dtype == precision.compute_dtype == precision.master_dtype == torch.float32
    assert "COOKBOOK_CPU_BF16=0" in precision.describe()


def test_float16_samples_in_half_and_trains_in_float32():
    precision = resolve_precision("cpu", "float16")  # resolvable, though refused on a CPU by the check
    assert (precision.sample_dtype, precision.compute_dtype) == (torch.float16, torch.float32)
    assert not precision.autocast


@pytest.mark.skipif(torch.cuda.is_available(), reason="auto picks CUDA on a GPU machine")
def test_auto_device_is_the_cpu_without_cuda():
    assert resolve_precision("auto", "float32").device == torch.device("cpu")


def test_a_trainer_refuses_a_model_on_another_device(tiny_model_and_tokenizer):
    model, tokenizer = tiny_model_and_tokenizer
    elsewhere = Precision(torch.device("meta"), torch.float32, torch.float32)
    with pytest.raises(ValueError, match="load the model on the configured device"):
        PolicyTrainer(model, pad_token_id=tokenizer.pad_token_id, learning_rate=1e-3, precision=elsewhere)


# --- the importance ratio of fresh samples, per dtype ------------------------------------------


def _fresh_samples(
    model, tokenizer, precision: Precision, fixed_shape_decode: bool | None = None
) -> list[TrainingSample]:
    """Sample replies with a generator holding the run's sampling copy of ``model``."""
    codec = make_codec(tokenizer)
    prompts = [
        codec.render_prompt([{"role": "user", "content": f"Tell me about {word}."}], [])
        for word in ("cats", "rain", "tea", "maps")
    ]

    async def sample_all():
        generator = HFGenerator(
            sampling_copy(model, precision),
            pad_token_id=tokenizer.pad_token_id,
            fixed_shape_decode=fixed_shape_decode,
        )
        async with generator:
            params = SamplingParams(temperature=1.0, max_tokens=24)
            return [await generator.sample(prompt, params) for prompt in prompts]

    torch.manual_seed(0)
    results = run_sync(sample_all())
    return [
        TrainingSample(
            tokens_T=prompt + result.tokens,
            loss_mask_T=[False] * len(prompt) + [True] * len(result.tokens),
            sampling_logprobs_T=[0.0] * len(prompt) + list(result.logprobs),
            policy_versions_T=[0] * (len(prompt) + len(result.tokens)),
            advantage=0.0,
            group_index=0,
            episode_index=i,
            end_cause=EndCause.TERMINATED,
            reward=0.0,
        )
        for i, (prompt, result) in enumerate(zip(prompts, results, strict=True))
    ]


def _check_ratio(
    model, tokenizer, dtype: str, tolerance: dict, fixed_shape_decode: bool | None = None
) -> None:
    precision = resolve_precision("cpu", dtype)
    samples = _fresh_samples(model, tokenizer, precision, fixed_shape_decode)
    trainer = PolicyTrainer(
        model, pad_token_id=tokenizer.pad_token_id, learning_rate=1e-3, precision=precision
    )

    batch = trainer._collate(samples)
    with torch.no_grad():
        logprobs_BT, entropy_N = trainer._token_logprobs(trainer.model, batch)
    assert entropy_N.dtype == logprobs_BT.dtype == torch.float32  # the loss is computed in fp32
    mask = batch["loss_mask"]
    log_ratio = (logprobs_BT - batch["sampling_logprobs"])[mask]
    mean_abs, worst = float(log_ratio.abs().mean()), float(log_ratio.abs().max().exp() - 1)
    assert mask.sum() > 40
    mean_bound, worst_bound = tolerance[precision.compute_dtype]
    assert mean_abs < mean_bound and worst < worst_bound, (
        f"{dtype}: mean |log r| {mean_abs}, max |r-1| {worst}"
    )
    # The signed mean is near 0: rounding noise, not a different distribution.
    assert abs(float(log_ratio.mean())) < mean_bound / 2


@pytest.mark.parametrize("fixed_shape_decode", [False, True], ids=["growing cache", "fixed-shape slots"])
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_fresh_samples_have_importance_ratio_one_and_an_fp32_loss(
    tiny_model_and_tokenizer, sharpen, dtype, fixed_shape_decode
):
    model, tokenizer = tiny_model_and_tokenizer
    # Peaked distributions, as a trained model's; its large weights make bf16 rounding worse.
    _check_ratio(sharpen(model, seed=3), tokenizer, dtype, RATIO_TOLERANCE, fixed_shape_decode)


@pytest.mark.slow
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_embedded_model_fresh_samples_have_importance_ratio_one(dtype):
    from cookbook_lib.runtime.models import load_model, load_tokenizer

    _check_ratio(load_model(), load_tokenizer(), dtype, EMBEDDED_RATIO_TOLERANCE)


# --- every model of a run is where the config says ----------------------------------------------


def _live_models() -> list[PreTrainedModel]:
    # type(), not isinstance(): isinstance reads __class__, which some lazy torch objects warn on.
    return [obj for obj in gc.get_objects() if issubclass(type(obj), PreTrainedModel)]


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize("kl_coef", [0.0, 0.05])
def test_every_model_of_a_run_is_on_the_configured_device_and_dtype(tiny_model_dir, tmp_path, dtype, kl_coef):
    precision = resolve_precision("cpu", dtype)
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
        run_name=f"precision-{dtype}-{kl_coef}",
        device="cpu",
        dtype=dtype,
    )
    before = {id(model) for model in _live_models()}
    seen: list[tuple[str, torch.device, torch.dtype]] = []

    def inspect_models(outcome) -> None:
        for model in _live_models():
            if id(model) in before:
                continue  # the session's fixtures, not this run's
            parameter = next(model.parameters())
            seen.append((type(model).__name__, parameter.device, parameter.dtype))

    tasks = [Task(prompt="Say a word.", target=None)]
    result = train_single_turn(
        config, tasks=tasks, reward_fn=lambda task, reply: float(len(reply) % 2), on_step=inspect_models
    )
    assert seen, "the callback saw no model"
    assert {device for _, device, _ in seen} == {precision.device}
    dtypes = [dtype for _, _, dtype in seen]
    # The trained weights are float32; the generator copy (and a KL reference) use the low precision.
    assert torch.float32 in dtypes
    assert set(dtypes) <= {torch.float32, precision.sample_dtype, precision.compute_dtype}
    if precision.sample_dtype != torch.float32:
        assert precision.sample_dtype in dtypes
    expected_models = 2 + (kl_coef > 0)  # trainer, generator replica, reference
    assert len(seen) / 2 >= expected_models  # step 0 and step 1 both inspect them
    assert next(result.model.parameters()).dtype == torch.float32
    assert [m["step"] for m in result.metrics] == [0, 1]
