"""Checkpoints: weights, Adam moments and RNG round trip; interrupted saves; keep_last; LoRA; resume."""

from __future__ import annotations

import random

import numpy as np
import pytest
import torch
from torch import nn

from cookbook_lib.runtime.checkpoint import (
    CHECKPOINTS_DIR,
    LATEST_FILE,
    checkpoint_dir,
    latest_checkpoint,
    load_checkpoint,
    save_checkpoint,
)
from cookbook_lib.runtime.metrics import MetricsLogger, read_metrics, truncate_metrics


class Net(nn.Module):
    """Small, with dropout (torch RNG) so that a resume that loses RNG state trains differently."""

    def __init__(self) -> None:
        super().__init__()
        self.layers = nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Dropout(0.3), nn.Linear(8, 1))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.layers(x)


def _seed(seed: int) -> None:
    random.seed(seed)
    np.random.seed(seed)
    torch.manual_seed(seed)


def _train_step(model: nn.Module, optimizer: torch.optim.Optimizer) -> float:
    """One step whose data uses all three RNGs: torch inputs, numpy noise, python scale."""
    x = torch.randn(16, 4)
    target = x.sum(dim=1, keepdim=True) + float(np.random.normal(scale=0.1)) * random.random()
    loss = nn.functional.mse_loss(model(x), target)
    optimizer.zero_grad()
    loss.backward()
    optimizer.step()
    return loss.item()


def _make(seed: int) -> tuple[Net, torch.optim.Adam]:
    torch.manual_seed(seed)
    model = Net()
    return model, torch.optim.Adam(model.parameters(), lr=0.05)


def _clone_state(model: nn.Module) -> dict[str, torch.Tensor]:
    return {name: tensor.detach().clone() for name, tensor in model.state_dict().items()}


def _assert_same_weights(model: nn.Module, expected: dict[str, torch.Tensor]) -> None:
    state = model.state_dict()
    assert set(state) == set(expected)
    for name, tensor in expected.items():
        assert torch.equal(state[name], tensor), name


def test_save_then_load_restores_weights_adam_moments_and_rng(tmp_path):
    _seed(0)
    model, optimizer = _make(0)
    for _ in range(3):
        _train_step(model, optimizer)
    path = save_checkpoint(tmp_path, 3, model=model, optimizer=optimizer, extra_state={"policy_version": 3})
    assert path == checkpoint_dir(tmp_path, 3) == tmp_path / CHECKPOINTS_DIR / "step_000003"
    weights = _clone_state(model)
    moments = {i: {k: v.clone() for k, v in s.items()} for i, s in enumerate(optimizer.state.values())}
    next_draws = (torch.rand(3), random.random(), np.random.rand(2))

    for _ in range(2):  # move everything on
        _train_step(model, optimizer)
    fresh_model, fresh_optimizer = _make(1)
    state = load_checkpoint(path, model=fresh_model, optimizer=fresh_optimizer)

    assert (state.step, state.extra_state, state.path) == (3, {"policy_version": 3}, path)
    _assert_same_weights(fresh_model, weights)
    restored = list(fresh_optimizer.state.values())
    assert len(restored) == len(moments) == 4
    for index, saved in moments.items():
        assert set(restored[index]) == {"step", "exp_avg", "exp_avg_sq"}
        for key, value in saved.items():
            assert torch.equal(restored[index][key], value), key
    assert torch.equal(torch.rand(3), next_draws[0])
    assert random.random() == next_draws[1]
    assert np.array_equal(np.random.rand(2), next_draws[2])


def test_a_model_only_checkpoint_restores_the_weights_and_leaves_the_optimizer_fresh(tmp_path):
    model, optimizer = _make(0)
    for _ in range(2):
        _train_step(model, optimizer)
    full = save_checkpoint(tmp_path, 2, model=model, optimizer=optimizer, extra_state={})
    path = save_checkpoint(tmp_path, 3, model=model, optimizer=None, extra_state={"v": 3}, keep_last=1)
    assert not full.exists()  # keep_last applies to model-only checkpoints too
    assert not (path / "optimizer.pt").exists()
    weights = _clone_state(model)

    fresh_model, fresh_optimizer = _make(1)
    state = load_checkpoint(path, model=fresh_model, optimizer=fresh_optimizer)
    assert (state.step, state.extra_state, state.optimizer_restored) == (3, {"v": 3}, False)
    _assert_same_weights(fresh_model, weights)
    assert not fresh_optimizer.state  # AdamW as built: no moments yet


