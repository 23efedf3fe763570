"""What a reply's tokens score under a model in one plain forward pass: the reference the
generator tests hold sampled log-probs to."""

from __future__ import annotations

import torch


def forward_logprobs(model, prompt: list[int], tokens: list[int], temperature: float = 1.0) -> torch.Tensor:
    """log_softmax(logits / T) at every sampled position, in float64: [tokens, vocab]."""
    with torch.inference_mode():
        logits = model(input_ids=torch.tensor([prompt + tokens])).logits[0, len(prompt) - 1 : -1]
    return torch.log_softmax(logits.double() / temperature, dim=-1)


def chosen_logprobs(model, prompt: list[int], tokens: list[int]) -> torch.Tensor:
    """The log-prob of each of ``tokens`` after what precedes it: [tokens], float64."""
    return forward_logprobs(model, prompt, tokens).gather(1, torch.tensor(tokens)[:, None]).squeeze(1)
