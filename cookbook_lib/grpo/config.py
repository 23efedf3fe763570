"""GRPOConfig: every setting of a GRPO run, checked before anything expensive happens.

The field names are the seed page's (``batch_size``, ``episodes_per_task``, ``max_steps_off_policy``
...), so a config written for the hosted cookbook reads the same here. Defaults are sized for the
embedded 135M model on a CPU where the page gives none.

``validate()`` looks only at the config and the environment variables, never at a model, so a
contradiction (or a missing W&B setup) fails in a second instead of after a model has loaded. It
collects every problem and reports them together, each with its fix.

W&B, a deliberate difference from the hosted page: there ``GRPOConfig`` logs to W&B by default;
here ``wandb_project`` defaults to ``None`` (no W&B, ``metrics.jsonl`` only), because a first run
of a CPU cookbook should not need an account or a network. Setting ``wandb_project``, as the seed's
example does, turns W&B on, and then the run refuses to start without a W&B setup, as on the page.

This module imports no torch or transformers: loading or checking a config stays cheap.
"""

from __future__ import annotations

import contextlib
import difflib
import enum
import importlib.util
import math
import os
import re
import secrets
import types
import typing
from collections.abc import Mapping
from dataclasses import asdict, dataclass, field, fields
from datetime import datetime
from pathlib import Path
from typing import Any, Literal, Union
from urllib.parse import urlparse

import yaml

from cookbook_lib.grpo.loss_settings import ImportanceRatioLevel, LossAggregation, LossNormalizer, LossType
from cookbook_lib.types import DEFAULT_MAX_TOKENS_PER_TURN

# Kept equal to cookbook_lib.runtime.models.DEFAULT_MODEL (a test pins it); not imported from there
# because that module imports torch and transformers.
DEFAULT_MODEL = "HuggingFaceTB/SmolLM2-135M-Instruct"
# A chat prompt (system prompt, tool specs, one user turn) cannot fit in fewer tokens than this.
MIN_PROMPT_TOKENS = 64

OnEnvError = Literal["end_episode", "raise"]
GeneratorBackend = Literal["hf", "vllm"]
GeneratorPlacement = Literal["local", "ray"]
StaleGroups = Literal["prevent", "requeue", "drop"]
FinalCheckpoint = Literal["full", "model", "none"]
# Spelling of GRPOConfig.device and .dtype; cookbook_lib/runtime/devices.py says what they mean and checks
# the machine has them (it imports torch, which this module must not).
DEVICE_PATTERN = re.compile(r"^(auto|cpu|cuda(:\d+)?)$")
DTypeName = Literal["auto", "float32", "bfloat16", "float16"]


class WeightSyncType(enum.StrEnum):
    """How new weights reach the generators after an optimizer step (values are the seed's names)."""

    WEIGHT_SYNC_TYPE_SYNCHRONOUS = "WEIGHT_SYNC_TYPE_SYNCHRONOUS"
    WEIGHT_SYNC_TYPE_BACKGROUND_PUBLISH = "WEIGHT_SYNC_TYPE_BACKGROUND_PUBLISH"
    WEIGHT_SYNC_TYPE_PIPELINE = "WEIGHT_SYNC_TYPE_PIPELINE"


DEFERRED_WEIGHT_SYNC = (
    WeightSyncType.WEIGHT_SYNC_TYPE_BACKGROUND_PUBLISH,
    WeightSyncType.WEIGHT_SYNC_TYPE_PIPELINE,
)


class ConfigError(ValueError):
    """A config that cannot run; ``problems`` lists each problem with its fix."""

    def __init__(self, problems: list[str]) -> None:
        self.problems = list(problems)
        lines = "\n".join(f"  - {p}" for p in self.problems)
        super().__init__(f"GRPOConfig has {len(self.problems)} problem(s):\n{lines}")


@dataclass(frozen=True)
class Bound:
    """A field's lowest value: ``low`` itself allowed unless ``strict``; ``note`` says how to fix it."""

    low: float
    strict: bool = False
    note: str = ""


def _setting(
    default: Any, *, at_least: float | None = None, above: float | None = None, note: str = ""
) -> Any:
    """A field's default and, beside it, its bound (``validate`` checks it): ``at_least`` allows
    the value itself, ``above`` does not. So a setting's type, default, bound and doc stand
    together."""
    if above is not None:
        return field(default=default, metadata={"bound": Bound(above, strict=True, note=note)})
    if at_least is not None:
        return field(default=default, metadata={"bound": Bound(at_least, note=note)})
    return field(default=default)


