"""``VLLMGenerator``: a vLLM engine in this process behind the ``Generator`` interface, sharing the GPU
with training, as TRL's "colocate" mode does.

Optional: ``pip install -e ".[vllm]"`` on a CUDA machine. This module imports without vllm; vllm
is imported when a generator is built (``import_vllm``). It was written against vLLM 0.33.0's
source and tested here only against a fake engine (``tests/fake_vllm.py``): no GPU or vllm wheel
was available where it was built (docs/benchmarks.md).

How our interface maps onto vLLM:

- **One engine, in this process.** ``vllm.LLM`` with ``VLLM_ENABLE_V1_MULTIPROCESSING=0`` and the
  ``uni`` executor, so the engine, its model and its weights live in this process and new weights
  are handed over by reference. One worker thread owns the engine and drives its request API
  (``llm.llm_engine.add_request`` / ``step`` / ``abort_request``): concurrent ``sample`` calls from
  many episodes become requests that vLLM's scheduler batches continuously.
- **Requests.** ``TokensPrompt(prompt_token_ids=...)``; ``SamplingParams`` with our temperature,
  top-p, ``max_tokens``, ``seed`` and ``stop_token_ids``, ``ignore_eos=True`` (we stop only on
  ``stop_token_ids``; vLLM would also stop on the model's EOS), ``logprobs=0`` (the sampled token's
  log-prob only), ``detokenize=False`` and ``output_kind=FINAL_ONLY``.
- **Log-probs of the sampling distribution.** The engine runs with
  ``logprobs_mode="processed_logprobs"``: log-softmax after temperature and top-p, the distribution
  the token was drawn from. Greedy requests get the temperature-1 log-softmax (vLLM skips
  temperature and top-p for them), as our interface asks.
- **The stop token is in the result.** vLLM keeps a ``stop_token_ids`` token in
  ``CompletionOutput.token_ids`` (only the text leaves it out); we check it is there.
- **Weights.** The engine starts from ``load_format="dummy"`` and loads the trainer's state dict
  at once (version 0), so it never reads a checkpoint and a warm-started model needs no saving.
  Every update goes through the model's own ``load_weights`` (``LLM.apply_model``; TRL reaches
  the same method through ``llm_engine.model_executor.driver_worker.model_runner.model``), then
  the prefix cache is reset: its cached keys and values came from the old weights.
- **Weight sync.** ``between_requests=True`` (SYNCHRONOUS, BACKGROUND_PUBLISH): new requests wait,
  running ones finish, then the weights load; every sample has one version. ``between_requests
  =False`` (PIPELINE): vLLM's pause keeps running requests (``LLM.sleep(level=0, mode="keep")``),
  the weights load, ``reset_prefix_cache(reset_running_requests=True)`` preempts the running
  requests so that vLLM recomputes their keys and values with the new weights, and scheduling
  resumes (``wake_up(tags=["scheduling"])``). vLLM labels each token with the weight version set
  by ``update_weight_version`` (``CompletionOutput.weight_versions``): our per-token versions.
- **Sleep.** ``sleep()`` (vLLM sleep level 1: weights to CPU memory, KV cache freed) lets the
  optimizer step use the GPU memory; the lockstep loop calls it before training, and the next
  ``update_weights`` or ``sample`` wakes the engine. Level 2 (weights discarded) would be wrong
  when a step publishes nothing: the engine would wake with garbage weights.

Not supported here: several engines in one process (one replica), a GPU other than the first
visible one (set ``CUDA_VISIBLE_DEVICES``), vLLM LoRA adapters (LoRA runs publish merged weights).
"""

from __future__ import annotations

import asyncio
import copy
import importlib
import inspect
import itertools
import logging
import os
import shutil
import tempfile
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from types import ModuleType
from typing import TYPE_CHECKING, Any

import torch

from cookbook_lib.generators.base import (
    FinishReason,
    GeneratorClosedError,
    SampleResult,
    SamplingParams,
    validate_prompt,
)
from cookbook_lib.generators.handoff import WeightUpdate, deliver
from cookbook_lib.generators.stats import GeneratorStats, StepInfo
from cookbook_lib.generators.worker import WorkerGenerator

