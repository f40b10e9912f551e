"""HTTP checks of a vLLM server: the calls TRL's client makes, each failure one message with its fix."""

from __future__ import annotations

import time
from dataclasses import dataclass, field


class VLLMPreflightError(RuntimeError):
    """The vLLM side is not ready for training; the message says what is wrong and how to fix it."""


class VLLMRestarted(RuntimeError):
    """vLLM restarted between a weight push and a generation (inside the retries of TRL's client, so no request
    failed): it answered with the weights it loaded at start, not the pushed ones. The message says when."""


class VLLMGone(RuntimeError):
    """vLLM stopped being there while nothing failed yet (TRL's async rollout worker retries a refused generation for
    minutes): its connection is refused or its name no longer resolves. The message says which."""


@dataclass
class ServerReport:
    url: str
    model: str | None = None
    max_model_len: int | None = None
    world_size: int | None = None
    weight_transfer_config: dict | None = None
    logprobs_mode: str | None = None
    dtype: str | None = None  # the served weights' dtype (model_config.dtype, e.g. "bfloat16"): what a push sends
    async_scheduling: bool | None = None  # scheduler_config.async_scheduling (vLLM 0.31: on by default on a GPU)
    vllm_version: str | None = None
    torch_version: str | None = None
    server_has_cuda: bool | None = None
    waited_s: float = 0.0
    warnings: list[str] = field(default_factory=list)


def _session():
    import requests

    return requests.Session()


def wait_healthy(url: str, timeout_s: float, session=None, poll_s: float = 2.0) -> float:
    """Poll GET /health until 200; seconds waited. Raises VLLMPreflightError after timeout_s."""
    session = session or _session()
    start = time.monotonic()
    last = "no answer"
    while True:
        try:
            r = session.get(f"{url}/health", timeout=5)
            if r.status_code == 200:
                return time.monotonic() - start
            last = f"HTTP {r.status_code}"
        except Exception as exc:  # noqa: BLE001 - connection refused, DNS, timeouts: keep polling
            last = f"{type(exc).__name__}: {str(exc)[:120]}"
        if time.monotonic() - start >= timeout_s:
            raise VLLMPreflightError(
                f"vLLM at {url} is not healthy after {timeout_s:.0f}s (last: {last}). A first start "
                "downloads and loads the model and captures CUDA graphs: minutes. Check "
                "`docker compose logs vllm` (out of GPU memory? lower VLLM_GPU_MEMORY_UTILIZATION or "
                "VLLM_MAX_MODEL_LEN; model not in the HF cache? run `make up` again), or raise "
                "VLLM_SERVER_TIMEOUT_S"
            )
        time.sleep(poll_s)


START_METRIC = "process_start_time_seconds"  # Prometheus' process collector, on vLLM's /metrics


def started_at(url: str, session=None) -> float | None:
    """When the vLLM API server's process started (its /metrics' process_start_time_seconds): another value is another
    process, a restart. None when /metrics does not answer or does not say (a vLLM whose metrics run multi-process)."""
    session = session or _session()
    try:
        r = session.get(f"{url}/metrics", timeout=10)
        if r.status_code != 200:
            return None
        for line in r.text.splitlines():
            if line.startswith(START_METRIC + " "):
                return float(line.split()[1])
    except Exception:  # noqa: BLE001 - a vLLM gone is the next request's to report (went_away)
        return None
    return None


def restart_blind(url: str, session=None) -> str | None:
    """One line when the vLLM at `url` gives no process start time on /metrics, else None. The trainer tells a
    restarted vLLM (it serves the weights it loaded at start) from the one its last push went into by that time alone
    (check_served_weights); without it a restart mid-run goes unnoticed and the run trains on the base policy's
    samples. vLLM 0.31 with data parallel runs several API servers and its metrics multi-process: the metric is gone."""
    if started_at(url, session) is not None:
        return None
    return (f"vLLM at {url} gives no {START_METRIC} on /metrics (VLLM_PARALLEL=data runs its metrics multi-process), "
            "so the trainer could not notice a vLLM restart mid-run (it would train on base-weight samples); set "
            "VLLM_PARALLEL=tensor or one VLLM_GPU (edit .env)")


