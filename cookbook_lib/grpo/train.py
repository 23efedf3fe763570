"""``train_multi_turn`` and ``train_single_turn``: the entry points of a GRPO run.

A run lives in ``runs/<run_name>/``: ``config.yaml``, ``config_history.jsonl`` (one line per start
or resume, with the settings changed), ``metrics.jsonl`` (one line per step, step 0
is the validation before training), ``episodes/step_*.jsonl``, ``checkpoints/``, the warm-started
model when there was a warm-start, ``training_curves.html``, and ``timeline.jsonl`` (when the
generators sampled, environments stepped, and the trainer trained, synced weights or waited; see
:mod:`cookbook_lib.runtime.timeline`). ``max_steps_off_policy`` set makes the run async
(:mod:`cookbook_lib.grpo.async_loop`); otherwise it is lockstep (:mod:`cookbook_lib.grpo.lockstep`).
Rerunning a killed run with the same ``run_name`` resumes from its last checkpoint (``resume="auto"``);
rerunning a finished one with a larger ``num_steps`` extends it. Which settings may change on a
resume is decided in :mod:`cookbook_lib.grpo.resume_rules`.
"""

from __future__ import annotations

import copy
import dataclasses
import logging
import random
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import torch
from transformers import PreTrainedModel, PreTrainedTokenizerBase

from cookbook_lib.codecs import Codec, make_codec
from cookbook_lib.envs.base import Env, StepResult, Task
from cookbook_lib.envs.contract import check_tasks
from cookbook_lib.generators.base import Generator
from cookbook_lib.generators.factory import make_generator
from cookbook_lib.generators.ray_replicas import RayReplicaPool
from cookbook_lib.generators.vllm import check_vllm_available
from cookbook_lib.grpo.config import GRPOConfig
from cookbook_lib.grpo.lockstep import sampling_params
from cookbook_lib.grpo.loops import make_loop
from cookbook_lib.grpo.resume_rules import CONFIG_FILE, check_resume, record_config
from cookbook_lib.grpo.sft import WarmStart, train_sft
from cookbook_lib.grpo.stall import StallWatch
from cookbook_lib.grpo.step import RunContext, StepOutcome, TrainingLoop
from cookbook_lib.grpo.trainer import PolicyTrainer
from cookbook_lib.grpo.weight_sync import GeneratorReplicas
from cookbook_lib.rollout.evaluate import evaluate_policy_async
from cookbook_lib.rollout.play import EnvFactory
from cookbook_lib.runtime.asyncio_utils import run_sync
from cookbook_lib.runtime.checkpoint import (
    checkpoint_step,
    delete_folder,
    latest_checkpoint,
    load_checkpoint,
    save_checkpoint,
)
from cookbook_lib.runtime.devices import Precision, check_precision, sampling_copy
from cookbook_lib.runtime.memory import release_memory
from cookbook_lib.runtime.metrics import (
    MetricsLogger,
    dump_episodes,
    episode_stats,
    read_metrics,
    truncate_metrics,
)
from cookbook_lib.runtime.models import load_model, load_tokenizer
from cookbook_lib.runtime.own_thread import run_in_own_thread
from cookbook_lib.runtime.progress import progress_bar, tokens_status
from cookbook_lib.runtime.quiet import quiet_libraries
from cookbook_lib.runtime.timeline import (
    TRAINER_LANE,
    VALIDATION,
    Timeline,
    generator_step_recorder,
    replica_lane,
)
from cookbook_lib.types import Message, ToolSpec

logger = logging.getLogger(__name__)

WARM_START_DIR = "warm_start_model"
TIMELINE_FILE = "timeline.jsonl"


@dataclass
class TrainResult:
    """What a run leaves: its folder, its metrics (one dict per step), the trained model."""

    run_dir: Path
    metrics: list[dict[str, Any]]
    model: PreTrainedModel = field(repr=False)
    tokenizer: PreTrainedTokenizerBase = field(repr=False)

    def validation_rewards(self) -> list[tuple[int, float]]:
        return [(m["step"], m["val/reward_mean"]) for m in self.metrics if "val/reward_mean" in m]


StepCallback = Callable[[StepOutcome], None]