if TYPE_CHECKING:
    from transformers import PreTrainedModel, PreTrainedTokenizerBase

logger = logging.getLogger(__name__)

INSTALL_HINT = (
    'pip install -e ".[vllm]" on a machine with a CUDA GPU (the vllm wheel pins its own torch: '
    'vLLM 0.33 needs torch 2.14), or use generator_backend="hf"'
)
# vLLM raises positive temperatures below 0.01 to 0.01 (sampling_params._MAX_TEMP, with a warning):
# the log-probs would then not be those of the temperature the trainer divides by.
MIN_TEMPERATURE = 0.01
# The engine's share of the GPU (weights, KV cache, CUDA graphs): TRL's colocate default. The rest
# is the trainer's; in lockstep runs the engine sleeps while the trainer steps.
DEFAULT_GPU_MEMORY_UTILIZATION = 0.3
# What switching weights under running requests needs (vLLM 0.33 has all three).
IN_FLIGHT_API = {
    "sleep": "LLM.sleep(level=0, mode='keep')",
    "reset_prefix_cache": "LLM.reset_prefix_cache(reset_running_requests=True)",
    "update_weight_version": "LLM.update_weight_version",
}


class VLLMUnavailableError(RuntimeError):
    """vllm, a CUDA GPU, or a vLLM feature this run needs is missing; the message says the fix."""


def import_vllm() -> ModuleType:
    """Import vllm for an in-process engine, or say how to install it."""
    # In-process: the engine's model is then an object here, and new weights reach it by
    # reference (with the default, a separate engine process, they would be pickled across).
    os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
    os.environ.setdefault("VLLM_LOGGING_LEVEL", "WARNING")  # no INFO lines in notebooks
    try:
        return importlib.import_module("vllm")
    except ImportError as exc:
        raise VLLMUnavailableError(
            f"generator_backend='vllm' needs the vllm package, which cannot be imported ({exc}): "
            + INSTALL_HINT
        ) from exc


def missing_in_flight_api(llm: Any) -> list[str]:
    """The parts of vLLM's API for switching weights under running requests that ``llm`` lacks.

    ``llm`` is ``vllm.LLM`` or an instance of it.
    """
    missing = []
    for attribute, parameter in (("sleep", "mode"), ("reset_prefix_cache", "reset_running_requests")):
        method = getattr(llm, attribute, None)
        if method is None or parameter not in inspect.signature(method).parameters:
            missing.append(IN_FLIGHT_API[attribute])
    if not hasattr(llm, "update_weight_version"):
        missing.append(IN_FLIGHT_API["update_weight_version"])
    return missing


def check_vllm_available(*, in_flight_updates: bool = False) -> None:
    """Fail now, before any model loads, if a vLLM run cannot start here; the error says the fix.

    ``in_flight_updates``: the run switches weights under running requests
    (``WEIGHT_SYNC_TYPE_PIPELINE``), so the installed vLLM must have the API for it.
    """
    vllm = import_vllm()
    if not torch.cuda.is_available():
        raise VLLMUnavailableError(
            "generator_backend='vllm' needs a CUDA GPU, and torch sees none here (vllm is installed): "
            "run on a GPU machine, or use generator_backend='hf'"
        )
    if in_flight_updates:
        missing = missing_in_flight_api(vllm.LLM)
        if missing:
            version = getattr(vllm, "__version__", "unknown")
            raise VLLMUnavailableError(
                f"WEIGHT_SYNC_TYPE_PIPELINE with vLLM switches weights under running requests, which "
                f"needs {', '.join(missing)}; the installed vLLM {version} lacks it: upgrade vLLM "
                "(0.33 has it), or use WEIGHT_SYNC_TYPE_SYNCHRONOUS or WEIGHT_SYNC_TYPE_BACKGROUND_PUBLISH"
            )


# ---- work handed to the worker thread -----------------------------------------------------------


@dataclass(eq=False)
class _Request:
    request_id: str
    prompt_tokens: list[int]
    params: SamplingParams
    future: asyncio.Future[SampleResult]
    loop: asyncio.AbstractEventLoop
    version: int = 0  # the weights' version when the request entered the engine
    cancelled: bool = False


