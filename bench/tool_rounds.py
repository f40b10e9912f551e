"""Env seconds per step: TRL's stock tool loop against the stack's rollout loop (trainer/rollouts/rollout_loop.py).

    .venv/bin/python bench/tool_rounds.py [--batches 8,64,256] [--delay 0.25] [--rounds 1] [--model DIR]

For each batch size, one generation batch runs through TRL's scoring path twice, once per loop, on the same
real env server: the rendezvous fixture (tests/fixtures/envs/rendezvous) with a tool that takes --delay
seconds. The model's turns are scripted (every rollout calls the tool on its first --rounds turns), so the
two runs do the same work. Env seconds = time inside the tool loop minus time inside generation. A third run
of our loop against the same env with an instant tool shows the floor: the CPU the env server and the loop
spend per round, which a tool's latency adds to.
Goal (issue #18): at batch 64, ours at least 0.8 x 64 times faster. A benchmark, not a test: it prints.
"""

from __future__ import annotations

import argparse
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from envs.core.tool import close_session  # noqa: E402
from tests.helpers import free_port, start_fixture  # noqa: E402
from tests.trainer.scripted import make_trainer, run_batch, script  # noqa: E402
from trainer.core.trl_privates import environment_pool  # noqa: E402

GOAL_BATCH, GOAL_SHARE = 64, 0.8


def env_seconds(trainer, tokenizer, batch: int, rounds: int) -> float:
    """Seconds inside the tool loop but not inside its generations, for one generation batch."""
    script(trainer, tokenizer, [f"r{k}" for k in range(batch)], rounds)
    generate, loop = trainer._generate_single_turn, trainer._tool_call_loop
    spent = {"loop": 0.0, "generation": 0.0, "in_loop": False}

    def timed_loop(*args):
        spent["in_loop"], start = True, time.perf_counter()
        try:
            return loop(*args)
        finally:
            spent["loop"] += time.perf_counter() - start
            spent["in_loop"] = False

    def timed_generate(*args, **kwargs):
        start = time.perf_counter()
        try:
            return generate(*args, **kwargs)
        finally:
            if spent["in_loop"]:
                spent["generation"] += time.perf_counter() - start

    trainer._generate_single_turn, trainer._tool_call_loop = timed_generate, timed_loop
    _, _, _, _, calls, failures, _ = run_batch(trainer)
    assert calls == batch * rounds and failures == 0, (calls, failures)
    return spent["loop"] - spent["generation"]


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--batches", default="8,64,256", help="rollouts per generation batch (default 8,64,256)")
    p.add_argument("--delay", type=float, default=0.25, help="seconds each tool call takes (default 0.25)")
    p.add_argument("--rounds", type=int, default=1, help="tool rounds per episode (default 1)")
    p.add_argument("--model", default=None, help="a tiny model already built (default: build one)")
    args = p.parse_args()
    batches = [int(b) for b in args.batches.split(",")]
    with tempfile.TemporaryDirectory() as tmp:
        model = Path(args.model) if args.model else Path(tmp) / "tiny"
        if not args.model:
            print("[bench] building the tiny model (about a minute)", flush=True)
            subprocess.run([sys.executable, "-m", "trainer.tiny_model", "--out", str(model)], cwd=ROOT, check=True,
                           stdout=subprocess.DEVNULL)
        urls, servers = {}, []
        for kind, delay in (("slow", args.delay), ("instant", 0.0)):
            port = free_port()
            servers.append(start_fixture("rendezvous", port, TOOL_DELAY_S=str(delay),
                                         MAX_CONCURRENT_ENVS=str(2 * max(batches) + 8)))
            urls[kind] = f"http://127.0.0.1:{port}"
        rows = []
        try:
            for batch in batches:
                figures = {}
                for name, kind, stock in (("stock", "slow", True), ("ours", "slow", False),
                                          ("instant", "instant", False)):
                    trainer, tokenizer = make_trainer(urls[kind], model, Path(tmp) / f"{name}{batch}", batch,
                                                      stock_loop=stock)
                    figures[name] = env_seconds(trainer, tokenizer, batch, args.rounds)
                    for env in environment_pool(trainer).get(None, []):
                        close_session(env)
                    print(f"[bench] batch {batch}: {name} {figures[name]:.2f} env s/step", flush=True)
                rows.append((batch, figures["stock"], figures["ours"], figures["instant"]))
        finally:
            for server in servers:
                server.kill()
    print(f"\nEnv seconds per step, tool call {args.delay:g} s, {args.rounds} round(s) per episode. 'instant tool': our "
          "loop on the same env with a 0 s tool, i.e. what the env server and the loop cost in CPU on this machine")
    print(f"{'batch':>6} {'stock TRL loop':>15} {'ours':>8} {'speed-up':>9} {'instant tool':>13}  goal")
    for batch, stock, ours, instant in rows:
        goal = f"speed-up >= {GOAL_SHARE * batch:.0f}x" if batch == GOAL_BATCH else ""
        print(f"{batch:>6} {stock:>14.2f}s {ours:>7.2f}s {stock / ours:>8.1f}x {instant:>12.2f}s  {goal}")

if __name__ == "__main__":
    main()
