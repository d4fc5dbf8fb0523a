"""Fixtures shared by the recipe's tests."""

from __future__ import annotations

from pathlib import Path

import pytest


@pytest.fixture(scope="session")
def cache(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The standard library's tokens, cached once per test process by a one-step run, so that the
    ranks of the runs using it (torchrun's included) only read it."""
    from recipes.pretrain import main  # (the recipe's modules, only where a test asks for this)

    path = tmp_path_factory.mktemp("cache")
    warm = ["--preset", "tiny", "--steps", "1", "--batch-size", "4", "--val-batches", "1", "--no-progress"]
    assert main([*warm, "--cache-dir", str(path), "--run-dir", str(path / "warm")]) == 0
    return path