def train_multi_turn(
    config: GRPOConfig,
    *,
    tasks: Sequence[Task],
    env_factory: EnvFactory,
    val_tasks: Sequence[Task] | None = None,
    warm_start: WarmStart | None = None,
    on_step: StepCallback | None = None,
) -> TrainResult:
    """Train ``config.model`` with multi-turn GRPO on ``tasks``, one fresh env per episode.

    Bad settings fail here, before any model is loaded. Works from scripts and notebooks alike.
    """
    run_dir = _check_before_loading(config, tasks, val_tasks)
    # The machine's side of device/dtype (a GPU there, bf16 support), still before any model loads.
    precision = check_precision(config.device, config.dtype)
    try:
        return run_sync(
            _train(config, precision, run_dir, list(tasks), env_factory, val_tasks, warm_start, on_step)
        )
    finally:
        release_memory()  # the generators' models and caches: a notebook's next run starts lean


def _check_before_loading(
    config: GRPOConfig, tasks: Sequence[Task], val_tasks: Sequence[Task] | None
) -> Path:
    config.validate()
    if not tasks:
        raise ValueError("train_multi_turn needs at least one task in tasks=")
    if val_tasks is not None and not val_tasks:
        raise ValueError("val_tasks is empty: pass None to skip validation, or some tasks")
    # Every episode records its task: a task that could not be recorded fails now, not after a run.
    check_tasks(tasks, "tasks")
    if val_tasks is not None:
        check_tasks(val_tasks, "val_tasks")
    if config.generator_backend == "vllm":  # vllm importable, a GPU, and what the sync mode needs
        check_vllm_available(in_flight_updates=config.weight_sync_type == "WEIGHT_SYNC_TYPE_PIPELINE")
    run_dir = config.run_dir
    saved = run_dir / CONFIG_FILE
    checkpoint = latest_checkpoint(run_dir)
    if config.resume is True and checkpoint is None:
        raise ValueError(f"resume=True but {run_dir} holds no checkpoint; use resume='auto' or False")
    if config.resume is False and saved.exists():
        raise ValueError(
            f"{run_dir} already holds a run; choose another run_name, delete the folder, or resume='auto'"
        )
    if config.resume and checkpoint is not None and saved.exists():
        # Logging, evaluation, checkpointing and a larger num_steps may change (a run is extended
        # that way); what is trained may not (see resume_rules).
        check_resume(run_dir, GRPOConfig.from_yaml(saved), config, checkpoint_step(checkpoint))
    return run_dir


def _seed_everything(seed: int) -> None:
    random.seed(seed)
    np.random.seed(seed)
    torch.manual_seed(seed)


async def _train(
    config: GRPOConfig,
    precision: Precision,
    run_dir: Path,
    tasks: list[Task],
    env_factory: EnvFactory,
    val_tasks: Sequence[Task] | None,
    warm_start: WarmStart | None,
    on_step: StepCallback | None,
) -> TrainResult:
    """Load the tokenizer (and check its template), the model, warm-start it, start the replicas,
    then run the steps (:func:`_run_steps`)."""
    run_dir.mkdir(parents=True, exist_ok=True)
    checkpoint = latest_checkpoint(run_dir) if config.resume else None
    # config.yaml: this start's config; config_history.jsonl: what changed since the last start.
    record_config(run_dir, config, checkpoint_step(checkpoint) if checkpoint is not None else 0)
    _seed_everything(config.seed)
    tokenizer = load_tokenizer(config.model)
    # The template self-check runs here, on the tokenizer alone: a template no codec serves
    # fails before any model is loaded.
    codec = make_codec(
        tokenizer, enable_thinking=config.enable_thinking, template_kwargs=config.chat_template_kwargs
    )
    warm_dir = run_dir / WARM_START_DIR
    # The trained weights: float32 on the run's device, whatever the precision policy.
    source = str(warm_dir) if warm_dir.is_dir() else config.model
    model = load_model(source, device=precision.device, dtype=precision.master_dtype)
    print(f"{config.run_name}: {precision.describe()}", flush=True)
    if checkpoint is None and warm_start is not None and not warm_dir.is_dir():
        # In a thread that ends with it: see runtime/own_thread.py.
        arguments = (model, tokenizer, codec, warm_start, config, warm_dir, precision)
        run_in_own_thread(lambda stop: _run_warm_start(*arguments, stop), name="warm-start")
        release_memory()  # the warm-start's optimizer state is garbage now
    timeline = Timeline()
    replicas, ray_pool = _make_replicas(config, model, tokenizer, precision, timeline)
    try:
        trainer = make_trainer(config, model, tokenizer, precision)
        context = RunContext(config, tasks, env_factory, trainer, replicas, codec, timeline)
        return await _run_steps(context, run_dir, checkpoint, tokenizer, val_tasks, on_step)
    finally:
        if ray_pool is not None:
            ray_pool.shutdown()


