"""Checks before the first step, so a mistake costs seconds instead of a GPU hour.

Each failure is one line naming the numbers and the fix; `run_all` collects them all and raises one
PreflightError. Warnings (e.g. a completion budget shorter than an episode) are printed, not fatal.

    python -m trainer.run.preflight          # same checks as `trainer.train` runs, then exit
"""

from __future__ import annotations

import json
import math
import sys
import time
from dataclasses import dataclass, field
from typing import Any

from envs import naming
from envs.core import http_mcp, probe
from envs.core.untrusted import log_text, one_line
from contract.config import ConfigError, RunConfig
from trainer.rollouts.envs_binding import BindingError, resolve_replicas
from trainer.core import grpo_args

# What the preflight line says of an env trained over MCP sessions over HTTP (envs.core.http_mcp).
HTTP_MCP_NOTE = (" (MCP sessions over HTTP POST /mcp: the server has no /ws; one session per episode, created "
                 "without the row's reset arguments)")
# Keys an env server may use to report its capacity in /health (ours does; upstream OpenEnv does not).
CAPACITY_KEYS = ("max_concurrent_envs", "max_sessions", "capacity")
ACTIVE_KEYS = ("active_sessions", "sessions")


class PreflightError(RuntimeError):
    """One line per failed check, each with its fix."""


@dataclass
class PreflightReport:
    specs: dict[str, Any] = field(default_factory=dict)  # name -> EnvSpec (built in) or GenericSpec (learned)
    replicas: dict[str, list[str]] = field(default_factory=dict)
    sessions: dict[str, int] = field(default_factory=dict)
    capacity: dict[str, int] = field(default_factory=dict)
    warnings: list[str] = field(default_factory=list)
    ok: list[str] = field(default_factory=list)
    server_max_model_len: int | None = None  # server mode: what the vLLM server reports (it refuses beyond it)
    served_dtype: str | None = None  # server mode: vLLM's weights dtype (/server_info); weight pushes cast to it
    served_model: str | None = None  # server mode: the model id vLLM serves (/v1/models); async requests name it
    judge_model: str | None = None  # JUDGE_*: the id the judge serves (/v1/models; trainer.judge.preflight)


def log(msg: str) -> None:
    print(f"[preflight] {log_text(msg)}", flush=True)


# ---------------------------------------------------------------------------- sessions / capacity
def sessions_needed(cfg: RunConfig, env_name: str, env_rows: int | None = None, num_processes: int = 1) -> int:
    """Sessions TRL opens on one env (RunConfig.sessions_needed: the rule the host's auto replicas use too)."""
    return cfg.sessions_needed(env_name, env_rows, num_processes)


def probe_server(url: str) -> tuple[bool, str, int | None, int | None]:
    """(healthy, detail, reported capacity, reported active sessions) for one replica; bounded (envs.core.probe)."""
    try:
        status, body = probe.get_json(f"{url}/health", probe.HEALTH_DEADLINE_S, probe.MAX_HEALTH_BYTES)
    except probe.ProbeError as exc:
        return False, str(exc).removeprefix(f"{url}/health: "), None, None
    body = body if isinstance(body, dict) else {}
    if status != 200 or str(body.get("status", "healthy")).lower() not in ("healthy", "ok"):
        return False, f"/health answered {status} {str(body)[:120]}", None, None
    cap = next((body[k] for k in CAPACITY_KEYS if isinstance(body.get(k), int)), None)
    active = next((body[k] for k in ACTIVE_KEYS if isinstance(body.get(k), int)), None)
    return True, "healthy", cap, active


def probe_capacity(url: str, want: int, transport: str = "websocket") -> tuple[int, str | None]:
    """Sessions one replica accepts, counted up to `want` by opening them (then all closed again), for servers
    whose /health does not report capacity (upstream `create_app` defaults to ONE session per server). Bounded
    in time as a whole; returns (accepted, None), or (accepted so far, what stopped the count). `transport`:
    `/ws` sessions, or MCP sessions over HTTP (`http-mcp`)."""
    if transport == http_mcp.TRANSPORT:
        return http_mcp.count_sessions(url, want)
    return probe.count_sessions(url, want)


