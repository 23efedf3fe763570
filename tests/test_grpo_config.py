"""GRPOConfig: YAML round trip, unknown keys, every contradiction, the W&B check, cheapness."""

from __future__ import annotations

import subprocess
import sys
from dataclasses import fields
from pathlib import Path

import pytest

from cookbook_lib.grpo.config import (
    DEFAULT_MODEL,
    ConfigError,
    GRPOConfig,
    WeightSyncType,
)

# An environment in which W&B counts as set up, so only the check under test can fire.
OFFLINE = {"WANDB_MODE": "offline"}
PIPELINE = WeightSyncType.WEIGHT_SYNC_TYPE_PIPELINE
BACKGROUND = WeightSyncType.WEIGHT_SYNC_TYPE_BACKGROUND_PUBLISH


def test_defaults_are_valid_and_follow_the_seed():
    config = GRPOConfig()
    config.validate(OFFLINE)
    assert config.problems({}) == []  # no wandb_project: no W&B setup needed
    assert config.weight_sync_type is WeightSyncType.WEIGHT_SYNC_TYPE_SYNCHRONOUS
    assert config.max_steps_off_policy is None and not config.is_async
    assert config.effective_groups_in_flight == config.batch_size
    assert (config.clip_ratio_low, config.clip_ratio_high) == (0.2, 0.28)
    assert config.run_dir == Path("runs") / config.run_name


def test_default_model_is_the_embedded_one():
    from cookbook_lib.runtime.models import DEFAULT_MODEL as MODELS_DEFAULT

    assert DEFAULT_MODEL == MODELS_DEFAULT == GRPOConfig().model


def test_the_seed_examples_construct():
    GRPOConfig(
        model="Qwen/Qwen3.8-27B",
        batch_size=4,
        episodes_per_task=8,
        num_steps=200,
        validation_interval=10,
        max_turns=6,
        max_model_length=2048,
        learning_rate=2e-5,
        wandb_project="grpo-tool-use-game",
        sequential_validation=True,
        max_sampling_attempts=2,
    ).validate({"WANDB_API_KEY": "k"})
    config = GRPOConfig(max_steps_off_policy=1, groups_in_flight=8, num_generator_replicas=2)
    config.validate(OFFLINE)
    assert config.is_async and config.effective_groups_in_flight == 8


def test_validation_plays_as_many_episodes_at_once_as_a_step_samples_unless_told():
    assert GRPOConfig(batch_size=4, episodes_per_task=4).effective_val_episodes_in_flight == 16
    async_config = GRPOConfig(batch_size=4, episodes_per_task=4, max_steps_off_policy=1, groups_in_flight=6)
    assert async_config.effective_val_episodes_in_flight == 24
    assert GRPOConfig(val_episodes_in_flight=40).effective_val_episodes_in_flight == 40
    with pytest.raises(ConfigError, match="val_episodes_in_flight"):
        GRPOConfig(val_episodes_in_flight=0).validate(OFFLINE)


def test_default_run_names_differ():
    assert GRPOConfig().run_name != GRPOConfig().run_name


def test_weight_sync_type_accepts_its_string_name():
    config = GRPOConfig(weight_sync_type="WEIGHT_SYNC_TYPE_PIPELINE", max_steps_off_policy=1)
    assert config.weight_sync_type is PIPELINE
    assert GRPOConfig(runs_dir=Path("a/b")).runs_dir == "a/b"


def test_yaml_round_trip_with_enums_and_none(tmp_path):
    config = GRPOConfig(
        weight_sync_type=BACKGROUND,
        max_steps_off_policy=2,
        groups_in_flight=None,
        max_grad_norm=None,
        wandb_project=None,
        resume=True,
        loss_type="cispo",
        learning_rate=3e-6,
        runs_dir=tmp_path / "runs",
    )
    path = config.to_yaml(tmp_path / "deep" / "config.yaml")
    text = path.read_text()
    assert "weight_sync_type: WEIGHT_SYNC_TYPE_BACKGROUND_PUBLISH" in text
    assert "groups_in_flight: null" in text and "!!python" not in text
    loaded = GRPOConfig.from_yaml(path)
    assert loaded == config
    assert loaded.weight_sync_type is BACKGROUND
    assert [f.name for f in fields(GRPOConfig)] == list(config.to_dict())


def test_hand_written_yaml(tmp_path):
    path = tmp_path / "config.yaml"
    # PyYAML reads 2e-5 (no dot) as a string; the config takes it as the float it means.
    path.write_text("learning_rate: 2e-5\nweight_sync_type: WEIGHT_SYNC_TYPE_SYNCHRONOUS\nbatch_size: 2\n")
    config = GRPOConfig.from_yaml(path)
    assert config.learning_rate == 2e-5 and config.batch_size == 2
    assert config.weight_sync_type is WeightSyncType.WEIGHT_SYNC_TYPE_SYNCHRONOUS
    path.write_text("")
    assert GRPOConfig.from_yaml(path).batch_size == GRPOConfig().batch_size
    path.write_text("- a list\n")
    with pytest.raises(ConfigError, match="mapping"):
        GRPOConfig.from_yaml(path)