def _default_run_name() -> str:
    # The random suffix keeps two runs started in the same second (tests, sweeps) apart, which
    # matters because resume="auto" would otherwise continue the other run.
    return f"grpo-{datetime.now():%Y%m%d-%H%M%S}-{secrets.token_hex(2)}"


@dataclass(frozen=True)
class GRPOConfig:
    """Settings of one GRPO run; each field's docstring says what it does and why.

    Frozen, so a config handed to rollout workers cannot change under them: derive a variant with
    ``dataclasses.replace(config, num_steps=5)``. Constructing one checks nothing; ``validate()`` does.
    """

    # --- the seed page's fields -----------------------------------------------------------
    model: str = DEFAULT_MODEL
    """Model name or local path; the default is the embedded SmolLM2-135M-Instruct (no hub)."""
    batch_size: int = _setting(4, at_least=1)
    """Tasks per optimizer step; each contributes one group of ``episodes_per_task`` episodes."""
    episodes_per_task: int = _setting(8, at_least=2, note="GRPO needs a group to compare with; 8 is common")
    """Group size: episodes per task, the baseline of the group-relative advantage (at least 2)."""
    num_steps: int = _setting(20, at_least=1)
    """Optimizer steps in the run (the seed's 200 is hours on a CPU)."""
    validation_interval: int = _setting(5, at_least=0, note="0 = validate only at the end")
    """Validate on ``val_tasks`` every this many steps, and at the end; 0 = only at the end."""
    val_episodes_per_task: int = _setting(1, at_least=1)
    """Episodes per validation task (more = a less noisy validation reward, slower)."""
    val_episodes_in_flight: int | None = _setting(None, at_least=1, note="None = a training step's")
    """Validation episodes playing at once; None = as many as a training step samples at once
    (``episodes_per_task`` times ``batch_size``, or ``groups_in_flight`` in an async run), so
    validation's KV caches take no more memory than sampling does (see ``effective_val_episodes_in_flight``).
    On a GPU with memory to spare, raise it: decoding more rows together costs little there."""
    max_turns: int = _setting(6, at_least=1)
    """Assistant turns before an episode is truncated with ``MAX_TURNS``."""
    max_model_length: int = 2048
    """Token limit of a whole conversation; filling it truncates with ``CONTEXT_OVERFLOW``."""
    learning_rate: float = _setting(2e-5, above=0)
    """AdamW learning rate."""
    warmup_steps: int = _setting(0, at_least=0, note="0 = the whole learning rate from the first update")
    """Optimizer updates over which the learning rate rises linearly to ``learning_rate``: update
    ``k`` (counted from 1) takes ``learning_rate * min(1, k / warmup_steps)``; 0 = no warm-up.
    AdamW's first update moves every weight by about the learning rate whatever the gradient's scale,
    so one unlucky first batch can break a policy's tool-call format; a short warm-up softens it
    (docs/benchmarks.md, sessions 33-34). Counted in updates taken, so a resumed run continues it."""
    wandb_project: str | None = None
    """W&B project to log to; ``None`` = no W&B (the hosted page defaults to logging; see module doc)."""
    sequential_validation: bool = False
    """Run validation on its own (async collection paused) instead of overlapped with training."""
    max_sampling_attempts: int = _setting(1, at_least=1, note="1 = no resampling of zero-variance groups")
    """Rounds of groups a step may sample to replace zero-variance groups (1 = no resampling)."""
    overlong_masking: bool = False
    """Build no samples from truncated episodes; their rewards still count in the group baseline."""
    failed_parse_reward: float = 0.0
    """Reward of an episode ended by a reply that could not be parsed (``PARSE_FAILURE``)."""
    use_lora: bool = False
    """Train LoRA adapters instead of full weights (on a CPU LoRA measured no faster, so off)."""
    # --- where and in what precision (see cookbook_lib/runtime/devices.py) ----------------------------
    device: str = "auto"
    """``auto`` (CUDA when present, else CPU), ``cpu``, ``cuda``, ``cuda:N``: where the run's models live."""
    dtype: DTypeName = "auto"
    """Precision policy: ``float32``; ``bfloat16`` (bf16 sampling, bf16 autocast training over float32
    weights); ``float16`` (fp16 sampling, fp32 training); ``auto``: bf16 on a GPU that has it, fp16 on
    one that has not; on a CPU bf16 where its bf16 matmuls measure faster (native bf16), else float32
    (``dtype="float32"`` keeps importance ratios exact; see devices.py)."""
    # --- async (max_steps_off_policy=None keeps lockstep) -----------------------------------
    max_steps_off_policy: int | None = _setting(
        None, at_least=0, note="None = lockstep; for async start with 1"
    )
    """Oldest admissible group, in optimizer steps since its rollout started; None = lockstep."""
    groups_in_flight: int | None = _setting(None, at_least=1, note="None = batch_size")
    """Groups collected concurrently; None = ``batch_size`` (see ``effective_groups_in_flight``)."""
    stale_groups: StaleGroups = "prevent"
    """How async keeps long episodes within ``max_steps_off_policy`` (without it, long groups go stale
    and training sees mostly short episodes: the length bias, docs/architecture.md). ``prevent``: the
    trainer takes groups in the order they started, waiting for a slow one, and a group starts only
    if it will be trained within the bound, so none goes stale. ``requeue``: groups are taken as they
    finish (oldest-started first); a stale group is dropped and its task restarted first, under new
    weights. ``drop``: the same, but the task is lost (trains fewest long episodes)."""
    weight_sync_type: WeightSyncType | str = WeightSyncType.WEIGHT_SYNC_TYPE_SYNCHRONOUS
    """How weights reach the generators; the two deferred modes need ``max_steps_off_policy``."""
    num_generator_replicas: int = _setting(1, at_least=1)
    """Generator copies serving rollouts; each receives every weight update."""
    generator_backend: GeneratorBackend = "hf"
    """Who samples: ``hf`` (transformers, CPU or GPU) or ``vllm`` (an in-process vLLM engine sharing the
    GPU with training: ``pip install -e ".[vllm]"`` on a CUDA machine; see ``generators/vllm.py``).
    With ``use_lora`` vLLM receives the merged weights, as the ``hf`` backend does."""
    cuda_graphs: bool = True
    """With the ``hf`` backend on CUDA: decode in fixed-shape slots, each step replayed as a CUDA graph
    (one launch instead of hundreds; ``generators/slot_batch.py``), for models with full attention
    and ``sdpa`` or ``eager`` attention (others keep the growing cache). False keeps the growing KV
    cache, as on a CPU: a way back if a model misbehaves under graphs. No effect on a CPU."""
    generator_placement: GeneratorPlacement = "local"
    """Where the replicas run: ``local`` (in this process, sharing its cores or device) or ``ray`` (one
    Ray actor per replica with its own model copy: one GPU each on a GPU machine, else
    ``ray_cpus_per_replica`` cores each; ``pip install -e ".[ray]"``; see ``generators/ray_replicas.py``)."""
    ray_address: str | None = None
    """With ``generator_placement="ray"``: the Ray cluster to join (``ray.init(address=...)``); None =
    ``RAY_ADDRESS`` if set, else a local Ray is started for the run and stopped after it."""
    ray_cpus_per_replica: int = _setting(1, at_least=1)
    """With ``generator_placement="ray"`` on a CPU: cores (and torch threads) of each replica's actor.
    1 measured fastest on a shared 2-core CPU (docs/benchmarks.md); raise it only on free cores."""
    # --- run directory, checkpoints ----------------------------------------------------------
    run_name: str = field(default_factory=_default_run_name)
    """Name of the run's directory ``runs_dir/run_name``; default: a timestamp and a random suffix."""
    runs_dir: str | Path = "runs"
    """Parent directory of all runs (stored as a string so the YAML stays plain)."""
    checkpoint_interval: int = _setting(10, at_least=0, note="0 = checkpoint only at the end")
    """Save a checkpoint every this many steps, and at the end; 0 = only at the end."""
    keep_last_checkpoints: int = _setting(2, at_least=1, note="a resume needs the newest checkpoint")
    """Checkpoints kept on disk, newest first; older ones are deleted once a newer one is complete.
    Each holds the weights and AdamW's two moments (three times the float32 weights: ~1.6 GB for
    the embedded 135M model). 1 keeps the least; a resume needs only the newest."""
    final_checkpoint: FinalCheckpoint = "full"
    """What the last step's checkpoint holds. "full": like every other checkpoint, everything an
    exact extension of the run needs (weights, AdamW's moments, RNG states). "model": the trained
    model only (weights in the training dtype and the tokenizer: a complete model folder, ~0.54 GB
    for the embedded model), and the run's older checkpoints are deleted once it is written.
    Checkpoints written while the run goes are full either way, so a killed run resumes exactly;
    extending a finished "model" run (a larger ``num_steps``) restarts AdamW from zero moments.
    "none": no checkpoint at the end (only those ``checkpoint_interval`` wrote), for quick runs
    whose folder should hold metrics and episodes only (megabytes); the trained model is still
    returned in ``TrainResult.model``."""
    keep_warm_start_model: bool = True
    """Keep ``run_dir/warm_start_model`` (the warm-started model, which other runs can start from
    with ``model=``) when the run finishes. False deletes it then, unless the run still needs it:
    LoRA checkpoints hold adapters on top of it, and a KL penalty's reference model is it."""
    resume: bool | Literal["auto"] = "auto"
    """True: continue from the run's last checkpoint (fail if none); False: start afresh;
    "auto": resume when ``run_dir`` holds a checkpoint (a rerun of a killed run continues)."""
    seed: int = 0
    """Seeds task order, sampling and initialisation, so a run can be repeated."""
    on_env_error: OnEnvError = "end_episode"
    """An exception in the env (or inside the library's ModelPolicy) ends that episode (``ERROR``, kept
    for inspection) or stops the run."""
    # --- sampling ----------------------------------------------------------------------------
    max_tokens_per_turn: int = _setting(DEFAULT_MAX_TOKENS_PER_TURN, at_least=1)
    """Sampling budget of one assistant turn (a tool call or an answer needs far fewer); the same
    default as ``evaluate``'s ``SamplingParams.max_tokens``."""
    temperature: float = _setting(
        1.0, above=0, note="greedy episodes of a group are identical, so every advantage is 0; use 1.0"
    )
    """Sampling temperature; must be > 0: greedy groups are identical and carry no signal."""
    top_p: float = _setting(1.0, above=0)
    """Nucleus sampling; 1 = the full distribution, which the importance ratio assumes."""
    enable_thinking: bool | None = None
    """Reasoning on (True) or off (False) in chat templates that have the switch (Qwen3, Qwen3.5+,
    GLM, Gemma 4: ``enable_thinking``), passed to every render; None keeps the template's default.
    Refused for templates without it. Reasoning is sampled and trained like any other token, and
    kept out of the answer the env scores (``Message["reasoning_content"]``)."""
    chat_template_kwargs: dict[str, Any] | None = None
    """Other variables of the model's chat template, passed to every render, e.g. gpt-oss's
    ``{"reasoning_effort": "low"}`` or Qwen3.8's ``{"preserve_thinking": False}``. None = none.
    Use ``enable_thinking`` for the thinking switch."""
    # --- LoRA (when use_lora) ----------------------------------------------------------------
    lora_rank: int = 16
    """Rank of the LoRA adapters."""
    lora_alpha: float = 32.0
    """LoRA scaling numerator (the update is scaled by ``lora_alpha / lora_rank``)."""
    # --- loss ---------------------------------------------------------------------------------
    loss_type: LossType = "ppo_clip"
    """``ppo_clip``: clipped surrogate; ``cispo``: clipped importance weight, stop-gradient (CISPO)."""
    importance_ratio_level: ImportanceRatioLevel = "token"
    """Ratio per token, or one per sequence, the geometric mean of the token ratios (GSPO)."""
    loss_aggregation: LossAggregation = "token_mean"
    """Mean over all tokens, mean of per-episode means, or sum / fixed horizon (Dr. GRPO, no length bias)."""
    loss_normalizer: LossNormalizer = "trained_groups"
    """What the aggregation's counts (tokens, sequences) cover. ``trained_groups``: the groups the
    step trains, so a step whose only signal is one group moves the weights as far as a step of
    ``batch_size`` such groups. ``batch_groups``: the step's ``batch_size`` groups, zero-variance
    groups included where resampling did not replace them (their advantage is 0: they add to the
    count, not the gradient), as TRL's and verl's GRPO losses count them: a step with less signal
    takes a smaller step."""
    clip_ratio_low: float = _setting(0.2, at_least=0)
    """Ratio clipped below at 1 - clip_ratio_low. (GSPO's paper uses ~3e-4 with sequence ratios.)"""
    clip_ratio_high: float = _setting(0.28, at_least=0)
    """Ratio clipped above at 1 + clip_ratio_high; higher than low, as in DAPO ("clip-higher")."""
    kl_coef: float = _setting(0.0, at_least=0, note="0 = no KL penalty")
    """KL penalty to the starting model; 0 = none, and the reference model is then never loaded."""
    normalize_advantages_by_std: bool = True
    """Divide advantages by the group's reward std (GRPO); False as in Dr. GRPO."""
    max_grad_norm: float | None = _setting(1.0, above=0, note="None = no clipping")
    """Clip the gradient to this global norm; None = no clipping."""
    weight_decay: float = _setting(0.0, at_least=0)
    """AdamW weight decay."""
    micro_batch_tokens: int = 2048
    """Token budget of one packed micro-batch; at least ``max_model_length`` so any episode fits."""
    activation_checkpointing: bool = True
    """Keep only each decoder layer's input for the backward pass and recompute the rest (also
    called gradient checkpointing): the trainer's activations shrink ~20x (embedded model: 1.4 MB
    to 72 KB per token of a micro-batch) for one more forward pass per step (~20-30 % of training
    time). False trades that memory back for speed."""
    shared_prefix_training: bool = True
    """Forward each token prefix that samples of a micro-batch share (a system prompt, a group's
    task) once, with every continuation attending to it through a block mask: the same loss and
    gradients as padded rows, ~4x fewer tokens forwarded at the tool-use demo's shape. Models whose
    layers cannot take a block mask (recurrent or sliding-window layers, flash attention) are
    padded as before; False always pads."""
    # --- soft overlong penalty (DAPO) --------------------------------------------------------
    overlong_buffer_tokens: int = _setting(256, at_least=0, note="0 = no overlong penalty")
    """Length of the linear ramp before the limit: the penalty grows from 0 to the factor over it."""
    overlong_penalty_factor: float = _setting(1.0, at_least=0, note="0 = no overlong penalty")
    """Reward lost at the limit by CONTEXT_OVERFLOW and MAX_TURNS episodes (the seed's table); 0 = off."""

    def __post_init__(self) -> None:
        # Normalise what YAML and notebooks hand us: the sync mode's name as a string, a Path.
        # A string naming no sync mode is kept, for validate() to report with the valid names.
        if isinstance(self.weight_sync_type, str) and self.weight_sync_type in WeightSyncType.__members__:
            object.__setattr__(self, "weight_sync_type", WeightSyncType(self.weight_sync_type))
        if isinstance(self.runs_dir, Path):
            object.__setattr__(self, "runs_dir", str(self.runs_dir))

    @classmethod
    def small(cls, **overrides: Any) -> GRPOConfig:
        """A quick run through the library API, for trying an env or a change: two steps of two
        tasks, two episodes each, short turns, no validation, no checkpoint and no warm-started
        model kept (the run folder holds metrics and episodes: megabytes). ``overrides`` set any
        field. About a minute on the embedded model on 2 CPU cores, seconds on a tiny one."""
        settings: dict[str, Any] = dict(
            batch_size=2,
            episodes_per_task=2,
            num_steps=2,
            max_turns=3,
            max_model_length=1536,
            max_tokens_per_turn=32,
            micro_batch_tokens=2048,
            validation_interval=0,
            checkpoint_interval=0,
            final_checkpoint="none",
            keep_warm_start_model=False,
            wandb_project=None,
        )
        settings.update(overrides)
        return cls(**settings)

    @property
    def run_dir(self) -> Path:
        """Where this run writes its config, metrics, episodes and checkpoints."""
        return Path(self.runs_dir) / self.run_name

    @property
    def effective_groups_in_flight(self) -> int:
        return self.batch_size if self.groups_in_flight is None else self.groups_in_flight

    @property
    def effective_val_episodes_in_flight(self) -> int:
        if self.val_episodes_in_flight is not None:
            return self.val_episodes_in_flight
        groups = self.effective_groups_in_flight if self.is_async else self.batch_size
        return self.episodes_per_task * groups

    @property
    def is_async(self) -> bool:
        return self.max_steps_off_policy is not None

    # --- YAML -----------------------------------------------------------------------------------
    def to_dict(self) -> dict[str, Any]:
        """Plain data (enums as their names), in field order."""
        data = asdict(self)
        data["weight_sync_type"] = str(self.weight_sync_type)
        return data

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> GRPOConfig:
        """Build from plain data; an unknown key raises ConfigError naming it and the closest key."""
        known = [f.name for f in fields(cls)]
        unknown = [key for key in data if key not in known]
        if unknown:
            raise ConfigError([_unknown_key(str(key), known) for key in unknown])
        values = dict(data)
        for name, (number, _) in _NUMBERS.items():
            # PyYAML reads "2e-5" (no dot) as a string; accept it as a float. A string that is no
            # number is kept, for validate() to report with the field's name.
            if number is float and isinstance(values.get(name), str):
                with contextlib.suppress(ValueError):
                    values[name] = float(values[name])
        return cls(**values)

    @classmethod
    def from_yaml(cls, path: str | Path) -> GRPOConfig:
        """Load a config written by ``to_yaml`` or by hand; missing keys take their defaults."""
        data = yaml.safe_load(Path(path).read_text()) or {}
        if not isinstance(data, dict):
            raise ConfigError(
                [f"{path} must hold a mapping of field names to values, got {type(data).__name__}"]
            )
        return cls.from_dict(data)

    def to_yaml(self, path: str | Path) -> Path:
        """Write every field (so the file documents the run completely); returns the path."""
        path = Path(path)
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(yaml.safe_dump(self.to_dict(), sort_keys=False))
        return path

    # --- checks -------------------------------------------------------------------------------
    def validate(self, environ: Mapping[str, str] | None = None) -> None:
        """Raise ConfigError listing every problem with its fix; ``environ`` defaults to os.environ.

        Cheap and model-free: ``train_multi_turn`` calls it before anything is loaded.
        """
        problems = self.problems(environ)
        if problems:
            raise ConfigError(problems)

    def problems(self, environ: Mapping[str, str] | None = None) -> list[str]:
        """Every reason this config cannot run, each with its fix; empty when it can."""
        found = _type_problems(self)
        if not found:  # the range checks compare numbers, so they need the right types first
            found = _range_problems(self)
        if self.wandb_project is not None and not _wandb_is_set_up(
            os.environ if environ is None else environ
        ):
            found.append(
                f"wandb_project={self.wandb_project!r} but W&B is not set up (no WANDB_API_KEY, WANDB_MODE "
                "not offline, no `wandb login`): export WANDB_API_KEY, set WANDB_MODE=offline to log "
                "locally, or pass wandb_project=None to turn W&B logging off"
            )
        return found