def transport_of(spec: Any) -> str:
    """How the env's sessions reach it: `websocket` (/ws), or `http-mcp` for a learned env that serves no /ws."""
    return getattr(getattr(spec, "interface", None), "transport", "websocket")


def image_hint(name: str) -> str:
    """`(image X)` when compose told the trainer which image serves this env."""
    import os

    image = os.environ.get(naming.image_var(name))
    return f" (image {image})" if image else ""


def resolve_envs(cfg: RunConfig) -> PreflightReport:
    """Replicas and specs of every env, without the checks: what the non-main trainer processes need
    once rank 0's preflight passed (probing capacity from every process would count each session twice)."""
    from envs import registry

    report = PreflightReport()
    for name in cfg.env_names:
        replicas = resolve_replicas(cfg.env_url(name))
        report.replicas[name] = replicas
        report.specs[name] = registry.resolve(name, replicas[0], **cfg.generic_env_options(name))
    return report


def resolve_within(url: str, deadline: float) -> list[str]:
    """The replicas behind `url`, asking Docker's DNS again until `deadline`: replicas just created can be healthy a
    moment before every name answers (seen: 'cannot resolve env-maze_env' with its 8 containers healthy, the same
    run passing when started again)."""
    while True:
        try:
            return resolve_replicas(url)
        except BindingError:
            if time.monotonic() >= deadline:
                raise
            time.sleep(1.0)


