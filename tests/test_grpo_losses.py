"""Each loss variant and aggregation against hand-computed values, gradients, masking and accumulation."""

from __future__ import annotations

import math

import pytest
import torch

from cookbook_lib.grpo.loss_settings import LossSettings
from cookbook_lib.grpo.losses import (
    Aggregation,
    cispo_loss,
    compute_loss,
    entropy_from_logits,
    gspo_loss,
    kl_penalty,
    masked_mean,
    masked_sum,
    ppo_clip_loss,
    token_logprobs,
)

LN = math.log
T, F = True, False


def leaf(rows: list[list[float]]) -> torch.Tensor:
    return torch.tensor(rows, dtype=torch.float64, requires_grad=True)


def ppo_inputs():
    """Two rows; old log-probs 0, so each ratio is exp(logp).

    row 0: r = 1.5, A = +1 -> clipped high: -1.28 | r = 0.5, A = -1 -> clipped low: +0.8
           r = 1.1, A = +1 -> inside: -1.1        | masked
    row 1: r = 0.5, A = +1 -> min(0.5, 0.8): -0.5 | r = 1.5, A = -1 -> min(-1.5, -1.28): +1.5
    """
    logp = leaf([[LN(1.5), LN(0.5), LN(1.1), 0.0], [LN(0.5), LN(1.5), 0.0, 0.0]])
    old = torch.zeros(2, 4, dtype=torch.float64)
    adv = torch.tensor([[1.0, -1.0, 1.0, 5.0], [1.0, -1.0, 0.0, 0.0]], dtype=torch.float64)
    mask = torch.tensor([[T, T, T, F], [T, T, F, F]])
    return logp, old, adv, mask


# --- masked helpers -----------------------------------------------------------------------------


def test_masked_sum_and_mean_ignore_masked_values_even_nan():
    values = torch.tensor([[1.0, 2.0, float("nan")], [4.0, float("inf"), 6.0]])
    mask = torch.tensor([[T, T, F], [T, F, T]])
    assert masked_sum(values, mask).item() == 13.0
    assert masked_mean(values, mask).item() == 3.25
    assert masked_mean(values, mask, dim=-1).tolist() == [1.5, 5.0]
    assert masked_mean(values, torch.zeros_like(mask)).item() == 0.0


# --- PPO clip -----------------------------------------------------------------------------------


def test_ppo_clip_token_mean_value_gradient_and_metrics():
    logp, old, adv, mask = ppo_inputs()
    loss, metrics = ppo_clip_loss(logp, old, adv, mask, clip_low=0.2, clip_high=0.28)
    # (-1.28 + 0.8 - 1.1 - 0.5 + 1.5) / 5 = -0.58 / 5
    assert loss.item() == pytest.approx(-0.116)
    loss.backward()
    # d/dlogp of -r A = -A r where the unclipped term is the min; 0 where the clip is active
    expected = [[0.0, 0.0, -1.1 / 5, 0.0], [-0.5 / 5, 1.5 / 5, 0.0, 0.0]]
    assert logp.grad.tolist() == [pytest.approx(row) for row in expected]
    assert metrics["clip_frac_low"] == pytest.approx(1 / 5)
    assert metrics["clip_frac_high"] == pytest.approx(1 / 5)
    assert metrics["clip_frac"] == pytest.approx(2 / 5)
    assert metrics["ratio_mean"] == pytest.approx((1.5 + 0.5 + 1.1 + 0.5 + 1.5) / 5)


def test_sequence_mean_and_fixed_horizon_by_hand():
    logp, old, adv, mask = ppo_inputs()
    loss, _ = ppo_clip_loss(logp, old, adv, mask, aggregation=Aggregation("sequence_mean"))
    # row means: -1.58 / 3 and 1.0 / 2, then their mean
    assert loss.item() == pytest.approx((-1.58 / 3 + 0.5) / 2)
    loss, _ = ppo_clip_loss(logp, old, adv, mask, aggregation=Aggregation("fixed_horizon", horizon=10))
    # -0.58 / (2 sequences * 10)
    assert loss.item() == pytest.approx(-0.029)


def test_equal_bounds_are_symmetric_clipping():
    logp = leaf([[LN(1.25), LN(0.75)]])
    adv = torch.tensor([[1.0, -1.0]], dtype=torch.float64)
    loss, metrics = ppo_clip_loss(
        logp, torch.zeros(1, 2), adv, torch.ones(1, 2, dtype=torch.bool), clip_low=0.2, clip_high=0.2
    )
    # -min(1.25, 1.2) and -min(-0.75, -0.8): (-1.2 + 0.8) / 2
    assert loss.item() == pytest.approx(-0.2)
    assert metrics["clip_frac"] == 1.0


