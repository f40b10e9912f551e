"""The judge service's host side (#64; docs/judge.md "Serving the judge"): where the judge runs for this .env, what the
generated compose file adds for it, and the lines preflight and `make doctor` print about it. No Docker call here.

JUDGE_MODEL set: compose.yaml's `judge` service (profile `judge`, agentnet only, uid 10001) serves it with `vllm serve`
under the name JUDGE_MODEL (the `model` of the trainer's calls) at JUDGE_MODEL_REVISION:
  gpu / colocate   on JUDGE_GPU: a GPU of its own, or (the default) vLLM's first GPU / the colocated trainer's, split:
                   the judge takes JUDGE_GPU_MEMORY_SHARE of it (0.3 shared, 0.9 alone) and the vllm service, when
                   VLLM_GPU_MEMORY_UTILIZATION is empty, 0.9 less the judge's share. On vLLM's GPU the judge starts
                   once vllm is healthy: two engines measuring one GPU's free memory at once would each count the
                   other's allocations as their own.
  cpu / rehearse   the vLLM CPU twin's image on CPU: JUDGE_MODEL a path under /models (the tiny model model-init makes,
                   /models/tiny-qwen3: no Hub), or a Hub id model-download fetches (run on the CPU trainer image).
  reward_model     vLLM's pooling runner: --runner=pooling (vLLM 0.31; /classify). No --convert: vLLM converts by the
                   model's config.json architectures itself (*ForSequenceClassification: classify, reading the
                   checkpoint's `score` head), and a forced --convert=classify would serve a causal LM with an
                   uninitialised head (garbage logits, one constant score) instead of failing preflight.
JUDGE_URL set: no judge container; the trainers read its key from the Compose secret judge_api_key (JUDGE_API_KEY_FILE).
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from urllib.parse import urlsplit

from tools import gpu_layout
from tools.compose_file import Override, OverrideMap, Reset
from tools.errors import StackError
from tools.images import TRAINER_CPU_BUILD, TWIN_BUILD, compose_yaml_services, image_ref
from tools.settings import ROOT

PROFILE = SERVICE = "judge"
SHARED_SHARE = 0.3   # the judge's share of a GPU it shares (JUDGE_GPU_MEMORY_SHARE empty)
OWN_SHARE = 0.9      # ... of a GPU of its own
VLLM_ALONE_SHARE = 0.9  # the vllm service's default (GpuMode.vllm_memory_share): lowered by the judge's when shared
POOLING_FLAGS = ("--runner=pooling",)  # JUDGE_METHOD=reward_model: a sequence classifier (module docstring)
LOCAL_MODELS = "/models/"  # the models volume: model-init's tiny model (the CPU profile's judge)
HEALTHY = {"condition": "service_healthy"}
DONE = {"condition": "service_completed_successfully"}


def model(values: dict[str, str]) -> str:
    return (values.get("JUDGE_MODEL") or "").strip()


def url(values: dict[str, str]) -> str:
    return (values.get("JUDGE_URL") or "").strip()


def served(values: dict[str, str]) -> bool:
    """The stack runs a judge container: JUDGE_MODEL set (JUDGE_URL too is refused, by `problems`)."""
    return bool(model(values)) and not url(values)


def local(name: str) -> bool:
    """A path, not a Hub id: only the CPU twin serves it, from the models volume."""
    return name.startswith("/")


@dataclass(frozen=True)
class JudgeGpu:
    """The judge's GPU on a GPU host and its memory split, resolved once from .env."""

    gpu: str
    share: float                 # JUDGE_GPU_MEMORY_SHARE, resolved
    shares_with: str | None      # "vllm" (TRAIN_MODE=gpu), "trainer" (colocate: its vLLM and its training), None
    vllm_share: float = 0.0      # vLLM's share of that GPU (the vllm service's or colocate's engine's)
    vllm_share_lowered: bool = False  # VLLM_GPU_MEMORY_UTILIZATION was empty: the plan gives vllm 0.9 - share

    def compose_env(self) -> dict[str, str]:
        """What compose.yaml interpolates: the judge's GPU and share, and vLLM's lowered share when it was lowered."""
        out = {"JUDGE_GPU": self.gpu, "JUDGE_GPU_MEMORY_SHARE": f"{self.share:g}"}
        if self.vllm_share_lowered:
            out["VLLM_GPU_MEMORY_UTILIZATION"] = f"{self.vllm_share:g}"
        return out

    def describe(self, name: str) -> str:
        if self.shares_with is None:
            return f"judge {name} on GPU {self.gpu} of its own ({self.share:g} of its memory)"
        whose = "vLLM" if self.shares_with == "vllm" else "the trainer and its colocated vLLM"
        how = " (VLLM_GPU_MEMORY_UTILIZATION was empty)" if self.vllm_share_lowered else ""
        return (f"judge {name} on GPU {self.gpu}, shared with {whose}: judge {self.share:g} of its memory "
                f"(JUDGE_GPU_MEMORY_SHARE), vLLM {self.vllm_share:g}{how}")