# Everything validate() checks per field is read off the fields themselves (their resolved type
# hints and their bounds), so a new setting is one field with its type, default, bound and doc.
_HINTS = typing.get_type_hints(GRPOConfig)


def _alternatives(hint: Any) -> tuple[Any, ...]:
    return (
        typing.get_args(hint)
        if isinstance(hint, types.UnionType) or typing.get_origin(hint) is Union
        else (hint,)
    )


def _number_kind(hint: Any) -> tuple[type, bool] | None:
    """``(int or float, whether None is allowed)`` for a numeric field, else None."""
    options = _alternatives(hint)
    numbers = [t for t in options if t in (int, float)]
    if len(numbers) != 1 or any(t not in (int, float, type(None)) for t in options):
        return None
    return numbers[0], type(None) in options


def _choices(hint: Any) -> tuple[object, ...] | None:
    """The values a Literal (or enum) field admits, True and False too where it also takes a bool."""
    found: list[object] = []
    for option in _alternatives(hint):
        if typing.get_origin(option) is Literal:
            found += typing.get_args(option)
        elif isinstance(option, type) and issubclass(option, enum.Enum):
            found += list(option)
        elif option is bool:
            found += [True, False]
    return tuple(found) if any(not isinstance(x, bool) for x in found) else None


_NUMBERS = {name: kind for name, hint in _HINTS.items() if (kind := _number_kind(hint)) is not None}
_BOOLS = tuple(name for name, hint in _HINTS.items() if hint is bool)
_CHOICES = {name: choices for name, hint in _HINTS.items() if (choices := _choices(hint)) is not None}
_BOUNDS: dict[str, Bound] = {f.name: f.metadata["bound"] for f in fields(GRPOConfig) if "bound" in f.metadata}


