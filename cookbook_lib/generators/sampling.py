"""Choosing next tokens from a batch of logits, each row with its own temperature, top-p and seed.

Shape suffixes: ``_B`` one entry per row of the batch, ``_V`` one per vocabulary entry.

Sampling is inverse-CDF: each row brings one uniform number drawn from its own random generator,
and the token is where that number falls in the row's cumulative distribution. So a seeded row
picks the same token whether it is sampled alone or next to other rows, and the randomness of one
row never depends on how many rows share the batch.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

_NUCLEUS_CANDIDATES = 1024


@dataclass
class RowSampling:
    """The per-row settings of one batched sampling call."""

    temperatures_B: torch.Tensor  # float32; 0 = greedy
    top_ps_B: torch.Tensor  # float32 in (0, 1]
    uniforms_B: torch.Tensor  # float64 in [0, 1); ignored for greedy rows


def choose_tokens(logits_BV: torch.Tensor, rows: RowSampling) -> tuple[torch.Tensor, torch.Tensor]:
    """Pick one token per row; returns ``(tokens_B, logprobs_B)``.

    The log-prob is of the chosen token under the distribution it was drawn from (temperature,
    then top-p renormalisation). Greedy rows return the argmax and its temperature-1 log-prob.
    """
    logits_BV = logits_BV.float()
    device = logits_BV.device
    temperatures_B = rows.temperatures_B.to(device)
    top_ps_B = rows.top_ps_B.to(device)
    greedy_B = temperatures_B == 0
    # Greedy rows are scaled by 1, so their log-probs are the model's own.
    scale_B = torch.where(greedy_B, torch.ones_like(temperatures_B), temperatures_B)
    logprobs_BV = torch.log_softmax(logits_BV / scale_B[:, None], dim=-1)

    tokens_B = logprobs_BV.argmax(dim=-1)
    chosen_B = logprobs_BV.gather(1, tokens_B[:, None]).squeeze(1)

    full_B = ~greedy_B & (top_ps_B >= 1)
    if full_B.any():
        index = full_B.nonzero().squeeze(1)
        sampled = _inverse_cdf(logprobs_BV[index].exp().double(), rows.uniforms_B.to(device)[index])
        tokens_B[index] = sampled
        chosen_B[index] = logprobs_BV[index].gather(1, sampled[:, None]).squeeze(1)

    nucleus_B = ~greedy_B & (top_ps_B < 1)
    if nucleus_B.any():
        index = nucleus_B.nonzero().squeeze(1)
        tokens, logprobs = _sample_nucleus(
            logprobs_BV[index], top_ps_B[index], rows.uniforms_B.to(device)[index]
        )
        tokens_B[index] = tokens
        chosen_B[index] = logprobs
    return tokens_B, chosen_B


def _inverse_cdf(probs_BV: torch.Tensor, uniforms_B: torch.Tensor) -> torch.Tensor:
    """Sample from (unnormalised) float64 probabilities with one uniform per row."""
    cdf_BV = probs_BV.cumsum(dim=-1)
    targets_B = uniforms_B.double() * cdf_BV[:, -1]
    # right=True lands on the first entry whose cdf exceeds the target: never a zero-probability one.
    index_B = torch.searchsorted(cdf_BV, targets_B[:, None], right=True).squeeze(1)
    return index_B.clamp(max=probs_BV.shape[-1] - 1)


def _sample_nucleus(
    logprobs_BV: torch.Tensor, top_ps_B: torch.Tensor, uniforms_B: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """Top-p sampling: keep the most likely tokens until their mass reaches top_p, renormalise."""
    # Sorting the whole vocabulary costs ~8x a top-k of 1024 on a CPU, and the nucleus is nearly
    # always inside the top 1024; the full sort stays as the fallback when it is not.
    k = min(_NUCLEUS_CANDIDATES, logprobs_BV.shape[-1])
    sorted_logprobs_BV, order_BV = logprobs_BV.topk(k, dim=-1)
    if k < logprobs_BV.shape[-1] and bool((sorted_logprobs_BV.double().exp().sum(-1) < top_ps_B).any()):
        sorted_logprobs_BV, order_BV = logprobs_BV.sort(dim=-1, descending=True)
    sorted_probs_BV = sorted_logprobs_BV.double().exp()
    mass_before_BV = sorted_probs_BV.cumsum(dim=-1) - sorted_probs_BV
    # A token is in the nucleus when the tokens more likely than it do not yet reach top_p;
    # the most likely token always is (its mass_before is 0 < top_p).
    keep_BV = mass_before_BV < top_ps_B.double()[:, None]
    kept_probs_BV = torch.where(keep_BV, sorted_probs_BV, torch.zeros_like(sorted_probs_BV))
    position_B = _inverse_cdf(kept_probs_BV, uniforms_B)
    kept_mass_B = kept_probs_BV.sum(dim=-1)
    tokens_B = order_BV.gather(1, position_B[:, None]).squeeze(1)
    logprobs_B = sorted_logprobs_BV.gather(1, position_B[:, None]).squeeze(1) - kept_mass_B.log().float()
    return tokens_B, logprobs_B