def _float(values: dict[str, str], key: str) -> float | None:
    raw = (values.get(key) or "").strip()
    try:
        return float(raw) if raw else None
    except ValueError:
        raise StackError(f"{key}={raw!r} is not a number; set a share like 0.3 (edit .env)") from None


def place(values: dict[str, str], mode, layout: gpu_layout.GpuLayout | None) -> JudgeGpu | None:
    """The judge's GPU and split on a GPU host (None: no judge served, or it runs on CPU). StackError with its fix."""
    if not served(values) or layout is None:
        return None
    default = layout.trainer[0] if mode.colocated else layout.vllm[0]
    try:
        ids = gpu_layout.parse_gpu_ids(values.get("JUDGE_GPU") or default, "JUDGE_GPU")
    except gpu_layout.LayoutError as exc:
        raise StackError(str(exc)) from None
    if len(ids) != 1:
        raise StackError(f"JUDGE_GPU={values.get('JUDGE_GPU')}: the judge runs on one GPU; name one id, e.g. "
                         f"JUDGE_GPU={ids[0]} (edit .env)")
    gpu = ids[0]
    if mode.server and gpu in layout.trainer:
        raise StackError(f"JUDGE_GPU={gpu} is the trainer's GPU (TRAINER_GPU), which TRAIN_MODE=gpu gives the trainer "
                         f"whole: set JUDGE_GPU={layout.vllm[0]} (vLLM's, split) or a GPU of its own (edit .env)")
    shares_with = ("vllm" if mode.server and gpu in layout.vllm else
                   "trainer" if mode.colocated and gpu in layout.trainer else None)
    share = _float(values, "JUDGE_GPU_MEMORY_SHARE") or (SHARED_SHARE if shares_with else OWN_SHARE)
    set_vllm = _float(values, "VLLM_GPU_MEMORY_UTILIZATION")
    vllm_share, lowered = 0.0, False
    if shares_with == "vllm":
        vllm_share, lowered = (set_vllm, False) if set_vllm else (round(VLLM_ALONE_SHARE - share, 2), True)
    elif shares_with == "trainer":
        vllm_share = set_vllm or mode.vllm_memory_share
    if lowered and vllm_share < 0.1:
        raise StackError(f"JUDGE_GPU_MEMORY_SHARE={share:g} on vLLM's GPU {gpu} leaves vLLM {max(vllm_share, 0):g} of "
                         f"it: set JUDGE_GPU_MEMORY_SHARE={SHARED_SHARE:g} (or VLLM_GPU_MEMORY_UTILIZATION as well), or "
                         "give the judge a GPU of its own (JUDGE_GPU) (edit .env)")
    if shares_with and vllm_share + share >= 1:
        fits = round(max(0.05, (0.9 if shares_with == "vllm" else 0.6) - vllm_share), 2)
        raise StackError(f"the judge and vLLM share GPU {gpu} and claim {share:g} + {vllm_share:g} of its memory "
                         f"(JUDGE_GPU_MEMORY_SHARE + VLLM_GPU_MEMORY_UTILIZATION), leaving nothing "
                         f"{'for the weight push' if shares_with == 'vllm' else 'to train with'}: set "
                         f"JUDGE_GPU_MEMORY_SHARE={fits:g} or lower, or give the judge a GPU of its own (JUDGE_GPU) "
                         "(edit .env)")
    return JudgeGpu(gpu, share, shares_with, vllm_share, lowered)