def test_interrupted_saves_are_ignored_and_cleaned_up(tmp_path):
    model, optimizer = _make(0)
    assert latest_checkpoint(tmp_path) is None
    save_checkpoint(tmp_path, 2, model=model, optimizer=optimizer, extra_state={})
    root = tmp_path / CHECKPOINTS_DIR
    (root / ".tmp-step_000004-abc").mkdir()  # a save killed before its rename
    (root / ".tmp-step_000004-abc" / "optimizer.pt").write_bytes(b"half")
    (root / "step_000006").mkdir()  # a folder with weights but no marker
    (root / "step_000006" / "model.safetensors").write_bytes(b"half")
    assert latest_checkpoint(tmp_path) == root / "step_000002"
    with pytest.raises(FileNotFoundError, match="not a complete checkpoint"):
        load_checkpoint(root / "step_000006", model=model, optimizer=optimizer)

    save_checkpoint(tmp_path, 4, model=model, optimizer=optimizer, extra_state={})
    assert latest_checkpoint(tmp_path) == root / "step_000004"
    assert not (root / ".tmp-step_000004-abc").exists()
    assert (root / LATEST_FILE).read_text().strip() == "step_000004"


def test_keep_last_deletes_older_checkpoints(tmp_path):
    model, optimizer = _make(0)
    for step in range(1, 6):
        save_checkpoint(tmp_path, step, model=model, optimizer=optimizer, extra_state={}, keep_last=2)
    root = tmp_path / CHECKPOINTS_DIR
    assert sorted(p.name for p in root.iterdir()) == [LATEST_FILE, "step_000004", "step_000005"]
    assert (root / LATEST_FILE).read_text().strip() == "step_000005"
    with pytest.raises(ValueError, match="keep_last"):
        save_checkpoint(tmp_path, 6, model=model, optimizer=optimizer, extra_state={}, keep_last=0)


def test_saving_a_step_again_replaces_it_and_bad_extra_state_writes_nothing(tmp_path):
    model, optimizer = _make(0)
    save_checkpoint(tmp_path, 2, model=model, optimizer=optimizer, extra_state={"v": 1})
    _train_step(model, optimizer)
    save_checkpoint(tmp_path, 2, model=model, optimizer=optimizer, extra_state={"v": 2})
    other, other_optimizer = _make(1)
    state = load_checkpoint(latest_checkpoint(tmp_path), model=other, optimizer=other_optimizer)
    assert state.extra_state == {"v": 2}
    _assert_same_weights(other, _clone_state(model))
    with pytest.raises(TypeError):
        save_checkpoint(tmp_path, 3, model=model, optimizer=optimizer, extra_state={"bad": object()})
    assert sorted(p.name for p in (tmp_path / CHECKPOINTS_DIR).iterdir()) == [LATEST_FILE, "step_000002"]


def test_transformers_model_round_trip_with_tied_embeddings(tmp_path):
    from transformers import AutoModelForCausalLM

    from cookbook_lib.runtime.models import tiny_random_model

    model, _ = tiny_random_model(seed=1, num_layers=1, hidden_size=32)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    path = save_checkpoint(tmp_path, 1, model=model, optimizer=optimizer, extra_state={})
    other, _ = tiny_random_model(seed=2, num_layers=1, hidden_size=32)
    assert not torch.equal(other.model.embed_tokens.weight, model.model.embed_tokens.weight)
    load_checkpoint(path, model=other, optimizer=torch.optim.AdamW(other.parameters(), lr=1e-3))
    _assert_same_weights(other, _clone_state(model))
    assert other.lm_head.weight.data_ptr() == other.model.embed_tokens.weight.data_ptr()  # still tied
    standalone = AutoModelForCausalLM.from_pretrained(path / "model")  # usable on its own
    _assert_same_weights(standalone, _clone_state(model))