def unreachable(url: str, session=None) -> str | None:
    """Why the vLLM server at `url` is not there (its /health refused, its host name gone with its container), or None
    when /health answers anything or only times out: a busy server is slow, not gone, and the next request says."""
    import requests

    session = session or _session()
    try:
        session.get(f"{url}/health", timeout=10)
    except requests.exceptions.ConnectionError as exc:  # refused, reset, or the name does not resolve
        if not isinstance(exc, requests.exceptions.ConnectTimeout):  # a full backlog: it is there, busy
            return f"its /health is refused ({str(exc)[:160]})"
    except requests.exceptions.RequestException:  # a read timeout: it is there
        pass
    return None


def activity(url: str, session=None, paused: bool = True) -> dict:
    """What the vLLM server at `url` is doing: paused (its dev route /is_paused; asked only with `paused`), requests
    running and waiting, tokens made so far (its /metrics). A key is missing where the server does not say."""
    session = session or _session()
    seen: dict = {}
    try:
        if paused:
            seen["paused"] = bool(session.get(f"{url}/is_paused", timeout=10).json()["is_paused"])
    except Exception:  # noqa: BLE001 - no dev routes, or no answer: not said
        pass
    wanted = {"vllm:num_requests_running": "running", "vllm:num_requests_waiting": "waiting",
              "vllm:generation_tokens_total": "tokens"}
    try:
        for line in session.get(f"{url}/metrics", timeout=10).text.splitlines():
            name = line.split("{", 1)[0].split(" ", 1)[0]
            if name in wanted:
                key = wanted[name]
                seen[key] = seen.get(key, 0.0) + float(line.rsplit(" ", 1)[1])  # summed over engines
    except Exception:  # noqa: BLE001
        pass
    return seen


def went_away(exc: BaseException, url: str, session=None) -> str | None:
    """Why a run that failed with `exc` failed because the vLLM server at `url` went away (it died, was stopped or
    restarted: the weights pushed to it went with it), or None when the failure is something else. Gone means a
    connection to it refused or cut somewhere in the exception's chain, a restart seen between a push and a
    generation (VLLMRestarted), a vLLM refused while the async rollout worker retried (VLLMGone), or any failure while
    it answers no /health."""
    import requests

    from urllib.parse import urlsplit

    parts = urlsplit(url)  # requests names it both ways: "host:port" in a URL, host='h', port=p in its pool
    where = (parts.netloc, f"host='{parts.hostname}', port={parts.port or 80}")
    seen: set[int] = set()
    err: BaseException | None = exc
    while err is not None and id(err) not in seen:
        seen.add(id(err))
        if isinstance(err, (VLLMRestarted, VLLMGone)):
            return str(err)
        if isinstance(err, (requests.exceptions.ConnectionError, requests.exceptions.ChunkedEncodingError)) \
                and any(name in str(err) for name in where):
            return f"a request to it failed ({type(err).__name__}: {str(err)[:160]})"
        err = err.__cause__ or err.__context__
    session = session or _session()
    try:
        status = session.get(f"{url}/health", timeout=5).status_code
    except Exception as probe:  # noqa: BLE001 - refused, DNS, timeout: it is not there
        return f"the run failed ({type(exc).__name__}) and /health does not answer ({type(probe).__name__})"
    if status != 200:
        return f"the run failed ({type(exc).__name__}) and /health answers HTTP {status}"
    return None


def gone_line(url: str, why: str, exit_code: int) -> str:
    return (f"[train] stopped: vLLM at {url} went away mid-run: {why}; the weights pushed to it went with it. "
            "`make train` restarts the vllm service, health-gated, and resumes from the last checkpoint; by hand: "
            f"`docker compose up -d --no-deps --force-recreate --wait vllm`, then train again (exit {exit_code})")


