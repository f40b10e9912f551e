"""`make chaos`'s figures (bench/chaos.py): read from the run's step records, traces, trainer log and the injector's
events, then printed beside their goals."""

from __future__ import annotations

import json
import math
import re
import time

from bench.chaos_faults import KINDS, Injector
from bench.chaos_stack import RESET_TIMEOUT_S, TOOL_TIMEOUT_S, Trainer

PING_S = 20 + 60  # the session client's keepalive: an idle socket nobody answers is closed within ping interval + timeout
HOSTILE_BOUND_S = 10.0  # a flood of control frames ends its session within: the client's rate window (1 s) + margin
DIAGNOSIS = ("stalled:", "no reply", "reset failed", "connection lost", "env session failed", "left out of training")
# What a silent server (a stopped one, or a half-open link) makes the trainer say: a reply late, or none (a step's, a
# reset's, a replay's "no reply and the server no pong"), pings or the session's close unanswered, a handshake that
# timed out (a stopped server takes the connection, never answers). Not a flood's abort, a dropped or killed link's
# (code 1006), a full server's: those lines are other faults', and a stall is never credited with them (#63).
SILENT = ("reply took", "no reply", "pings unanswered", "no answer to the session's close",
          "timed out during opening handshake")
FROM = re.compile(r"\(from ([^()\s]+)\)")  # the connection a line names (envs.core.client.stalled): the trainer's side
REPLAYED, REPLAY_FAILED = "reset was replayed", "could not start the episode again"  # envs.core.client lines


# ---------------------------------------------------------------------------- figures
def paired_wrong(rows: list[dict]) -> tuple[int, int]:
    """(calls checked, calls whose reply is not their own request's): echo answers with the message it was sent."""
    checked = wrong = 0
    for row in rows:
        for call in row.get("tool_calls", []):
            if call.get("failed"):
                continue
            message = (call.get("arguments") or {}).get("message")
            if not isinstance(message, str):
                continue
            checked += 1
            result = call.get("result")
            if call["tool"] == "echo_message":
                ok = result == message
            else:
                try:
                    ok = json.loads(result).get("message") == message
                except (ValueError, AttributeError):
                    ok = False
            wrong += not ok
    return checked, wrong