def test_peft_lora_round_trip_restores_adapter_weights(tmp_path):
    from peft import LoraConfig, get_peft_model
    from safetensors.torch import load_file

    from cookbook_lib.runtime.models import tiny_random_model
    from cookbook_lib.runtime.quiet import quiet_libraries

    def lora_model(seed: int):
        base, _ = tiny_random_model(seed=1, num_layers=1, hidden_size=32)
        torch.manual_seed(seed)  # different LoRA A init per seed
        with quiet_libraries():  # peft reads a deprecated transformers property (FutureWarning)
            return get_peft_model(base, LoraConfig(r=4, target_modules=["q_proj", "v_proj"]))

    model = lora_model(0)
    with torch.no_grad():  # LoRA B starts at zero; make every adapter weight distinctive
        for name, param in model.named_parameters():
            if "lora_" in name:
                param.normal_()
    optimizer = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-3)
    path = save_checkpoint(tmp_path, 7, model=model, optimizer=optimizer, extra_state={"use_lora": True})
    saved = load_file(path / "model" / "adapter_model.safetensors")
    assert saved and all("lora_" in key for key in saved)  # the adapter only, not the base weights

    other = lora_model(1)
    other_optimizer = torch.optim.AdamW([p for p in other.parameters() if p.requires_grad], lr=1e-3)
    state = load_checkpoint(path, model=other, optimizer=other_optimizer)
    assert state.step == 7
    _assert_same_weights(other, _clone_state(model))

    plain, _ = tiny_random_model(seed=1, num_layers=1, hidden_size=32)
    with pytest.raises(ValueError, match="peft model"):
        load_checkpoint(path, model=plain, optimizer=torch.optim.AdamW(plain.parameters()))


def _run(run_dir, total_steps: int, *, kill_after: int | None = None, broken: str | None = None) -> Net:
    """A fake training run: log every step, checkpoint every 2; resume when a checkpoint exists."""
    _seed(0)
    model, optimizer = _make(0)
    start = 0
    latest = latest_checkpoint(run_dir)
    if latest is not None:
        state = load_checkpoint(latest, model=model, optimizer=optimizer, restore_rng=broken != "rng")
        if broken == "optimizer":
            optimizer = torch.optim.Adam(model.parameters(), lr=0.05)
        assert state.extra_state == {"policy_version": state.step}
        start = state.step
        truncate_metrics(run_dir, after_step=start)
    logger = MetricsLogger(run_dir, wandb_project=None, run_name="resume")
    for step in range(start + 1, total_steps + 1):
        logger.log(step, {"loss": _train_step(model, optimizer)})
        if step % 2 == 0:
            save_checkpoint(
                run_dir, step, model=model, optimizer=optimizer, extra_state={"policy_version": step}
            )
        if step == kill_after:
            break  # "killed": no final checkpoint; the logged lines are already on disk
    logger.close()
    return model


def test_resume_continues_exactly_as_an_uninterrupted_run(tmp_path):
    uninterrupted = _run(tmp_path / "straight", 6)
    _run(tmp_path / "resumed", 6, kill_after=5)
    assert [r["step"] for r in read_metrics(tmp_path / "resumed")] == [1, 2, 3, 4, 5]
    assert latest_checkpoint(tmp_path / "resumed").name == "step_000004"
    resumed = _run(tmp_path / "resumed", 6)

    assert [r["step"] for r in read_metrics(tmp_path / "resumed")] == [1, 2, 3, 4, 5, 6]
    assert read_metrics(tmp_path / "resumed") == read_metrics(tmp_path / "straight")
    _assert_same_weights(resumed, _clone_state(uninterrupted))


@pytest.mark.parametrize("broken", ["rng", "optimizer"])
def test_resume_without_rng_or_optimizer_state_diverges(tmp_path, broken):
    """The control for the test above: it would catch a checkpoint that forgot either."""
    uninterrupted = _run(tmp_path / "straight", 6)
    _run(tmp_path / "resumed", 6, kill_after=5)
    resumed = _run(tmp_path / "resumed", 6, broken=broken)
    assert not all(
        torch.equal(a, b) for a, b in zip(resumed.parameters(), uninterrupted.parameters(), strict=True)
    )
