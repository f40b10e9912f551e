"""bench/async_figures.py's pure figures (`make bench-async`; the benchmark itself is not a test): samples trained per
step in each mode, time to learn from the learning checks, the trainer's shares, the goals' verdicts, the CPU sets."""

from __future__ import annotations

import pytest

from bench.async_figures import cpusets, figures, time_to_learn, trained_samples, trainer_shares, verdicts


def sync_row(step: int, t: float, reward: float = 0.5) -> dict:
    return {"kind": "step", "step": step, "time": t, "step_time": 10.0, "time/training_s": 4.0,
            "time/weight_sync_s": 1.0, "env/echo/episodes": 16, "reward": reward}


def async_row(step: int, t: float, reward: float = 0.5) -> dict:
    return {"kind": "step", "step": step, "time": t, "time/step_s": 5.0, "time/training_s": 4.0,
            "time/weight_sync_s": 0.5, "async/samples_at_lag/0": 30, "async/samples_at_lag/1": 10,
            "env/echo/episodes": 55, "async/staleness_p50": 0.0, "async/staleness_p90": 1.0,
            "async/staleness_max": 1, "async/dropped_stale": 2, "ratio": 1.01, "reward": reward}


def test_a_step_trains_its_lag_histogram_in_async_and_its_episodes_in_sync():
    assert trained_samples(async_row(1, 0.0)) == 40  # not the 55 episodes the worker scored in the window
    assert trained_samples(sync_row(1, 0.0)) == 16
    assert trained_samples({"env/echo/episodes": 8, "env/wordle/episodes": 8}) == 16


def test_time_to_learn_is_the_first_check_at_the_bar_after_the_first_step_started():
    rows = [sync_row(s, 100.0 + 10 * s) for s in range(1, 7)]  # step 1 starts at 100
    checks = [{"time": 100.0, "step": 0, "exact": 0.0}, {"time": 121.0, "step": 2, "exact": 0.5},
              {"time": 141.0, "step": 4, "exact": 0.85}, {"time": 161.0, "step": 6, "exact": 0.9}]
    assert time_to_learn(rows, checks, 0.8) == {"seconds": 41.0, "steps": 4, "samples": 64.0}
    assert time_to_learn(rows, checks, 0.95) == {"seconds": None, "steps": None, "samples": None}


def test_the_trainer_shares_split_the_logged_span():
    rows = [sync_row(s, 100.0 + 10 * s) for s in range(1, 5)]  # 40 s: 16 training, 4 pushing
    assert trainer_shares(rows) == pytest.approx({"training": 0.4, "pushing": 0.1, "waiting": 0.5})


def test_figures_of_an_async_run_carry_staleness_the_ratio_and_a_curve_per_sample():
    rows = [async_row(s, 100.0 + 5 * s, reward=0.1 * s) for s in range(1, 5)]
    samples = [(100.0 + k, 1.0 if k % 2 else 0.0, 50.0 * k) for k in range(0, 21)]
    f = figures(rows, samples, [{"time": 112.0, "step": 2, "exact": 0.9}], 0.8)
    assert f["learn"] == {"seconds": 12.0, "steps": 2, "samples": 80.0}
    assert f["samples"] == 160 and f["samples_per_min"] == pytest.approx(60 * 160 / 20)
    assert f["tokens_per_s"] == pytest.approx(50.0) and 0.4 < f["vllm_busy"] < 0.6
    assert f["staleness"] == {"p50": 0.0, "p90": 1.0, "max": 1, "dropped": 8}
    assert f["is_ratio"] == pytest.approx(1.01) and f["reward"] == pytest.approx(0.3)
    assert [c for c, _, _ in f["curve"]] == [40, 80, 120, 160]


def result(seconds, reward, waiting):
    return {"learn": {"seconds": seconds}, "reward": reward, "trainer": {"waiting": waiting}}


