"""Generators: sample completions (tokens, log-probs, policy versions) for many concurrent episodes.

``Generator`` is the interface rollouts use; ``HFGenerator`` is the transformers backend that
batches concurrent requests. A vLLM backend and remote replicas implement the same interface.
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

__all__ = [
    "FinishReason",
    "Generator",
    "GeneratorClosedError",
    "GeneratorStats",
    "HFGenerator",
    "SampleResult",
    "SamplingParams",
    "StepInfo",
]
