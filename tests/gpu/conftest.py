"""Every test under tests/gpu is a ``gpu`` test: ``pytest -m gpu`` runs them, ``-m "not gpu"`` skips them.

Each module still skips itself where CUDA (or vllm) is missing, so a plain ``pytest`` passes on a CPU.
"""

from __future__ import annotations

from pathlib import Path

import pytest

HERE = Path(__file__).parent


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    # Hooks of a conftest see the whole session's items: mark only this folder's.
    for item in items:
        if HERE in Path(item.path).parents:
            item.add_marker(pytest.mark.gpu)
