"""#43 item 1: every row of every env resets with a seed its whole GRPO group shares, and `make rollouts` shows it.

Before: an ENV_PROMPTS_FILE row without "reset" became `reset_kwargs: {}`, so each member of its group reset a
stochastic env with no seed and played a different episode (the group baseline then compared different tasks).
"""

from __future__ import annotations

import inspect
import json

import pytest

from envs import registry
from envs.generic.task import make_dataset
from trainer.rollouts import traces


def write_rows(path, rows) -> None:
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))


def seeds(path) -> list:
    return [row["reset_kwargs"].get("seed", "absent") for row in make_dataset(0, 0, "guess", prompts_file=str(path))]


def test_a_file_row_without_a_seed_gets_a_fixed_one_from_its_content(tmp_path):
    f = tmp_path / "prompts.jsonl"
    write_rows(f, [{"prompt": "Play."}, {"prompt": "Play.", "reset": {"level": 2}}, {"prompt": "Other."}])
    first = seeds(f)
    assert all(isinstance(s, int) and 0 <= s < 2**31 for s in first), first
    assert len(set(first)) == 3
    assert seeds(f) == first  # a resume reads the same file: the same episodes
    rows = make_dataset(0, 0, "guess", prompts_file=str(f))
    assert rows[1]["reset_kwargs"] == {"level": 2, "seed": first[1]}  # the row's own kwargs stay
    # Another line inserted above, and the rows' keys reordered and respaced: each row keeps its seed.
    f.write_text('{"prompt": "New."}\n' + '{"prompt":"Play."}\n' + '{"reset": {"level": 2},  "prompt": "Play."}\n'
                 + '{"prompt": "Other."}\n')
    assert seeds(f)[1:] == first


def test_duplicate_rows_play_different_episodes_and_an_explicit_seed_is_kept(tmp_path):
    f = tmp_path / "prompts.jsonl"
    write_rows(f, [{"prompt": "Play."}, {"prompt": "Play."}, {"prompt": "Play.", "reset": {"seed": 5}},
                   {"prompt": "Play.", "reset": {"seed": None}}])
    got = seeds(f)
    assert got[0] != got[1]
    assert got[2:] == [5, None]  # `"seed": null` is the file's way to send none


def test_every_builtin_env_whose_reset_takes_a_seed_gets_one_in_every_row():
    """A built-in env's rows hold its whole start state: a seed where its tool's reset takes one (wordle, catch), or
    the kwargs that fix the episode (echo's target: a deterministic server)."""
    for name in registry.names():
        spec = registry.get(name)
        takes = set(inspect.signature(spec.tool_class.reset).parameters) - {"self", "row"}
        rows = spec.make_dataset(8, 3)
        assert rows and all(takes & set(row) for row in rows), (name, takes, rows[0])
        if "seed" in takes:
            assert all(isinstance(row["seed"], int) for row in rows), name
            assert spec.make_dataset(8, 3) == rows  # a resume rebuilds the same rows


def trace_row(seed, reward: float) -> dict:
    return {"step": 3, "env": "guess", "reset": {"reset_kwargs": {"seed": seed}}, "prompt": [], "turns": [],
            "tool_calls": [], "env_reward": reward, "reward": reward, "rewards": {}}


def test_make_rollouts_shows_the_seed_each_group_played(tmp_path, capsys):
    run = tmp_path / "run-1"
    run.mkdir()
    rows = [trace_row(11, 1.0), trace_row(11, 0.0), trace_row(42, 0.5), trace_row(42, 0.5)]
    rows.append({**trace_row(None, 0.0), "env": "echo", "reset": {"target": "apple"}})
    assert all(traces.problems(r) == [] for r in rows)
    traces.append(run, rows)
    assert traces.main(["--outputs", str(tmp_path)]) == 0
    out = capsys.readouterr().out
    assert "played: seed 11 ×2, seed 42 ×2, no seed ×1\n" in out
    assert out.count("· seed 11 · reset") == 2 and "· seed - · reset {\"target\": \"apple\"}" in out
    assert traces.seed_of({"seed": 9}) == 9 and traces.seed_of("not a dict") is None


@pytest.mark.parametrize("reset", [{"seed": "\x1b]52;c;x\x07"}, {"reset_kwargs": {"seed": "\r7"}}])
def test_a_seed_from_a_hand_edited_file_is_printed_escaped(reset):
    line = traces.render({**trace_row(None, 0.0), "reset": reset})
    assert "\x1b" not in line and "\r" not in line and "\x07" not in line
