"""Rollouts: an episode and its record (``episode``), playing episodes and groups (``play``), the
policy backed by a model and a codec (``model_policy``), and evaluation (``evaluate``).

The names of ``play`` are re-exported here, so ``from cookbook_lib.rollout import run_episode``
works; ``model_policy`` and ``evaluate`` load torch and transformers and are imported by name.
"""

from cookbook_lib.rollout.play import (
    ContainedPolicy,
    EnvFactory,
    Policy,
    PolicyStep,
    run_episode,
    run_group,
)

__all__ = ["ContainedPolicy", "EnvFactory", "Policy", "PolicyStep", "run_episode", "run_group"]