def figures(args, trainer: Trainer, injector: Injector, killed_at: list[dict], slots: dict, wall_s: float,
            generation_batch: int) -> dict:
    from trainer.rollouts import traces as rollouts

    rows = trainer.steps_logged()
    steps = [r["step"] for r in rows]
    traces = rollouts.read(trainer.out / "chaos" / rollouts.ROLLOUTS_FILE) \
        if (trainer.out / "chaos" / rollouts.ROLLOUTS_FILE).exists() else []
    checked, wrong = paired_wrong(traces)
    infra = sum(int(r.get("rollout/infra_failures") or 0) for r in rows)
    # sync: every step trains one generation batch; async: the worker's episodes scored in each step's logging window
    # (env/echo/episodes), infra-ended ones included (their samples are dropped before the queue)
    episodes = len(rows) * generation_batch if generation_batch else \
        sum(int(r.get("env/echo/episodes") or 0) for r in rows)
    state = json.loads((trainer.out / "chaos" / f"checkpoint-{args.steps}" / "trainer_state.json").read_text()) \
        if (trainer.out / "chaos" / f"checkpoint-{args.steps}" / "trainer_state.json").exists() else {}
    lost = sorted(set(range(1, args.steps + 1)) - set(steps))
    repeated = sorted({s for s in steps if steps.count(s) > 1})
    # stalls: a stopped server: the next step came within its bound; a half-open link: the trainer's side closed it
    # within its bound (a call's TOOL_TIMEOUT_S, a reset's RESET_TIMEOUT_S, an idle socket's keepalive). Diagnosis:
    # a line of the trainer's saying that a server was silent, naming one of the fault's own links (own_lines).
    bounds = {"stop": TOOL_TIMEOUT_S + 5 + 2 * RESET_TIMEOUT_S + args.step_allowance_s,
              "half_open": max(TOOL_TIMEOUT_S + 5, 2 * RESET_TIMEOUT_S, PING_S) + 5}
    # A restart (the trainer killed, the vLLM twin killed) logs no step until the run is back, and none comes after
    # the last: a stop inside a restart or after the last step is not timed by a next step (that would time the
    # restart, or never end), it is listed apart.
    restarts = [(e["time"], next((r["time"] for r in rows if r["time"] > e["time"]), time.time()))
                for e in injector.events if e["kind"] in ("trainer_kill", "vllm_restart") and not e.get("error")]
    if rows:
        restarts.append((rows[-1]["time"], math.inf))
    by_link = getattr(injector.proxy, "sees_trainer_ports", True)
    stalls, during_restart = [], []
    for event in injector.events:
        if event["kind"] not in bounds or event.get("error") or event.get("link", 1) is None:
            continue
        start = event["time"]
        if event["kind"] == "stop" and any(a <= event.get("continued", start) and start <= b for a, b in restarts):
            during_restart.append({"kind": "stop", "at": start, "why": "a restart while the server was stopped"})
            continue
        link = None
        if event["kind"] == "stop":
            after = [r["time"] for r in rows if r["time"] > start]
            end = after[0] if after else None
        else:
            link = injector.proxy.frozen_link(event["link"])
            end = link.client_gone_at if link is not None else None
        took = None if end is None else end - start
        window_end = (end if end is not None else time.time()) + 5
        if event["kind"] == "stop":
            window_end = max(window_end, event.get("continued", start) + 5)
            backend = tuple(event["backend"]) if event.get("backend") else None
            conns = set(injector.proxy.waited(backend, start, event.get("continued", window_end)) or ())
            waited = bool(conns)
        else:  # a frozen link: a request went into it since it froze (a ping does not count), or it was idle
            waited = bool(getattr(link, "waited", False)) if link is not None else True
            conns = {event["client"]} if event.get("client") else None  # None: a proxy that did not say
        diagnosed = own_lines(trainer.lines, start, window_end, conns if by_link else None)
        # the trainer killed, or the run ended, while the link was frozen and before the client gave up on it: the
        # client never stalled on it (no line of its own): listed apart, as a stop inside a restart
        if event["kind"] == "half_open" and not diagnosed and end is not None and any(
                start <= a <= end or (b == math.inf and a <= start) for a, b in restarts):
            during_restart.append({"kind": "half_open", "at": start, "why": "a restart closed the link before the "
                                   f"client gave up on it ({took:.1f} s after it froze)"})
            continue
        # a stopped server nothing waited on stalled nothing: the time to the next step is then the step's own
        # (on a loaded machine an async step outlasted the bound: 98 s, with no request sent to the stopped server)
        within = (took is not None and took <= bounds[event["kind"]]) or (event["kind"] == "stop" and not waited)
        stalls.append({"kind": event["kind"], "ended_after_s": took, "bound_s": bounds[event["kind"]],
                       "within": within, "waited": waited,
                       "diagnosis": diagnosed[0][:240] if diagnosed else None})
    planned = getattr(injector, "planned", [])
    return {
        "wall_s": round(wall_s), "steps": args.steps, "replicas": args.replicas, "seed": args.seed,
        "per_kind": getattr(args, "per_kind", None),
        "faults": {k: sum(1 for e in injector.events if e["kind"] == k and not e.get("error")) for k in KINDS},
        "faults_planned": {k: sum(1 for p in planned if p.kind == k) for k in KINDS},
        "trainer_kill": killed_at,
        "hostile": hostile_ended(injector, restarts),
        "calls_checked": checked, "replies_paired_wrong": wrong,
        "episodes": episodes, "infra_failures": infra, "infra_share": infra / episodes if episodes else None,
        "slots_held_at_end": slots,
        "steps_lost": lost, "steps_repeated": repeated, "final_global_step": state.get("global_step"),
        "stalls": stalls, "stalls_during_restart": during_restart,
        "lost_by_cause": lost_by_cause(traces, rows, injector.events),
        # saved only when the replay finished inside the rollout loop's bound (else the loop had given up on it)
        "replayed": sum(replay_in_time(text) for _, text in trainer.lines),
        "replay_failed": sum(REPLAY_FAILED in text for _, text in trainer.lines),
        "rollouts": args.rollouts, "vllm_restart": vllm_restart_figure(injector.events, trainer.lines),
        "judge_restart": judge_restart_figure(injector.events, rows, traces),
    }


