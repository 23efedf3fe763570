"""Repo-wide pytest set-up. It also applies to the notebooks that nbmake runs from notebooks/.

Notebooks read their sizes from environment variables in their ``parameters`` cell; the test run
sets ``COOKBOOK_SMALL=1`` so each runs in its small mode (the kernel inherits the environment).
"""

import os

os.environ.setdefault("COOKBOOK_SMALL", "1")
os.environ.setdefault("WANDB_MODE", "offline")