# Token ids every vocabulary has. Five, not one: on the CPU twin a one-token prompt as the very first request of a
# fresh engine killed its worker (twice of two tries here); five ids as the first request never did in the tests.
PROBE_PROMPT = [11, 12, 13, 14, 15]


def one_token(url: str, timeout_s: float, session=None) -> str | None:
    """Ask vLLM for a one-token completion (a deadline per read, timeout_s); None when it answers, else what went
    wrong. /health only says the engine process lives; this says it generates. vLLM 0.31 exposes no "weight update
    active" state: workers blocked in NCCL leave this unanswered; after a `start_weight_update` with no finish, the
    twin's engine dies on it (HTTP 500, EngineDeadError). Either way the cure is a restart."""
    import requests

    session = session or requests.Session()
    url = url.rstrip("/")
    try:
        models = session.get(f"{url}/v1/models", timeout=timeout_s)
        model = models.json()["data"][0]["id"] if models.status_code == 200 else None
        r = session.post(f"{url}/v1/completions", timeout=timeout_s,
                         json={"model": model, "prompt": PROBE_PROMPT, "max_tokens": 1, "temperature": 0})
    except requests.Timeout:
        return f"no one-token completion within {timeout_s:.0f}s (engine hung? blocked in a weight update?)"
    except requests.RequestException as exc:
        return f"the one-token completion failed ({type(exc).__name__}: {str(exc)[:160]})"
    except (ValueError, KeyError, IndexError):
        return f"/v1/models answered HTTP {models.status_code} with no model: {models.text[:160]}"
    if r.status_code != 200:
        return f"the one-token completion answered HTTP {r.status_code}: {r.text[:200]}"
    return None


def check_vllm_server(url: str, timeout_s: float, session=None) -> ServerReport:
    """HTTP-only checks of a vLLM server, the calls TRL's client makes: /health, /server_info
    (dev mode, nccl weight transfer, logprobs mode), /get_world_size, /v1/models."""
    url = url.rstrip("/")
    session = session or _session()
    rep = ServerReport(url=url)
    rep.waited_s = wait_healthy(url, timeout_s, session=session)

    r = session.get(f"{url}/server_info", params={"config_format": "json"}, timeout=30)
    if r.status_code == 404:
        raise VLLMPreflightError(
            f"vLLM at {url} answers 404 on /server_info: its development endpoints are off, so TRL cannot "
            "push weights into it. Fix: set VLLM_SERVER_DEV_MODE=1 in the vllm service's environment "
            "(compose.yaml) and restart it (`docker compose up -d vllm`)"
        )
    if r.status_code != 200:
        raise VLLMPreflightError(f"vLLM at {url}: /server_info answered HTTP {r.status_code}: {r.text[:200]}")
    info = r.json()
    cfg = info.get("vllm_config") or {}
    rep.weight_transfer_config = cfg.get("weight_transfer_config")
    backend = (rep.weight_transfer_config or {}).get("backend")
    if backend != "nccl":
        raise VLLMPreflightError(
            f"vLLM at {url} has weight_transfer_config={rep.weight_transfer_config!r}: no NCCL weight "
            "transfer engine, so weight syncs would fail. Fix: start it with "
            """--weight-transfer-config '{"backend":"nccl"}' (the vllm service's command in compose.yaml)"""
        )
    model_cfg = cfg.get("model_config") or {}
    rep.logprobs_mode = model_cfg.get("logprobs_mode")
    rep.dtype = dtype_name(model_cfg.get("dtype"))
    scheduling = (cfg.get("scheduler_config") or {}).get("async_scheduling")
    rep.async_scheduling = scheduling if isinstance(scheduling, bool) else None
    if rep.logprobs_mode not in (None, "processed_logprobs"):
        rep.warnings.append(
            f"vLLM runs with --logprobs-mode {rep.logprobs_mode}: TRL's importance-sampling correction "
            "wants --logprobs-mode processed_logprobs"
        )
    system = info.get("system_env") or {}
    rep.vllm_version = system.get("vllm_version")
    rep.torch_version = system.get("torch_version")
    cuda = system.get("is_cuda_available")
    rep.server_has_cuda = None if cuda is None else str(cuda).lower() == "true"

    r = session.get(f"{url}/get_world_size", timeout=30)
    if r.status_code != 200:
        raise VLLMPreflightError(f"vLLM at {url}: /get_world_size answered HTTP {r.status_code} (dev mode off?)")
    rep.world_size = int(r.json()["world_size"])

    r = session.get(f"{url}/v1/models", timeout=30)
    if r.status_code == 200 and r.json().get("data"):
        first = r.json()["data"][0]
        rep.model, rep.max_model_len = first.get("id"), first.get("max_model_len")
    return rep


