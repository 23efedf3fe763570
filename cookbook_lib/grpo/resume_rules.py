"""Which settings may change when a run resumes, and the record of every start of a run.

Rerunning a run (same ``runs_dir``/``run_name``) continues it from its last checkpoint. That is
how a killed run finishes and how a finished run is extended: rerun a 10-step run with
``num_steps=20`` and it trains steps 11 to 20. What the checkpoint was trained under must not
change on the way, or the run would silently become a different experiment: every field that
alters what is trained (the model, the data and its sampling, the loss, the optimizer, the
precision) is :data:`FIXED_ON_RESUME`. Fields that only say how long to train, how often to
validate or checkpoint, where to log, or which hardware runs the same computation are
:data:`CHANGEABLE_ON_RESUME`.

Every field of ``GRPOConfig`` is in exactly one of the two (a test checks, so a new field must be
classified); a field in neither is treated as fixed, the safe default.

Each start of a run appends one line to ``config_history.jsonl`` in the run folder (the step it
started after, and every field that differs from the config the run had before), and
``config.yaml`` holds the config of the latest start, so ``GRPOConfig.from_yaml`` keeps working.
"""

from __future__ import annotations

import dataclasses
import json
from datetime import datetime
from pathlib import Path
from typing import Any

import yaml

from cookbook_lib.grpo.config import ConfigError, GRPOConfig

CONFIG_FILE = "config.yaml"
HISTORY_FILE = "config_history.jsonl"

CHANGEABLE_ON_RESUME: tuple[str, ...] = (
    # How long: may grow to extend a run, never below the last checkpoint's step.
    "num_steps",
    # Evaluation: validation reads the policy, it never trains it. (In an async run validation
    # shares the generators, so its schedule shifts which rollouts overlap it; async runs depend on
    # timing anyway, and what a group may be trained on is bounded by max_steps_off_policy, fixed.)
    "validation_interval",
    "val_episodes_per_task",
    "val_episodes_in_flight",
    "sequential_validation",
    # Bookkeeping: checkpoints, logging, where the run folder is, how it was started.
    "checkpoint_interval",
    "keep_last_checkpoints",
    "final_checkpoint",
    "keep_warm_start_model",
    "wandb_project",
    "run_name",
    "runs_dir",
    "resume",
    # Whether an environment failure stops the run; a run that goes on trains as it would have.
    "on_env_error",
    # Where the same computation runs: the device, the sampling backend (same distribution), and
    # the micro-batch size (gradients accumulate exactly over micro-batches), and recomputing
    # activations instead of keeping them (the same gradients, less memory).
    "device",
    "generator_backend",
    "cuda_graphs",  # the same decode step, recorded once or launched kernel by kernel
    # Where the replicas run (in this process or in Ray actors, same generator, same seeds).
    "generator_placement",
    "ray_address",
    "ray_cpus_per_replica",
    "micro_batch_tokens",
    "activation_checkpointing",
    "shared_prefix_training",
)

FIXED_ON_RESUME: tuple[str, ...] = (
    # The model and how its weights are trained and stored.
    "model",
    "use_lora",
    "lora_rank",
    "lora_alpha",
    "dtype",
    # The data: tasks per step, groups, episodes and how they are sampled and scored.
    "seed",
    "batch_size",
    "episodes_per_task",
    "max_turns",
    "max_model_length",
    "max_tokens_per_turn",
    "enable_thinking",  # what the prompts say, so what is sampled
    "chat_template_kwargs",
    "temperature",
    "top_p",
    "max_sampling_attempts",
    "failed_parse_reward",
    "overlong_masking",
    "overlong_buffer_tokens",
    "overlong_penalty_factor",
    # The loss and the optimizer.
    "learning_rate",
    "warmup_steps",
    "loss_type",
    "importance_ratio_level",
    "loss_aggregation",
    "loss_normalizer",
    "clip_ratio_low",
    "clip_ratio_high",
    "kl_coef",
    "normalize_advantages_by_std",
    "max_grad_norm",
    "weight_decay",
    # Async training: how stale a trained group may be, and how weights reach the generators.
    "max_steps_off_policy",
    "groups_in_flight",
    "stale_groups",  # which groups are trained (the length mix), not only when
    "weight_sync_type",
    "num_generator_replicas",
)


