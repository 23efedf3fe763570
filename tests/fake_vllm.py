"""A fake ``vllm`` package for CPU tests: vLLM's offline API, backed by a real (tiny) transformers model.

vLLM cannot be installed where the tests run (vLLM 0.33 pins torch 2.14 and needs CUDA), so
``tests/test_vllm_generator.py`` puts this module tree in ``sys.modules`` as ``vllm``. It follows
the API of vLLM 0.33.0 that ``VLLMGenerator`` uses, with the same names, signatures, defaults and
return structures (source paths in vLLM 0.33.0):

- ``LLM(model, *, dtype, load_format, seed, gpu_memory_utilization, enable_sleep_mode,
  logprobs_mode, enable_prefix_caching, distributed_executor_backend, max_model_len, ...)``
  (``entrypoints/llm.py``); unknown arguments raise ``TypeError`` as ``EngineArgs`` does.
- ``llm.llm_engine.add_request(request_id, prompt, params)`` / ``step()`` / ``abort_request(ids)``
  / ``has_unfinished_requests()`` (``v1/engine/llm_engine.py``); outputs carry the caller's id.
- ``RequestOutput.outputs[0]``: ``CompletionOutput`` with ``token_ids`` (a stop token included,
  ``v1/engine/detokenizer.py``), ``logprobs`` (one ``{token_id: Logprob}`` per token),
  ``finish_reason`` ``"stop"``/``"length"``, ``stop_reason``, ``weight_versions`` spans
  (``outputs.py``, ``v1/engine/output_processor.py``); ``output_kind`` CUMULATIVE, DELTA, FINAL_ONLY.
- sampling as ``v1/sample/sampler.py``: greedy below temperature 1e-5 (log-probs: log-softmax of
  the raw logits), else temperature, then top-p over the sorted distribution; with
  ``logprobs_mode="processed_logprobs"`` the log-probs are of that distribution, with the default
  ``"raw_logprobs"`` of the raw logits. Stop checks in ``v1/core/sched/utils.py``'s order.
- ``sleep(level, mode)`` / ``wake_up(tags)`` / ``reset_prefix_cache(reset_running_requests)`` /
  ``apply_model(fn)`` / ``update_weight_version`` (``entrypoints/llm.py``, ``v1/engine/core.py``,
  ``v1/core/sched/scheduler.py``): level 1 keeps the weights in CPU memory, level 2 discards them
  (NaN here, so waking without loading shows); a step while the weights or KV cache are not
  resident raises, where the real engine would fault or produce garbage.

The model runs a full forward per step (no KV cache): after a weight switch every later token is
computed with the new weights, as vLLM's ``reset_prefix_cache(reset_running_requests=True)`` makes
it recompute preempted requests. ``llm.events`` logs the calls, for tests of their order.
"""

from __future__ import annotations

import enum
import os
import sys
import types
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import Any, TypedDict

import torch
from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

SAMPLING_EPS = 1e-5  # vllm/sampling_params.py _SAMPLING_EPS
MAX_TEMP = 1e-2  # vllm/sampling_params.py _MAX_TEMP
BLOCK_SIZE = 4  # prefix-cache block (16 in vLLM; small so that short test prompts fill blocks)


# ---- vllm.sampling_params, vllm.inputs, vllm.logprobs, vllm.outputs -----------------------------


class RequestOutputKind(enum.Enum):
    CUMULATIVE = 0
    DELTA = 1
    FINAL_ONLY = 2


@dataclass(kw_only=True)
class SamplingParams:
    n: int = 1
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    seed: int | None = None
    stop_token_ids: list[int] | None = None
    ignore_eos: bool = False
    max_tokens: int | None = 16
    logprobs: int | None = None
    detokenize: bool = True
    output_kind: RequestOutputKind = RequestOutputKind.CUMULATIVE

    def __post_init__(self) -> None:
        if 0 < self.temperature < MAX_TEMP:
            self.temperature = MAX_TEMP
        self.stop_token_ids = list(dict.fromkeys(self.stop_token_ids or []))
        if self.temperature < SAMPLING_EPS:
            self.top_p, self.top_k = 1.0, 0


class TokensPrompt(TypedDict):
    prompt_token_ids: list[int]


@dataclass
class Logprob:
    logprob: float
    rank: int | None = None
    decoded_token: str | None = None


@dataclass
class WeightVersionSpan:
    version: str
    start: int
    end: int


@dataclass
class CompletionOutput:
    index: int
    text: str
    token_ids: list[int]
    cumulative_logprob: float | None
    logprobs: list[dict[int, Logprob]] | None
    finish_reason: str | None = None
    stop_reason: int | str | None = None
    weight_versions: list[WeightVersionSpan] | None = None


