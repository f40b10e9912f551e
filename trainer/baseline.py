"""Play each env with a random policy (and the scripted expert) through the same tool class the
trainer uses, and print mean reward and episode length, so you see whether the reward has room.

    python -m trainer.baseline [--episodes 32] [--env echo,wordle]     # envs default to ENV_NAME
"""

from __future__ import annotations

import argparse
import random
import statistics
import sys
import time

from envs.core.untrusted import one_line, strip_credentials
from contract.config import ConfigError, RunConfig


def play(tool, row: dict, choose, max_turns: int) -> dict:
    """One episode: reset, then tool calls chosen by `choose(observation_text, turn)` until the env
    refuses a call (finished episode), the policy stops (None), or max_turns."""
    obs = tool.reset(**row)
    text = row["prompt"][-1]["content"] + (obs if isinstance(obs, str) else "")
    calls = errors = 0
    for turn in range(max_turns):
        action = choose(text, turn)
        if action is None:
            break
        name, args = action
        try:
            text = str(getattr(tool, name)(**args))
            calls += 1
        except Exception:  # noqa: BLE001 - a finished episode answers with an exception: stop there
            errors += 1
            break
    return {"reward": float(tool.get_reward()), "calls": calls, "errors": errors}


def run_env(name: str, cfg: RunConfig, episodes: int, max_turns: int, seed: int) -> dict[str, dict]:
    from envs import registry
    from envs.core.tool import close_session
    from trainer.rollouts.envs_binding import bind, resolve_replicas
    from trainer.run.preflight import probe_server

    spec = registry.resolve(name, cfg.env_url(name), **cfg.generic_env_options(name))
    cls = bind(name, spec.tool_class, cfg.env_url(name), text_chars=cfg.env_observation_chars)  # same class, replicas and counters as training
    for url in resolve_replicas(cfg.env_url(name)):  # fail fast: the session client would retry a dead server for a while
        healthy, detail, _, _ = probe_server(url)
        if not healthy:
            raise RuntimeError(f"{url} {detail}")
    tool = cls()
    rows = spec.make_dataset(episodes, seed)
    rng = random.Random(seed)
    results = {}

    def random_policy(row):
        return lambda text, turn: spec.baseline_action(rng, text)

    def expert_policy(row):
        calls = list(spec.demo_calls(row))
        return lambda text, turn: calls[turn] if turn < len(calls) else None

    policies = [("random", random_policy)]
    if registry.is_builtin(name):  # an env learned from its server has no expert: its calls are synthetic
        policies.append(("scripted expert", expert_policy))
    for label, policy in policies:
        t0 = time.monotonic()
        eps = [play(tool, row, policy(row), max_turns) for row in rows]
        results[label] = {
            "episodes": len(eps),
            "reward_mean": statistics.fmean(e["reward"] for e in eps),
            "reward_min": min(e["reward"] for e in eps),
            "reward_max": max(e["reward"] for e in eps),
            "episode_length": statistics.fmean(e["calls"] for e in eps),
            "refused_episodes": sum(1 for e in eps if e["errors"]) / len(eps),
            "seconds": time.monotonic() - t0,
        }
    close_session(tool)
    return results


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m trainer.baseline", description=__doc__.splitlines()[0])
    p.add_argument("--env", help="comma list of envs (default: ENV_NAME)")
    p.add_argument("--episodes", type=int, default=32)
    p.add_argument("--max-turns", type=int, default=None, help="default: MAX_TOOL_CALLING_ITERATIONS or 16")
    p.add_argument("--seed", type=int, default=0)
    args = p.parse_args(argv)
    try:
        cfg = RunConfig.load([], **({"env_name": args.env} if args.env else {}))
    except ConfigError as exc:
        print(f"[baseline] config error:\n{exc}", file=sys.stderr)
        return 2
    max_turns = args.max_turns or cfg.max_tool_calling_iterations or 16
    status = 0
    for name in cfg.env_names:
        try:
            res = run_env(name, cfg, args.episodes, max_turns, args.seed)
        except Exception as exc:  # noqa: BLE001 - one env down must not hide the others
            print(f"[baseline] {name}: cannot play ({type(exc).__name__}: {one_line(strip_credentials(str(exc)), 500)}); "
                  f"is env-{name} up? "
                  f"(`make up`, COMPOSE_PROFILES must include {name})", file=sys.stderr)
            status = 1
            continue
        for label, r in res.items():
            print(f"[baseline] {name} {label:>15}: {r['episodes']} episodes, mean reward {r['reward_mean']:.3f} "
                  f"(min {r['reward_min']:.2f}, max {r['reward_max']:.2f}), episode length {r['episode_length']:.2f} "
                  f"tool calls (ended by a refused call: {100 * r['refused_episodes']:.0f}%) ({r['seconds']:.1f}s)")
        if "scripted expert" not in res:
            continue
        rnd, best = res["random"]["reward_mean"], res["scripted expert"]["reward_mean"]
        if best > 0 and rnd >= 0.9 * best:
            print(f"[baseline] {name}: WARNING: a random policy already earns {rnd:.3f} of the expert's {best:.3f}: "
                  "the reward leaves little to learn")
        else:
            print(f"[baseline] {name}: room to learn: random {rnd:.3f} vs scripted expert {best:.3f}")
    return status


if __name__ == "__main__":
    raise SystemExit(main())
