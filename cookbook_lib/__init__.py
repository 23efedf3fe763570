"""cookbook_lib: a small library for training tool-use agents with multi-turn GRPO.

The public environment API lives in :mod:`cookbook_lib.envs` and :mod:`cookbook_lib.types`;
episodes are run by :mod:`cookbook_lib.rollout.play`.
"""

from cookbook_lib.runtime.onednn_caches import bound_onednn_caches

# Before torch first runs oneDNN, which reads the caches' capacity once (runtime/onednn_caches.py).
bound_onednn_caches()

__version__ = "0.1.0"