def problems(values: dict[str, str], on_cpu: bool) -> list[str]:
    """What stops a run before anything starts, one line each with its fix (the settings section refuses more)."""
    out = []
    name, where = model(values), url(values)
    if name and where:
        out.append("JUDGE_MODEL and JUDGE_URL are both set: JUDGE_MODEL is a judge the stack serves, JUDGE_URL one "
                   "elsewhere; keep one (edit .env)")
    if served(values) and local(name) and not on_cpu:
        out.append(f"JUDGE_MODEL={name} is a path: only the CPU profile and `make rehearse` serve a local model (the "
                   "tiny model under /models); on a GPU host name a Hub id and pin JUDGE_MODEL_REVISION (edit .env)")
    if served(values) and local(name) and on_cpu and not name.startswith(LOCAL_MODELS):
        out.append(f"JUDGE_MODEL={name}: a local judge lives on the models volume, under {LOCAL_MODELS} (e.g. "
                   "/models/tiny-qwen3, the tiny model model-init makes); or name a Hub id (edit .env)")
    if served(values) and (line := method_problem(values)):
        out.append(line)
    if where:
        out.extend(url_problems(where))
    return out


def method_problem(values: dict[str, str]) -> str | None:
    """The CPU profile's own models against JUDGE_METHOD: vLLM serves a causal LM with the pooling runner as an
    embedder (no /classify) and refuses to start a classifier with the generate runner."""
    from contract.config.judge import TINY_JUDGE, TINY_REWARD_MODEL
    from contract.config.model import CPU_DEFAULT_MODEL

    name, method = model(values).rstrip("/"), (values.get("JUDGE_METHOD") or "").strip() or "rubric"
    if method == "reward_model" and name in (TINY_JUDGE, CPU_DEFAULT_MODEL):
        return (f"JUDGE_MODEL={name} is a causal LM, and JUDGE_METHOD=reward_model needs a sequence classifier: set "
                f"JUDGE_MODEL={TINY_REWARD_MODEL} (model-init makes it) or a Hub reward model (edit .env)")
    if method != "reward_model" and name == TINY_REWARD_MODEL:
        return (f"JUDGE_MODEL={name} is a sequence classifier (a reward model), which JUDGE_METHOD={method} cannot "
                f"serve: set JUDGE_METHOD=reward_model, or JUDGE_MODEL={TINY_JUDGE} for a rubric judge (edit .env)")
    return None


def url_problems(where: str) -> list[str]:
    """JUDGE_URL's form (a reachable endpoint is the trainer's preflight: it calls it)."""
    parts = urlsplit(where)
    if parts.scheme not in ("http", "https") or not parts.hostname:
        return [f"JUDGE_URL={where!r} is not an http(s) URL with a host; set the endpoint's base, e.g. "
                "https://host/v1 (edit .env)"]
    if parts.username or parts.password:
        return ["JUDGE_URL holds a user or password, which would reach the trainers' environment and `make config`: "
                "remove it and put the key in the file named by JUDGE_API_KEY_FILE (a Compose secret) (edit .env)"]
    if parts.hostname == SERVICE:
        return [f"JUDGE_URL={where} names the stack's own judge service, which runs only with JUDGE_MODEL: set "
                "JUDGE_MODEL instead and leave JUDGE_URL empty (edit .env)"]
    return []


def notes(values: dict[str, str], judge_gpu: JudgeGpu | None, on_cpu: bool) -> list[str]:
    """What the plan says about the judge, each a line (the unpinned revision a warning)."""
    name, where = model(values), url(values)
    out = []
    if served(values):
        if judge_gpu is not None:
            out.append(judge_gpu.describe(name))
        elif on_cpu:
            source = "the models volume" if local(name) else "the Hub cache (model-download fetches it)"
            out.append(f"judge {name} on CPU: the vLLM CPU twin serves it from {source}")
        if not local(name) and not (values.get("JUDGE_MODEL_REVISION") or "").strip():
            out.append("WARNING: JUDGE_MODEL_REVISION is empty: the judge is main's latest, which can change under "
                       "a run (its scores with it); set it to a commit of the model (its Hub page, \"Files and "
                       "versions\" > history)")
    elif where:
        key = "its key from JUDGE_API_KEY_FILE (a secret)" if values.get("JUDGE_API_KEY_FILE") else "no key"
        out.append(f"judge at JUDGE_URL {redact(where)}, {key}: no judge container starts")
    return out