@dataclass
class RequestOutput:
    request_id: str
    prompt: str | None
    prompt_token_ids: list[int] | None
    prompt_logprobs: None
    outputs: list[CompletionOutput]
    finished: bool
    num_cached_tokens: int | None = None


# ---- the engine -----------------------------------------------------------------------------------


class FakeVLLMModel:
    """The engine's model as ``apply_model`` hands it out: ``load_weights`` as vLLM models have it."""

    def __init__(self, model: torch.nn.Module, events: list[str]) -> None:
        self.model = model
        self.events = events

    def named_parameters(self):
        return self.model.named_parameters()

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> set[str]:
        """Copy checkpoint-named tensors in; an unknown name raises KeyError (vLLM: params_dict[name])."""
        params = dict(self.model.named_parameters())
        tied = getattr(self.model.config, "tie_word_embeddings", False)
        loaded = set()
        with torch.no_grad():
            for name, tensor in weights:
                if tied and name.startswith("lm_head."):
                    continue  # vLLM skips the tied head (AutoWeightsLoader skip_prefixes)
                params[name].copy_(tensor)
                loaded.add(name)
        self.events.append("load_weights")
        return loaded


@dataclass(eq=False)
class _FakeRequest:
    request_id: str
    prompt: list[int]
    params: SamplingParams
    generator: torch.Generator
    output: list[int] = field(default_factory=list)
    logprobs: list[dict[int, Logprob]] = field(default_factory=list)
    version_starts: list[tuple[str, int]] = field(default_factory=list)
    num_cached_tokens: int | None = None
    sent: int = 0  # tokens already returned (DELTA)


class FakeLLMEngine:
    """``llm.llm_engine``: requests in, one token per running request per ``step``."""

    def __init__(self, llm: LLM) -> None:
        self.llm = llm
        self.requests: dict[str, _FakeRequest] = {}
        self.prefix_cache: set[tuple[int, ...]] = set()
        self.steps = 0

    def add_request(
        self, request_id: str, prompt: TokensPrompt, params: SamplingParams, **kwargs: Any
    ) -> str:
        if not isinstance(request_id, str):
            raise TypeError(f"request_id must be a string, got {type(request_id)}")
        if not isinstance(params, SamplingParams):
            raise TypeError(f"params must be SamplingParams, got {type(params)}")
        tokens = list(prompt["prompt_token_ids"])
        if len(tokens) >= self.llm.max_model_len:
            raise ValueError(
                f"The decoder prompt (length {len(tokens)}) is longer than the maximum model length "
                f"of {self.llm.max_model_len}."
            )
        seed = (
            params.seed
            if params.seed is not None
            else int(torch.randint(0, 2**62, (), generator=self.llm.rng))
        )
        self.requests[request_id] = _FakeRequest(
            request_id, tokens, params, torch.Generator().manual_seed(seed)
        )
        self.llm.events.append("add_request")
        return f"{request_id}-0a1b2c3d"  # vLLM's internal id; outputs carry the caller's

    def abort_request(self, request_ids: list[str], internal: bool = False) -> None:
        for request_id in request_ids:
            self.requests.pop(request_id, None)

    def has_unfinished_requests(self) -> bool:
        return bool(self.requests)

    def get_num_unfinished_requests(self) -> int:
        return len(self.requests)

    def step(self) -> list[RequestOutput]:
        llm = self.llm
        if llm.paused:
            return []  # paused scheduling: requests wait
        if not (llm.weights_resident and llm.kv_cache_resident):
            raise RuntimeError("fake vLLM: a step while the weights or the KV cache are asleep")
        self.steps += 1
        llm.events.append("step")
        outputs = []
        for request in list(self.requests.values()):
            if request.num_cached_tokens is None:
                request.num_cached_tokens = self._cached_prefix(request.prompt)
            token, logprob, rank = self._sample(request)
            request.output.append(token)
            if request.params.logprobs is not None:
                request.logprobs.append({token: Logprob(logprob, rank)})
            if not request.version_starts or request.version_starts[-1][0] != llm.weight_version:
                request.version_starts.append((llm.weight_version, len(request.output) - 1))
            finish_reason, stop_reason = self._check_stop(request, token)
            if finish_reason is not None:
                del self.requests[request.request_id]
                self._cache(request.prompt + request.output)
            output = self._output(request, finish_reason, stop_reason)
            if output is not None:
                outputs.append(output)
        return outputs

    def _sample(self, request: _FakeRequest) -> tuple[int, float, int]:
        params = request.params
        with torch.no_grad():
            logits = self.llm.model(torch.tensor([request.prompt + request.output])).logits[0, -1].float()
        raw = torch.log_softmax(logits, dim=-1)
        if params.temperature < SAMPLING_EPS:
            processed = raw
            token = int(torch.argmax(logits))
        else:
            scaled = logits / params.temperature
            if params.top_p < 1.0:  # vllm/v1/sample/ops/topk_topp_sampler.py apply_top_p
                sorted_logits, order = scaled.sort(descending=False)
                cumulative = sorted_logits.softmax(dim=-1).cumsum(dim=-1)
                drop = cumulative <= 1 - params.top_p
                drop[-1] = False  # at least one token stays
                scaled = scaled.scatter(0, order, sorted_logits.masked_fill(drop, -float("inf")))
            processed = torch.log_softmax(scaled, dim=-1)
            token = int(torch.multinomial(processed.exp(), 1, generator=request.generator))
        reported = processed if self.llm.logprobs_mode == "processed_logprobs" else raw
        logprob = float(reported[token])
        return token, logprob, int((reported > reported[token]).sum()) + 1

    def _check_stop(self, request: _FakeRequest, token: int) -> tuple[str | None, int | None]:
        params = request.params
        eos = getattr(self.llm.model.config, "eos_token_id", None)
        if not params.ignore_eos and token == eos:
            return "stop", None
        if token in params.stop_token_ids:
            return "stop", token
        if len(request.prompt) + len(request.output) >= self.llm.max_model_len or (
            params.max_tokens is not None and len(request.output) >= params.max_tokens
        ):
            return "length", None
        return None, None

    def _output(
        self, request: _FakeRequest, finish_reason: str | None, stop_reason: int | None
    ) -> RequestOutput | None:
        kind = request.params.output_kind
        finished = finish_reason is not None
        if kind == RequestOutputKind.FINAL_ONLY and not finished:
            return None
        start = request.sent if kind == RequestOutputKind.DELTA else 0
        request.sent = len(request.output)
        spans = None
        if finished:
            ends = [s for _, s in request.version_starts[1:]] + [len(request.output)]
            spans = [
                WeightVersionSpan(v, s, e) for (v, s), e in zip(request.version_starts, ends, strict=True)
            ]
        completion = CompletionOutput(
            index=0,
            text="",  # detokenize=False
            token_ids=request.output[start:],
            cumulative_logprob=None,
            logprobs=request.logprobs[start:] if request.params.logprobs is not None else None,
            finish_reason=finish_reason,
            stop_reason=stop_reason,
            weight_versions=spans,
        )
        return RequestOutput(
            request.request_id, None, request.prompt, None, [completion], finished, request.num_cached_tokens
        )

    def _cached_prefix(self, tokens: list[int]) -> int:
        cached = 0
        for end in range(BLOCK_SIZE, len(tokens) + 1, BLOCK_SIZE):
            if tuple(tokens[:end]) not in self.prefix_cache:
                break
            cached = end
        return cached

    def _cache(self, tokens: list[int]) -> None:
        for end in range(BLOCK_SIZE, len(tokens) + 1, BLOCK_SIZE):
            self.prefix_cache.add(tuple(tokens[:end]))