# --- GSPO ---------------------------------------------------------------------------------------


def gspo_inputs():
    # log-ratios [0.3, -0.1, 0.1] (+ one masked): sequence log-ratio 0.1, s = exp(0.1) = 1.105171
    logp = leaf([[0.3, -0.1, 0.1, 7.0]])
    old = torch.zeros(1, 4, dtype=torch.float64)
    adv = torch.ones(1, 4, dtype=torch.float64)
    return logp, old, adv, torch.tensor([[T, T, T, F]])


def test_gspo_uses_one_ratio_per_sequence_with_equal_token_gradients():
    logp, old, adv, mask = gspo_inputs()
    loss, metrics = gspo_loss(logp, old, adv, mask, clip_low=0.2, clip_high=0.28)
    assert loss.item() == pytest.approx(-1.105171, abs=1e-6)
    assert metrics["ratio_mean"] == pytest.approx(1.105171, abs=1e-6)
    loss.backward()
    # GSPO: d(-A s)/dlogp_t = -A s / |y| = -1.105171 / 3 at every token (token-level would differ)
    assert logp.grad.tolist()[0] == pytest.approx([-0.368390, -0.368390, -0.368390, 0.0], abs=1e-6)


def test_gspo_token_form_has_the_sequence_objectives_gradient():
    logp, old, adv, mask = gspo_inputs()
    gspo_loss(logp, old, adv, mask, clip_low=0.2, clip_high=0.28)[0].backward()
    direct = leaf([[0.3, -0.1, 0.1]])
    (-torch.exp(direct.mean())).backward()  # GSPO's definition, written out for one sequence
    assert logp.grad[0, :3].tolist() == pytest.approx(direct.grad[0].tolist())


def test_gspo_default_clip_range_is_tight():
    logp, old, adv, mask = gspo_inputs()
    loss, metrics = gspo_loss(logp, old, adv, mask)  # 3e-4 / 4e-4: s = 1.105 is clipped at 1.0004
    assert loss.item() == pytest.approx(-1.0004)
    assert metrics["clip_frac_high"] == 1.0
    loss.backward()
    assert logp.grad.abs().sum().item() == 0.0


# --- CISPO --------------------------------------------------------------------------------------


def test_cispo_value_and_detached_clipped_weight_gradient():
    # r = [2, 0.5, 1.1]; no lower bound (clip_low=1), upper 1.28 -> weights [1.28, 0.5, 1.1]
    logp = leaf([[LN(2.0), LN(0.5), LN(1.1)]])
    adv = torch.tensor([[1.0, 1.0, -2.0]], dtype=torch.float64)
    mask = torch.ones(1, 3, dtype=torch.bool)
    loss, metrics = cispo_loss(logp, torch.zeros(1, 3), adv, mask, clip_low=1.0, clip_high=0.28)
    # -w A logp: -1.28 * 0.693147 = -0.887228; -0.5 * -0.693147 = 0.346574; 2.2 * 0.095310 = 0.209682
    assert loss.item() == pytest.approx((-0.887228 + 0.346574 + 0.209682) / 3, abs=1e-6)
    loss.backward()
    # gradient = -clipped_weight * A / 3: nonzero even where the weight was clipped (unlike PPO)
    assert logp.grad.tolist()[0] == pytest.approx([-1.28 / 3, -0.5 / 3, 2.2 / 3])
    assert (metrics["clip_frac_high"], metrics["clip_frac_low"]) == (pytest.approx(1 / 3), 0.0)


def test_cispo_lower_bound_when_set():
    logp = leaf([[LN(0.5)]])
    loss, metrics = cispo_loss(
        logp, torch.zeros(1, 1), torch.ones(1, 1), torch.ones(1, 1, dtype=torch.bool), clip_low=0.2
    )
    loss.backward()
    assert logp.grad.item() == pytest.approx(-0.8)  # weight clipped up to 0.8
    assert metrics["clip_frac_low"] == 1.0


# --- KL, entropy, log-probs ---------------------------------------------------------------------


def test_k3_kl_penalty_by_hand():
    logp = leaf([[0.0, LN(2.0), 5.0]])
    ref = torch.tensor([[0.0, 0.0, 0.0]], dtype=torch.float64)
    mask = torch.tensor([[T, T, F]])
    loss, metrics = kl_penalty(logp, ref, mask, kl_coef=0.1)
    # d = ref - logp = [0, -ln 2]; k3 = e^d - d - 1 = [0, 0.5 + 0.693147 - 1 = 0.193147]
    assert metrics["kl"] == pytest.approx(0.193147 / 2, abs=1e-6)
    assert loss.item() == pytest.approx(0.1 * 0.193147 / 2, abs=1e-7)
    loss.backward()
    # dk3/dlogp = 1 - e^d = [0, 0.5], times 0.1 / 2 tokens
    assert logp.grad.tolist()[0] == pytest.approx([0.0, 0.025, 0.0])