def redact(where: str) -> str:
    """JUDGE_URL for a line of output: scheme, host, port and path only."""
    parts = urlsplit(where)
    port = f":{parts.port}" if parts.port else ""
    return f"{parts.scheme}://{parts.hostname}{port}{parts.path}"


# ------------------------------------------------------------------ the generated compose file
def compose_services(values: dict[str, str], on_cpu: bool, trainers: tuple[str, ...],
                     judge_gpu: JudgeGpu | None) -> dict[str, dict]:
    """The generated file's part for a served judge (nothing otherwise): the trainers wait for it healthy; on vLLM's
    GPU it waits for vllm; JUDGE_METHOD=reward_model runs vLLM's pooling runner; on CPU the twin's image serves it."""
    if not served(values):
        return {}
    name = model(values)
    judge: dict = {}
    if (values.get("JUDGE_METHOD") or "").strip() == "reward_model":
        judge["command"] = Override([*compose_yaml_services()[SERVICE]["command"], *POOLING_FLAGS])
    services: dict[str, dict] = {}
    if on_cpu:
        judge.update({
            "image": image_ref(TWIN_BUILD),
            "entrypoint": ["vllm-serve", name.replace("$", "$$")],  # the twin's `vllm serve` (services/vllm-cpu)
            "environment": {"VLLM_CPU_KVCACHE_SPACE": "${VLLM_CPU_KVCACHE_SPACE:-1}"},
            "mem_limit": "${VLLM_CPU_MEM_LIMIT:-6g}",
            "shm_size": "1g",
            "deploy": Reset(),
        })
        if local(name):  # model-init's tiny model: no Hub, no hf-cache
            judge["volumes"] = Override(["models:/models:ro"])
            judge["depends_on"] = OverrideMap({"model-init": DONE})
        else:  # the Hub id, fetched by model-download on the CPU trainer's image (no GPU image on a CPU host)
            judge["depends_on"] = OverrideMap({"model-download": DONE})
            services["model-download"] = {"image": image_ref(TRAINER_CPU_BUILD),
                                          "profiles": Override(["gpu", "colocate", "cpu"]),
                                          "environment": {"MODEL_NAME": ""}}  # the CPU policy is model-init's
    elif judge_gpu is not None and judge_gpu.shares_with == "vllm":
        judge["depends_on"] = {"vllm": HEALTHY}  # after vLLM measured its GPU's free memory (module docstring)
    services[SERVICE] = judge
    for trainer in trainers:
        services[trainer] = {"depends_on": {SERVICE: HEALTHY}}
    return services


# ------------------------------------------------------------------ make doctor
def key_file_problem(values: dict[str, str]) -> str | None:
    """JUDGE_API_KEY_FILE: present, and readable by the trainers' uid 10001 (Compose keeps the host file's mode)."""
    raw = (values.get("JUDGE_API_KEY_FILE") or "").strip()
    if not raw:
        return None
    path = Path(raw) if Path(raw).is_absolute() else ROOT / raw
    if not path.is_file():
        return f"JUDGE_API_KEY_FILE={raw}: no such file; write the key there (one line) or fix the path (edit .env)"
    if not path.stat().st_mode & 0o004:
        return (f"{path} is not readable by the trainers' uid 10001 (Compose keeps the host file's mode): "
                f"`chmod 644 {path}` and keep its directory private (`chmod 700 {path.parent}`)")
    if path.parent.stat().st_mode & 0o077:
        return (f"{path.parent} is open to other users of this host (mode {path.parent.stat().st_mode & 0o777:o}): "
                f"they can read the judge's key in it; `chmod 700 {path.parent}`")
    return None