def check_env_servers(cfg: RunConfig, report: PreflightReport, wait_s: float = 20.0,
                      num_processes: int = 1, check_seeds: bool = True) -> list[str]:
    """Each env: healthy, its interface learned, capacity for the sessions this trainer opens, and (`check_seeds`,
    for training: GRPO groups share a start state) whether its resets honour `seed`."""
    errors = []
    from envs import registry

    for name in cfg.env_names:
        url = cfg.env_url(name)
        where = ("`make logs` for ENV_URLS" if name in cfg.env_url_overrides else
                 f"`make fleet-logs` for the fleet's env-{name}" if cfg.env_fleet == "swarm" else
                 f"`make logs` for the env-{name} service")
        deadline = time.monotonic() + wait_s  # a server that was just (re)started gets a short grace period
        try:  # its name too, where Docker gives it (a host named in ENV_URLS is the user's: a typo fails at once)
            replicas = resolve_within(url, time.monotonic() if name in cfg.env_url_overrides else deadline)
        except BindingError as exc:
            if name in cfg.env_url_overrides:
                fix = "fix ENV_URLS, or start that server where the trainer can reach it"
            elif cfg.env_fleet == "swarm":
                fix = (f"deploy the fleet (`make fleet-up` on a swarm manager; ENV_NAME must include {name}) and run the "
                       "trainer through `make train`, which joins it to the fleet's network")
            else:
                fix = f"start the env-{name} service (`make up`; COMPOSE_PROFILES must include {name})"
            errors.append(f"env {name}: {exc} at {url}: {fix}")
            continue
        report.replicas[name] = replicas
        results = {}
        pending = list(replicas)
        while True:
            for rep in list(pending):
                results[rep] = probe_server(rep)
                if results[rep][0]:
                    pending.remove(rep)
            if not pending or time.monotonic() >= deadline:
                break
            time.sleep(1.0)
        bad = [f"{rep} ({results[rep][1]})" for rep in pending]
        if bad:
            errors.append(f"env {name}: not healthy: {', '.join(bad)}: check {where}; "
                          f"the trainer needs every replica of it")
            continue
        try:
            spec = registry.resolve(name, replicas[0], **cfg.generic_env_options(name))
        except Exception as exc:  # noqa: BLE001 - InterfaceError / UnsupportedSchema / PromptsFileError: one line each
            errors.append(f"env {name}{image_hint(name)}: {exc}")
            continue
        report.specs[name] = spec
        transport = transport_of(spec)
        try:
            rows = len(spec.make_dataset(cfg.dataset_size, cfg.seed)) if len(cfg.env_names) > 1 else None
        except ValueError as exc:  # a bad ENV_PROMPTS_FILE
            errors.append(f"env {name}: {exc}")
            continue
        needed = sessions_needed(cfg, name, env_rows=rows, num_processes=num_processes)
        per_replica = math.ceil(needed / len(replicas))  # the session clients spread them evenly
        caps = [results[r][2] for r in replicas]
        actives = [results[r][3] or 0 for r in replicas]
        batch = (f"PER_DEVICE_TRAIN_BATCH_SIZE {cfg.per_device_train_batch_size} x STEPS_PER_GENERATION "
                 f"{cfg.effective_steps_per_generation}")
        if cfg.rollouts.is_async:  # RunConfig.sessions_needed: the episodes the async worker keeps in flight
            batch = cfg.rollouts.inflight_rule(cfg)
        opens = (f"< {needed} sessions this trainer opens ({batch}"
                 + (f" x {num_processes} trainer processes" if num_processes > 1 else "")
                 + (", worst-case share of a multi-env batch" if len(cfg.env_names) > 1 else "") + ")")
        var = naming.replicas_var(name)
        fleet = cfg.env_fleet == "swarm"
        scale = f"scale the fleet ({var}, then `make fleet-up`)" if fleet else f"add replicas ({var})"
        what = f"{len(replicas)} fleet task(s)" if fleet else f"{len(replicas)} replica(s)"
        if all(c is not None for c in caps):
            free = [c - a for c, a in zip(caps, actives)]
            source = "reported by the servers" + (f", {sum(actives)} already in use" if any(actives) else "")
            fix = f"raise MAX_CONCURRENT_ENVS to >= {per_replica}, {scale}, or lower the batch (edit .env)"
        else:  # the server does not say (upstream create_app): count what each replica accepts, up to its share
            probed = [probe_capacity(r, per_replica, transport) for r in replicas]
            free = [n for n, _ in probed]
            problems = [f"{r}: {p}" for r, (_, p) in zip(replicas, probed) if p]
            source = "probed: the server does not report it" + (f"; {'; '.join(problems)}" if problems else "")
            held = max(free)
            fix = (f"set {var}={math.ceil(needed / held)}{' and run `make fleet-up`' if fleet else ''} (this image "
                   f"holds {held} session(s) per container) or {var}=auto (sized for you), or lower the batch (edit .env)"
                   if held else
                   f"check {'`make fleet-logs`' if fleet else '`make logs`'} for env-{name}: it accepted no session")
        total = sum(free)
        spread = "" if len(set(free)) <= 1 else f" ({', '.join(map(str, free))})"
        report.sessions[name], report.capacity[name] = needed, total
        if total < needed:
            errors.append(f"env {name}{image_hint(name)}: capacity {total} sessions over {what}{spread} ({source}) "
                          f"{opens}: {fix}")
        else:
            seeded, warning = (("", None) if not check_seeds else
                               check_seed(cfg, name, replicas[0], spec) if transport != http_mcp.TRANSPORT else
                               ("; seed not checked (an MCP session over HTTP takes no reset arguments)", None))
            report.ok.append(f"env {name}: {what} healthy; capacity {total} sessions in all{spread} ({source}) "
                             f">= {needed} this trainer opens"
                             + (f" ({num_processes} trainer processes)" if num_processes > 1 else "")
                             + f"; transport {transport}"
                             + (HTTP_MCP_NOTE if transport == http_mcp.TRANSPORT else " (/ws sessions)") + seeded)
            report.warnings += [warning] if warning else []
            if getattr(spec, "interface", None) is not None:
                tools = ", ".join(f"{t.name}({', '.join(p.name for p in t.params)})" for t in spec.interface.tools)
                report.ok.append(f"env {name}: learned from the server ({spec.interface.kind} env): tools {tools}")
            if getattr(spec, "tasks", None) is not None:  # OpenEnv's Task API (envs.generic.tasks)
                report.ok.append(task_line(name, spec))
        if transport == http_mcp.TRANSPORT:
            report.warnings.append(
                f"env {name}: over MCP sessions on HTTP a tool call reports a reward only where the env's step() "
                "answers it (OpenEnv 0.10.0 sends an MCPEnvironment's tool calls straight to its tools: no reward, "
                "every episode scores 0); check the first steps' rewards, or ask the env's author for /ws")
        budget = getattr(spec, "episode_budget_tokens", None)
        if budget and cfg.max_completion_length < budget:
            report.warnings.append(
                f"env {name}: MAX_COMPLETION_LENGTH={cfg.max_completion_length} is below the ~{budget} tokens a full "
                f"episode needs (all turns plus tool results): episodes will be cut short; raise "
                f"MAX_COMPLETION_LENGTH to >= {budget}"
            )
    return errors


