"""Keeping transformers' and huggingface_hub's own bars and warnings out of our output.

Loading a model prints a "Loading weights" bar, saving one a "Writing model shards" bar, and both
log advice meant for transformers' developers or raise deprecation warnings about transformers'
own internals (peft calls them); in a notebook each of these lands in the cell's output between our
own lines. :func:`quiet_libraries` turns them off around our calls and puts back exactly what was
set before, so a user who wants transformers' bars elsewhere keeps them.

Nested and concurrent uses (a checkpoint saved on the trainer's thread while the notebook's thread
loads a model) share one silence: the first to enter saves the settings, the last to leave
restores them.
"""

from __future__ import annotations

import contextlib
import threading
import warnings
from collections.abc import Iterator
from dataclasses import dataclass

_lock = threading.Lock()
_depth = 0
# Python warnings raised from inside these libraries (FutureWarning, UserWarning...).
_LIBRARIES = r"(transformers|huggingface_hub|peft|accelerate)(\.|$)"


@dataclass(frozen=True)
class _Settings:
    transformers_verbosity: int
    transformers_bars: bool
    hub_bars_disabled: bool
    warning_filter: tuple


_saved: _Settings | None = None


def _silence() -> _Settings:
    from huggingface_hub.utils import are_progress_bars_disabled, disable_progress_bars
    from transformers.utils import logging as transformers_logging

    warnings.filterwarnings("ignore", module=_LIBRARIES)  # inserted first: it wins
    saved = _Settings(
        transformers_verbosity=transformers_logging.get_verbosity(),
        transformers_bars=transformers_logging.is_progress_bar_enabled(),
        hub_bars_disabled=are_progress_bars_disabled(),
        warning_filter=warnings.filters[0],
    )
    transformers_logging.set_verbosity_error()
    transformers_logging.disable_progress_bar()
    if not saved.hub_bars_disabled:
        with warnings.catch_warnings():  # HF_HUB_DISABLE_PROGRESS_BARS=0 refuses, with a warning
            warnings.simplefilter("ignore")
            disable_progress_bars()
    return saved


def _restore(saved: _Settings) -> None:
    from huggingface_hub.utils import disable_progress_bars, enable_progress_bars
    from transformers.utils import logging as transformers_logging

    transformers_logging.set_verbosity(saved.transformers_verbosity)
    # Only our filter goes, not filters others added meanwhile (what catch_warnings would undo).
    # An "ignore" leaves no trace in the modules' warning registries, so no cache needs clearing.
    with contextlib.suppress(ValueError):
        warnings.filters.remove(saved.warning_filter)
    # Both libraries warn when an environment variable overrides the call; the variable wins
    # either way, and the warning would be exactly the noise this module removes.
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        if saved.transformers_bars:
            transformers_logging.enable_progress_bar()  # also enables the hub's: reset it below
        if saved.hub_bars_disabled:
            disable_progress_bars()
        else:
            enable_progress_bars()


@contextlib.contextmanager
def quiet_libraries() -> Iterator[None]:
    """No transformers / huggingface_hub progress bars or warnings inside; settings restored after.

    Errors still show: transformers logs at ERROR level, and exceptions propagate as usual.
    """
    global _depth, _saved
    with _lock:
        if _depth == 0:
            _saved = _silence()
        _depth += 1
    try:
        yield
    finally:
        with _lock:
            _depth -= 1
            if _depth == 0 and _saved is not None:
                _restore(_saved)
                _saved = None
