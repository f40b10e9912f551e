"""#47 item 2, #62: ROLLOUTS and TRAIN_MODE each chosen once, as a typed choice (contract.config's pydantic
discriminated unions): the variant carries its own knobs and refusals, the flat .env names stay, TRAIN_MODE=auto is
resolved once into the config, and the code below asks the variant instead of comparing the string."""

from __future__ import annotations

import re
from pathlib import Path

import pytest
from pydantic import ValidationError

from contract import config as modes
from contract.config import ConfigError, RunConfig

ROOT = Path(__file__).resolve().parents[1]


def refusal(monkeypatch, env: dict[str, str]) -> str:
    """The one-line error RunConfig gives for these .env values (read from the environment, as the trainer does)."""
    for key, value in env.items():
        monkeypatch.setenv(key, value)
    with pytest.raises(ConfigError) as exc:
        RunConfig.load([])
    message = str(exc.value)
    assert "\n" not in message, message
    return message


def test_max_staleness_set_for_sync_rollouts_is_refused_in_one_line(monkeypatch):
    message = refusal(monkeypatch, {"ROLLOUTS": "sync", "MAX_STALENESS": "2"})
    assert message.startswith("MAX_STALENESS=2 is a setting of ROLLOUTS=async"), message
    assert "ROLLOUTS=sync" in message and "(edit .env)" in message


def test_the_env_example_values_still_load(monkeypatch):
    # .env.example keeps MAX_STALENESS=4 beside ROLLOUTS=sync: a knob at its default is no choice, nothing to refuse
    monkeypatch.setenv("ROLLOUTS", "sync")
    monkeypatch.setenv("MAX_STALENESS", "4")
    assert RunConfig.load([]).rollouts == modes.SyncRollouts()
    monkeypatch.setenv("MAX_STALENESS", "")  # compose passes an unset variable as empty
    assert RunConfig.load([]).rollouts == modes.SyncRollouts()


def test_rollouts_is_chosen_once_with_its_own_knobs(monkeypatch):
    monkeypatch.setenv("ROLLOUTS", "async")
    monkeypatch.setenv("MAX_STALENESS", "7")
    cfg = RunConfig.load([])
    assert cfg.rollouts == modes.AsyncRollouts(max_staleness=7) and cfg.rollouts.is_async
    with pytest.raises(ValidationError, match="frozen"):
        cfg.rollouts.max_staleness = 1  # type: ignore[misc]
    # what is written down (run.json, `python -m contract.config`) is the .env value, as before
    assert cfg.model_dump()["rollouts"] == "async" and '"rollouts":"async"' in cfg.model_dump_json()
    assert RunConfig(**cfg.model_dump()).rollouts == cfg.rollouts  # a dump loads back to the same choice
    assert RunConfig.load(["--rollouts", "sync", "--max-staleness", "4"]).rollouts == modes.SyncRollouts()  # CLI wins
    monkeypatch.delenv("MAX_STALENESS")
    sync = RunConfig.load([], rollouts="sync").rollouts
    assert not sync.is_async and not hasattr(sync, "max_staleness")  # sync has no staleness to read


def test_each_rollouts_variant_answers_what_the_code_asks():
    cfg = RunConfig.load([], rollouts="async", max_staleness=3, train_mode="gpu", per_device_train_batch_size=8)
    assert cfg.rollouts.session_pool(cfg, 2) == (3 * 8 * 2, 1)  # one pool, the rollout worker's
    assert cfg.rollouts.problem(modes.CpuMode(), 1, "ddp").startswith("ROLLOUTS=async generates with a vLLM server")
    assert cfg.rollouts.problem(cfg.placement, 2, "ddp").startswith("ROLLOUTS=async shards 2 trainer processes")
    assert cfg.rollouts.problem(cfg.placement, 2, "fsdp") is None
    sync = RunConfig.load([], per_device_train_batch_size=8)
    assert sync.rollouts.session_pool(sync, 2) == (8, 2)  # TRL's pool per process
    assert sync.rollouts.problem(modes.CpuMode(), 8, "ddp") is None
    assert modes.rollouts_variant("async") == modes.AsyncRollouts()
    assert modes.rollouts_variant(None) == modes.SyncRollouts()


@pytest.mark.parametrize("mode, transfer, want", [
    ("cpu", "nccl", dict(server=False, colocated=False, uses_vllm=False, trainer_on_cpu=True, reload_dir=None)),
    ("gpu", "nccl", dict(server=True, colocated=False, uses_vllm=True, trainer_on_cpu=False, reload_dir=None)),
    ("gpu", "reload", dict(server=True, colocated=False, uses_vllm=True, trainer_on_cpu=True, reload_dir="/w")),
    ("colocate", "nccl", dict(server=False, colocated=True, uses_vllm=True, trainer_on_cpu=False, reload_dir=None)),
])
def test_each_train_mode_variant_answers_what_the_code_asks(mode, transfer, want):
    cfg = RunConfig.load([], train_mode=mode, weight_transfer=transfer, weight_reload_dir="/w")
    chosen = cfg.placement
    assert {key: getattr(chosen, key) for key in want} == want
    assert chosen == cfg.placement and str(chosen) == mode and chosen.spec.trainer_service
    assert cfg.placement.trainer_on_cpu is want["trainer_on_cpu"]
    # the host asks the same questions of a variant with default knobs (layout questions only)
    bare = modes.train_mode_variant(mode)
    assert (bare.server, bare.colocated, bare.uses_vllm) == (want["server"], want["colocated"], want["uses_vllm"])
    assert bare.vllm_memory_share == {"cpu": 0.0, "gpu": 0.9, "colocate": 0.3}[mode]


def test_train_mode_auto_is_resolved_before_it_is_asked():
    cfg = RunConfig.load([])  # TRAIN_MODE=auto: only whoever counts the GPUs resolves it
    with pytest.raises(ConfigError, match="TRAIN_MODE=auto is not resolved yet"):
        cfg.placement  # noqa: B018
    assert cfg.resolved(modes.ColocateMode()).placement.colocated
    with pytest.raises(ConfigError, match=r"TRAIN_MODE='tpu': choose from cpu, gpu, colocate"):
        modes.train_mode_variant("tpu")


# Comparing a mode's string to pick a branch, in the code below the config (the variant answers instead). Left alone:
# `auto` (the choice before it is resolved), TRL's own attributes (vllm_mode), metric records read back.
BRANCH_ON_STRING = re.compile(r"""\b(mode|rollouts|train_mode)\s*(==|!=)\s*["'](cpu|gpu|colocate|sync|async)["']"""
                              r"""|\bmode\s+(not\s+)?in\s+\(\s*["'](cpu|gpu|colocate)["']""")


def test_no_code_branches_on_a_mode_string():
    found = [f"{path.relative_to(ROOT)}:{n}: {line.strip()}"
             for top in ("contract", "trainer", "tools") for path in sorted((ROOT / top).rglob("*.py"))
             for n, line in enumerate(path.read_text().splitlines(), 1) if BRANCH_ON_STRING.search(line)]
    assert not found, ("ask the variant (cfg.rollouts.is_async, cfg.placement.server, plan.mode.colocated) "
                       "instead of comparing the string:\n" + "\n".join(found))