def dtype_name(value) -> str | None:
    """vLLM's /server_info writes a torch dtype as str() ("torch.bfloat16"): the bare name, or None when absent."""
    if not value or not isinstance(value, str):
        return None
    return value.removeprefix("torch.")


def version_skew(report: ServerReport, local_vllm: str | None, local_torch: str | None) -> list[str]:
    """Problems when the two ends of the broadcast do not run the same vLLM / torch builds."""
    problems = []
    if report.vllm_version and local_vllm and report.vllm_version != local_vllm:
        problems.append(
            f"version skew: the trainer has vllm {local_vllm}, the server runs vllm {report.vllm_version}; "
            "build the trainer image FROM the same VLLM_IMAGE as the vllm service (`make build`)"
        )
    if report.torch_version and local_torch and report.torch_version != local_torch:
        problems.append(
            f"version skew: the trainer has torch {local_torch}, the server torch {report.torch_version}; "
            "both images must come from one VLLM_IMAGE (`make build`)"
        )
    return problems


def world_size_mismatch(report: ServerReport, expected: int) -> list[str]:
    """The server's vLLM workers (/get_world_size) against what .env asked for (VLLM_GPU, VLLM_PARALLEL):
    TRL's weight-sync group is those workers + the trainer, and every worker must receive the weights."""
    if report.world_size is None or report.world_size == expected:
        return []
    return [f"vLLM at {report.url} runs {report.world_size} worker(s) (/get_world_size) but this run expects "
            f"{expected} (VLLM_GPU and VLLM_PARALLEL in .env): the vllm service was started with another layout; "
            "restart it with this .env (`make down && make up`)"]


def explain_init_failure(status: int | None, body: str, report: ServerReport | None) -> str:
    """One clear message for a failed /init_weight_transfer_engine (or trainer-side init)."""
    text = body or ""
    if (report is not None and report.server_has_cuda is False) or "accelerator device when none" in text:
        torch_v = f" (torch {report.torch_version})" if report and report.torch_version else ""
        return (
            f"the vLLM server has no GPU{torch_v}: NCCL weight transfer needs CUDA on both ends. The CPU twin "
            "(vllm-cpu) serves generation only; train with TRAIN_MODE=cpu there, or run the `vllm` service "
            "on an NVIDIA GPU (TRAIN_MODE=gpu)"
        )
    if "needs a CUDA device" in text:
        return ("the trainer has no CUDA device: server mode pushes weights over NCCL from the trainer's GPU. "
                "Give the trainer service a GPU (TRAINER_GPU) or use TRAIN_MODE=colocate / cpu")
    if "Weight transfer not configured" in text:
        return ("""the vLLM server has no weight-transfer engine: start it with --weight-transfer-config """
                """'{"backend":"nccl"}'""")
    return (f"setting up the NCCL weight-transfer group failed ({'HTTP ' + str(status) + ': ' if status else ''}"
            f"{text[:300]}); the vLLM side logs why: `docker compose logs vllm | grep -B2 -A20 "
            "init_weight_transfer`, then run `make nccl-check`")
