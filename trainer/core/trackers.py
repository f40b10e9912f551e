"""Experiment trackers (REPORT_TO): one mapping from our per-step record to every tracker, so all show the same keys.

metrics.jsonl (trainer.core.metrics) stays the source of truth; each tracker gets `view(record)`, whose keys sort into
the order a reader wants them (TensorBoard orders its cards alphabetically by tag, the others by name too):

    reward, reward/<env>                                   the reward GRPO used, overall and per env
    eval/reward, eval/<env>/reward_mean, ...               EVAL_EVERY steps: held-out episodes (trainer.run.evaluation)
    rollout/tool_calls_per_episode[/<env>], rollout/tool_failures_per_episode[/<env>], rollout/tool_failure_rate,
    rollout/episodes/<env>                                 what the agent did per episode
    time/generation_s, time/env_s, time/training_s, ...    the step time split
    async/staleness_p50, async/samples_at_lag/<k>, ...     ROLLOUTS=async only (trainer.core.async_metrics)
    rollout/off_policy/ratio_max, .../clipped_share, ...   both modes: metrics.jsonl's off_policy/* (how far the trained
                                                           rollouts were off-policy, OFF_POLICY_CORRECTION's effect:
                                                           trainer.core.off_policy)
    trl/<key>                                              everything else TRL logs (loss, kl, clip_ratio/..., ...)

Trackers: tensorboard (OUTPUT_DIR/<run>/tensorboard), trackio (OUTPUT_DIR/trackio, `make dashboard`), wandb
(OUTPUT_DIR/<run>/wandb; WANDB_MODE=offline by default, online with the key in the wandb_api_key secret), mlflow
(MLFLOW_TRACKING_URI; default a file store in OUTPUT_DIR/mlruns). trackio, wandb and mlflow are optional packages:
the trainer images install those REPORT_TO names at build time (pyproject extras of the same names).
"""

from __future__ import annotations

import json
import os
import time
from pathlib import Path
from typing import Any

from contract.tracker_names import PROJECT, TB_DIR, TRACKIO_DIR
from envs.core.untrusted import strip_credentials

WANDB_KEY_SECRET = "/run/secrets/wandb_api_key"
IDS_FILE = "trackers.json"  # in the run folder: the W&B / MLflow run ids a resumed run continues
RECORD_FIELDS = ("kind", "step", "time", "mode", "rollouts")  # bookkeeping of a metrics.jsonl row, not metrics


# ---------------------------------------------------------------------------- the one mapping
def _number(value: Any) -> float | None:
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        return None
    return None if value != value else float(value)  # NaN: not logged


def view(record: dict[str, Any]) -> dict[str, float]:
    """A metrics.jsonl step record as tracker keys, in display order (see the module docstring)."""
    out: dict[str, float] = {}
    used = set(RECORD_FIELDS)

    def put(key: str, value: Any, *sources: str) -> None:
        used.update(sources)
        number = _number(value)
        if number is not None:
            out[key] = number

    envs = sorted({k.split("/")[1] for k in record if k.startswith("env/") and k.count("/") == 2})
    put("reward", record.get("reward"), "reward")
    for env in envs:
        put(f"reward/{env}", record.get(f"env/{env}/reward_mean"), f"env/{env}/reward_mean")
    for key in sorted(k for k in record if k.startswith("eval/")):  # EVAL_EVERY's held-out figures, as they are
        put(key, record[key], key)
    calls, rate = _number(record.get("tools/call_frequency")), _number(record.get("tools/failure_frequency"))
    put("rollout/tool_calls_per_episode", calls, "tools/call_frequency")
    for env in envs:
        put(f"rollout/tool_calls_per_episode/{env}", record.get(f"env/{env}/episode_length"),
            f"env/{env}/episode_length")
    put("rollout/tool_failures_per_episode", calls * rate if calls is not None and rate is not None else None,
        "tools/failure_frequency")  # TRL's rate is per call
    for env in envs:
        length, env_rate = (_number(record.get(f"env/{env}/{k}")) for k in ("episode_length", "tool_failure_frequency"))
        put(f"rollout/tool_failures_per_episode/{env}", length * env_rate if None not in (length, env_rate) else None,
            f"env/{env}/tool_failure_frequency")
    put("rollout/tool_failure_rate", rate)
    for env in envs:
        put(f"rollout/episodes/{env}", record.get(f"env/{env}/episodes"), f"env/{env}/episodes")
    for part in ("generation_s", "env_s", "training_s", "scoring_s", "weight_sync_s", "step_s", "eval_s"):
        put(f"time/{part}", record.get(f"time/{part}"), f"time/{part}")
    for key in sorted(k for k in record if k.startswith("off_policy/")):  # both modes (after reward: rollout/...)
        put(f"rollout/{key}", record[key], key)
    for key in sorted(k for k in record if k.startswith("async/")):  # ROLLOUTS=async: lag, drops, queue, pauses
        put(key, record[key], key)
    for key, value in record.items():
        if key not in used:
            put(f"trl/{key}", value)
    return out