# ---------------------------------------------------------------------------- seed
# Keys left out when comparing two reset observations, at any depth: OpenEnv's State names each episode with a fresh
# uuid4 (our servers and upstream's do), and an env that shows it (or its session's id) in an observation would
# differ on every reset, seeded or not.
EPISODE_ID_KEYS = frozenset({"episode_id", "session_id"})


def _without_ids(value: Any) -> Any:
    if isinstance(value, dict):
        return {k: _without_ids(v) for k, v in value.items() if k not in EPISODE_ID_KEYS}
    if isinstance(value, list):
        return [_without_ids(v) for v in value]
    return value


def _canonical(value: Any) -> str:
    return json.dumps(_without_ids(value), sort_keys=True, separators=(",", ":"), default=str)


def check_seed(cfg: RunConfig, name: str, url: str, spec: Any) -> tuple[str, str | None]:
    """Does the env honour `seed`? One session, two resets with what a row of this env sends (its first row), their
    observations compared (EPISODE_ID_KEYS aside). Returns (a note for the env's ok line, a warning or None). Never
    fails the run: a reset that errs or outlasts RESET_TIMEOUT_S (or probe.SEED_CHECK_DEADLINE_S in all) is noted."""
    from envs.core.tool import reset_data

    try:
        rows = spec.make_dataset(1, cfg.seed)
        data = reset_data(spec.tool_class, rows[0]) if rows else None
    except Exception:  # noqa: BLE001 - a bad ENV_PROMPTS_FILE is reported by the checks above
        data = None
    if data is None:
        return "", None
    if "seed" in data and data["seed"] is None:
        return "; unseeded (its rows send seed null)", None
    try:
        first, second = probe.reset_twice(url, data, cfg.reset_timeout_s)
    except probe.ProbeError as exc:
        return f"; seed not checked ({exc})", None
    a, b = first.get("observation"), second.get("observation")
    if _canonical(a) == _canonical(b):
        return "; resets seeded", None
    fields = sorted(k for k in set(a) | set(b) if _canonical(a.get(k)) != _canonical(b.get(k))) \
        if isinstance(a, dict) and isinstance(b, dict) else []
    differ = f" (fields {', '.join(one_line(f, 40) for f in fields[:4])}{', ...' if len(fields) > 4 else ''})" \
        if fields else ""
    sent = one_line(json.dumps(data, sort_keys=True, default=str), 80)
    return "", (f"env {name}: two resets with the same kwargs {sent} gave different observations{differ}: it ignores "
                "`seed`, so the members of a GRPO group play different episodes and the group baseline compares "
                "different tasks; nothing breaks, learning is noisier. Env author: make reset(seed=...) choose the "
                "episode (seed its RNG from it)")


