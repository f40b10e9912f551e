"""The generic env path's pure functions (#45 items 3-5): learned tool names, observations within budget, demo
calls the schema and the observation allow. No server."""

from __future__ import annotations

import random

import pytest

from envs.generic.interface import action_tool_name
from envs.generic.tool import render_observation


# ---------------------------------------------------------------------------------------------- names (item 5)
@pytest.mark.parametrize("title, name", [
    ("REPLAction", "repl_action"), ("ReplAction", "repl_action"), ("DIPGAction", "dipg_action"),
    ("FinRLAction", "finrl_action"), ("DMControlAction", "dm_control_action"), ("AWMAction", "awm_action"),
    ("OpenSpielAction", "open_spiel_action"), ("BrowserGymAction", "browser_gym_action"),
    ("Connect4Action", "connect4_action"), ("Tbench2Action", "tbench2_action"), ("XMLHttpRequest", "xml_http_request"),
    ("guess_action", "guess_action"), ("reset", "reset_action"), ("class", "class_action"), ("2048Action", "act_2048_action"),
    ("", "action"),
])
def test_learned_tool_names_split_acronyms(title, name):
    """Before: replaction, dipgaction, fin_rlaction, dmcontrol_action."""
    assert action_tool_name(title) == name


# ---------------------------------------------------------------------------------------------- observations (item 3)
def test_a_huge_screen_is_summarised_and_legal_actions_and_score_come_first():
    """Before: the screen, first in field order, filled the whole budget; legal actions and the score never showed."""
    screen = [[[(r * 7 + c * 3 + k) % 256 for k in range(3)] for c in range(160)] for r in range(210)]
    obs = {"screen": screen, "lives": 3, "legal_actions": [0, 1, 2, 3], "score": 120.5, "metadata": {}}
    shown = render_observation(obs, 2000)
    lines = shown.split("\n")
    assert lines[:2] == ["legal_actions: [0, 1, 2, 3]", "score: 120.5"]
    assert lines[2].startswith("screen: [array 210x160x3, int; min 0, max 255, mean ") and "too big" in lines[2]
    assert lines[3] == "lives: 3"
    assert len(shown) <= 2000


def test_every_field_gets_its_share():
    obs = {"log": "x" * 50_000, "board": "y" * 50_000, "turn": 7}
    shown = render_observation(obs, 1000)
    assert len(shown) <= 1000
    lines = shown.split("\n")
    assert [line.split(":")[0] for line in lines] == ["log", "board", "turn"] and lines[2] == "turn: 7"
    log, board = len(lines[0]), len(lines[1])
    assert abs(log - board) <= 2 and log > 450  # the two big ones split what the small one leaves


def test_a_numeric_array_that_fits_is_shown_as_it_is():
    obs = {"info_state": [0.0] * 47 + [1.0, 0.0, 0.0], "legal_actions": [0, 1, 2]}
    shown = render_observation(obs, 2000)
    assert shown == "legal_actions: [0, 1, 2]\ninfo_state: " + str([0.0] * 47 + [1.0, 0.0, 0.0])


def test_a_summary_says_what_it_could_not_shape():
    ragged = [[1, 2, 3], [4, 5]] * 200
    shown = render_observation({"cells": ragged, "note": "n" * 3000}, 300)
    assert "[array 1,000 numbers, ragged, int; min 1, max 5, mean 3" in shown
    mixed = [1, "a"] * 1000  # not numbers: cut, not summarised
    assert "array" not in render_observation({"cells": mixed}, 200)