def rollout_table(rows: list[dict[str, Any]]) -> tuple[list[str], list[list[Any]]]:
    """rollouts.jsonl rows (trainer.rollouts.traces) as (columns, rows) for a tracker's table: one line per rollout."""
    columns = ["step", "env", "reward", "env_reward", "tool_calls", "failed_calls", "reset", "prompt", "completion",
               "calls"]
    table = []
    for r in rows:
        user = [m.get("content") for m in r.get("prompt", []) if isinstance(m, dict) and m.get("role") == "user"]
        turns = "\n".join(f"{t.get('role', '?')}: {t.get('content') or json.dumps(t.get('tool_calls'))}"
                          for t in r.get("turns", []) if isinstance(t, dict))
        calls = "\n".join(f"{c['tool']}({json.dumps(c['arguments'])}) -> {'FAILED ' if c['failed'] else ''}"
                          f"{c['result']}" for c in r.get("tool_calls", []))
        table.append([r["step"], r["env"], r["reward"], r.get("env_reward"), len(r.get("tool_calls", [])),
                      sum(1 for c in r.get("tool_calls", []) if c.get("failed")), json.dumps(r.get("reset")),
                      str(user[-1]) if user else "", turns, calls])
    return columns, table


# ---------------------------------------------------------------------------- the trackers
class TensorBoard:
    def __init__(self, run: "RunInfo") -> None:
        from torch.utils.tensorboard import SummaryWriter

        # purge_step drops events logged after the checkpoint we resumed from (they are re-run).
        self.writer = SummaryWriter(str(Path(run.run_dir) / TB_DIR),
                                    purge_step=run.resume_step + 1 if run.resume_step else None)

    def log(self, step: int, metrics: dict[str, float]) -> None:
        for key, value in metrics.items():
            self.writer.add_scalar(key, value, step)
        self.writer.flush()

    def log_rollouts(self, step: int, rows: list[dict[str, Any]]) -> None:
        pass  # rollouts.jsonl and `make rollouts` are TensorBoard's view of them

    def close(self) -> None:
        self.writer.close()


def prepare_env(names: list[str], output_dir: str) -> None:
    """Before TRL is imported: it imports trackio when installed, and trackio reads TRACKIO_DIR once, then. Compose
    sets it; a bare `python -m trainer.train` keeps the store on OUTPUT_DIR too."""
    if "trackio" in names:
        os.environ.setdefault("TRACKIO_DIR", str(Path(output_dir) / TRACKIO_DIR))


class Trackio:
    def __init__(self, run: "RunInfo") -> None:
        import trackio
        from trackio.sqlite_storage import SQLiteStorage

        self.trackio = trackio
        if not run.resume_step:  # a start from step 0: an earlier attempt's points would mix with this run's
            SQLiteStorage.delete_run(PROJECT, run.name)
        self.run = trackio.init(project=PROJECT, name=run.name, config=run.config, resume="allow", embed=False,
                                auto_log_gpu=False, auto_log_cpu=False)

    def log(self, step: int, metrics: dict[str, float]) -> None:
        self.run.log(metrics, step=step)

    def log_rollouts(self, step: int, rows: list[dict[str, Any]]) -> None:
        columns, data = rollout_table(rows)
        self.run.log({"rollouts": self.trackio.Table(columns=columns, data=data)}, step=step)

    def close(self) -> None:
        self.run.finish()


class Wandb:
    def __init__(self, run: "RunInfo") -> None:
        import wandb

        self.wandb = wandb
        mode, key = run.wandb_mode, None
        if mode == "online":
            key = wandb_key()
            if not key:  # preflight said so already
                raise RuntimeError(no_wandb_key())
        settings = wandb.Settings(api_key=key, silent=True, x_disable_stats=True) if key else \
            wandb.Settings(silent=True, x_disable_stats=True)
        self.run = wandb.init(project=PROJECT, name=run.name, id=run.ids.setdefault("wandb", _new_id()),
                              resume="allow", dir=run.run_dir, mode=mode, config=run.config, settings=settings)

    def log(self, step: int, metrics: dict[str, float]) -> None:
        self.run.log(metrics, step=step)

    def log_rollouts(self, step: int, rows: list[dict[str, Any]]) -> None:
        columns, data = rollout_table(rows)
        self.run.log({"rollouts": self.wandb.Table(columns=columns, data=data)}, step=step)

    def close(self) -> None:
        self.run.finish()