async def _run_steps(
    context: RunContext,
    run_dir: Path,
    checkpoint: Path | None,
    tokenizer: PreTrainedTokenizerBase,
    val_tasks: Sequence[Task] | None,
    on_step: StepCallback | None,
) -> TrainResult:
    """Resume, then validate at step 0 and step, log, checkpoint and validate until ``num_steps``."""
    config, trainer, replicas, timeline = context.config, context.trainer, context.replicas, context.timeline
    start_step, first_group_index = await _resume(checkpoint, run_dir, context)
    loop = make_loop(context, first_group_index)
    validator = _Validator(context, val_tasks, loop)
    # Lines after the checkpoint (all of them, without one) are redone: nothing is logged twice.
    truncate_metrics(run_dir, start_step if checkpoint is not None else -1)
    log = MetricsLogger(
        run_dir, wandb_project=config.wandb_project, run_name=config.run_name, config=config.to_dict()
    )
    stall = StallWatch()
    try:
        if start_step == 0:
            metrics = await validator.run() if val_tasks else {}
            log.log(0, metrics)
            _print_step(0, config.num_steps, metrics)
            _notify(on_step, StepOutcome(step=0, metrics=metrics, episodes=[]))
        for step in range(start_step + 1, config.num_steps + 1):
            outcome = await loop.step(step)
            last = step == config.num_steps
            if val_tasks and (
                last or (config.validation_interval and step % config.validation_interval == 0)
            ):
                outcome.metrics |= await validator.run()
            log.log(step, outcome.metrics)
            dump_episodes(run_dir, step, outcome.episodes)
            periodic = bool(config.checkpoint_interval) and step % config.checkpoint_interval == 0
            if periodic or (last and config.final_checkpoint != "none"):
                model_only = last and config.final_checkpoint == "model"
                _save(run_dir, step, context, tokenizer, loop.groups_started, model_only)
                timeline.save(run_dir / TIMELINE_FILE)
            _print_step(step, config.num_steps, outcome.metrics)
            if notice := stall.after(step, outcome.metrics):
                print(notice, flush=True)
            _notify(on_step, outcome)
            release_memory()  # validation's KV caches, the checkpoint's buffers: back to the system
    finally:
        # Cancel what is in flight first (each episode closes its environment), then the generators.
        await loop.close()
        log.close()
        await replicas.close()
        timeline.save(run_dir / TIMELINE_FILE)
    _drop_warm_start_if_unneeded(run_dir, config)
    metrics_by_step = read_metrics(run_dir)
    _write_curves(run_dir, metrics_by_step)
    return TrainResult(run_dir=run_dir, metrics=metrics_by_step, model=trainer.model, tokenizer=tokenizer)


def make_trainer(
    config: GRPOConfig, model: PreTrainedModel, tokenizer: PreTrainedTokenizerBase, precision: Precision
) -> PolicyTrainer:
    """The trainer a run of ``config`` trains ``model`` with (also what bench/bench_step.py times)."""
    # float32 like the trained weights: its forwards run under the same autocast and fp32 head.
    reference = copy.deepcopy(model).eval() if config.kl_coef > 0 and not config.use_lora else None
    return PolicyTrainer(
        model,
        pad_token_id=tokenizer.pad_token_id,
        learning_rate=config.learning_rate,
        warmup_steps=config.warmup_steps,
        weight_decay=config.weight_decay,
        max_grad_norm=config.max_grad_norm,
        micro_batch_tokens=config.micro_batch_tokens,
        temperature=config.temperature,
        use_lora=config.use_lora,
        lora_rank=config.lora_rank,
        lora_alpha=config.lora_alpha,
        reference_model=reference,
        precision=precision,
        activation_checkpointing=config.activation_checkpointing,
        shared_prefix=config.shared_prefix_training,
    )