# ---------------------------------------------------------------------------- chat template
def check_chat_template(tokenizer, model_name: str) -> list[str]:
    """Mirror what GRPOTrainer.__init__ needs for tools, before it loads the model."""
    import copy

    from trl.chat_template_utils import (
        add_response_schema,
        get_training_chat_template,
        is_chat_template_prefix_preserving,
        supports_tool_calling,
    )

    families = "Qwen3, Qwen2.5, Llama 3.1/3.2, GPT-OSS, GLM-4 MoE, Gemma 4, ..."
    if tokenizer.chat_template is None:
        return [f"MODEL_NAME={model_name}: its tokenizer has no chat template; use an instruct/chat model "
                f"({families})"]
    if not supports_tool_calling(tokenizer):
        return [f"MODEL_NAME={model_name}: its chat template drops tool calls or tool results, so TRL cannot "
                f"train tool use with it; use a tool-calling model ({families})"]
    if getattr(tokenizer, "response_template", None) is None and getattr(tokenizer, "response_schema", None) is None:
        try:
            add_response_schema(copy.deepcopy(tokenizer))
        except ValueError:
            return [f"MODEL_NAME={model_name}: TRL has no tool-call parser for this chat template (\"Unrecognized "
                    f"chat template\"); use a model whose template TRL recognizes ({families}) or set "
                    "`response_template` on the tokenizer"]
    if not is_chat_template_prefix_preserving(tokenizer):
        try:
            get_training_chat_template(tokenizer)
        except Exception as exc:  # noqa: BLE001 - TRL raises ValueError for unknown templates
            return [f"MODEL_NAME={model_name}: its chat template is not prefix-preserving and TRL has no training "
                    f"version of it ({exc}); use a model family TRL ships a training template for ({families})"]
    return []


# ---------------------------------------------------------------------------- lengths
def tools_of(tool_class) -> list:
    """The tools TRL shows the model for an env class: its public methods but reset/get_reward, bound to an
    instance made without __init__ (no session is opened)."""
    import inspect

    instance = tool_class.__new__(tool_class)
    return [getattr(instance, n) for n, _ in inspect.getmembers(tool_class, predicate=inspect.isfunction)
            if n not in ("reset", "get_reward") and not n.startswith("_")]


def longest_prompt(cfg: RunConfig, tokenizer, specs: dict) -> tuple[int, str]:
    """(tokens, env) of the longest dataset prompt, rendered as TRL renders it for generation: with the env's
    tools, TRL's training template, the generation prompt and CHAT_TEMPLATE kwargs (thinking on/off)."""
    from trl.chat_template_utils import get_training_chat_template, is_chat_template_prefix_preserving

    template = None if is_chat_template_prefix_preserving(tokenizer) else get_training_chat_template(tokenizer)
    longest, where = 0, ""
    for name in cfg.env_names:
        tools = tools_of(specs[name].tool_class) or None
        seen = set()
        for row in specs[name].make_dataset(cfg.dataset_size, cfg.seed):
            prompt = row["prompt"]
            key = str(prompt)
            if key in seen:
                continue
            seen.add(key)
            messages = prompt if isinstance(prompt, list) else [{"role": "user", "content": prompt}]
            ids = tokenizer.apply_chat_template(messages, tools=tools, chat_template=template, add_generation_prompt=True,
                                                tokenize=True, return_dict=True, **cfg.chat_template_kwargs())["input_ids"]
            if len(ids) > longest:
                longest, where = len(ids), name
    return longest, where