class LLM:
    """``vllm.LLM``, the offline entry point, with the methods ``VLLMGenerator`` uses."""

    instances: list[LLM] = []

    def __init__(
        self,
        model: str,
        *,
        dtype: str = "auto",
        load_format: str = "auto",
        seed: int = 0,
        gpu_memory_utilization: float = 0.92,
        enable_sleep_mode: bool = False,
        logprobs_mode: str = "raw_logprobs",
        enable_prefix_caching: bool | None = None,
        distributed_executor_backend: str | None = None,
        max_model_len: int | None = None,
        enforce_eager: bool = False,
        max_num_seqs: int | None = None,
    ) -> None:
        self.kwargs = {
            "model": model,
            "dtype": dtype,
            "load_format": load_format,
            "seed": seed,
            "gpu_memory_utilization": gpu_memory_utilization,
            "enable_sleep_mode": enable_sleep_mode,
            "logprobs_mode": logprobs_mode,
            "enable_prefix_caching": enable_prefix_caching,
            "distributed_executor_backend": distributed_executor_backend,
            "max_model_len": max_model_len,
        }
        # The engine core runs in this process only when told so (vllm/envs.py, default "1").
        self.in_process = os.environ.get("VLLM_ENABLE_V1_MULTIPROCESSING", "1") == "0"
        self.enable_sleep_mode = enable_sleep_mode
        self.logprobs_mode = logprobs_mode
        self.events: list[str] = []
        self.rng = torch.Generator().manual_seed(seed)
        config = AutoConfig.from_pretrained(model)
        AutoTokenizer.from_pretrained(model)  # vLLM loads it too: the folder must hold one
        torch_dtype = torch.float32 if dtype == "auto" else getattr(torch, dtype)
        if load_format == "dummy":  # vLLM's dummy loader: small uniform random weights
            self.model = AutoModelForCausalLM.from_config(config, dtype=torch_dtype)
            with torch.no_grad():
                for parameter in self.model.parameters():
                    parameter.uniform_(-1e-3, 1e-3)
        else:
            self.model = AutoModelForCausalLM.from_pretrained(model, dtype=torch_dtype)
        self.model.eval()
        self.max_model_len = max_model_len or config.max_position_embeddings
        self.weight_version = "default"
        self.weights_resident = self.kv_cache_resident = True
        self.paused = False
        self.sleep_level: int | None = None
        self._cpu_weights: dict[str, torch.Tensor] = {}
        self.llm_engine = FakeLLMEngine(self)
        LLM.instances.append(self)

    def apply_model(self, func: Callable[[Any], Any]) -> list[Any]:
        if not self.in_process:
            raise RuntimeError("fake vLLM: the engine core runs in another process; its model is not here")
        return [func(FakeVLLMModel(self.model, self.events))]

    def sleep(self, level: int = 1, mode: str = "abort") -> None:
        if mode not in ("abort", "wait", "keep"):
            raise ValueError(f"Invalid pause mode: {mode}")
        if mode == "wait":
            raise ValueError("'wait' mode can't be used in inproc-engine mode")
        if level >= 1 and not self.enable_sleep_mode:
            raise RuntimeError("Sleep mode is not enabled. Enable it with enable_sleep_mode=True.")
        self.events.append(f"sleep({level},{mode})")
        if mode == "abort":
            self.llm_engine.requests.clear()
        self.paused = True
        if level >= 1:
            self.llm_engine.prefix_cache.clear()
            self.kv_cache_resident = False
            self.weights_resident = False
            self.sleep_level = level
            with torch.no_grad():
                for name, parameter in self.model.named_parameters():
                    if level == 1:
                        self._cpu_weights[name] = parameter.detach().clone()
                    parameter.fill_(float("nan"))  # the GPU copy is gone

    def wake_up(self, tags: list[str] | None = None) -> bool:
        self.events.append(f"wake_up({tags})")
        tags = ["weights", "kv_cache", "scheduling"] if tags is None else tags
        if "weights" in tags and not self.weights_resident:
            with torch.no_grad():
                for name, parameter in self.model.named_parameters():
                    if name in self._cpu_weights:  # level 1; level 2 leaves the garbage
                        parameter.copy_(self._cpu_weights.pop(name))
            self.weights_resident = True
        if "kv_cache" in tags:
            self.kv_cache_resident = True
        fully_awake = self.weights_resident and self.kv_cache_resident
        if fully_awake:
            self.paused = False
            self.sleep_level = None
        return fully_awake

    def is_sleeping(self) -> bool:
        return self.paused or not (self.weights_resident and self.kv_cache_resident)

    def reset_prefix_cache(self, reset_running_requests: bool = False, reset_connector: bool = False) -> bool:
        self.events.append(f"reset_prefix_cache(reset_running_requests={reset_running_requests})")
        if self.llm_engine.requests and not reset_running_requests:
            return False  # blocks of running requests are still in use
        self.llm_engine.prefix_cache.clear()
        return True

    def update_weight_version(self, new_version: str) -> None:
        self.events.append(f"update_weight_version({new_version})")
        self.weight_version = new_version

    def get_weight_version(self) -> str:
        return self.weight_version