@dataclass(eq=False)
class _Power:
    """A ``sleep`` (which waits for the running requests, like a between-requests update) or ``wake_up``."""

    asleep: bool
    future: asyncio.Future[None]
    loop: asyncio.AbstractEventLoop

    @property
    def between_requests(self) -> bool:
        return self.asleep


class VLLMGenerator(WorkerGenerator):
    """Sampling from an in-process ``vllm.LLM``; build one with :meth:`from_model`.

    Args:
        llm: the engine, built in this process (``VLLM_ENABLE_V1_MULTIPROCESSING=0``) with
            ``logprobs_mode="processed_logprobs"``.
        sleep_mode: whether ``llm`` was built with ``enable_sleep_mode=True``; without it
            ``sleep`` does nothing.
        vocab_size: the model's vocabulary, to reject out-of-range prompt tokens in the caller.
        step_callback: called on the worker thread after every engine step with a ``StepInfo``
            (``kind="prefill"`` when requests joined just before the step: vLLM mixes their
            prefill with the others' decoding); it must be quick. Errors in it are logged.
        engine_dir: a folder to delete on ``close`` (``from_model``'s config and tokenizer copy).
    """

    _worker_name = "VLLMGenerator"
    _failure = "the vLLM engine failed"

    def __init__(
        self,
        llm: Any,
        *,
        sleep_mode: bool,
        vocab_size: int | None = None,
        step_callback: Callable[[StepInfo], None] | None = None,
        engine_dir: str | Path | None = None,
    ) -> None:
        vllm = import_vllm()
        self.llm = llm
        self.stats = GeneratorStats()
        self.sleep_mode = sleep_mode
        self.supports_in_flight_updates = not missing_in_flight_api(llm)
        self._tokens_prompt = vllm.TokensPrompt
        self._sampling_params_cls = vllm.SamplingParams
        self._final_only = importlib.import_module("vllm.sampling_params").RequestOutputKind.FINAL_ONLY
        self._vocab_size = vocab_size
        self._step_callback = step_callback
        self._engine_dir = Path(engine_dir) if engine_dir is not None else None
        self._ids = itertools.count()
        self._asleep = False  # worker thread only, after construction
        self._running: dict[str, _Request] = {}  # worker thread only
        self._joined_tokens = 0  # prompt tokens admitted since the last step (worker thread only)
        self._init_worker()  # the request and control queues, shared with the worker
        self._label(0)

    @classmethod
    def from_model(
        cls,
        model: PreTrainedModel,
        tokenizer: PreTrainedTokenizerBase,
        *,
        step_callback: Callable[[StepInfo], None] | None = None,
        seed: int = 0,
        max_model_length: int | None = None,
        gpu_memory_utilization: float = DEFAULT_GPU_MEMORY_UTILIZATION,
        sleep_mode: bool = True,
        engine_options: Mapping[str, Any] | None = None,
    ) -> VLLMGenerator:
        """An engine with ``model``'s architecture, dtype and current weights (version 0).

        The engine reads only the config and the tokenizer, from a temporary folder: its weights
        start as vLLM's dummy initialisation and are replaced by ``model``'s at once, so a
        warm-started or otherwise changed model needs no saving. ``engine_options`` are further
        ``vllm.LLM`` arguments (``enforce_eager=True``, ``max_num_seqs=...``).
        """
        vllm = import_vllm()
        engine_dir = Path(tempfile.mkdtemp(prefix="cookbook-vllm-"))
        try:
            config = copy.deepcopy(model.config)
            # As save_pretrained does: vLLM picks its model class from this list.
            config.architectures = [type(model).__name__]
            config.save_pretrained(engine_dir)
            tokenizer.save_pretrained(engine_dir)
            options: dict[str, Any] = {
                "model": str(engine_dir),
                "dtype": str(next(model.parameters()).dtype).removeprefix("torch."),
                "load_format": "dummy",
                "seed": seed,
                "gpu_memory_utilization": gpu_memory_utilization,
                "enable_sleep_mode": sleep_mode,
                "logprobs_mode": "processed_logprobs",
                "enable_prefix_caching": True,
                "distributed_executor_backend": "uni",
            }
            if max_model_length is not None:
                options["max_model_len"] = max_model_length
            options.update(engine_options or {})
            llm = vllm.LLM(**options)
            generator = cls(
                llm,
                sleep_mode=sleep_mode,
                vocab_size=_vocab_size(model),
                step_callback=step_callback,
                engine_dir=engine_dir,
            )
            generator._load(model.state_dict())
        except BaseException:
            shutil.rmtree(engine_dir, ignore_errors=True)
            raise
        return generator

    # ---- the Generator interface -----------------------------------------------------------------

    @property
    def num_running(self) -> int:
        """Requests inside the engine (vLLM's own queue included)."""
        return len(self._running)

    async def sample(self, prompt_tokens: list[int], params: SamplingParams) -> SampleResult:
        validate_prompt(prompt_tokens, self._vocab_size)
        if 0 < params.temperature < MIN_TEMPERATURE:
            raise ValueError(
                f"temperature={params.temperature}: vLLM samples temperatures below {MIN_TEMPERATURE} at "
                f"{MIN_TEMPERATURE}, so its log-probs would not match; use temperature >= {MIN_TEMPERATURE} "
                "or 0 (greedy)"
            )
        loop = asyncio.get_running_loop()
        request = _Request(
            f"cookbook-{next(self._ids)}", list(prompt_tokens), params, loop.create_future(), loop
        )
        self._submit(self._queue, request)
        try:
            return await request.future
        except asyncio.CancelledError:
            self._withdraw(request)  # the worker aborts it in the engine if it is there
            raise

    async def update_weights(
        self, state_dict: Mapping[str, torch.Tensor], version: int, *, between_requests: bool = False
    ) -> None:
        if not between_requests and not self.supports_in_flight_updates:
            missing = ", ".join(missing_in_flight_api(self.llm))
            raise ValueError(
                f"this vLLM cannot switch weights under running requests (it lacks {missing}): pass "
                "between_requests=True (WEIGHT_SYNC_TYPE_SYNCHRONOUS/BACKGROUND_PUBLISH) or upgrade vLLM"
            )
        loop = asyncio.get_running_loop()
        update = WeightUpdate(state_dict, version, loop.create_future(), loop, between_requests)
        self._submit(self._controls, update)
        await update.future

    async def sleep(self) -> None:
        """vLLM sleep level 1 once the running requests finish: weights to CPU memory, KV cache freed."""
        await self._power(asleep=True)

    async def wake_up(self) -> None:
        await self._power(asleep=False)

    @property
    def is_sleeping(self) -> bool:
        return self._asleep

    async def close(self) -> None:
        # The worker finishes its engine step, aborts and fails the running requests, and exits.
        await self._stop_worker()
        if self.llm is not None:
            self.llm = None
            await asyncio.to_thread(_release_engine)
        if self._engine_dir is not None:
            shutil.rmtree(self._engine_dir, ignore_errors=True)
            self._engine_dir = None

    # ---- the caller's side ---------------------------------------------------------------------

    async def _power(self, *, asleep: bool) -> None:
        loop = asyncio.get_running_loop()
        order = _Power(asleep, loop.create_future(), loop)
        self._submit(self._controls, order)
        await order.future

    # ---- the worker thread ---------------------------------------------------------------------

    def _is_busy(self) -> bool:
        return bool(self._running)

    def _drop_cancelled(self) -> None:
        cancelled = [r.request_id for r in self._running.values() if r.cancelled]
        if cancelled:
            self.llm.llm_engine.abort_request(cancelled)
            for request_id in cancelled:
                del self._running[request_id]

    def _apply_control(self, control: WeightUpdate | _Power) -> None:
        self._apply(control)

    def _fail_running(self, error: GeneratorClosedError) -> None:
        running, self._running = list(self._running.values()), {}
        if running and self.llm is not None:
            try:
                self.llm.llm_engine.abort_request([r.request_id for r in running])
            except Exception:  # the engine may be what failed
                logger.exception("could not abort the running vLLM requests")
        for request in running:
            deliver(request.future, request.loop, error)

    def _apply(self, control: WeightUpdate | _Power) -> None:
        try:
            if isinstance(control, WeightUpdate):
                self._apply_weights(control)
            elif control.asleep:
                if self.sleep_mode and not self._asleep:
                    # Level 1: the weights wait in CPU memory, the KV cache (and prefix cache) is freed.
                    self.llm.sleep(level=1)
                    self._asleep = True
            else:
                self._ensure_awake()
        except Exception as exc:
            deliver(control.future, control.loop, exc)
            return
        deliver(control.future, control.loop, None)

    def _apply_weights(self, update: WeightUpdate) -> None:
        if self._running:  # a PIPELINE update: switch under the running requests
            self.llm.sleep(level=0, mode="keep")  # pause scheduling; running requests are kept
            try:
                self._load(update.state_dict)
                self._version = update.version
                self._label(update.version)
                # Preempted and recomputed by the new weights: tokens sampled after the switch never
                # read keys and values of the old weights, and no new request reuses them.
                self.llm.reset_prefix_cache(reset_running_requests=True)
            finally:
                self.llm.wake_up(tags=["scheduling"])
            return
        if self._asleep:  # take the weights' memory back only: the KV cache is not needed yet
            _empty_cuda_cache()
            self.llm.wake_up(tags=["weights"])
        self._load(update.state_dict)
        self._version = update.version
        self._label(update.version)
        if self._asleep:
            self.llm.wake_up(tags=["kv_cache"])
            self._asleep = False
        # Even for the same version number: the weights may have changed (a resumed run).
        if not self.llm.reset_prefix_cache():
            raise RuntimeError("vLLM did not reset its prefix cache although no request was running")

    def _ensure_awake(self) -> None:
        if self._asleep:
            _empty_cuda_cache()  # the trainer's freed blocks back to the GPU, for vLLM to take
            self.llm.wake_up()
            self._asleep = False

    def _load(self, state_dict: Mapping[str, torch.Tensor]) -> None:
        """Load a plain model's state dict into the engine's model, by reference (same process)."""
        weights = list(state_dict.items())

        def load(model: torch.nn.Module) -> tuple[set[str] | None, set[str]]:
            # vLLM's own loader makes the same check (model_loader/default_loader.py).
            return model.load_weights(weights), {name for name, _ in model.named_parameters()}

        for loaded, expected in self.llm.apply_model(load):
            if loaded is not None and expected - loaded:
                raise ValueError(
                    "these vLLM parameters got no weights from the state dict: "
                    f"{sorted(expected - loaded)[:5]}; pass a whole state dict of the same architecture "
                    "(PolicyTrainer.export_weights gives one)"
                )

    def _label(self, version: int) -> None:
        """Name the weights' version in vLLM, which labels every token sampled from now on with it."""
        if hasattr(self.llm, "update_weight_version"):
            self.llm.update_weight_version(str(version))

    def _admit(self, requests: list[_Request]) -> None:
        self._ensure_awake()
        for request in requests:
            try:
                self.llm.llm_engine.add_request(
                    request.request_id,
                    self._tokens_prompt(prompt_token_ids=request.prompt_tokens),
                    self._vllm_params(request.params),
                )
            except Exception as exc:  # e.g. longer than the engine's max_model_len: this one fails
                deliver(request.future, request.loop, exc)
                continue
            request.version = self._version
            self._running[request.request_id] = request
            self._joined_tokens += len(request.prompt_tokens)

    def _vllm_params(self, params: SamplingParams) -> Any:
        return self._sampling_params_cls(
            temperature=params.temperature,
            top_p=1.0 if params.greedy else params.top_p,
            max_tokens=params.max_tokens,
            seed=params.seed,
            stop_token_ids=list(params.stop_token_ids),
            ignore_eos=True,
            logprobs=0,
            detokenize=False,
            output_kind=self._final_only,
        )

    def _step(self) -> None:
        rows, joined, self._joined_tokens = len(self._running), self._joined_tokens, 0
        start = time.perf_counter()
        outputs = self.llm.llm_engine.step()  # an error here is the engine's: the worker stops
        self._record(
            StepInfo(
                "prefill" if joined else "decode", rows, start, time.perf_counter(), self._version, joined
            )
        )
        for output in outputs:
            if not output.finished:
                continue
            request = self._running.pop(output.request_id, None)
            if request is None or request.cancelled:
                continue
            try:
                result = _sample_result(output.outputs[0], request)
            except Exception as exc:
                deliver(request.future, request.loop, exc)
                continue
            deliver(request.future, request.loop, result)

    def _record(self, step: StepInfo) -> None:
        self.stats.record(step)
        if self._step_callback is not None:
            try:
                self._step_callback(step)
            except Exception:
                logger.exception("VLLMGenerator step_callback raised; ignored")