def test_unknown_keys_are_named_with_a_suggestion(tmp_path):
    path = tmp_path / "config.yaml"
    path.write_text("batchsize: 4\nlearning_rate: 1.0e-5\nzzz_qqq: 1\n")
    with pytest.raises(ValueError) as info:
        GRPOConfig.from_yaml(path)
    message = str(info.value)
    assert "'batchsize'" in message and "did you mean 'batch_size'?" in message
    assert "'zzz_qqq'" in message and "2 problem(s)" in message
    assert len(info.value.problems) == 2


CONTRADICTIONS = [
    ({"weight_sync_type": PIPELINE, "use_lora": True, "max_steps_off_policy": 1}, "set use_lora=False"),
    ({"weight_sync_type": PIPELINE}, "set max_steps_off_policy"),
    ({"weight_sync_type": BACKGROUND}, "set max_steps_off_policy"),
    ({"max_steps_off_policy": -1}, "max_steps_off_policy must be >= 0"),
    ({"max_tokens_per_turn": 2048, "max_model_length": 2048}, "lower max_tokens_per_turn"),
    ({"max_tokens_per_turn": 4096, "max_model_length": 2048}, "lower max_tokens_per_turn"),
    (
        {"max_model_length": 32, "max_tokens_per_turn": 8, "overlong_buffer_tokens": 0},
        "raise max_model_length",
    ),
    ({"overlong_buffer_tokens": 2048, "max_model_length": 2048}, "overlong_buffer_tokens=2048 must be below"),
    ({"micro_batch_tokens": 1024, "max_model_length": 2048}, "set micro_batch_tokens >= max_model_length"),
    ({"batch_size": 0}, "batch_size must be >= 1"),
    ({"episodes_per_task": 0}, "episodes_per_task must be >= 2"),
    ({"episodes_per_task": 1}, "episodes_per_task must be >= 2"),
    ({"num_steps": 0}, "num_steps must be >= 1"),
    ({"max_turns": 0}, "max_turns must be >= 1"),
    ({"clip_ratio_low": -0.1}, "clip_ratio_low must be >= 0"),
    ({"clip_ratio_high": -0.1}, "clip_ratio_high must be >= 0"),
    ({"temperature": 0.0}, "temperature must be > 0"),
    ({"temperature": -1.0}, "temperature must be > 0"),
    ({"top_p": 0.0}, "top_p must be > 0"),
    ({"top_p": 1.5}, "top_p must be at most 1"),
    ({"groups_in_flight": 0}, "groups_in_flight must be >= 1"),
    ({"num_generator_replicas": 0}, "num_generator_replicas must be >= 1"),
    ({"loss_aggregation": "mean"}, "'token_mean', 'sequence_mean', 'fixed_horizon'"),
    ({"importance_ratio_level": "episode"}, "'token', 'sequence'"),
    ({"loss_type": "ppo"}, "'ppo_clip', 'cispo'"),
    ({"on_env_error": "ignore"}, "'end_episode', 'raise'"),
    ({"stale_groups": "skip"}, "'prevent', 'requeue', 'drop'"),
    ({"final_checkpoint": "weights"}, "'full', 'model'"),
    ({"keep_warm_start_model": "no"}, "keep_warm_start_model"),
    ({"weight_sync_type": "PIPELINE"}, "'WEIGHT_SYNC_TYPE_PIPELINE'"),
    ({"resume": "yes"}, "True, False, 'auto'"),
    ({"validation_interval": -1}, "validation_interval must be >= 0"),
    ({"checkpoint_interval": -1}, "checkpoint_interval must be >= 0"),
    ({"max_sampling_attempts": 0}, "max_sampling_attempts must be >= 1"),
    ({"use_lora": True, "lora_rank": 0}, "lora_rank must be >= 1 with use_lora=True"),
    ({"use_lora": True, "lora_alpha": 0.0}, "lora_alpha must be > 0 with use_lora=True"),
    ({"learning_rate": 0.0}, "learning_rate must be > 0"),
    ({"warmup_steps": -1}, "warmup_steps must be >= 0"),
    ({"kl_coef": -0.01}, "kl_coef must be >= 0"),
    ({"weight_decay": -0.01}, "weight_decay must be >= 0"),
    ({"max_grad_norm": 0.0}, "max_grad_norm must be > 0"),
    ({"overlong_buffer_tokens": -1}, "overlong_buffer_tokens must be >= 0"),
    ({"overlong_penalty_factor": -1.0}, "overlong_penalty_factor must be >= 0"),
    ({"run_name": "a/b"}, "single directory name"),
    ({"run_name": ""}, "run_name must be a non-empty string"),
    ({"batch_size": 2.5}, "batch_size must be an integer"),
    ({"batch_size": True}, "batch_size must be an integer"),
    ({"learning_rate": float("nan")}, "learning_rate must be a finite number"),
    ({"learning_rate": "fast"}, "learning_rate must be a finite number"),
    ({"use_lora": "yes"}, "use_lora must be true or false"),
    ({"cuda_graphs": "no"}, "cuda_graphs must be true or false"),
    ({"enable_thinking": "off"}, "enable_thinking must be true, false or None"),
    ({"chat_template_kwargs": ["reasoning_effort"]}, "chat_template_kwargs must be a mapping"),
    ({"chat_template_kwargs": {"enable_thinking": False}}, "set GRPOConfig.enable_thinking instead"),
]