def changed_fields(before: GRPOConfig, after: GRPOConfig) -> dict[str, tuple[Any, Any]]:
    """``{field: (value before, value after)}`` for every field that differs, in field order."""
    old, new = before.to_dict(), after.to_dict()
    return {name: (old[name], new[name]) for name in new if old.get(name) != new[name]}


def resume_problems(saved: GRPOConfig, config: GRPOConfig, checkpoint_step: int) -> list[str]:
    """Why ``config`` cannot continue a run saved as ``saved`` after ``checkpoint_step``; [] if it can."""
    problems = []
    fixed = {
        name: values
        for name, values in changed_fields(saved, config).items()
        if name not in CHANGEABLE_ON_RESUME  # FIXED_ON_RESUME, or not classified yet: refused
    }
    if fixed:
        listed = "; ".join(f"{name}: {old!r} in the run, {new!r} now" for name, (old, new) in fixed.items())
        problems.append(
            f"a different config for what is trained ({listed}). A run continues only with the settings "
            f"it was trained with: restore {', '.join(fixed)}, or start a new run (another run_name) to "
            "train with the new settings. Settings that may change on resume: "
            + ", ".join(CHANGEABLE_ON_RESUME)
        )
    if config.num_steps < checkpoint_step:
        problems.append(
            f"num_steps={config.num_steps} is below step {checkpoint_step} of the run's last checkpoint; "
            f"a trained run cannot be shortened: set num_steps >= {checkpoint_step} ({checkpoint_step} "
            "keeps it as it is), or start a new run_name"
        )
    return problems


def check_resume(run_dir: Path, saved: GRPOConfig, config: GRPOConfig, checkpoint_step: int) -> None:
    """Raise ``ValueError`` naming every field that keeps ``config`` from continuing the saved run."""
    problems = resume_problems(saved, config, checkpoint_step)
    if problems:
        reasons = "\n".join(f"  - {problem}" for problem in problems)
        raise ValueError(f"cannot resume {run_dir} after step {checkpoint_step} with this config:\n{reasons}")


def record_config(run_dir: Path, config: GRPOConfig, start_step: int) -> Path:
    """Write ``config.yaml`` and append this start to ``config_history.jsonl``; returns the YAML path.

    ``start_step`` is the step the run continues after (0 for a run starting from scratch). The
    history line lists every field that differs from the ``config.yaml`` already there, if any.
    """
    run_dir = Path(run_dir)
    path = run_dir / CONFIG_FILE
    changed = _changes_from_saved(path, config) if path.exists() else {}
    entry = {
        "time": datetime.now().isoformat(timespec="seconds"),
        "start_step": start_step,
        "num_steps": config.num_steps,
        "changed": {name: {"before": old, "after": new} for name, (old, new) in changed.items()},
    }
    config.to_yaml(path)
    with (run_dir / HISTORY_FILE).open("a", encoding="utf-8") as history:
        history.write(json.dumps(entry, default=str) + "\n")
    return path


def _changes_from_saved(path: Path, config: GRPOConfig) -> dict[str, tuple[Any, Any]]:
    try:
        return changed_fields(GRPOConfig.from_yaml(path), config)
    except ConfigError:
        # Written by another version of the library (a field since renamed): compare key by key.
        saved = yaml.safe_load(path.read_text()) or {}
        new = config.to_dict()
        names = sorted(set(saved) | set(new))
        return {name: (saved.get(name), new.get(name)) for name in names if saved.get(name) != new.get(name)}


def read_config_history(run_dir: Path) -> list[dict[str, Any]]:
    """The lines of ``config_history.jsonl``, oldest first (empty for a run that has none)."""
    path = Path(run_dir) / HISTORY_FILE
    if not path.exists():
        return []
    return [json.loads(line) for line in path.read_text(encoding="utf-8").splitlines() if line.strip()]


def unclassified_fields() -> list[str]:
    """``GRPOConfig`` fields in neither tuple, or in both: what a new field must fix (a test checks)."""
    names = [f.name for f in dataclasses.fields(GRPOConfig)]
    return [name for name in names if (name in CHANGEABLE_ON_RESUME) == (name in FIXED_ON_RESUME)]


__all__ = [
    "CHANGEABLE_ON_RESUME",
    "FIXED_ON_RESUME",
    "HISTORY_FILE",
    "changed_fields",
    "check_resume",
    "read_config_history",
    "record_config",
    "resume_problems",
]
