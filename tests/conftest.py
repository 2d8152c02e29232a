"""Shared fixtures: the embedded tiny DreamZero, built once per test session."""

from __future__ import annotations

from pathlib import Path

import pytest

from ardiff_policies.dreamzero.tiny import ensure_tiny_checkpoint


@pytest.fixture(scope="session")
def tiny_checkpoint() -> Path:
    return ensure_tiny_checkpoint()


@pytest.fixture(scope="session")
def tiny_model(tiny_checkpoint):
    from ardiff_policies.dreamzero.model import DreamZeroModel

    return DreamZeroModel.load(tiny_checkpoint)