def _type_problems(c: GRPOConfig) -> list[str]:
    out = []
    for name, (number, optional) in _NUMBERS.items():
        value = getattr(c, name)
        if value is None and optional:
            continue
        is_int = number is int
        ok = isinstance(value, int) if is_int else isinstance(value, int | float) and math.isfinite(value)
        if isinstance(value, bool) or not ok:
            out.append(f"{name} must be {'an integer' if is_int else 'a finite number'}, got {value!r}")
    for name, choices in _CHOICES.items():
        value = getattr(c, name)
        if not any(value == x and type(value) is type(x) for x in choices):
            out.append(f"{name}={value!r} is not one of {_names(choices)}")
    for name in _BOOLS:
        if not isinstance(getattr(c, name), bool):
            out.append(f"{name} must be true or false, got {getattr(c, name)!r}")
    for name in ("model", "run_name", "runs_dir"):
        if not isinstance(getattr(c, name), str) or not getattr(c, name):
            out.append(f"{name} must be a non-empty string, got {getattr(c, name)!r}")
    if not (isinstance(c.device, str) and DEVICE_PATTERN.match(c.device)):
        out.append(f"device={c.device!r} is not one of 'auto', 'cpu', 'cuda', 'cuda:N' (N a GPU index)")
    if not (c.ray_address is None or (isinstance(c.ray_address, str) and c.ray_address)):
        out.append(
            f"ray_address must be a Ray address such as 'ray://host:10001', or None, got {c.ray_address!r}"
        )
    kwargs = c.chat_template_kwargs
    if kwargs is not None and not (isinstance(kwargs, dict) and all(isinstance(k, str) for k in kwargs)):
        out.append(
            f"chat_template_kwargs must be a mapping of variable names to values, or None, got {kwargs!r}"
        )
    elif kwargs and "enable_thinking" in kwargs:
        out.append("chat_template_kwargs holds enable_thinking; set GRPOConfig.enable_thinking instead")
    if c.enable_thinking is not None and not isinstance(c.enable_thinking, bool):
        out.append(
            f"enable_thinking must be true, false or None (the template's default), got {c.enable_thinking!r}"
        )
    if not (c.wandb_project is None or isinstance(c.wandb_project, str)):
        out.append(f"wandb_project must be a string or None, got {c.wandb_project!r}")
    return out