def own_lines(lines: list[tuple[float, str]], start: float, window_end: float, conns: set[str] | None) -> list[str]:
    """The trainer's lines from `start` on that diagnose a silent server on one of `conns`, the fault's own links by
    the trainer's side of each (HOST:PORT, as the proxy saw it; a line names its connection: envs.core.client.stalled).
    A line naming no connection (a connect that never opened one) counts up to `window_end`. `conns` None (the proxy
    cannot see the trainer's sockets: the fleet's, behind Docker's published port): any such line up to `window_end`.
    By link, not by time: two faults in one window (a flood beside a half-open link) each get their own line."""
    out = []
    for t, text in lines:
        if t < start or not any(d in text for d in DIAGNOSIS) or not any(k in text for k in SILENT):
            continue
        named = FROM.search(text)
        if (conns is not None and named is not None and named.group(1) in conns) or (
                (conns is None or named is None) and t <= window_end):
            out.append(text)
    return out


def hostile_ended(injector: Injector, restarts: list[tuple[float, float]]) -> list[dict]:
    """Each hostile_frames burst: which side ended that link first and when; the client's answer to the flood only
    when its side closed first (not after the server's: a killed env, a drop) and no restart came between (a killed
    trainer closes every link, as the run's end does), within HOSTILE_BOUND_S."""
    out = []
    for event in injector.events:
        if event["kind"] != "hostile_frames" or event.get("error"):
            continue
        start = event["time"]
        ends = injector.proxy.link_ends(event["link"]) or {}
        client, server = ends.get("client"), ends.get("server")
        first = min((t for t in (client, server) if t is not None), default=None)
        if first is None:
            by = None
        elif any(start <= a <= first for a, _ in restarts):
            by = "restart"
        else:
            by = "client" if first == client else "server"
        took = None if first is None else first - start
        out.append({"frames": event.get("frames"), "ended_after_s": took, "ended_by": by,
                    "within": by == "client" and took <= HOSTILE_BOUND_S})
    return out


def vllm_restart_figure(events: list[dict], lines: list[tuple[float, str]]) -> dict | None:
    """The twin killed once (async): whether make rehearse stopped the trainer for it (exit 77), restarted vLLM, and
    which checkpoint the run resumed from after it (None: no restart was injected)."""
    kill = next((e for e in events if e["kind"] == "vllm_restart" and not e.get("error")), None)
    if kill is None:
        return None
    after = [text for t, text in lines if t >= kill["time"]]
    resumed = next((m for text in after if (m := re.search(r"resuming from \S+/checkpoint-(\d+)", text))), None)
    return {"after_step": kill["after_step"],
            "trainer_stopped": any("went away mid-run" in text for text in after),
            "restarted": any("restarting the vllm service" in text for text in after),
            "resumed_from": int(resumed.group(1)) if resumed else None}


# what a failed judge call's reason (trainer.judge.client) says of when it failed: a call the kill cut (its connection
# closed or reset mid-request) or one made while the judge was down (no connection: refused, no such host, none within
# the timeout)
JUDGE_CUT = ("RemoteProtocolError", "ReadError", "WriteError")
JUDGE_ABSENT = ("ConnectError", "ConnectTimeout", "judge timeout")