class Mlflow:
    def __init__(self, run: "RunInfo") -> None:
        import mlflow

        # The default file store: MLflow 3 keeps it, frozen, behind a switch; it writes a metric as a file named by
        # its key, so `reward` and `reward/echo` cannot both exist there: its keys say `reward.echo` instead.
        self.file_store = run.mlflow_tracking_uri.startswith("file:")
        if self.file_store:
            os.environ.setdefault("MLFLOW_ALLOW_FILE_STORE", "true")
        self.client = mlflow.MlflowClient(tracking_uri=run.mlflow_tracking_uri)
        experiment = self.client.get_experiment_by_name(PROJECT)
        experiment_id = experiment.experiment_id if experiment else self.client.create_experiment(PROJECT)
        run_id = run.ids.get("mlflow")
        if not run_id:
            created = self.client.create_run(experiment_id, run_name=run.name)
            run_id = run.ids["mlflow"] = created.info.run_id
            for key, value in run.config.items():
                self.client.log_param(run_id, key, str(value)[:500])
        self.run_id = run_id

    def log(self, step: int, metrics: dict[str, float]) -> None:
        from mlflow.entities import Metric

        now = int(time.time() * 1000)
        self.client.log_batch(self.run_id, metrics=[Metric(k.replace("/", ".") if self.file_store else k, v, now, step)
                                                    for k, v in metrics.items()])

    def log_rollouts(self, step: int, rows: list[dict[str, Any]]) -> None:
        pass  # rollouts.jsonl is in the run folder; MLflow has no table a reader would browse them in

    def close(self) -> None:
        self.client.set_terminated(self.run_id)


CLASSES = {"tensorboard": TensorBoard, "trackio": Trackio, "wandb": Wandb, "mlflow": Mlflow}


def _new_id() -> str:
    import secrets

    return secrets.token_hex(4)


def wandb_key() -> str:
    """The W&B API key from its Compose secret file ('' when absent or empty: the default mounts an empty file)."""
    path = Path(WANDB_KEY_SECRET)
    return path.read_text().strip() if path.exists() else ""


def no_wandb_key() -> str:
    return (f"WANDB_MODE=online needs a W&B API key in the secret file WANDB_API_KEY_FILE names (seen in the "
            f"trainer as {WANDB_KEY_SECRET}); put the key there, or set WANDB_MODE=offline (logs stay in the run "
            "folder; `wandb sync` uploads them later)")


def public_config(value: Any) -> Any:
    """The run's settings as trackers may keep them (W&B uploads its config, MLflow stores parameters): every URL in
    them without credentials (ENV_URLS, VLLM_SERVER_URL, ... may carry `user:token@` or `?token=`)."""
    if isinstance(value, str):
        return strip_credentials(value)
    if isinstance(value, dict):
        return {k: public_config(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [public_config(v) for v in value]
    return value


class RunInfo:
    """What the trackers need to know about a run (from contract.config.RunConfig, or given in tests)."""

    def __init__(self, run_dir: str, name: str, output_dir: str, config: dict[str, Any] | None = None,
                 resume_step: int = 0, wandb_mode: str = "offline", mlflow_tracking_uri: str | None = None) -> None:
        self.run_dir, self.name, self.output_dir = run_dir, name, output_dir
        self.config = public_config(config or {})
        self.resume_step, self.wandb_mode = resume_step, wandb_mode
        self.mlflow_tracking_uri = mlflow_tracking_uri or f"file:{Path(output_dir).resolve() / 'mlruns'}"
        ids_path = Path(run_dir) / IDS_FILE  # a start from step 0 opens new runs; a resumed one continues them
        self.ids: dict[str, str] = json.loads(ids_path.read_text()) if resume_step and ids_path.exists() else {}

    def save_ids(self) -> None:
        if self.ids:
            Path(self.run_dir).mkdir(parents=True, exist_ok=True)
            (Path(self.run_dir) / IDS_FILE).write_text(json.dumps(self.ids))


class Trackers:
    """Every tracker REPORT_TO names, behind one log / log_rollouts / close (main process only)."""

    def __init__(self, names: list[str], run: RunInfo) -> None:
        self.names, self.run = list(names), run
        self._open: list[Any] | None = None

    def _trackers(self) -> list[Any]:
        if self._open is None:  # lazily: at the first logged step, on the process that logs
            self._open = [CLASSES[name](self.run) for name in self.names]
            self.run.save_ids()
        return self._open

    def log_record(self, record: dict[str, Any]) -> None:
        metrics = view(record)
        for tracker in self._trackers():
            tracker.log(record["step"], metrics)

    def log_rollouts(self, step: int, rows: list[dict[str, Any]]) -> None:
        for tracker in self._trackers() if rows else []:
            tracker.log_rollouts(step, rows)

    def close(self) -> None:
        for tracker in self._open or []:
            tracker.close()
        self._open = None