def _range_problems(c: GRPOConfig) -> list[str]:
    out = []
    for name, bound in _BOUNDS.items():
        value = getattr(c, name)
        if value is not None and (value <= bound.low if bound.strict else value < bound.low):
            out.append(
                f"{name} must be {'>' if bound.strict else '>='} {bound.low:g}, got {value}"
                + (f" ({bound.note})" if bound.note else "")
            )
    if c.top_p > 1:
        out.append(f"top_p must be at most 1 (1 = the full distribution), got {c.top_p}")
    room = c.max_model_length - c.max_tokens_per_turn
    if room < MIN_PROMPT_TOKENS:
        out.append(
            f"max_tokens_per_turn={c.max_tokens_per_turn} leaves {room} of max_model_length="
            f"{c.max_model_length} tokens for the prompt (system prompt, tools, history); lower "
            f"max_tokens_per_turn or raise max_model_length so that at least {MIN_PROMPT_TOKENS} remain"
        )
    if c.overlong_buffer_tokens >= c.max_model_length:
        out.append(
            f"overlong_buffer_tokens={c.overlong_buffer_tokens} must be below max_model_length="
            f"{c.max_model_length}, or every episode is penalised; lower it, or set 0 to turn the penalty off"
        )
    if c.micro_batch_tokens < c.max_model_length:
        out.append(
            f"micro_batch_tokens={c.micro_batch_tokens} cannot hold an episode of max_model_length="
            f"{c.max_model_length} tokens; set micro_batch_tokens >= max_model_length"
        )
    if c.use_lora and c.lora_rank < 1:
        out.append(f"lora_rank must be >= 1 with use_lora=True, got {c.lora_rank}")
    if c.use_lora and c.lora_alpha <= 0:
        out.append(f"lora_alpha must be > 0 with use_lora=True, got {c.lora_alpha}")
    if c.run_name in (".", "..") or set("/\\") & set(c.run_name):
        out.append(f"run_name={c.run_name!r} must be a single directory name, without path separators")
    if c.weight_sync_type in DEFERRED_WEIGHT_SYNC and c.max_steps_off_policy is None:
        out.append(
            f"{c.weight_sync_type} defers weight publication, which needs async training to bound the "
            "drift: set max_steps_off_policy (start with 1), or use WEIGHT_SYNC_TYPE_SYNCHRONOUS"
        )
    if c.weight_sync_type == WeightSyncType.WEIGHT_SYNC_TYPE_PIPELINE and c.use_lora:
        out.append(
            "WEIGHT_SYNC_TYPE_PIPELINE needs full-weight training: set use_lora=False or use "
            "WEIGHT_SYNC_TYPE_SYNCHRONOUS/BACKGROUND_PUBLISH"
        )
    if c.generator_backend == "vllm":
        out += _vllm_problems(c)
    if c.generator_placement == "ray":
        out += _ray_problems(c)
    return out