def judge_restart_figure(events: list[dict], rows: list[dict], traces: list[dict] = ()) -> dict | None:
    """The judge killed once (--judge): the calls in flight at the kill (its vLLM's requests running and waiting),
    when it was started again and back healthy, the rows the trainer left out for failed judge calls over the run
    (its judge/failures; None: the trainer logs no such figure) and the steps they were in, and of the traced
    rollouts (rollouts.jsonl) those whose judge call failed, by what their reason says (cut by the kill, made while
    the judge was absent), and how many of them have a reward (a failed call scored: must be 0). None: no judge
    restart was injected."""
    kill = next((e for e in events if e["kind"] == "judge_restart" and not e.get("error")), None)
    if kill is None:
        return None
    failures = [(r["step"], int(r["judge/failures"])) for r in rows if r.get("judge/failures") is not None]
    judged = [t for t in traces if isinstance(t.get("judge"), dict)]
    failed = [t for t in judged if t["judge"].get("failure")]
    reasons = [t["judge"]["failure"] for t in failed]
    return {"after_step": kill["after_step"], "down_s": kill.get("down_s"), "in_flight": kill.get("in_flight"),
            "healthy_after_s": kill["healthy"] - kill["time"] if kill.get("healthy") else None,
            "judge_failures": sum(n for _, n in failures) if failures else None,
            "failure_steps": [s for s, n in failures if n],
            "traced_judged": len(judged), "traced_failed": len(failed),
            "traced_cut": sum(any(k in r for k in JUDGE_CUT) for r in reasons),
            "traced_absent": sum(any(k in r for k in JUDGE_ABSENT) for r in reasons),
            # scored: a total reward, a judge score, or the judge column's value (the worker's sample metrics: NaN,
            # written null, when the judge gave nothing)
            "traced_failed_scored": sum(t.get("reward") is not None or t["judge"].get("score") is not None
                                        or (t.get("rewards") or {}).get("judge") is not None for t in failed),
            "reason_examples": sorted(set(reasons))[:4]}


def replay_in_time(line: str) -> bool:
    """A client line saying an episode was replayed inside the rollout loop's bound (else the loop gave up first)."""
    m = re.search(r"([0-9.]+) s into the step", line) if REPLAYED in line else None
    return m is not None and float(m.group(1)) < TOOL_TIMEOUT_S


CAUSES = (("no reply within TOOL_TIMEOUT_S", "call past TOOL_TIMEOUT_S"), ("reset failed", "reset failed"),
          ("SESSION_LOST", "session lost mid-episode"), ("connection lost", "connection lost mid-call"),
          ("no reply", "no reply"), ("CAPACITY_REACHED", "no capacity"))


def cause_of(reason: str) -> str:
    return next((name for key, name in CAUSES if key in reason), "other")


def lost_by_cause(traces: list[dict], rows: list[dict], events: list[dict]) -> dict[str, dict[str, int]]:
    """Episodes the env side ended, by what the trainer saw (the trace's reason) and by the faults injected while
    their step ran (between the step before's record and theirs): {reason: {faults: n}}."""
    ends = {r["step"]: r["time"] for r in rows}
    out: dict[str, dict[str, int]] = {}
    for row in traces:
        if not row.get("infra_failure"):
            continue
        step = row.get("step")
        lo, hi = ends.get(step - 1, 0.0) if step else 0.0, ends.get(step, float("inf"))
        kinds = sorted({e["kind"] for e in events if lo <= e["time"] <= hi and not e.get("error")}) or ["none"]
        by = out.setdefault(cause_of(row["infra_failure"]), {})
        by["+".join(kinds)] = by.get("+".join(kinds), 0) + 1
    return out