def test_entropy_is_a_masked_mean_in_nats():
    logits = torch.tensor(
        [[[0.0, 0.0, 0.0, 0.0], [100.0, 0.0, 0.0, 0.0], [0.0, 0.0, 50.0, 50.0]]], requires_grad=True
    )
    assert entropy_from_logits(logits, torch.tensor([[T, F, F]])) == pytest.approx(LN(4))
    assert entropy_from_logits(logits, torch.tensor([[T, T, T]])) == pytest.approx((LN(4) + 0.0 + LN(2)) / 3)
    assert entropy_from_logits(logits, torch.tensor([[F, F, F]])) == 0.0


def test_token_logprobs_by_hand():
    logits = torch.tensor([[[0.0, LN(3.0)], [LN(3.0), 0.0]]])  # probabilities [1/4, 3/4], [3/4, 1/4]
    assert token_logprobs(logits, torch.tensor([[1, 1]])).tolist()[0] == pytest.approx([LN(0.75), LN(0.25)])


# --- masking and non-finite inputs --------------------------------------------------------------

LOSSES = {
    "ppo_clip": lambda lp, old, adv, m, agg: ppo_clip_loss(lp, old, adv, m, aggregation=agg),
    "gspo": lambda lp, old, adv, m, agg: gspo_loss(
        lp, old, adv, m, clip_low=0.2, clip_high=0.28, aggregation=agg
    ),
    "cispo": lambda lp, old, adv, m, agg: cispo_loss(lp, old, adv, m, aggregation=agg),
    "kl": lambda lp, old, adv, m, agg: kl_penalty(lp, old, m, kl_coef=0.5, aggregation=agg),
}
AGGREGATIONS = [Aggregation(), Aggregation("sequence_mean"), Aggregation("fixed_horizon", horizon=16)]


def random_batch(seed: int, rows: int = 5, width: int = 7):
    gen = torch.Generator().manual_seed(seed)
    logp = -torch.rand(rows, width, generator=gen, dtype=torch.float64) * 2
    old = logp + torch.randn(rows, width, generator=gen, dtype=torch.float64) * 0.3
    adv = torch.randn(rows, 1, generator=gen, dtype=torch.float64).expand(rows, width).clone()
    lengths = torch.randint(1, width + 1, (rows,), generator=gen)
    mask = torch.arange(width) < lengths.unsqueeze(-1)
    return logp, old, adv, mask


@pytest.mark.parametrize("name", LOSSES)
def test_masked_positions_change_neither_loss_nor_gradient(name):
    logp, old, adv, mask = random_batch(1)
    clean = logp.clone().requires_grad_()
    loss_clean, _ = LOSSES[name](clean, old, adv, mask, Aggregation())
    loss_clean.backward()
    dirty_logp = torch.where(mask, logp, torch.tensor(float("nan"), dtype=torch.float64)).requires_grad_()
    dirty_old = torch.where(mask, old, torch.tensor(float("-inf"), dtype=torch.float64))
    dirty_adv = torch.where(mask, adv, torch.tensor(float("inf"), dtype=torch.float64))
    loss_dirty, _ = LOSSES[name](dirty_logp, dirty_old, dirty_adv, mask, Aggregation())
    loss_dirty.backward()
    assert loss_dirty.item() == pytest.approx(loss_clean.item())
    assert torch.equal(dirty_logp.grad, clean.grad)
    assert torch.all(dirty_logp.grad[~mask] == 0)


@pytest.mark.parametrize(
    ("name", "which"), [(name, which) for name in LOSSES for which in range(2 if name == "kl" else 3)]
)
@pytest.mark.parametrize("bad", [float("nan"), float("inf"), float("-inf")])
def test_a_non_finite_trained_input_gives_a_non_finite_loss(name, which, bad):
    # which: 0 = logprobs, 1 = sampling (or reference) logprobs, 2 = advantages
    inputs = list(random_batch(2))
    inputs[which] = inputs[which].clone()
    inputs[which][0, 0] = bad  # position (0, 0) is always trained: every row has at least one token
    loss, _ = LOSSES[name](*inputs, Aggregation())
    assert not torch.isfinite(loss)


