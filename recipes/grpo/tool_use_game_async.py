"""Async GRPO on the bundled tool-use game: the lockstep demo, with rollouts overlapping training.

The config has the seed page's async shape (``max_steps_off_policy=1``, ``groups_in_flight``,
``num_generator_replicas``, ``weight_sync_type``), on top of ``recipes.grpo.tool_use_game``'s
``demo_config``, sized for a 2-core CPU and the embedded 135M model. The flags are the lockstep
recipe's (the two share one ``main``), plus ``--weight-sync``, ``--replicas`` and ``--ray``:

    python -m recipes.grpo.tool_use_game_async
    python -m recipes.grpo.tool_use_game_async --weight-sync pipeline --steps 20 --run-name pipelined
    python -m recipes.grpo.tool_use_game_async --replicas 2 --ray   # replicas as Ray actors
    python -m recipes.grpo.tool_use_game_async --small          # a tiny run, to check it works

The async settings, and why these values here:

- ``max_steps_off_policy=1``: a group may have started its rollout at most one optimizer step
  before the trainer takes it; older ones are never trained. With 0 no group could play while the
  trainer steps (lockstep again, with more bookkeeping); 1 is the seed's advice.
- ``groups_in_flight=2 * batch_size``: the trainer needs ``batch_size`` groups per step; twice as
  many in flight keeps the next step's groups playing while the trainer steps, without piling up
  groups that would be one version too old by the time the trainer gets to them.
- ``stale_groups="prevent"`` (the default): groups are trained in the order they started and a
  group starts only when it will be trained within the bound, so none is dropped as stale and
  the long episodes (the game's multi-call tasks) are trained as often as in lockstep.
- ``num_generator_replicas=1``: a replica is a full copy of the model serving rollouts. On a CPU
  every copy competes for the same 2 cores, so a second one halves each one's speed, doubles the
  memory and the weight updates, and gains nothing. On GPUs use one replica per device.
- ``weight_sync_type``: ``WEIGHT_SYNC_TYPE_SYNCHRONOUS`` (the default) publishes new weights
  before the next step starts; ``--weight-sync background_publish`` or ``pipeline`` defer it (see
  ``cookbook_lib.grpo.weight_sync``).

It writes runs/<run_name>/ like the lockstep recipe, plus ``timeline.jsonl`` (see notebook 04) and
the ``async/*`` metrics in metrics.jsonl. ``--config my.yaml`` takes the whole config from YAML
(set ``max_steps_off_policy`` there, or the run is lockstep); the flags override it.
"""

from __future__ import annotations

import argparse
import dataclasses

from cookbook_lib.grpo.config import GRPOConfig, WeightSyncType
from cookbook_lib.grpo.train import TrainResult
from recipes.grpo import tool_use_game

SYNC_PREFIX = "WEIGHT_SYNC_TYPE_"


def async_demo_config(**overrides) -> GRPOConfig:
    """``demo_config`` made async; ``groups_in_flight`` is twice the (possibly overridden) batch size.

    Any field, the async ones included, can be overridden: ``max_steps_off_policy=None`` gives
    back the lockstep demo config.
    """
    config = tool_use_game.demo_config(**overrides)
    async_settings = dict(
        max_steps_off_policy=1,
        groups_in_flight=2 * config.batch_size,
        stale_groups="prevent",
        num_generator_replicas=1,
        weight_sync_type=WeightSyncType.WEIGHT_SYNC_TYPE_SYNCHRONOUS,
    )
    return dataclasses.replace(
        config, **{name: value for name, value in async_settings.items() if name not in overrides}
    )


def weight_sync_type(text: str) -> WeightSyncType:
    """``--weight-sync``'s value: a short name (``pipeline``) or the full one, in any case."""
    name = text.strip().upper().replace("-", "_")
    if not name.startswith(SYNC_PREFIX):
        name = SYNC_PREFIX + name
    try:
        return WeightSyncType(name)
    except ValueError:
        short = ", ".join(mode.removeprefix(SYNC_PREFIX).lower() for mode in WeightSyncType)
        raise argparse.ArgumentTypeError(f"{text!r} is no weight-sync mode; use one of {short}") from None


def make_parser() -> argparse.ArgumentParser:
    parser = tool_use_game.make_parser(__doc__)
    parser.add_argument(
        "--weight-sync",
        dest="weight_sync_type",  # a GRPOConfig field: the shared main passes it on
        metavar="MODE",
        type=weight_sync_type,
        default=None,
        help="synchronous (the default), background_publish or pipeline",
    )
    parser.add_argument(
        "--replicas",
        dest="num_generator_replicas",
        metavar="N",
        type=int,
        default=None,
        help="generator replicas (default 1)",
    )
    parser.add_argument(
        "--ray",
        dest="generator_placement",
        action="store_const",
        const="ray",
        default=None,
        help='run each replica as a Ray actor (generator_placement="ray"; pip install -e ".[ray]")',
    )
    return parser


def main(argv: list[str] | None = None) -> TrainResult:
    return tool_use_game.main(argv, base_config=async_demo_config, parser=make_parser())


if __name__ == "__main__":
    main()