async def _resume(checkpoint: Path | None, run_dir: Path, context: RunContext) -> tuple[int, int]:
    """The step a run continues after and where its stream of groups resumes: (0, 0) when it
    starts afresh; else the checkpoint's, its weights and optimizer loaded and published."""
    if checkpoint is None:
        return 0, 0
    trainer, replicas = context.trainer, context.replicas
    state = load_checkpoint(checkpoint, model=trainer.model, optimizer=trainer.optimizer)
    await replicas.load_everywhere(trainer.export_weights(), int(state.extra_state["policy_version"]))
    print(f"resumed {run_dir} after step {state.step}")
    if not state.optimizer_restored and state.step < context.config.num_steps:
        print(
            f"{state.path.name} holds the model only (final_checkpoint='model'): "
            "AdamW restarts from zero moments, so the extension is not what one longer run would train"
        )
    return state.step, int(state.extra_state.get("groups_started", 0))


def _make_replicas(
    config: GRPOConfig,
    model: PreTrainedModel,
    tokenizer: PreTrainedTokenizerBase,
    precision: Precision,
    timeline: Timeline,
) -> tuple[GeneratorReplicas, RayReplicaPool | None]:
    """The run's generator replicas, and the Ray actors behind them when placed on Ray.

    The caller shuts the pool down in a ``finally``: actors outlive nothing.
    """
    ray_pool: RayReplicaPool | None = None
    if config.generator_placement == "ray":
        # One Ray actor per replica, each with its own copy of the sampling model; the actors
        # are killed (and a Ray started here stopped) by the caller, however the run ends.
        ray_pool = RayReplicaPool(
            sampling_copy(model, precision),
            tokenizer.pad_token_id,
            config.num_generator_replicas,
            address=config.ray_address,
            cpus_per_replica=config.ray_cpus_per_replica,
            trainer_gpu=precision.device if precision.device.type == "cuda" else None,
            cuda_graphs=config.cuda_graphs,
        )
        generators: list[Generator] = list(
            ray_pool.generators(
                [generator_step_recorder(timeline, replica_lane(i)) for i in range(ray_pool.count)]
            )
        )
    else:
        # Each replica samples with its own copy (but see _sampling_model); the trainer's weights
        # reach it only when published.
        generators = []
        for i in range(config.num_generator_replicas):
            sampled = _sampling_model(model, precision, config)
            generators.append(
                make_generator(
                    config.generator_backend,
                    sampled,
                    tokenizer,
                    step_callback=generator_step_recorder(timeline, replica_lane(i)),
                    seed=config.seed,
                    max_model_length=config.max_model_length,
                    cuda_graphs=config.cuda_graphs,
                    owns_model=sampled is not model,
                )
            )
    return GeneratorReplicas(generators, config.weight_sync_type, timeline), ray_pool


def _notify(on_step: StepCallback | None, outcome: StepOutcome) -> None:
    """Call the user's callback; a failing plot must not end a long run (the error is logged)."""
    if on_step is None:
        return
    try:
        on_step(outcome)
    except Exception:
        logger.exception("on_step callback failed at step %d; training goes on", outcome.step)


def _sampling_model(model: PreTrainedModel, precision: Precision, config: GRPOConfig) -> PreTrainedModel:
    """What the generator samples from: the trained model itself where a copy would change nothing.

    Lockstep never samples while it trains, and publishes after every optimizer step, so one
    ``hf`` generator in the trained dtype can sample from the trained model itself: a model's worth
    of memory saved (0.54 GB for the embedded model) beside the training step; while it samples,
    its routed layers may hold packed copies of the weights (runtime/routed_linear.py), which the
    lockstep loop's ``replicas.sleep()`` lets go before training. Async runs (sampling goes on while the
    weights change), several replicas, another sampling dtype, LoRA (the generator samples the
    merged weights) and vLLM get a copy; in lockstep a low-precision copy's float32 head is the
    trained head itself (``sampling_copy(share_head=True)``).
    """
    lockstep_hf = not config.is_async and config.generator_backend == "hf" and not config.use_lora
    same_dtype = precision.sample_dtype == precision.master_dtype
    if lockstep_hf and config.num_generator_replicas == 1 and same_dtype:
        return model
    # In lockstep a bf16 copy's float32 head can be the trained head itself (0.11 GB less).
    return sampling_copy(model, precision, share_head=lockstep_hf)


