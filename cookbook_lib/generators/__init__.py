"""Generators: sample completions (tokens, log-probs, policy versions) for many concurrent episodes.

``Generator`` is the interface rollouts use; ``HFGenerator`` is the transformers backend that
batches concurrent requests; ``VLLMGenerator`` (optional, GPU) runs an in-process vLLM engine
behind the same interface. ``factory.make_generator`` builds either from a backend name.
"""

from cookbook_lib.generators.base import (
    FinishReason,
    Generator,
    GeneratorClosedError,
    SampleResult,
    SamplingParams,
)
from cookbook_lib.generators.hf import HFGenerator
from cookbook_lib.generators.stats import GeneratorStats, StepInfo
from cookbook_lib.generators.vllm import VLLMGenerator

__all__ = [
    "FinishReason",
    "Generator",
    "GeneratorClosedError",
    "GeneratorStats",
    "HFGenerator",
    "SampleResult",
    "SamplingParams",
    "StepInfo",
    "VLLMGenerator",
]
