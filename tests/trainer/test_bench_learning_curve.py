"""bench/learning_curve.py's pure helpers for `--compare-zero-std` (the benchmark itself is not a test)."""

from __future__ import annotations

import pytest

from bench.learning_curve import compare_row, window_means


def test_window_means_one_point_per_ten_steps_and_a_short_last_window():
    assert window_means([float(i) for i in range(1, 31)]) == [5.5, 15.5, 25.5]
    assert window_means([1.0, 2.0, 3.0, 4.0, 5.0], width=2) == [1.5, 3.5, 5.0]
    assert window_means([]) == []
    with pytest.raises(ValueError, match="width must be >= 1"):
        window_means([1.0], width=0)


def test_compare_row_prints_the_curve_the_flat_share_and_the_end_figure():
    records = [{"env/echo/reward_mean": 0.5, "frac_reward_zero_std": 0.25}] * 10 + \
              [{"env/echo/reward_mean": 1.0, "frac_reward_zero_std": 0.75}] * 10
    line = compare_row("echo", 42, "drop", records, "greedy 0.00 -> 1.00")
    assert line.split() == ["echo", "42", "drop", "0.500", "1.000", "|", "0.50", "|", "greedy", "0.00", "->", "1.00"]
    # a run whose records lack the key (an old trainer) shows nan, not a crash
    assert "nan" in compare_row("echo", 7, "keep", [{"env/echo/reward_mean": 0.2}], "x")


def test_catch_runs_with_room_for_a_whole_game():
    """Under the CPU defaults (256 tokens, 4 tool rounds) no catch game ends (9 moves), so every reward is 0."""
    from bench.learning_curve import EPISODE_ARGS
    from contract.config import RunConfig
    from envs import registry
    from envs.catch.task import ROWS

    cfg = RunConfig.load(["--env-name", "catch", *EPISODE_ARGS["catch"]])
    assert cfg.max_tool_calling_iterations >= ROWS - 1  # one move per row the ball falls
    assert cfg.max_completion_length >= registry.get("catch").episode_budget_tokens