def _run_warm_start(
    model: PreTrainedModel,
    tokenizer: PreTrainedTokenizerBase,
    codec: Codec,
    warm_start: WarmStart,
    config: GRPOConfig,
    warm_dir: Path,
    precision: Precision,
    stop: threading.Event | None = None,
) -> None:
    """The SFT warm-start; ``stop`` set (an interrupt) ends it after the step it is in."""
    sft = PolicyTrainer(
        model,
        pad_token_id=tokenizer.pad_token_id,
        learning_rate=warm_start.learning_rate,
        micro_batch_tokens=config.micro_batch_tokens,
        max_grad_norm=config.max_grad_norm,
        precision=precision,
        activation_checkpointing=config.activation_checkpointing,
        shared_prefix=config.shared_prefix_training,
    )

    # A bar while it runs, one line when it is done: the run's output stays one line per stage.
    with progress_bar("warm-start", total=warm_start.steps, unit="step") as bar:

        def report(step: int, metrics: dict[str, float]) -> None:
            bar.update()
            bar.set_postfix_str(f"sft loss {metrics['sft_loss']:.4f}")
            if stop is not None and stop.is_set():
                raise KeyboardInterrupt("the warm-start was interrupted")

        history = train_sft(
            sft,
            codec,
            warm_start.demonstrations,
            steps=warm_start.steps,
            batch_size=warm_start.batch_size,
            seed=config.seed,
            on_step=report,
        )
    if history:
        first, last = history[0]["sft_loss"], history[-1]["sft_loss"]
        print(f"warm-start: {len(history)} SFT steps | sft loss {first:.4f} -> {last:.4f}", flush=True)
    # Saved so that a resumed run (LoRA adapters in its checkpoints) starts from the same base,
    # and so that other runs can start from it (model="./runs/<run>/warm_start_model").
    with quiet_libraries():
        model.save_pretrained(warm_dir)
        tokenizer.save_pretrained(warm_dir)  # a complete model folder: usable as another run's config.model


class _Validator:
    """Validation on ``val_tasks`` with the newest weights, on replica 0.

    It first waits for the newest weights to reach the replicas (an async run may still be
    publishing), and runs inside the loop's validation pause (with ``sequential_validation`` an
    async run lets the groups in flight finish and collects nothing until validation is done).
    """

    def __init__(self, context: RunContext, val_tasks: Sequence[Task] | None, loop: TrainingLoop) -> None:
        self.context, self.val_tasks, self.loop = context, val_tasks, loop

    async def run(self) -> dict[str, float]:
        config, replicas, codec = self.context.config, self.context.replicas, self.context.codec
        assert self.val_tasks
        async with self.loop.validation_pause():
            started = time.perf_counter()  # after the pause: the span is validation alone
            await replicas.flush()
            policy_factory = replicas.policy_factory(
                0, codec, sampling_params(config, codec), config.max_model_length
            )
            report = await evaluate_policy_async(
                policy_factory,
                self.val_tasks,
                self.context.env_factory,
                episodes_per_task=config.val_episodes_per_task,
                max_turns=config.max_turns,
                on_env_error=config.on_env_error,
                failed_parse_reward=config.failed_parse_reward,
                progress="validation",
                progress_status=tokens_status(replicas.generators[:1]),
                max_episodes_in_flight=config.effective_val_episodes_in_flight,
            )
            # Validation's episodes have ended; the next step's would allocate beside their caches.
            # (An async run's episodes in flight on replica 0 lose theirs too: one full prefill each.)
            await replicas.drop_kept_prefixes([0])
        self.context.timeline.add(TRAINER_LANE, VALIDATION, started, time.perf_counter())
        metrics = episode_stats(report.episodes, prefix="val/")
        metrics |= {f"val/pass@{k}": v for k, v in report.pass_at_k.items()}
        metrics["val/time_s"] = report.wall_time_s
        return metrics


