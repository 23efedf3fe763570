"""The installed transformers: inside the range pyproject.toml declares, driven with the cache keyword
it takes, and our sampling and training paths raise none of its deprecation warnings.

``scripts/ci_transformers_range.sh`` runs this file, with the generator, rollout and GRPO-step
tests, against the oldest and the newest transformers of the declared range; it sets
``COOKBOOK_EXPECT_TRANSFORMERS`` so that a lane which installed another version fails.
"""

from __future__ import annotations

import asyncio
import logging
import os
import re
import tomllib
import warnings
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import pytest
import torch
import transformers
from packaging.requirements import Requirement
from packaging.specifiers import SpecifierSet
from packaging.version import Version

from cookbook_lib.envs import Task
from cookbook_lib.generators import HFGenerator, SamplingParams, kv_cache
from cookbook_lib.generators.batch import DecodeBatch, Request
from cookbook_lib.grpo.config import GRPOConfig
from cookbook_lib.grpo.train import train_single_turn

PYPROJECT = Path(__file__).resolve().parents[1] / "pyproject.toml"
INSTALLED = Version(transformers.__version__)
# transformers 5.24 renamed the forward's ``past_key_values`` to ``cache`` (the old name warns).
CACHE_RENAMED_IN = Version("5.24")


def declared_transformers_range() -> SpecifierSet:
    dependencies = tomllib.loads(PYPROJECT.read_text())["project"]["dependencies"]
    (spec,) = [Requirement(d).specifier for d in dependencies if Requirement(d).name == "transformers"]
    return spec


def test_the_installed_transformers_is_the_one_this_run_meant_and_in_the_declared_range():
    expected = os.environ.get("COOKBOOK_EXPECT_TRANSFORMERS")
    if expected:
        assert transformers.__version__ == expected
    declared = declared_transformers_range()
    assert declared.contains(INSTALLED), (
        f"transformers {INSTALLED} is outside the range pyproject.toml declares ({declared}); "
        "install one inside it, or test this one with scripts/ci_transformers_range.sh and widen the range"
    )


def lane_version(name: str) -> Version:
    script = (PYPROJECT.parent / "scripts" / "ci_transformers_range.sh").read_text()
    (value,) = re.findall(rf"^{name}=(\S+)", script, flags=re.MULTILINE)
    return Version(value)


def test_the_ci_lane_tests_both_ends_of_the_declared_range():
    """The declared range is the tested one: from the lane's oldest version to its newest minor."""
    oldest, newest = lane_version("TRANSFORMERS_OLDEST"), lane_version("TRANSFORMERS_NEWEST")
    bounds = {spec.operator: Version(spec.version) for spec in declared_transformers_range()}
    assert bounds == {">=": oldest, "<": Version(f"{newest.major}.{newest.minor + 1}")}, (
        "pyproject.toml's transformers range must run from TRANSFORMERS_OLDEST to just above "
        "TRANSFORMERS_NEWEST's minor (scripts/ci_transformers_range.sh); change both together"
    )


def test_the_cache_keyword_is_the_one_this_transformers_takes(tiny_model_and_tokenizer):
    model = tiny_model_and_tokenizer[0]
    keyword = kv_cache.cache_keyword(model)
    assert keyword == ("cache" if INSTALLED >= CACHE_RENAMED_IN else "past_key_values")
    cache = kv_cache.new_cache(model)
    with warnings.catch_warnings(), torch.no_grad():
        warnings.simplefilter("error")
        model(torch.tensor([[1, 2, 3]]), use_cache=True, **{keyword: cache})
    # The name matters: a forward that does not know it drops it into **kwargs, unfilled.
    assert kv_cache.is_filled(cache) and cache.get_seq_length() == 3


def test_a_model_that_takes_no_cache_is_refused_with_the_fix():
    class NoCache(torch.nn.Module):
        def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
            return input_ids

    with pytest.raises(TypeError, match="AutoModelForCausalLM"):
        kv_cache.cache_keyword(NoCache())