def test_the_verdicts_judge_each_seed_of_the_slow_env():
    results = {("slow", "sync", 42): result(300.0, 0.9, 0.6), ("slow", "async", 42): result(150.0, 0.92, 0.1),
               ("slow", "sync", 7): result(240.0, 0.95, 0.6), ("slow", "async", 7): result(200.0, 0.99, 0.3),
               ("instant", "sync", 42): result(100.0, 0.9, 0.5)}
    lines = verdicts(results)
    assert "seed 42: async learned in 150 s, sync in 300 s: 2.00x faster (goal >= 1.5x: met)" in lines
    assert "seed 7: async learned in 200 s, sync in 240 s: 1.20x faster (goal >= 1.5x: NOT met)" in lines
    assert any(line.startswith("seed 7: async trainer waiting 30%") and line.endswith("NOT met)") for line in lines)
    assert "seed 7: async final reward 0.990, sync's seeds 0.900..0.950 (NOT within)" in lines
    assert "seed 42: async final reward 0.920, sync's seeds 0.900..0.950 (within)" in lines
    assert verdicts({("slow", "sync", 1): result(None, 0.5, 0.5), ("slow", "async", 1): result(10.0, 0.5, 0.1)})[0] \
        .startswith("seed 1: time to learn not measured")


def test_cpu_sets_halve_the_cores_or_take_what_is_given(monkeypatch):
    monkeypatch.setattr("os.sched_getaffinity", lambda pid: {0, 1})
    assert cpusets("auto") == {"REHEARSE_VLLM_CPUSET": "0", "REHEARSE_TRAINER_CPUSET": "1"}
    monkeypatch.setattr("os.sched_getaffinity", lambda pid: {0, 1, 2, 3})
    assert cpusets("auto") == {"REHEARSE_VLLM_CPUSET": "0,1", "REHEARSE_TRAINER_CPUSET": "2,3"}
    monkeypatch.setattr("os.sched_getaffinity", lambda pid: {0})
    assert cpusets("auto") == {}  # one core: nothing to split
    assert cpusets("none") == {} and cpusets("0-1:2") == {"REHEARSE_VLLM_CPUSET": "0-1", "REHEARSE_TRAINER_CPUSET": "2"}
    with pytest.raises(SystemExit, match="VLLM:TRAINER"):
        cpusets("0")


def test_the_stress_bench_weighs_generated_and_trained_figures_by_their_counts_and_judges_the_cap():
    import math

    from bench.async_stress import stress_figures, verdicts

    rows = [{"time": 10.0, "time/step_s": 2.0, "reward": 1.0, "async/generated_reward": 0.5, "env/echo/episodes": 4,
             "async/samples_at_lag/0": 2, "async/samples_at_lag/1": 0, "async/generated_tokens": 40.0,
             "async/trained_tokens": 20.0, "off_policy/ratio_max": 5.0, "off_policy/weight_max": 4.0,
             "off_policy/weight_cap": 4.0, "off_policy/clipped_share": 0.1, "async/dropped_stale": 3,
             "async/staleness_max": 2},
            {"time": 12.0, "reward": 0.0, "async/generated_reward": 0.0, "env/echo/episodes": 12,
             "async/samples_at_lag/0": 6, "async/samples_at_lag/1": 0, "async/generated_tokens": 80.0,
             "async/trained_tokens": 60.0, "off_policy/ratio_max": 9.0, "off_policy/weight_max": 4.5,
             "off_policy/weight_cap": 4.0, "off_policy/clipped_share": 0.3, "async/dropped_stale": 1}]
    f = stress_figures(rows)
    assert f["generated_reward"] == 0.125 and f["trained_reward"] == 0.25  # (0.5*4 + 0*12)/16, (1*2 + 0*6)/8
    assert f["generated_tokens"] == 70.0 and f["trained_tokens"] == 50.0
    assert f["ratio_max"] == 9.0 and f["dropped"] == 4 and f["trained"] == 8 and f["generated"] == 16
    assert math.isclose(f["clipped_share"], 0.25) and f["wall_s"] == 4.0
    [line, _] = verdicts({"async two_sided free 42": f}, "x")
    assert "max weight 4.50 ABOVE cap 4.00" in line and "trained-generated reward +0.125, tokens -20.0" in line
