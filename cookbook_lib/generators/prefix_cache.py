"""Prefix reuse: keep the KV cache of finished samples so the next turn of an episode skips re-prefilling.

A multi-turn episode sends, for each turn, exactly the previous prompt + the tokens sampled for it +
a few new tokens (the end of the turn, the tool result, the next generation prompt). When a sample
finishes, its row of the batch's KV cache already holds keys and values for the prompt and every
sampled token but the last one (that one was never fed to the model). Keeping that row lets the
next turn prefill only the tokens after it: on a CPU, ~50 tokens instead of ~500.

What is kept is bounded: at most ``max_entries`` sequences and ``max_tokens`` tokens in all
(``HFGenerator`` bounds both by default), least recently stored dropped first. An entry is taken out
when a request reuses it: the episode has moved on, and a sequence is nearly always extended once.
The last turn of an episode that ended is never taken: ``HFGenerator.forget_prefix`` drops it
when the episode's policy says the episode is over, and otherwise, as the episodes still playing
store newer entries, it is the first to go. Entries are valid for one set of weights only: ``HFGenerator``
clears them when weights are updated.

Only the worker thread touches a ``PrefixCache``; it takes no locks.
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass

from cookbook_lib.generators.kv_cache import LayerKV


@dataclass(eq=False)
class CachedPrefix:
    """Keys and values of one finished sample, for the tokens ``tokens`` (one entry per layer)."""

    tokens: tuple[int, ...]
    layers: list[LayerKV]

    def __len__(self) -> int:
        return len(self.tokens)


class PrefixCache:
    """Finished samples' KV caches, found by the tokens they cover; an LRU bounded in entries and tokens.

    Args:
        max_entries: the most sequences kept (0 keeps none: prefix reuse is off).
        max_tokens: the most tokens kept over all entries, or None for no bound but ``max_entries``.
            Memory per token is ``2 * layers * kv_heads * head_dim * bytes per element`` (about
            46 KB for the embedded 135M model in float32).
    """

    def __init__(self, max_entries: int, max_tokens: int | None = None) -> None:
        if max_entries < 0:
            raise ValueError(f"max_entries must be >= 0, got {max_entries}")
        if max_tokens is not None and max_tokens < 1:
            raise ValueError(f"max_tokens must be >= 1 or None, got {max_tokens}")
        self.max_entries = max_entries
        self.max_tokens = max_tokens
        # Keyed by the covered tokens: a lookup hashes the prompt's first n tokens for each length n
        # present, instead of comparing the prompt with every entry token by token.
        self._entries: OrderedDict[tuple[int, ...], CachedPrefix] = OrderedDict()
        self._lengths: dict[int, int] = {}  # entry length -> how many entries have it
        self._tokens = 0

    def __len__(self) -> int:
        return len(self._entries)

    @property
    def num_tokens(self) -> int:
        """Tokens held over all entries."""
        return self._tokens

    def put(self, prefix: CachedPrefix) -> None:
        """Keep ``prefix`` as the most recent entry, dropping the oldest ones beyond the bounds."""
        if self.max_entries == 0 or not prefix.tokens:
            return
        if self.max_tokens is not None and len(prefix) > self.max_tokens:
            return  # would evict everything and still not fit
        self._pop(prefix.tokens)  # a sequence sampled twice: the newer copy replaces the older
        self._entries[prefix.tokens] = prefix
        self._lengths[len(prefix)] = self._lengths.get(len(prefix), 0) + 1
        self._tokens += len(prefix)
        while len(self._entries) > self.max_entries or (
            self.max_tokens is not None and self._tokens > self.max_tokens
        ):
            self._pop(next(iter(self._entries)))

    def take(self, prompt: list[int]) -> CachedPrefix | None:
        """Remove and return the longest entry that is a proper prefix of ``prompt``, if any.

        Proper: at least the prompt's last token must still be fed to the model, for its logits.
        """
        for length in sorted(self._lengths, reverse=True):
            if length < len(prompt):
                key = tuple(prompt[:length])
                if key in self._entries:
                    return self._pop(key)
        return None

    def drop(self, tokens: tuple[int, ...]) -> bool:
        """Drop the entry for exactly ``tokens`` (its episode ended); whether there was one."""
        return self._pop(tokens) is not None

    def clear(self) -> None:
        self._entries.clear()
        self._lengths.clear()
        self._tokens = 0

    def _pop(self, key: tuple[int, ...]) -> CachedPrefix | None:
        prefix = self._entries.pop(key, None)
        if prefix is not None:
            self._tokens -= len(prefix)
            self._lengths[len(prefix)] -= 1
            if self._lengths[len(prefix)] == 0:
                del self._lengths[len(prefix)]
        return prefix