def check_lengths(cfg: RunConfig, tokenizer, specs: dict,
                  server_max_model_len: int | None = None) -> tuple[list[str], str]:
    """The worst case of an episode: longest prompt + MAX_COMPLETION_LENGTH must fit where generation happens. vLLM
    refuses a request whose prompt + max_tokens exceeds its max_model_len; TRL itself only checks the model's own
    limit. The server's limit is the one it reports (server mode), else VLLM_MAX_MODEL_LEN, else the model's on CPU.
    MAX_COMPLETION_LENGTH bounds a whole episode in both modes, so no later turn asks for more: sync
    (trainer.rollouts.rollout_loop) ends an episode whose next input would not fit, async
    (trainer.async_grpo.async_budget) asks each turn for what is left of the budget, iterations unlimited or not."""
    if not specs:
        return [], ""
    fix = "raise VLLM_MAX_MODEL_LEN (GPU memory permitting)"
    chosen = cfg.placement
    if chosen.server and server_max_model_len:
        limit, what = server_max_model_len, "the vLLM server's max_model_len"
    elif chosen.uses_vllm and cfg.vllm_max_model_len:
        limit, what = cfg.vllm_max_model_len, "VLLM_MAX_MODEL_LEN"
    else:
        from transformers import AutoConfig

        name = cfg.model_id
        config = AutoConfig.from_pretrained(cfg.model_path, **cfg.model_load_kwargs)
        limit = getattr(config, "max_position_embeddings", 0) or 0
        what, fix = f"the model's max_position_embeddings ({name})", "use a model with a longer context"
        if not limit:
            return [], ""
    prompt, env = longest_prompt(cfg, tokenizer, specs)
    total = prompt + cfg.max_completion_length
    line = (f"longest prompt {prompt} tokens (env {env}, rendered with its tools) + MAX_COMPLETION_LENGTH "
            f"{cfg.max_completion_length} = {total}")
    if total > limit:
        return [f"{line} > {what} {limit}: generation would be refused; {fix}, or lower MAX_COMPLETION_LENGTH to "
                f"<= {max(limit - prompt, 0)} (edit .env)"], ""
    return [], f"lengths: {line} <= {what} {limit}"


def check_memory(cfg: RunConfig, num_processes: int, prompt_tokens: int | None,
                 gpu_bytes: int | None = None, config: dict | None = None) -> tuple[list[str], str]:
    """The trainer's GPU memory for this model, layout and lengths (contract.memory: weights, gradients, AdamW,
    activations) against its smallest GPU: (errors, the breakdown line). Nothing to check on CPU, or before the
    model's config.json is here (the tokenizer check names that)."""
    from contract import memory

    if cfg.placement.trainer_on_cpu:  # the CPU profile, the rehearsal
        return [], ""
    config = config or memory.read_config(cfg.model_path)
    if config is None:
        return [], ""
    if gpu_bytes is None:
        import torch

        if not torch.cuda.is_available():
            return [], ""  # the vLLM checks name the missing GPU
        gpu_bytes = min(torch.cuda.get_device_properties(i).total_memory for i in range(torch.cuda.device_count()))
    try:
        est, problem = memory.check(
            config, gpu_bytes, mode=cfg.placement, processes=num_processes, sharding=cfg.trainer_sharding,
            batch=cfg.per_device_train_batch_size, prompt_tokens=prompt_tokens or memory.DEFAULT_PROMPT_TOKENS,
            completion_tokens=cfg.max_completion_length, vllm_share=cfg.vllm_memory_share,
            method=memory.method_of(cfg.lora), lora_r=cfg.lora_r)
    except memory.ShapeError as exc:
        return [], f"trainer memory: not estimated ({exc})"
    line = f"trainer memory: {est.breakdown()}; trainer GPU {memory.gib(gpu_bytes)}"
    line += "; by method: " + memory.compare(
        config, gpu_bytes, mode=cfg.placement, processes=num_processes, sharding=cfg.trainer_sharding,
        batch=cfg.per_device_train_batch_size, prompt_tokens=prompt_tokens or memory.DEFAULT_PROMPT_TOKENS,
        completion_tokens=cfg.max_completion_length, vllm_share=cfg.vllm_memory_share, lora_r=cfg.lora_r)
    return ([f"{problem}"] if problem else []), line