# ---- vLLM outputs to our results -----------------------------------------------------------------


def _sample_result(completion: Any, request: _Request) -> SampleResult:
    """``completion`` (a ``vllm.CompletionOutput``, finished) as a ``SampleResult``, checked."""
    tokens = [int(token) for token in completion.token_ids]
    finish_reason: FinishReason
    if completion.finish_reason == "stop":
        if not tokens or tokens[-1] not in request.params.stop_token_ids:
            raise RuntimeError(
                f"vLLM stopped request {request.request_id} (stop_reason={completion.stop_reason!r}) but its "
                f"last token {tokens[-1:]} is none of stop_token_ids {request.params.stop_token_ids}"
            )
        finish_reason = "stop"
    elif completion.finish_reason == "length":
        finish_reason = "length"
    else:  # "abort", "error", "repetition": nothing our interface can return
        raise RuntimeError(
            f"vLLM ended request {request.request_id} with finish_reason={completion.finish_reason!r} "
            f"(stop_reason={completion.stop_reason!r})"
        )
    return SampleResult(
        tokens=tokens,
        logprobs=_sampled_logprobs(tokens, completion.logprobs),
        finish_reason=finish_reason,
        policy_versions=_token_versions(completion, len(tokens), request.version),
    )


def _sampled_logprobs(tokens: list[int], logprobs: Sequence[Mapping[int, Any]] | None) -> list[float]:
    """The sampled tokens' log-probs from vLLM's per-position ``{token_id: Logprob}`` dicts."""
    if logprobs is None or len(logprobs) != len(tokens):
        raise RuntimeError(
            f"vLLM returned {0 if logprobs is None else len(logprobs)} log-prob positions for {len(tokens)} "
            "tokens; the engine must run with logprobs_mode='processed_logprobs' and requests with logprobs=0"
        )
    try:
        return [float(position[token].logprob) for token, position in zip(tokens, logprobs, strict=True)]
    except (KeyError, TypeError) as exc:
        raise RuntimeError(f"vLLM's log-probs lack a sampled token: {exc!r}") from exc