class _Records(logging.Handler):
    def __init__(self) -> None:
        super().__init__(logging.WARNING)
        self.messages: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.messages.append(f"{record.name}: {record.getMessage()}")


@contextmanager
def no_transformers_warnings() -> Iterator[None]:
    """Fails if the block raises a deprecation or future warning (from any thread), or logs a
    warning on transformers' logger (its verbosity set to WARNING, its once-only cache cleared)."""
    handler, logger = _Records(), logging.getLogger("transformers")
    verbosity = transformers.logging.get_verbosity()
    warning_once = getattr(logging.Logger, "warning_once", None)
    if warning_once is not None and hasattr(warning_once, "cache_clear"):
        warning_once.cache_clear()  # a message logged once earlier in this process would hide here
    transformers.logging.set_verbosity_warning()
    logger.addHandler(handler)
    try:
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            yield
    finally:
        logger.removeHandler(handler)
        transformers.logging.set_verbosity(verbosity)
    deprecations = [
        f"{w.category.__name__} at {w.filename}:{w.lineno}: {w.message}"
        for w in caught
        if issubclass(w.category, DeprecationWarning | FutureWarning)
    ]
    assert deprecations == [], deprecations
    assert handler.messages == [], handler.messages


@pytest.mark.parametrize("fixed_shape_decode", [False, True], ids=["growing cache", "fixed-shape slots"])
def test_multi_turn_sampling_with_prefix_reuse_warns_nothing(tiny_model_and_tokenizer, fixed_shape_decode):
    model, tokenizer = tiny_model_and_tokenizer
    prompt = tokenizer.encode("What is two plus two?")
    turn_end = tokenizer.encode("<|im_end|>\n<|im_start|>user\nresult: 4<|im_end|>\n<|im_start|>assistant\n")

    async def two_turns() -> HFGenerator:
        async with HFGenerator(
            model, pad_token_id=tokenizer.pad_token_id, fixed_shape_decode=fixed_shape_decode
        ) as generator:
            first = await generator.sample(prompt, SamplingParams(max_tokens=6, seed=0))
            await asyncio.gather(
                *(
                    generator.sample(prompt + first.tokens + turn_end, SamplingParams(max_tokens=6, seed=s))
                    for s in (1, 2)
                )
            )
            return generator

    with no_transformers_warnings():
        generator = asyncio.run(two_turns())
    assert generator.stats.reused_tokens > 0  # the second turn started from the first one's cache


def test_a_grpo_step_warns_nothing(tiny_model_dir, tmp_path):
    config = GRPOConfig(
        model=tiny_model_dir,
        batch_size=2,
        episodes_per_task=4,
        num_steps=1,
        validation_interval=0,
        max_turns=1,
        max_model_length=256,
        max_tokens_per_turn=8,
        micro_batch_tokens=512,
        overlong_buffer_tokens=16,
        learning_rate=1e-3,
        runs_dir=str(tmp_path),
        run_name="warnings",
    )
    tasks = [Task(prompt=f"Say something about {word}.", target=None) for word in ("cats", "rain")]
    with no_transformers_warnings():
        result = train_single_turn(config, tasks=tasks, reward_fn=lambda task, reply: float(len(reply) % 2))
    assert (result.run_dir / "checkpoints").is_dir()


def test_a_cache_the_forward_left_empty_is_an_error_that_names_the_fix(tiny_model_and_tokenizer):
    """What an unknown cache keyword did before 5.24 (the forward drops it, the cache stays empty)
    is caught at the prefill, not later as a crash deep in the prefix cache."""
    model, tokenizer = tiny_model_and_tokenizer
    batch = DecodeBatch(model, pad_token_id=tokenizer.pad_token_id, device=torch.device("cpu"))
    batch._cache_keyword = "not_a_cache_keyword"
    loop = asyncio.new_event_loop()
    try:
        params, future = SamplingParams(max_tokens=2), loop.create_future()
        request = Request([1, 2, 3], params, torch.Generator(), future, loop)
        with pytest.raises(RuntimeError, match=r"left the KV cache .* empty.*range in pyproject\.toml"):
            batch.admit([request], version=0)
    finally:
        loop.close()