def load_tokenizer(cfg: RunConfig):
    from transformers import AutoTokenizer

    name = cfg.model_id
    try:
        return AutoTokenizer.from_pretrained(cfg.model_path, **cfg.model_load_kwargs), None
    except Exception as exc:  # noqa: BLE001 - OSError / ValueError / hub errors: all mean "not here"
        if cfg.placement.spec.makes_model_locally:
            fix = ("the CPU profile's init job makes it: `docker compose --profile cpu run --rm model-init` "
                   "(or `python -m trainer.tiny_model --out <dir>`), and the CPU profile never downloads")
        else:
            fix = "the model-download job fetches it into the HF cache (`make up`); check MODEL_NAME and HF_TOKEN"
        detail = " ".join(str(exc).split())[:160]  # one line, whatever the hub client printed
        return None, f"MODEL_NAME={name}: cannot load its tokenizer ({type(exc).__name__}: {detail}); {fix}"


# ---------------------------------------------------------------------------- all
def check_trackers(cfg: RunConfig, report: PreflightReport) -> list[str]:
    """REPORT_TO's trackers are installed (the images install them at build time), and W&B online has its key."""
    from contract import tracker_names
    from trainer.core import trackers

    problem = tracker_names.check_installed(cfg.trackers)
    if problem:
        return [problem]
    if "wandb" in cfg.trackers and cfg.wandb_mode == "online" and not trackers.wandb_key():
        return [trackers.no_wandb_key()]
    if cfg.trackers:
        report.ok.append(f"trackers: {', '.join(cfg.trackers)}")
    return []


def check_trl(cfg: RunConfig, report: PreflightReport) -> list[str]:
    """The TRL internals this run's trainer relies on (trainer.core.trl_privates), on the installed TRL: one line naming
    each that moved and what to re-check."""
    from trainer.core import trl_privates

    problem = trl_privates.startup_problem(cfg.rollouts)
    if problem:
        return [problem]
    version = trl_privates.installed_version()
    if version != trl_privates.TRL_VERSION:
        report.warnings.append(f"trl {version} is installed; the stack was checked against trl "
                               f"{trl_privates.TRL_VERSION}: the TRL internals it relies on are there, but their code "
                               "may differ (tests/trainer/test_trl_privates.py names what changed)")
    else:
        report.ok.append(f"trl {version}: every TRL internal the trainer relies on is in place (trainer/core/trl_privates.py)")
    return []


def task_line(name: str, spec: Any) -> str:
    """What preflight says of an env that serves its own tasks: its splits and sizes, what trains and what evaluates."""
    train = spec.tasks.train_split(spec.split)
    held = spec.tasks.eval_split(train.name)
    answer = f"; a final answer in plain text is submitted through its {spec.answer[0]!r} tool" if spec.answer else ""
    return (f"env {name}: serves its own tasks (OpenEnv's Task API): {spec.tasks.line()}; trains on {train.name!r} "
            f"(one row per task, each group resetting with its split and index), held-out evaluation on "
            + (f"{held.name!r}" if held else "none (no test or validation split)") + answer)


def check_eval(cfg: RunConfig, report: PreflightReport) -> list[str]:
    """EVAL_EVERY: every env has held-out rows (trainer.run.held_out), played on the sessions training opens."""
    if not cfg.rollouts.eval_every or set(cfg.env_names) - set(report.specs):
        return []  # off, or an env not resolved (its error is listed already)
    from trainer.run.held_out import NoHeldOutRows, batch_rows, held_out

    try:
        tasks = held_out(cfg, report.specs, cfg.rollouts.eval_episodes)
    except NoHeldOutRows as exc:
        return [str(exc)]
    batches = ", ".join(f"{name} {batch_rows(cfg, name, len(rows), 1)} at once" for name, (_, rows) in tasks.items())
    sources = ", ".join(f"{name} {rows[0]['reset_kwargs']['split']!r} split" for name, (_, rows) in tasks.items()
                        if rows and "split" in rows[0].get("reset_kwargs", {}))
    report.ok.append(f"eval every {cfg.rollouts.eval_every} steps: {cfg.rollouts.eval_episodes} held-out episodes per "
                     f"env (seeds training never uses{'; tasks of ' + sources if sources else ''}), greedy; "
                     + (f"{cfg.rollouts.eval_sessions(cfg)} at once in the trainer's process beside the rollout worker, "
                        "on env sessions of their own (counted in the capacity above)" if cfg.rollouts.is_async else
                        f"{batches}, on the training sessions (no env capacity beyond training's)"))
    return []


