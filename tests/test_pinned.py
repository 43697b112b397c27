"""Pinned numbers (nanodo style): one training step of configs/tiny.py from seed 0 on the 8 fake CPU devices
gives these loss, gradient norm, parameter norm and balance loss. A change that alters numerics anywhere on the
path (init, data order, masks, routing, dispatch, optimizer) fails here and must say why in its commit.

Recorded 2026-11-23 with jax 0.10.2 on x86-64 CPU. The tolerance absorbs reduction-order differences between
platforms and XLA versions, not a change of the math (a single-token change of the data moves the loss by
more than 1e-3)."""

import pytest

from tests.conftest import tiny_config
from train.loop import run

PINNED = {"loss": 9.016656875610352, "grad_norm": 0.7331291437149048, "param_norm": 27.78090476989746,
          "balance_loss": 0.00010055285383714363}


def test_one_tiny_step_matches_the_pinned_numbers(tmp_path):
    c = tiny_config(**{"train.steps": 1, "log.every": 1, "eval.every": 100, "checkpoint.every": 100,
                       "execution.grouped_matmul": "auto"})  # CPU's default (slab), trained end to end here
    m = run(c, tmp_path / "run", log=lambda *a: None)
    for key, want in PINNED.items():
        assert m[key] == pytest.approx(want, rel=2e-5), (key, m[key], want)