@pytest.mark.parametrize(("overrides", "fix"), CONTRADICTIONS, ids=[str(o) for o, _ in CONTRADICTIONS])
def test_each_contradiction_is_refused_with_its_fix(overrides, fix):
    config = GRPOConfig(**overrides)
    with pytest.raises(ConfigError) as info:
        config.validate(OFFLINE)
    assert isinstance(info.value, ValueError)
    assert len(info.value.problems) == 1, info.value.problems
    assert fix in str(info.value)


def test_the_bounds_themselves_are_accepted():
    GRPOConfig(
        episodes_per_task=2,
        max_steps_off_policy=0,
        validation_interval=0,
        checkpoint_interval=0,
        overlong_buffer_tokens=0,
        overlong_penalty_factor=0.0,
        kl_coef=0.0,
        clip_ratio_low=0.0,
        max_model_length=192,
        max_tokens_per_turn=128,
        micro_batch_tokens=192,
        top_p=1.0,
        max_grad_norm=None,
        use_lora=False,
        lora_rank=0,  # ignored without use_lora
        weight_sync_type=PIPELINE,
    ).validate(OFFLINE)


def test_all_problems_are_reported_together():
    config = GRPOConfig(
        weight_sync_type=PIPELINE, use_lora=True, episodes_per_task=1, temperature=0.0, wandb_project="p"
    )
    with pytest.raises(ConfigError) as info:
        config.validate({})
    message = str(info.value)
    assert "5 problem(s)" in message
    for fix in (
        "use_lora=False",
        "max_steps_off_policy",
        "episodes_per_task",
        "temperature",
        "WANDB_API_KEY",
    ):
        assert fix in message


REMEDIES = ["export WANDB_API_KEY", "WANDB_MODE=offline", "wandb_project=None"]


def test_wandb_check_fires_without_a_setup_and_names_the_remedies(monkeypatch, tmp_path):
    for name in ("WANDB_API_KEY", "WANDB_MODE", "NETRC", "WANDB_BASE_URL"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("HOME", str(tmp_path))  # no ~/.netrc from a real `wandb login`
    config = GRPOConfig(wandb_project="grpo-tool-use-game")
    with pytest.raises(ConfigError) as info:
        config.validate()
    for remedy in REMEDIES:
        assert remedy in str(info.value)
    # WANDB_MODE=online is a mode, not a setup: still no key.
    monkeypatch.setenv("WANDB_MODE", "online")
    with pytest.raises(ConfigError):
        config.validate()


@pytest.mark.parametrize("remedy", ["key", "offline", "disabled", "no_project", "netrc"])
def test_each_wandb_remedy_silences_the_check(monkeypatch, tmp_path, remedy):
    for name in ("WANDB_API_KEY", "WANDB_MODE", "NETRC", "WANDB_BASE_URL"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("HOME", str(tmp_path))
    config = GRPOConfig(wandb_project="grpo-tool-use-game")
    if remedy == "key":
        monkeypatch.setenv("WANDB_API_KEY", "secret")
    elif remedy in ("offline", "disabled"):
        monkeypatch.setenv("WANDB_MODE", remedy)
    elif remedy == "no_project":
        config = GRPOConfig(wandb_project=None)
    else:
        (tmp_path / ".netrc").write_text("machine api.wandb.ai\n  login user\n  password secret\n")
    config.validate()


def test_validate_loads_no_model(monkeypatch):
    import transformers

    def refuse(*args, **kwargs):
        raise AssertionError("validate() must not load a model")

    monkeypatch.setattr(transformers.AutoModelForCausalLM, "from_pretrained", refuse)
    monkeypatch.setattr(transformers.AutoTokenizer, "from_pretrained", refuse)
    monkeypatch.setattr("cookbook_lib.runtime.models.load_model", refuse)
    monkeypatch.setattr("cookbook_lib.runtime.models.load_tokenizer", refuse)
    GRPOConfig(model="no/such-model").validate(OFFLINE)
    with pytest.raises(ConfigError):
        GRPOConfig(model="no/such-model", episodes_per_task=1).validate(OFFLINE)


def test_config_and_validate_import_no_model_code():
    """Checked in a fresh interpreter: the test session itself has torch loaded long ago."""
    code = (
        "import sys\n"
        "from cookbook_lib.grpo.config import GRPOConfig\n"
        "before = set(sys.modules)\n"
        "GRPOConfig(episodes_per_task=1).problems({})\n"
        "GRPOConfig().validate({})\n"
        "new = sorted(m for m in set(sys.modules) - before if m.split('.')[0] in ('torch', 'transformers'))\n"
        "assert not new, new\n"
        "assert 'cookbook_lib.runtime.models' not in set(sys.modules) - before\n"
    )
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr
