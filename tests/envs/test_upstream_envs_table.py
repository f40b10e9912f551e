"""docs/upstream-envs.json (#45 item 6): every upstream OpenEnv env classed, each run's result recorded with its
evidence, and the docs table saying the same; bench/upstream_envs.py reads `make train`'s output as it is."""

from __future__ import annotations

import json
import re

from tests.helpers import ROOT

TABLE = json.loads((ROOT / "docs" / "upstream-envs.json").read_text())
RESULTS = {"ok", "fail (ours)", "fail (upstream)", "refused (by design)", "not run"}


def test_every_env_is_classed_once_with_a_one_line_reason():
    envs = [r["env"] for r in TABLE["envs"]]
    assert len(envs) == len(set(envs)) and len(envs) >= 30, envs
    for r in TABLE["envs"]:
        assert r["class"] in ("none", "outside"), r
        assert r["why"] and "\n" not in r["why"], r
        assert r["result"] in RESULTS, r
        if r["class"] == "outside":
            assert r["result"] == "not run", f"{r['env']}: needs an outside service, so it is not a goal here"


def test_each_result_carries_its_figures_and_evidence():
    for r in TABLE["envs"]:
        if r["result"] == "not run":
            continue
        assert isinstance(r["wall_s"], (int, float)) and r["wall_s"] > 0, r
        if r["result"] == "ok":  # the goal: 3 steps with tool calls, demo calls accepted >= 90 %
            assert r["acceptance"] is not None and r["acceptance"] >= 0.9, r
        else:  # whose fault and the error itself, quoted
            assert r["note"] and ("'" in r["note"] or '"' in r["note"] or ":" in r["note"]), r


def test_the_docs_page_shows_the_table():
    page = (ROOT / "docs" / "environments.md").read_text()
    for r in TABLE["envs"]:
        row = re.search(rf"^\| `{re.escape(r['env'])}` \|([^\n]*)$", page, re.M)
        assert row, f"docs/environments.md has no row for {r['env']}"
        assert r["result"] in row.group(1), (r["env"], r["result"], row.group(1))


def test_the_bench_reads_train_output():
    from bench.upstream_envs import Row, first_error, parse_train

    out = """ Container up6-echo_env-env-echo_env-1  Healthy
[preflight] ok: env echo_env: 1 replica(s) healthy; capacity 8 sessions in all (probed: the server does not report it) >= 8 this trainer opens; transport websocket (/ws sessions); resets seeded
[preflight] ok: env echo_env: learned from the server (mcp env): tools echo_message(message), echo_with_length(message)
[train] step 1/3 reward 0.000 tool_calls/ep 2.75 tool_fail 0.00 loss 0.0000 step 4.30s (gen 3.20 env 2.96 train 0.47)
[train] step 3/3 reward 0.000 tool_calls/ep 2.38 tool_fail 0.00 loss 0.0000 step 11.40s (gen 8.08 env 0.17 train 3.14)
[train] done: step 3/3; last 3 steps: reward 0.000, tool calls/episode 2.42, tool failures 0.00
"""
    row = Row("echo_env", "up6/echo_env:local")
    parse_train(row, out)
    assert (row.healthy, row.transport, row.steps) == (True, "websocket", 3)
    assert (row.tool_calls, row.tool_failures) == (2.42, 0.0)
    assert row.tools == "mcp env: echo_message(message), echo_with_length(message)"
    assert first_error("# build\n[stack] ok\n[tiny-model] cannot learn the tools of x: boom\nlast") == \
        "[tiny-model] cannot learn the tools of x: boom"
    compose = 'time="2026-12-05T08:03:48Z" level=warning msg="... but buildx isn\'t installed"\n'  # not "stalled"
    assert first_error(compose + "[preflight] FAILED:\n- env x: cannot resolve 'env-x'\n") == \
        "[preflight] FAILED: - env x: cannot resolve 'env-x'"
