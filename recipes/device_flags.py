"""The ``--device`` and ``--dtype`` flags every recipe shares (GRPOConfig's fields of those names)."""

from __future__ import annotations

import argparse
from typing import get_args

from cookbook_lib.grpo.config import DTypeName


def add_device_flags(parser: argparse.ArgumentParser) -> None:
    """Add ``--device`` and ``--dtype``; both default to ``None``, which leaves the config's own ("auto")."""
    parser.add_argument(
        "--device",
        default=None,
        help="auto (CUDA when present, else CPU), cpu, cuda or cuda:N; default: the config's (auto)",
    )
    parser.add_argument(
        "--dtype",
        default=None,
        choices=get_args(DTypeName),
        help="precision policy (see cookbook_lib/runtime/devices.py); default: the config's (auto)",
    )


def device_overrides(args: argparse.Namespace) -> dict[str, str]:
    """The config fields the flags set (only those given)."""
    return {name: getattr(args, name) for name in ("device", "dtype") if getattr(args, name, None)}