def print_figures(f: dict) -> None:
    def line(name, value, goal, ok):
        print(f"  {name:<44} {value:<28} goal {goal:<8} {'ok' if ok else 'MISSED'}")

    mode = " (async rollouts)" if f.get("rollouts") == "async" else ""  # sync: the line as before
    print(f"== chaos figures{mode}: {f['steps']} steps, {f['replicas']} replicas, seed {f['seed']}, {f['wall_s']} s; "
          f"trainer killed after steps {[k['after_step'] for k in f['trainer_kill']]}")
    asked = {k: n for k, n in f["faults_planned"].items() if n}
    line("faults injected, by kind (of those planned)",
         ", ".join(f"{k} {f['faults'][k]}/{n}" for k, n in asked.items()), "as plan",
         all(f["faults"][k] >= n for k, n in asked.items()))
    line("replies paired with the wrong request", f"{f['replies_paired_wrong']} of {f['calls_checked']} checked",
         "0", f["replies_paired_wrong"] == 0)
    share = f["infra_share"]
    line("episodes lost to infrastructure", f"{f['infra_failures']} of {f['episodes']} ({(share or 0):.1%})", "<=1 %",
         share is not None and share <= 0.01)
    held = f["slots_held_at_end"]
    line("session slots held at the end", f"{sum(held['held'].values())} ({held['after_s']:.0f} s after exit)", "0",
         sum(held["held"].values()) == 0)
    lr = len(f["steps_lost"]) + len(f["steps_repeated"])
    line("optimizer steps lost/repeated (trainer kill)", f"{len(f['steps_lost'])}/{len(f['steps_repeated'])}, "
         f"final step {f['final_global_step']}", "0", lr == 0 and f["final_global_step"] == f["steps"])
    within = [s for s in f["stalls"] if s["within"]]
    line("stalls ended within their bound", f"{len(within)} of {len(f['stalls'])}", "all",
         len(within) == len(f["stalls"]))
    # a stall nothing waited on (a stopped server no request reached, a frozen link closed idle): nothing to say
    felt = [s for s in f["stalls"] if s.get("waited", True)]
    diagnosed = [s for s in felt if s["diagnosis"]]
    line("stalls diagnosed (one line each)", f"{len(diagnosed)} of {len(felt)} (+{len(f['stalls']) - len(felt)} "
         "nothing waited on)", "all", len(diagnosed) == len(felt))
    for s in f.get("stalls_during_restart") or []:
        print(f"    + {s['kind']} not timed: {s.get('why', 'during a restart')} (trainer or vLLM killed, or the run's "
              "end: no step, and nothing of the client's, to time it by)")
    for s in f["stalls"]:
        took = "never" if s["ended_after_s"] is None else f"{s['ended_after_s']:.1f} s"
        print(f"    {s['kind']}: ended after {took} (bound {s['bound_s']:.0f} s); "
              f"{'waited on' if s.get('waited', True) else 'nothing waited on it'}; diagnosis: {s['diagnosis']}")
    hostile = f.get("hostile") or []
    line("hostile frame bursts ended by the client", f"{sum(h['within'] for h in hostile)} of {len(hostile)} "
         f"(within {HOSTILE_BOUND_S:.0f} s)", "all", all(h["within"] for h in hostile))
    for h in hostile:
        took = "never" if h["ended_after_s"] is None else f"{h['ended_after_s']:.1f} s"
        by = {"client": "the trainer's side (the session client)", "server": "the server's side (an env fault)",
              "restart": "a trainer or vLLM restart, or the run's end", None: "nobody"}[h["ended_by"]]
        print(f"    hostile_frames ({h['frames']}): link ended after {took} by {by}")
    print(f"  episodes lost, by what ended them and the faults of their step: {json.dumps(f['lost_by_cause'])}")
    print(f"  episodes saved by replaying their reset on a fresh session (lost before this fix): {f['replayed']}"
          f" (a replay that failed: {f['replay_failed']})")
    if f.get("rollouts") == "async":
        v = f["vllm_restart"] or {}
        line("vLLM twin killed mid-run, recovered", f"after step {v.get('after_step')}: resumed from checkpoint-"
             f"{v.get('resumed_from')}" if v else "not injected", "yes",
             bool(v) and v["restarted"] and v["resumed_from"] is not None and f["final_global_step"] == f["steps"])
    j = f.get("judge_restart")
    if j is not None:
        flight = j.get("in_flight") or {}
        line("judge killed with calls in flight", f"after step {j['after_step']}: {flight.get('running', 0):.0f} "
             f"running, {flight.get('waiting', 0):.0f} waiting", ">0", bool(flight))
        failed = "not logged" if j["judge_failures"] is None else \
            f"{j['judge_failures']} (steps {j['failure_steps']})"
        line("judge calls failed, rows left out (judge/failures)", failed, ">0", bool(j["judge_failures"]))
        line("failed judge calls scored (traced rows)", f"{j['traced_failed_scored']} of {j['traced_failed']} failed "
             f"({j['traced_cut']} cut by the kill, {j['traced_absent']} made while down; {j['traced_judged']} judged)",
             "0", j["traced_failed_scored"] == 0)
        back = "never" if j["healthy_after_s"] is None else f"{j['healthy_after_s']:.0f} s after the kill"
        line("judge back healthy, run finished", f"{back}; final step {f['final_global_step']}", "back",
             j["healthy_after_s"] is not None and f["final_global_step"] == f["steps"])
        for reason in j.get("reason_examples") or []:
            print(f"    judge failure: {reason[:200]}")