def install(monkeypatch) -> types.ModuleType:
    """Put this fake in ``sys.modules`` as ``vllm`` (undone by ``monkeypatch`` after the test)."""
    package = types.ModuleType("vllm")
    package.__version__ = "0.33.0+fake"
    package.LLM = LLM
    package.SamplingParams = SamplingParams
    package.TokensPrompt = TokensPrompt
    package.RequestOutput = RequestOutput
    package.CompletionOutput = CompletionOutput
    submodules = {
        "sampling_params": {"SamplingParams": SamplingParams, "RequestOutputKind": RequestOutputKind},
        "inputs": {"TokensPrompt": TokensPrompt},
        "logprobs": {"Logprob": Logprob},
        "outputs": {
            "RequestOutput": RequestOutput,
            "CompletionOutput": CompletionOutput,
            "WeightVersionSpan": WeightVersionSpan,
        },
    }
    monkeypatch.setitem(sys.modules, "vllm", package)
    for name, attributes in submodules.items():
        module = types.ModuleType(f"vllm.{name}")
        for attribute, value in attributes.items():
            setattr(module, attribute, value)
        setattr(package, name, module)
        monkeypatch.setitem(sys.modules, f"vllm.{name}", module)
    # import_vllm sets these; the test's monkeypatch restores them afterwards.
    monkeypatch.setenv("VLLM_ENABLE_V1_MULTIPROCESSING", "1")
    monkeypatch.setenv("VLLM_LOGGING_LEVEL", "INFO")
    LLM.instances.clear()
    return package
