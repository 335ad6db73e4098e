"""Fixtures shared by the auto tests."""

from __future__ import annotations

import pytest


@pytest.fixture(scope="module")
def folder(tmp_path_factory: pytest.TempPathFactory) -> str:
    """A folder with the auto test script's three models saved in it, one per test module."""
    from fixtures import auto_script  # torch: imported when a test asks for the models

    path = tmp_path_factory.mktemp("auto")
    auto_script.save_models(str(path))
    return str(path)