def doctor_rows(values: dict[str, str], mode, layout: gpu_layout.GpuLayout | None, gpus: list,
                on_cpu: bool) -> list[tuple[str, str, str]]:
    """(status: ok, WARN or FAIL, check, message) rows for the judge; each problem names its fix. `gpus`: the
    detected GPUs (gpu_doctor.Gpu), for the split against each GPU's size."""
    from contract.memory import vllm_push_room

    name, where = model(values), url(values)
    if not name and not where:
        return [("ok", "judge", "none (JUDGE_MODEL and JUDGE_URL empty): every reward is the env's")]
    rows = [("FAIL", "judge", line) for line in problems(values, on_cpu)]
    if rows:
        return rows
    if where:
        rows.append(("ok", "JUDGE_URL", f"{redact(where)}: no judge container starts"))
        if urlsplit(where).scheme == "http" and urlsplit(where).hostname not in ("localhost", "127.0.0.1", "::1") \
                and values.get("JUDGE_API_KEY_FILE"):
            rows.append(("WARN", "JUDGE_URL", "plain http to another host: its key and every transcript cross the "
                         "network unencrypted; use https"))
        problem = key_file_problem(values)
        rows.append(("FAIL", "JUDGE_API_KEY_FILE", problem) if problem else
                    ("ok", "JUDGE_API_KEY_FILE", "mounted into the trainers as the secret judge_api_key")
                    if values.get("JUDGE_API_KEY_FILE") else
                    ("WARN", "JUDGE_API_KEY_FILE", "empty: the calls carry no key; set it to the key's file if the "
                     "endpoint needs one"))
        return rows
    try:
        judge_gpu = place(values, mode, layout)
    except StackError as exc:
        return [("FAIL", "judge GPU", str(exc))]
    for line in notes(values, judge_gpu, on_cpu):
        warn = line.startswith("WARNING: ")
        rows.append(("WARN" if warn else "ok", "JUDGE_MODEL_REVISION" if warn else "judge",
                     line.removeprefix("WARNING: ")))
    if judge_gpu is None:
        return rows
    by_id = {g.index: g for g in gpus} | {g.uuid: g for g in gpus}
    gpu = by_id.get(judge_gpu.gpu)
    if gpus and gpu is None:
        rows.append(("FAIL", "JUDGE_GPU", f"JUDGE_GPU={judge_gpu.gpu}: GPU {judge_gpu.gpu} is not here (have "
                     f"{', '.join(sorted(g.index for g in gpus))}): edit .env"))
    elif gpu is not None:
        total = gpu.total_mib * 1024 ** 2
        claimed = judge_gpu.share + judge_gpu.vllm_share
        short = vllm_push_room(total, claimed) if judge_gpu.shares_with == "vllm" else None
        if short:
            rows.append(("FAIL", "judge GPU split", f"GPU {gpu.index}: judge {judge_gpu.share:g} + vLLM "
                         f"{judge_gpu.vllm_share:g}: {short.replace('VLLM_GPU_MEMORY_UTILIZATION', 'their sum')}; "
                         "lower JUDGE_GPU_MEMORY_SHARE or give the judge a GPU of its own (JUDGE_GPU)"))
        else:
            rows.append(("ok", "judge GPU split", f"GPU {gpu.index} {gpu.name}: judge {judge_gpu.share:g} + vLLM "
                         f"{judge_gpu.vllm_share:g} of {gpu.total_mib} MiB"
                         + (" (the trainer's memory below counts both)" if judge_gpu.shares_with == "trainer" else "")))
        need = int(gpu.total_mib * claimed)  # what the engines on it will claim, against what is free now
        rows.append(("ok", "judge free memory", f"GPU {gpu.index}: {gpu.free_mib} MiB free, {need} MiB to claim")
                    if gpu.free_mib >= need else
                    ("FAIL", "judge free memory", f"GPU {gpu.index}: {gpu.free_mib} MiB free, the judge and vLLM on it "
                     f"will claim {need} MiB: stop what uses the GPU (`nvidia-smi`) or lower JUDGE_GPU_MEMORY_SHARE"))
    return rows


def trainer_gpu_share(values: dict[str, str], mode, layout: gpu_layout.GpuLayout | None, gpu: str) -> float:
    """What else a colocated trainer's GPU gives away to the judge (0 when the judge is elsewhere): added to the
    colocated vLLM's share in the trainer's memory estimate (gpu_doctor.memory_rows)."""
    try:
        judge_gpu = place(values, mode, layout)
    except StackError:
        return 0.0
    return judge_gpu.share if judge_gpu and judge_gpu.shares_with == "trainer" and judge_gpu.gpu == gpu else 0.0
