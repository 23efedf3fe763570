"""Repo-wide pytest set-up. It also applies to the notebooks that nbmake runs from notebooks/.

Notebooks read their sizes from environment variables in their ``parameters`` cell; the test run
sets ``COOKBOOK_SMALL=1`` so each runs in its small mode (the kernel inherits the environment).
Otherwise a notebook runs with the library's defaults, as in a user's kernel: the settings
tests/conftest.py makes for the tests alone (a fixed thread count, float32 on every CPU) are out of
the environment while a notebook runs, also when nbmake runs it after the tests in one process.
"""

import importlib.util
import os

import pytest

os.environ.setdefault("COOKBOOK_SMALL", "1")
os.environ.setdefault("WANDB_MODE", "offline")

# A notebook that needs an optional extra, and the modules that extra installs: without them the
# notebook is skipped with the install hint, as the extra's own tests are.
NOTEBOOK_EXTRAS = {"05_bring_your_own_env.ipynb": ("envs", ("gem", "textarena", "reasoning_gym"))}


# tests/conftest.py lists here, comma-separated, the settings it made for the tests (not the user's).
TEST_ONLY_RECORD = "COOKBOOK_TEST_ONLY_SETTINGS"


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_call(item: pytest.Item):
    """A notebook's kernel, started in the call phase, inherits no setting made for the tests."""
    names = [name for name in os.environ.get(TEST_ONLY_RECORD, "").split(",") if name]
    if item.path.suffix != ".ipynb" or not names:
        yield
        return
    saved = {name: os.environ.pop(name) for name in names if name in os.environ}
    try:
        yield
    finally:
        os.environ.update(saved)


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
