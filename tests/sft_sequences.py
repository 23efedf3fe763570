"""Two short SFT sequences (12 tokens each, the first a prompt token, the rest assistant tokens):
enough for a trainer's ``sft_step`` in tests that need a real optimizer step, not a useful one."""

from __future__ import annotations

from cookbook_lib.rollout.episode import TokenSequence


def two_sft_sequences() -> list[TokenSequence]:
    return [
        TokenSequence(
            tokens_T=list(range(start, start + 12)),
            assistant_mask_T=[False] + [True] * 11,
            sampling_logprobs_T=[0.0] * 12,
            policy_versions_T=[0] * 12,
        )
        for start in (100, 300)
    ]