def run_all(cfg: RunConfig, wait_s: float = 20.0, tokenizer=None, num_processes: int = 1) -> PreflightReport:
    """Every check, once (rank 0 when several trainer processes run: capacity is counted for all of them)."""
    report = PreflightReport()
    errors = check_trl(cfg, report)
    errors += check_env_servers(cfg, report, wait_s=wait_s, num_processes=num_processes)
    errors += check_eval(cfg, report)
    errors += check_trackers(cfg, report)
    if tokenizer is None:
        tokenizer, err = load_tokenizer(cfg)
        if err:
            errors.append(err)
    chosen = cfg.placement
    if chosen.uses_vllm:  # never imported on CPU: trainer.gpu's checks import torch.cuda / vllm
        try:
            from trainer import gpu

            info = gpu.preflight_vllm(cfg)
            if chosen.server and isinstance(info, dict) and info.get("max_model_len"):
                report.server_max_model_len = int(info["max_model_len"])
            if chosen.server and isinstance(info, dict):
                report.served_dtype = info.get("dtype")
                report.served_model = info.get("model")
            report.ok.append(f"vLLM server {cfg.vllm_server_url}: healthy, dev mode on, weight transfer configured"
                             if chosen.server else "vLLM colocated: CUDA and vllm importable")
        except Exception as exc:  # noqa: BLE001 - trainer.gpu raises with its own diagnosis
            errors.append(f"vLLM: {exc}")
    if tokenizer is not None:
        tmpl_errors = check_chat_template(tokenizer, cfg.model_id)
        errors += tmpl_errors
        if not tmpl_errors:
            report.ok.append("chat template: TRL can parse and train tool calls with it")
            length_errors, fits = check_lengths(cfg, tokenizer, report.specs, report.server_max_model_len)
            errors += length_errors
            report.ok += [fits] if fits else []
    if cfg.judge_on:  # the rubric parses, the judge answers, its context fits (trainer.judge.preflight)
        from trainer.judge import preflight as judge_preflight

        judged = judge_preflight.check(cfg, _prompt_tokens(cfg, tokenizer, report.specs))
        errors += judged.errors
        report.ok += judged.ok
        report.judge_model = judged.model
    if chosen.uses_vllm:
        try:  # the activations scale with the real prompt; a template error is reported above
            prompt = longest_prompt(cfg, tokenizer, report.specs)[0] if tokenizer is not None and report.specs else None
        except Exception:  # noqa: BLE001
            prompt = None
        memory_errors, breakdown = check_memory(cfg, num_processes, prompt)
        errors += memory_errors
        if breakdown:
            log(breakdown)
    for line in report.ok:
        log(f"ok: {line}")
    for line in report.warnings:
        log(f"WARNING: {line}")
    if errors:
        raise PreflightError(log_text("\n".join(f"- {e}" for e in errors)))  # errors quote env text and URLs
    return report


def _prompt_tokens(cfg: RunConfig, tokenizer, specs: dict) -> int | None:
    try:
        return longest_prompt(cfg, tokenizer, specs)[0] if tokenizer is not None and specs else None
    except Exception:  # noqa: BLE001 - a template error is reported by its own check
        return None


def main(argv: list[str] | None = None) -> int:
    try:
        cfg = RunConfig.load(argv)
    except ConfigError as exc:
        print(f"[preflight] config error:\n{exc}", file=sys.stderr)
        return 2
    try:
        run_all(grpo_args.resolve(cfg))
    except PreflightError as exc:
        print(f"[preflight] FAILED:\n{exc}", file=sys.stderr)
        return 3
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