def _save(
    run_dir: Path,
    step: int,
    context: RunContext,
    tokenizer: PreTrainedTokenizerBase,
    groups_started: int,
    model_only: bool,
) -> None:
    # groups_started: where an async run's stream of groups resumes (groups in flight are redone).
    # The tokenizer goes with the weights, so every checkpoint's model/ is a complete model folder.
    config, trainer = context.config, context.trainer
    save_checkpoint(
        run_dir,
        step,
        model=trainer.model,
        optimizer=None if model_only else trainer.optimizer,
        extra_state={
            "policy_version": context.replicas.version,
            "groups_started": groups_started,
            "seed": config.seed,
        },
        keep_last=1 if model_only else config.keep_last_checkpoints,
        tokenizer=tokenizer,
    )


def _drop_warm_start_if_unneeded(run_dir: Path, config: GRPOConfig) -> None:
    """Delete the warm-started model of a finished run when asked and nothing depends on it.

    A resume loads every weight from the checkpoint, except LoRA (adapters on top of this model)
    and a KL penalty (its reference model is this model): those keep it whatever the setting.
    """
    warm_dir = run_dir / WARM_START_DIR
    needed = config.use_lora or config.kl_coef > 0
    if config.keep_warm_start_model or needed or not warm_dir.is_dir():
        return
    # A run with checkpoints resumes from them; one without (final_checkpoint="none") never resumes.
    if latest_checkpoint(run_dir) is not None or config.final_checkpoint == "none":
        delete_folder(warm_dir)


def _print_step(step: int, num_steps: int, metrics: dict[str, float]) -> None:
    parts = [f"step {step}/{num_steps}"]
    for key, label, fmt in (
        ("reward_mean", "reward", ".3f"),
        ("val/reward_mean", "val", ".3f"),
        ("terminated_ratio", "terminated", ".2f"),
        ("zero_variance_skip_ratio", "zero-var", ".2f"),
        ("train/policy_loss", "loss", ".4f"),
        ("time/step_s", "time", ".1f"),
    ):
        if key in metrics and metrics[key] is not None:
            parts.append(f"{label} {metrics[key]:{fmt}}")
    print(" | ".join(parts), flush=True)


def _write_curves(run_dir: Path, metrics: list[dict[str, Any]]) -> None:
    try:
        from cookbook_lib.display.training_plots import training_curves_figure

        training_curves_figure(metrics).write_html(run_dir / "training_curves.html", include_plotlyjs=True)
    except Exception as exc:  # a plot must never fail a finished run
        logger.warning("could not write training_curves.html: %r", exc)


# --- single turn ---------------------------------------------------------------------------


RewardFn = Callable[[Task, str], float]


class SingleTurnEnv(Env):
    """One prompt, one reply, scored by a reward function: GRPO's classic single-turn setting."""

    def __init__(self, reward_fn: RewardFn, system_prompt: str | None = None) -> None:
        self.reward_fn = reward_fn
        self.system_prompt = system_prompt
        self._messages: list[Message] = []
        self._task: Task | None = None

    async def reset(self, task: Task) -> list[Message]:
        self._task = task
        self._messages = [Message(role="user", content=task.prompt)]
        if self.system_prompt:
            self._messages.insert(0, Message(role="system", content=self.system_prompt))
        return list(self._messages)

    async def step(self, message: Message) -> StepResult:
        assert self._task is not None, "reset() first"
        self._messages.append(message)
        reward = float(self.reward_fn(self._task, message.get("content", "")))
        return StepResult(terminated=True, truncated=False, messages=list(self._messages), reward=reward)

    @property
    def tool_specs(self) -> list[ToolSpec]:
        return []

    @property
    def messages(self) -> list[Message]:
        return list(self._messages)


def train_single_turn(
    config: GRPOConfig,
    *,
    tasks: Sequence[Task],
    reward_fn: RewardFn,
    val_tasks: Sequence[Task] | None = None,
    system_prompt: str | None = None,
    warm_start: WarmStart | None = None,
    on_step: StepCallback | None = None,
) -> TrainResult:
    """GRPO on single replies: ``reward_fn(task, reply_text)`` scores each; no tools, one turn."""
    return train_multi_turn(
        dataclasses.replace(config, max_turns=1),
        tasks=tasks,
        env_factory=lambda task: SingleTurnEnv(reward_fn, system_prompt),
        val_tasks=val_tasks,
        warm_start=warm_start,
        on_step=on_step,
    )


__all__ = [
    "SingleTurnEnv",
    "TrainResult",
    "WarmStart",
    "make_trainer",
    "train_multi_turn",
    "train_single_turn",
]
