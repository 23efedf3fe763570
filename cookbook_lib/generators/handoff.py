"""Handing work and results between callers' event loops and ``HFGenerator``'s worker thread.

A future belongs to the loop that created it and must be resolved on that loop's thread; the
worker resolves it through ``call_soon_threadsafe``. Each item carries its loop because callers
may run on different loops (one per notebook cell, one per ``asyncio.run``). New weights are
checked in the caller, so a bad state dict fails there and never reaches the worker.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

import torch
from transformers import PreTrainedModel

from cookbook_lib.runtime.packed_linear import weight_shapes


@dataclass(eq=False)
class WeightUpdate:
    """An ``update_weights`` call waiting for the worker to apply it between two forwards."""

    state_dict: Mapping[str, torch.Tensor]
    version: int
    future: asyncio.Future[None]
    loop: asyncio.AbstractEventLoop
    between_requests: bool = False


@dataclass(eq=False)
class WorkerCall:
    """A ``run_on_worker`` call: a function the worker runs between two steps, when no request
    is running (``between_requests``), its result or exception delivered to ``future``."""

    function: Callable[[], Any]
    future: asyncio.Future[Any]
    loop: asyncio.AbstractEventLoop
    between_requests: bool = True


def deliver(future: asyncio.Future, loop: asyncio.AbstractEventLoop, outcome: object) -> None:
    """Resolve ``future`` from the worker thread, on its own event loop (if that loop still runs)."""

    def resolve() -> None:
        if future.done():  # cancelled by its caller meanwhile
            return
        if isinstance(outcome, BaseException):
            future.set_exception(outcome)
        else:
            future.set_result(outcome)

    # A closed loop raises RuntimeError: nobody is waiting any more.
    with contextlib.suppress(RuntimeError):
        loop.call_soon_threadsafe(resolve)


def check_state_dict(model: PreTrainedModel, state_dict: Mapping[str, torch.Tensor]) -> None:
    """Reject a state dict that names weights the model lacks, or gives them other shapes."""
    own = weight_shapes(model)  # packed linears (a sampling copy's) under their nn.Linear names
    unknown = sorted(set(state_dict) - set(own))
    if unknown:
        raise ValueError(f"update_weights got names the model does not have: {unknown[:5]}")
    for name, tensor in state_dict.items():
        if tensor.shape != own[name]:
            raise ValueError(
                f"update_weights: {name} has shape {tuple(tensor.shape)}, model has {tuple(own[name])}"
            )