def _token_versions(completion: Any, length: int, admitted_version: int) -> list[int]:
    """Per-token versions: vLLM's ``weight_versions`` spans (labels we set), else the admission version."""
    spans = getattr(completion, "weight_versions", None)
    versions = [admitted_version] * length
    for span in spans or ():
        try:
            version = int(span.version)
        except ValueError as exc:
            raise RuntimeError(
                f"vLLM labelled tokens with weight version {span.version!r}, not ours"
            ) from exc
        versions[span.start : span.end] = [version] * (span.end - span.start)
    return versions


def _vocab_size(model: PreTrainedModel) -> int:
    embeddings = model.get_output_embeddings()
    return int(embeddings.weight.shape[0]) if embeddings is not None else int(model.config.vocab_size)


def _release_engine() -> None:
    """After the last reference to an engine is dropped: free its GPU memory and vLLM's process-wide
    distributed state, so that another engine can start in this process (vLLM's examples do this
    after ``del llm``)."""
    try:
        cleanup = importlib.import_module("vllm.distributed").cleanup_dist_env_and_memory
    except (ImportError, AttributeError):  # an older or a fake vllm: the reference is dropped, that is all
        return
    cleanup()


def _empty_cuda_cache() -> None:
    # Blocks the trainer freed stay reserved by torch's caching allocator until emptied, and vLLM
    # allocates outside it (TRL does the same before wake_up).
    if torch.cuda.is_available():
        torch.cuda.empty_cache()
