"""Repo-wide pytest set-up. It also applies to the notebooks that nbmake runs from notebooks/.

Notebooks read their sizes from environment variables in their ``parameters`` cell; the test run
sets ``COOKBOOK_SMALL=1`` so each runs in its small mode (the kernel inherits the environment).
"""

import importlib.util
import os

import pytest

os.environ.setdefault("COOKBOOK_SMALL", "1")
os.environ.setdefault("WANDB_MODE", "offline")

# A notebook that needs an optional extra, and the modules that extra installs: without them the
# notebook is skipped with the install hint, as the extra's own tests are.
NOTEBOOK_EXTRAS = {"05_bring_your_own_env.ipynb": ("envs", ("gem", "textarena", "reasoning_gym"))}


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    for item in items:
        needs = NOTEBOOK_EXTRAS.get(item.path.name)
        if needs is None:
            continue
        extra, modules = needs
        missing = [name for name in modules if importlib.util.find_spec(name) is None]
        if missing:
            hint = f'{", ".join(missing)} not installed: pip install -e ".[{extra}]"'
            item.add_marker(pytest.mark.skip(reason=hint))