@pytest.mark.parametrize("name", ["ppo_clip", "gspo", "cispo"])
@pytest.mark.parametrize("advantage", [1.0, -1.0])
def test_huge_finite_log_ratios_neither_overflow_nor_give_nan_gradients(name, advantage):
    # exp(200) overflows float32; the log-ratio is clamped to 20 first
    logp = torch.zeros(1, 2, requires_grad=True)
    old = torch.tensor([[-200.0, 0.0]])
    loss, _ = LOSSES[name](
        logp, old, torch.full((1, 2), advantage), torch.ones(1, 2, dtype=torch.bool), Aggregation()
    )
    loss.backward()
    assert torch.isfinite(loss) and torch.isfinite(logp.grad).all()


# --- gradient accumulation ----------------------------------------------------------------------


@pytest.mark.parametrize("name", LOSSES)
@pytest.mark.parametrize("agg", AGGREGATIONS, ids=lambda a: a.mode)
def test_micro_batches_with_step_normalisers_sum_to_the_full_batch(name, agg):
    logp, old, adv, mask = random_batch(3)
    full = logp.clone().requires_grad_()
    full_loss, _ = LOSSES[name](full, old, adv, mask, agg)
    full_loss.backward()
    step = Aggregation(agg.mode, num_tokens_total=int(mask.sum()), num_sequences_total=5, horizon=agg.horizon)
    total, grads = 0.0, []
    for rows in (slice(0, 2), slice(2, 3), slice(3, 5)):
        part = logp[rows].clone().requires_grad_()
        loss, _ = LOSSES[name](part, old[rows], adv[rows], mask[rows], step)
        loss.backward()
        total += loss.item()
        grads.append(part.grad)
    assert total == pytest.approx(full_loss.item(), abs=1e-12)
    assert torch.allclose(torch.cat(grads), full.grad, atol=1e-12)


def test_micro_batches_without_step_normalisers_do_not_sum_to_the_full_batch():
    # why the normalisers exist: per-micro-batch token means weigh tokens unequally
    logp, old, adv, mask = random_batch(3)
    full_loss, _ = ppo_clip_loss(logp, old, adv, mask)
    parts = sum(ppo_clip_loss(logp[r], old[r], adv[r], mask[r])[0].item() for r in (slice(0, 2), slice(2, 5)))
    assert parts != pytest.approx(full_loss.item())


# --- compute_loss -------------------------------------------------------------------------------


def test_compute_loss_picks_by_name_and_adds_the_kl_penalty():
    logp, old, adv, mask = ppo_inputs()
    loss, metrics = compute_loss(logp, old, adv, mask, LossSettings(kl_coef=0.1), ref_logprobs_BT=old)
    # PPO token mean -0.116, plus 0.1 * mean k3 with d = -logp over the five trained tokens
    d = [-LN(1.5), -LN(0.5), -LN(1.1), -LN(0.5), -LN(1.5)]
    kl = sum(math.exp(x) - x - 1 for x in d) / 5
    assert loss.item() == pytest.approx(-0.116 + 0.1 * kl)
    assert metrics["policy_loss"] == pytest.approx(-0.116)
    assert metrics["kl"] == pytest.approx(kl)
    assert metrics["num_tokens"] == 5.0
    cispo, _ = compute_loss(logp, old, adv, mask, LossSettings(loss_type="cispo", clip_ratio_low=1.0))
    assert cispo.item() == pytest.approx(cispo_loss(logp, old, adv, mask)[0].item())
    seq, _ = compute_loss(
        logp, old, adv, mask, LossSettings(importance_ratio_level="sequence", aggregation="sequence_mean")
    )
    assert seq.item() == pytest.approx(
        gspo_loss(logp, old, adv, mask, clip_low=0.2, clip_high=0.28)[0].item()
    )


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"loss_type": "ppo"}, "unknown loss_type 'ppo'"),
        ({"importance_ratio_level": "episode"}, "unknown importance ratio level 'episode'"),
        ({"aggregation": "mean"}, "unknown aggregation 'mean'"),
        ({"aggregation": "fixed_horizon"}, "positive horizon"),
        ({"num_tokens_total": 0}, "num_tokens_total must be positive"),
        ({"kl_coef": 0.1}, "needs ref_logprobs_BT"),
    ],
)
def test_compute_loss_rejects_unknown_names_and_bad_settings(kwargs, message):
    logp, old, adv, mask = ppo_inputs()
    with pytest.raises(ValueError, match=message):
        counts = {k: kwargs.pop(k) for k in ("num_tokens_total",) if k in kwargs}
        compute_loss(logp, old, adv, mask, LossSettings(**kwargs), **counts)
