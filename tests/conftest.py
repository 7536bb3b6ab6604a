"""Shared pytest fixtures."""

from __future__ import annotations

import pytest


@pytest.fixture(scope="session")
def tiny_moe_dir(tmp_path_factory):
    """A tiny random-weight Qwen3-MoE checkpoint (4 MoE layers, 16 experts, top-4), built once per session."""
    from eldr_cli.checkpoints.tiny import build_tiny_moe

    return build_tiny_moe(tmp_path_factory.mktemp("tiny-moe") / "qwen3_moe", "qwen3_moe")
