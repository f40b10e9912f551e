"""trainer/core/trl_privates.py: every TRL internal the stack relies on is pinned there, and holds on the installed TRL.

A TRL upgrade fails here with the list of what to re-check (each pin's `where` and `why`); the trainer's preflight
runs the same check (without the source digests) and stops the run with one line.
"""

from __future__ import annotations

import inspect
import os
import re
from pathlib import Path

import pytest

from contract.config import AsyncRollouts, SyncRollouts
from trainer.core import trl_privates
from trainer.core.trl_privates import PINS, Pin

ROOT = Path(__file__).resolve().parents[2]
os.environ.setdefault("TRL_EXPERIMENTAL_SILENCE", "1")


def test_the_installed_trl_is_the_pinned_release():
    assert trl_privates.installed_version() == trl_privates.TRL_VERSION


@pytest.mark.parametrize("pin", PINS, ids=lambda pin: pin.dotted.removeprefix("trl."))
def test_each_pin_holds_on_the_installed_trl(pin):
    assert pin.kind in trl_privates.KINDS
    found = trl_privates.problem(pin)
    assert found is None, f"{pin.dotted}: {found}: re-check {pin.where}: {pin.why}"
    if pin.digest:
        digest = trl_privates.source_digest(trl_privates.import_dotted(pin.dotted))
        assert digest == pin.digest, f"{pin.dotted} changed in trl: re-check {pin.where}: {pin.why}"


def test_no_pin_is_listed_twice():
    dotted = [pin.dotted for pin in PINS]
    assert len(dotted) == len(set(dotted))


def trl_private_names() -> dict[str, set[str]]:
    """Every underscored name the pinned TRL owners define ({name: owners}): members of their TRL classes (and the
    attributes TRL's code assigns on their instances), or of the modules."""
    out: dict[str, set[str]] = {}
    for owner in {pin.owner for pin in PINS}:
        obj = trl_privates.import_dotted(owner)
        if inspect.isclass(obj):
            names = set(trl_privates._assigned(owner))
            for cls in inspect.getmro(obj):
                if cls.__module__.split(".")[0] == "trl":
                    names |= set(vars(cls))
        else:
            names = set(vars(obj))
        for name in names:
            if name.startswith("_") and not name.startswith("__"):
                out.setdefault(name, set()).add(owner)
    return out


def test_every_trl_private_the_stack_names_is_pinned():
    """Any underscored name in trainer/ or bench/ that is one of TRL's (on a class or module the stack already
    touches) must be pinned: a new reach into TRL cannot slip in unlisted."""
    defined = trl_private_names()
    pinned = {pin.name for pin in PINS}
    unpinned: dict[str, list[str]] = {}
    for path in sorted((ROOT / "trainer").rglob("*.py")) + sorted((ROOT / "bench").rglob("*.py")):
        if path.name == "trl_privates.py":
            continue
        for number, line in enumerate(path.read_text().splitlines(), 1):
            for name in set(re.findall(r"\b(_[a-z][a-z0-9_]*)\b", line)):
                if name in defined and name not in pinned:
                    unpinned.setdefault(name, []).append(f"{path.relative_to(ROOT)}:{number}")
    assert not unpinned, f"TRL privates used but not pinned in trainer/core/trl_privates.py: {unpinned}"


def test_a_moved_private_stops_the_run_with_one_line_naming_what_to_recheck(monkeypatch):
    from trainer.run import preflight
    from contract.config import RunConfig

    gone = Pin(trl_privates.GRPO, "_tool_call_loop_v2", "method", "trainer/rollouts/rollout_loop.py", "the tool loop we copy")
    other_kind = Pin(trl_privates.GRPO, "_generate", "coroutine", "trainer/evaluate.py", "overridden")
    async_only = Pin(trl_privates.ASYNC_LOOP, "_nowhere", "attribute", "trainer/async_grpo/async_run.py", "not this run's")
    monkeypatch.setattr(trl_privates, "PINS", PINS + (gone, other_kind, async_only))
    line = trl_privates.startup_problem(SyncRollouts())
    assert line is not None and "\n" not in line
    assert "GRPOTrainer._tool_call_loop_v2: gone (re-check trainer/rollouts/rollout_loop.py: the tool loop we copy)" in line
    assert "GRPOTrainer._generate: a method now, not a coroutine (re-check trainer/evaluate.py: overridden)" in line
    assert "_nowhere" not in line  # an async pin does not stop a sync run
    assert line.endswith(f"Install trl=={trl_privates.TRL_VERSION}, or re-check those and update the pins")
    assert "_nowhere: no longer assigned by TRL" in trl_privates.startup_problem(AsyncRollouts())
    report = preflight.PreflightReport()
    assert preflight.check_trl(RunConfig.load([]), report) == [line]


def test_a_changed_parameter_list_is_named():
    pin = Pin(trl_privates.GRPO, "_calculate_rewards", "method", "trainer/train.py", "overridden", "self, inputs")
    assert trl_privates.problem(pin) == ("parameters (self, inputs, prompts, completions, completion_ids_list), "
                                         "not (self, inputs)")


def test_preflight_says_the_pins_hold():
    from trainer.run import preflight
    from contract.config import RunConfig

    report = preflight.PreflightReport()
    assert preflight.check_trl(RunConfig.load([]), report) == []
    assert report.ok == [f"trl {trl_privates.TRL_VERSION}: every TRL internal the trainer relies on is in place "
                         "(trainer/core/trl_privates.py)"]


def test_environment_pool_is_trls_own_dict_or_empty():
    from types import SimpleNamespace

    pool = {None: [object()]}
    assert trl_privates.environment_pool(SimpleNamespace(_environment_pool=pool)) is pool
    assert trl_privates.environment_pool(SimpleNamespace()) == {}


def test_the_async_rollout_lifecycle_is_pinned_and_a_change_stops_an_async_run(monkeypatch):
    """#43 item 5: the async path relies on TRL's `_generate_loop` (env drawn from the pool, reset(**row), reward
    before the env goes back) and `_repeat_iterator` (a group is one row repeated: it shares its seed). Before, neither
    was pinned, so a TRL that reshaped them started an async run as if nothing had changed."""
    from trl.experimental.async_grpo.async_rollout_worker import _AsyncRolloutLoop

    pinned = {pin.name: pin for pin in PINS if pin.owner == trl_privates.ASYNC_LOOP}
    for name, params in (("_generate_loop", "self, stop_event"), ("_repeat_iterator", "self")):
        assert name in pinned and pinned[name].group == "async" and pinned[name].digest, name
        assert pinned[name].params == params
    assert trl_privates.startup_problem(AsyncRollouts()) is None

    async def _generate_loop(self, stop_event, episode_budget):  # another parameter list
        return None

    monkeypatch.setattr(_AsyncRolloutLoop, "_generate_loop", _generate_loop)
    monkeypatch.setattr(_AsyncRolloutLoop, "_repeat_iterator", None)
    line = trl_privates.startup_problem(AsyncRollouts())
    assert "_AsyncRolloutLoop._generate_loop: parameters (self, stop_event, episode_budget), not (self, stop_event)" in line
    assert "_AsyncRolloutLoop._repeat_iterator: a NoneType now, not a method" in line
    assert trl_privates.startup_problem(SyncRollouts()) is None  # a sync run does not use them
