"""``make_generator``: the one place a backend name (``GRPOConfig.generator_backend``) becomes a generator.

Training replicas and ``evaluate`` build their generators here, so where and in which precision a
model samples is decided by what the caller hands in, the same way for every backend.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import get_args

from transformers import PreTrainedModel, PreTrainedTokenizerBase

from cookbook_lib.generators.base import Generator
from cookbook_lib.generators.hf import HFGenerator
from cookbook_lib.generators.stats import StepInfo
from cookbook_lib.generators.vllm import VLLMGenerator
from cookbook_lib.grpo.config import GeneratorBackend


def make_generator(
    backend: GeneratorBackend,
    model: PreTrainedModel,
    tokenizer: PreTrainedTokenizerBase,
    *,
    step_callback: Callable[[StepInfo], None] | None = None,
    seed: int = 0,
    max_model_length: int | None = None,
    cuda_graphs: bool = True,
    owns_model: bool = False,
) -> Generator:
    """A generator of ``backend`` that samples ``model``.

    ``"hf"``: an ``HFGenerator`` on ``model`` itself, on its device and in its dtype (pass a copy
    when the original is being trained). ``"vllm"``: an in-process vLLM engine with ``model``'s
    architecture, dtype and current weights (``VLLMGenerator.from_model``; the engine runs on
    the first visible GPU and keeps no reference to ``model``). ``seed`` and ``max_model_length``
    size and seed the vLLM engine; the ``hf`` backend draws its seeds from torch's global RNG.
    ``cuda_graphs=False`` keeps the ``hf`` backend on its growing KV cache on CUDA as well.
    ``owns_model=True`` says ``model`` is a copy only this generator uses: the ``hf`` backend may
    then prepack its weights on a CPU (``HFGenerator(pack_weights=True)``), after which the
    model samples but cannot be trained.
    """
    if backend == "hf":
        return HFGenerator(
            model,
            pad_token_id=tokenizer.pad_token_id,
            step_callback=step_callback,
            fixed_shape_decode=None if cuda_graphs else False,
            pack_weights=owns_model,
        )
    if backend == "vllm":
        return VLLMGenerator.from_model(
            model, tokenizer, step_callback=step_callback, seed=seed, max_model_length=max_model_length
        )
    raise ValueError(f"generator backend {backend!r} is not one of {get_args(GeneratorBackend)}")
