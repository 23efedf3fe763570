"""The soft overlong penalty (DAPO, arXiv:2503.14476 section 3.4), for multi-turn episodes.

DAPO adds a length-aware penalty instead of punishing every truncated sample the same: zero while
the length stays ``buffer`` tokens short of the limit, then a linear ramp down to ``-factor`` at
the limit. A long answer that almost fit is punished a little, one that hit the wall fully.

In multi-turn training the penalty is added only where the episode ran out of room, as the seed's
truncation table says: ``CONTEXT_OVERFLOW`` and ``MAX_TURNS`` (``EndCause.is_overlong``). An
environment truncation (``ENV``), a reply that did not parse (``PARSE_FAILURE``, which already got
``failed_parse_reward``), a terminated episode and an ``ERROR`` never get it.

How length is measured (the same for both causes): the tokens of the episode's context at its
end, i.e. the last sampled turn's prompt plus its sampled tokens (the length of the episode's last
token sequence), against ``max_model_length``.

* ``CONTEXT_OVERFLOW``: sampling ran into ``max_model_length``, so the length is the limit and the
  penalty is the full ``-factor``. Where the overflow came from the *next* prompt (a long tool
  output left no room to sample), that prompt was never sampled from and is not in the record: the
  length is the context the model last sampled in, so a model whose own context was short and
  whose tool dumped a huge output is penalised less than one that filled the context itself.
* ``MAX_TURNS``: such an episode has, by definition, used exactly ``max_turns`` turns, so a ramp
  measured in turns would always give the full ``-factor`` and be no ramp at all. Measuring the
  context instead keeps the penalty about *length*, as in DAPO: an episode that spent its turns
  on short tool calls is penalised little or not at all (its reward, from the last step, already
  says it did not finish), one that also filled the context nearly as much as an overflow.
"""

from __future__ import annotations

from cookbook_lib.rollout.episode import Episode


def context_length(episode: Episode) -> int:
    """Tokens in the episode's context when it ended: the last sampled turn's prompt + sample.

    This is the length of the episode's last token sequence (a chat template that rewrote the
    history starts a new, shorter sequence, and the model only ever saw that one). An episode with
    no sampled turn (a scripted policy, an error before the first sample) has length 0.
    """
    if not episode.turns:
        return 0
    last = episode.turns[-1]
    return len(last.prompt_tokens) + len(last.sampled_tokens)


def soft_overlong_penalty(length: int, max_model_length: int, buffer_tokens: int, factor: float) -> float:
    """DAPO's ramp: 0 up to ``max_model_length - buffer_tokens``, then linear to ``-factor`` at the limit.

    Beyond the limit it stays at ``-factor``. ``buffer_tokens=0`` or ``factor=0`` turns the penalty
    off (as ``GRPOConfig`` documents), rather than making it a step at the limit: a flat penalty
    for every overflow is a reward-function decision, not a length shaping.
    """
    if max_model_length <= 0:
        raise ValueError(f"max_model_length must be positive, got {max_model_length}")
    if not 0 <= buffer_tokens <= max_model_length:
        raise ValueError(f"buffer_tokens must be in [0, max_model_length], got {buffer_tokens}")
    if factor < 0:
        raise ValueError(f"the overlong penalty factor must be >= 0 (it is subtracted), got {factor}")
    if buffer_tokens == 0 or factor == 0:
        return 0.0
    if length >= max_model_length:
        return -factor
    exceed = length - (max_model_length - buffer_tokens)
    if exceed <= 0:
        return 0.0
    return -factor * exceed / buffer_tokens


def overlong_penalty(episode: Episode, max_model_length: int, buffer_tokens: int, factor: float) -> float:
    """The penalty (<= 0) to add to ``episode.reward``: nonzero only for CONTEXT_OVERFLOW and MAX_TURNS."""
    if not episode.end_cause.is_overlong:
        return 0.0
    return soft_overlong_penalty(context_length(episode), max_model_length, buffer_tokens, factor)
