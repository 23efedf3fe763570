"""``SequentialHFGenerator``: one plain ``model.generate`` call per request, one request at a time.

This is the baseline that batching is measured against (``bench/bench_rollout.py``), shaped as a
``Generator`` so that both arms of the benchmark run the very same ``ModelPolicy``/``run_episode``
code and only the generator differs. It is also the simplest correct generator: use it to check
a result of ``HFGenerator`` against transformers' own sampling loop.

It serves one request at a time, each with a separate ``generate`` call on a worker thread (so
the event loop keeps running), and takes the log-probs of the sampled tokens from the scores
``generate`` returns. It never batches: concurrent callers just wait their turn.
"""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Mapping
from dataclasses import dataclass

import torch
from transformers import GenerationConfig, PreTrainedModel

from cookbook_lib.generators.base import (
    Generator,
    GeneratorClosedError,
    SampleResult,
    SamplingParams,
    validate_prompt,
)
from cookbook_lib.generators.handoff import check_state_dict
from cookbook_lib.runtime.packed_linear import load_weights


@dataclass(eq=False)
class _Job:
    prompt_tokens: list[int]
    params: SamplingParams
    cancelled: bool = False  # set by a cancelled caller; a job not started yet is then skipped


class SequentialHFGenerator(Generator):
    """Samples with ``model.generate``, one prompt per call, one call at a time.

    Args:
        model: the causal LM; it is not copied, so training it in place changes what is sampled.
        pad_token_id: passed to ``generate`` (no padding happens: every call holds one prompt).

    The sampling distribution is exactly ``SamplingParams``': temperature, top-p, and nothing else
    (``generate``'s default top-k of 50 and any processors in the model's generation config are
    switched off). Unseeded requests draw from torch's global random generator, so
    ``torch.manual_seed`` before a run makes it repeatable; a seeded request uses its own seed.
    Cancelling a caller skips its request if it has not started; a running ``generate`` cannot be
    interrupted and finishes first (its result is dropped).
    """

    def __init__(self, model: PreTrainedModel, *, pad_token_id: int) -> None:
        self.model = model
        self.pad_token_id = pad_token_id
        self.device = next(model.parameters()).device
        output_embeddings = model.get_output_embeddings()
        self._vocab_size: int = (
            output_embeddings.weight.shape[0] if output_embeddings is not None else model.config.vocab_size
        )
        self._version = 0
        self._closed = False
        # Held by the worker thread for each generate call and weight update: one at a time.
        self._model_lock = threading.Lock()

    @property
    def policy_version(self) -> int:
        return self._version

    async def sample(self, prompt_tokens: list[int], params: SamplingParams) -> SampleResult:
        validate_prompt(prompt_tokens, self._vocab_size)
        if self._closed:
            raise GeneratorClosedError("the generator is closed")
        job = _Job(list(prompt_tokens), params)
        try:
            result = await asyncio.to_thread(self._serve, job)
        except asyncio.CancelledError:
            job.cancelled = True
            raise
        if result is None:
            raise GeneratorClosedError("the generator was closed")
        return result

    async def update_weights(
        self, state_dict: Mapping[str, torch.Tensor], version: int, *, between_requests: bool = False
    ) -> None:
        # One request at a time under the model lock: every update already lands between requests.
        check_state_dict(self.model, state_dict)

        def load() -> None:
            with self._model_lock:
                load_weights(self.model, state_dict)  # copied in place, as HFGenerator's are
                self._version = version

        await asyncio.to_thread(load)

    async def close(self) -> None:
        """Refuse new requests; waits for a running ``generate`` (its caller gets the error)."""
        self._closed = True

        def wait_for_running_call() -> None:
            with self._model_lock:
                pass

        await asyncio.to_thread(wait_for_running_call)

    # ---- the worker thread -------------------------------------------------------------------

    def _serve(self, job: _Job) -> SampleResult | None:
        """Run one request; None when the generator was closed before or while it ran."""
        with self._model_lock:
            if self._closed or job.cancelled:
                return None
            version = self._version
            tokens, logprobs = self._generate(job.prompt_tokens, job.params)
            if self._closed:
                return None
        stops = job.params.stop_token_ids
        finish = "stop" if tokens and tokens[-1] in stops else "length"
        return SampleResult(tokens, logprobs, finish, [version] * len(tokens))

    def _generate(self, prompt_tokens: list[int], params: SamplingParams) -> tuple[list[int], list[float]]:
        ids = torch.tensor([prompt_tokens], device=self.device)
        config = _generation_config(params, self.pad_token_id)
        # A seeded request must not disturb the global stream that unseeded ones draw from.
        devices = [self.device] if self.device.type == "cuda" else []
        with torch.inference_mode(), torch.random.fork_rng(devices=devices, enabled=params.seed is not None):
            if params.seed is not None:
                torch.manual_seed(params.seed)
            output = self.model.generate(ids, attention_mask=torch.ones_like(ids), generation_config=config)
        tokens = output.sequences[0, ids.shape[1] :].tolist()
        # Sampling: `scores` are the logits after temperature and top-p (-inf outside the nucleus),
        # i.e. the distribution each token was drawn from. Greedy: `logits` are the raw ones, whose
        # temperature-1 log-prob is what SampleResult asks for.
        steps = output.logits if params.greedy else output.scores
        logprobs = [
            torch.log_softmax(step[0].float(), dim=-1)[token].item()
            for step, token in zip(steps, tokens, strict=True)
        ]
        return tokens, logprobs


def _generation_config(params: SamplingParams, pad_token_id: int) -> GenerationConfig:
    """A config that leaves nothing to the model's defaults.

    ``generate`` fills every field left ``None`` from the model's generation config (an
    ``eos_token_id=None`` becomes the model's EOS), so "no stop token" is an empty list here.
    """
    return GenerationConfig(
        do_sample=not params.greedy,
        temperature=params.temperature if not params.greedy else 1.0,
        top_p=params.top_p,
        top_k=0,
        max_new_tokens=params.max_tokens,
        eos_token_id=list(params.stop_token_ids),
        pad_token_id=pad_token_id,
        output_scores=not params.greedy,
        output_logits=params.greedy,
        return_dict_in_generate=True,
    )
