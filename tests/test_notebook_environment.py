"""Notebooks run with the library's defaults, not the settings tests/conftest.py makes for the tests.

nbmake runs the notebooks in the same pytest process as the tests, after them, and a notebook's
kernel inherits that process's environment: without the root conftest's hook it would run with a
fixed thread count and float32 forced, as no user's kernel does (CI's notebooks ran 7-8x slower
beside another busy process so, 2026-12-07).
"""

from __future__ import annotations

import importlib.util
import os
from pathlib import Path
from types import SimpleNamespace

import pytest

ROOT = Path(__file__).resolve().parents[1]


def _root_conftest():
    spec = importlib.util.spec_from_file_location("root_conftest_under_test", ROOT / "conftest.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _run_call_phase(hook, path: str) -> dict[str, str | None]:
    """What the environment holds for the settings while an item at ``path`` runs."""
    seen: dict[str, str | None] = {}
    wrapper = hook(SimpleNamespace(path=Path(path)))
    next(wrapper)  # up to the yield: the item's call phase runs here
    for name in ("COOKBOOK_FIT_THREADS", "COOKBOOK_CPU_BF16", "USERS_OWN_SETTING"):
        seen[name] = os.environ.get(name)
    with pytest.raises(StopIteration):
        wrapper.send(None)
    return seen


def test_a_notebook_runs_without_the_settings_made_for_the_tests(monkeypatch):
    root = _root_conftest()
    monkeypatch.setenv("COOKBOOK_FIT_THREADS", "0")
    monkeypatch.setenv("COOKBOOK_CPU_BF16", "0")
    monkeypatch.setenv("USERS_OWN_SETTING", "1")
    monkeypatch.setenv(root.TEST_ONLY_RECORD, "COOKBOOK_FIT_THREADS,COOKBOOK_CPU_BF16")
    during = _run_call_phase(root.pytest_runtest_call, "notebooks/03_lockstep_grpo.ipynb")
    assert during == {"COOKBOOK_FIT_THREADS": None, "COOKBOOK_CPU_BF16": None, "USERS_OWN_SETTING": "1"}
    assert os.environ["COOKBOOK_FIT_THREADS"] == "0" and os.environ["COOKBOOK_CPU_BF16"] == "0"  # back after
    # A test keeps them; and a setting the user made (not in the record) stays for notebooks too.
    assert _run_call_phase(root.pytest_runtest_call, "tests/test_x.py")["COOKBOOK_FIT_THREADS"] == "0"
    monkeypatch.setenv(root.TEST_ONLY_RECORD, "COOKBOOK_CPU_BF16")
    during = _run_call_phase(root.pytest_runtest_call, "notebooks/03_lockstep_grpo.ipynb")
    assert during["COOKBOOK_FIT_THREADS"] == "0" and during["COOKBOOK_CPU_BF16"] is None


def test_this_run_records_what_tests_conftest_set():
    recorded = os.environ.get(_root_conftest().TEST_ONLY_RECORD, "").split(",")
    for name in recorded:
        assert name in ("COOKBOOK_FIT_THREADS", "COOKBOOK_CPU_BF16", "")
        if name:
            assert os.environ[name] == "0"