def _ray_problems(c: GRPOConfig) -> list[str]:
    """What Ray placement needs. (Every weight-sync mode keeps its meaning: each actor's generator
    switches weights between requests or between decode steps, as a local one does.)"""
    out = []
    if c.generator_backend != "hf":
        out.append(
            f"generator_placement='ray' runs generator_backend='hf' replicas in Ray actors, but "
            f"generator_backend={c.generator_backend!r} (vLLM's engine runs in this process): set "
            "generator_backend='hf', or generator_placement='local'"
        )
    if importlib.util.find_spec("ray") is None:
        out.append(
            "generator_placement='ray' needs Ray, which is not installed: pip install -e \".[ray]\" "
            "(or pip install ray), or use generator_placement='local'"
        )
    return out


def _vllm_problems(c: GRPOConfig) -> list[str]:
    """What the in-process vLLM engine cannot do. Whether vllm and a GPU are there is checked before
    any model loads by ``cookbook_lib.generators.vllm.check_vllm_available``: it needs imports this
    module avoids. (WEIGHT_SYNC_TYPE_PIPELINE is no problem: vLLM can pause running requests, take
    new weights and resume them; that check makes sure the installed vLLM has that API.)"""
    out = []
    if c.num_generator_replicas != 1:
        out.append(
            f"generator_backend='vllm' with num_generator_replicas={c.num_generator_replicas}: the vLLM "
            "engine runs inside this process (one per process) and batches every episode itself; set "
            "num_generator_replicas=1"
        )
    if c.device == "cpu":
        out.append(
            "generator_backend='vllm' samples on a CUDA GPU, but device='cpu': set device='auto' or "
            "'cuda' on a GPU machine, or use generator_backend='hf'"
        )
    elif c.device.startswith("cuda:") and c.device != "cuda:0":
        out.append(
            f"generator_backend='vllm' runs its engine on the first visible GPU, but device={c.device!r}: "
            f"start Python with CUDA_VISIBLE_DEVICES={c.device.removeprefix('cuda:')} and set "
            "device='cuda', or use generator_backend='hf'"
        )
    return out


def _names(choices: tuple[object, ...]) -> str:
    return ", ".join(repr(str(x)) if isinstance(x, str) else repr(x) for x in choices)


def _unknown_key(key: str, known: list[str]) -> str:
    close = difflib.get_close_matches(key, known, n=1)
    hint = f" (did you mean {close[0]!r}?)" if close else ""
    return f"unknown key {key!r}{hint}; GRPOConfig's fields are: {', '.join(known)}"


def _wandb_is_set_up(env: Mapping[str, str]) -> bool:
    """An API key, an offline/disabled mode, or a `wandb login` entry in the netrc file."""
    if env.get("WANDB_API_KEY") or env.get("WANDB_MODE", "").lower() in ("offline", "disabled", "dryrun"):
        return True
    netrc = env.get("NETRC") or (str(Path(env["HOME"]) / ".netrc") if env.get("HOME") else None)
    host = urlparse(env.get("WANDB_BASE_URL") or "https://api.wandb.ai").hostname or "api.wandb.ai"
    try:
        return netrc is not None and host in Path(netrc).read_text()
    except OSError:
        return False
