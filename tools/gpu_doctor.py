"""GPU checks of the host (standard library only): `make doctor`, and `make train` on GPU hosts.

    python tools/gpu_doctor.py          # exit 0 all fine (or no GPU here), 1 problems found

GPUs are counted the way Docker really hands them out: a throw-away container started with
`--gpus all` (the NVIDIA container hook, with or without an `nvidia` runtime in `docker info`), else
with the CDI device `nvidia.com/gpu=all`, runs `nvidia-smi` (both inject it). Checks: how many GPUs
(>= 2 for TRAIN_MODE=gpu; exactly one -> colocate), that VLLM_GPU / TRAINER_GPU exist (and differ),
the driver against the vLLM image's CUDA, and free memory against what vLLM will take.
Reads .env (or .env.example) with the host's one reader, tools/settings.py; STACK_ENV_FILE points elsewhere.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Callable

from tools import gpu_layout, images, settings
from tools.settings import load_env
from contract import defaults
from contract.train_mode import MODE_SPECS  # stdlib only: the GPU defaults of each mode

if TYPE_CHECKING:  # the variant is handed in (tools/derive.py resolves TRAIN_MODE once)
    from contract.config import TrainModeVariant

ROOT = Path(__file__).resolve().parent.parent
NO_GPU = "no NVIDIA GPU here"
QUERY = "index,uuid,name,memory.total,memory.used,memory.free,driver_version"
DEFAULT_VLLM_IMAGE = defaults.VLLM_IMAGE

# The oldest Linux driver that runs a CUDA major release (NVIDIA's CUDA release notes, "minor version
# compatibility"): any 12.x toolkit runs on R525+, any 13.x on R580+.
MIN_DRIVER_FOR_CUDA = {12: "525.60.13", 13: "580.65.06"}
# CUDA of vLLM images whose tag we know, so a too-old driver is caught before a multi-GB pull;
# any other image is read from its CUDA_VERSION once it is on this machine.
KNOWN_IMAGE_CUDA = {defaults.VLLM_IMAGE: "13.0"}  # v0.31.0

# CUDA forward compatibility (NVIDIA's "CUDA Compatibility" guide): the compat libraries of a newer CUDA run on an
# older driver branch, on datacenter GPUs only (a GeForce/RTX card fails with CUDA error 803). The branches the stack
# offers it on for CUDA 13: R535 to R570. CUDA_FORWARD_COMPAT=1 turns it on (tools/compose_file.add_cuda_compat).
FORWARD_COMPAT_BRANCHES = (535, 579)
_DATACENTER = re.compile(r"\b(tesla|[abhlt]\d{1,3}[a-z]?|gh\d{3}|gb\d{3})\b", re.I)
_NOT_DATACENTER = re.compile(r"geforce|rtx|quadro|titan", re.I)


def datacenter_gpu(name: str) -> bool:
    """Whether nvidia-smi's name is a datacenter GPU (H100, H200, A100, A10G, L40S, L4, T4, GH200, B200, Tesla ...),
    the ones CUDA forward compatibility supports."""
    return bool(_DATACENTER.search(name)) and not _NOT_DATACENTER.search(name)


PROBE_BUILDS = (images.TRAINER_GPU_BUILD, images.ENV_SERVER_BUILD)  # ours, when built (compose.yaml holds the tags)
PROBE_PUBLIC_IMAGE = "python:3.11-slim-bookworm"
PROBE_FALLBACK_IMAGE = "ubuntu:24.04"  # pulled when nothing local fits (nvidia-smi needs glibc)
@dataclass
class Gpu:
    index: str
    uuid: str
    name: str
    total_mib: int
    used_mib: int
    free_mib: int
    driver: str


# ------------------------------------------------------------------ parsing (unit-tested)
def parse_gpu_csv(text: str) -> list[Gpu]:
    """`nvidia-smi --query-gpu=<QUERY> --format=csv,noheader,nounits`."""
    gpus = []
    for line in text.strip().splitlines():
        parts = [p.strip() for p in line.split(",")]
        if len(parts) < 7 or not parts[0].isdigit():
            continue
        def mib(v: str) -> int:
            return int(float(v)) if re.fullmatch(r"[0-9.]+", v) else 0
        gpus.append(Gpu(parts[0], parts[1], parts[2], mib(parts[3]), mib(parts[4]), mib(parts[5]), parts[6]))
    return gpus


def image_cuda_version(image_env: list[str] | None) -> str | None:
    """CUDA_VERSION from an image's Config.Env (NVIDIA's CUDA base images set it)."""
    for item in image_env or []:
        key, _, value = item.partition("=")
        if key == "CUDA_VERSION" and value:
            return value
    return None


def _ver(text: str, parts: int = 3) -> tuple[int, ...]:
    return tuple(int(x) for x in re.findall(r"[0-9]+", text)[:parts])


def check_driver(driver: str | None, image: str, image_cuda: str | None, gpu_name: str = "",
                 compat: bool = False) -> tuple[bool, str]:
    """(ok, one line): does the host's driver run `image`'s CUDA? Names the driver found and the one needed, and on a
    datacenter GPU on R535-R570 whether CUDA forward compatibility (`compat`: CUDA_FORWARD_COMPAT=1) applies."""
    if not image_cuda:
        return True, f"driver {driver or '?'}; CUDA of {image} unknown until it is pulled (checked again then)"
    major = _ver(image_cuda, 1)[0]
    need = MIN_DRIVER_FOR_CUDA.get(major)
    if need is None:
        return True, f"driver {driver or '?'}; {image} is built for CUDA {image_cuda}, whose minimum driver is not known here"
    if driver and _ver(driver) < _ver(need) and major >= 13:
        return forward_compat(driver, need, image, image_cuda, gpu_name, compat)
    if compat and gpu_name and not datacenter_gpu(gpu_name):
        return False, (f"CUDA_FORWARD_COMPAT=1 on {gpu_name}: consumer GPUs have no CUDA forward compatibility (CUDA "
                       "error 803 at start); set CUDA_FORWARD_COMPAT=0 in .env")
    if driver and _ver(driver) < _ver(need):
        return False, (f"NVIDIA driver {driver} is too old for {image} (CUDA {image_cuda}): it needs driver >= {need} "
                       f"(R{need.split('.')[0]}+). Upgrade the driver, or set VLLM_IMAGE in .env to a vLLM release "
                       "built for your driver's CUDA (its trainer image is rebuilt on top of it)")
    return True, f"driver {driver or '?'} runs {image} (CUDA {image_cuda} needs >= {need})"


def forward_compat_on(values: dict[str, str]) -> bool:
    """CUDA_FORWARD_COMPAT from .env (tools/settings.StackEnv), as a bool."""
    return (values.get("CUDA_FORWARD_COMPAT") or "").strip().lower() in ("1", "true", "yes", "on")


def forward_compat(driver: str, need: str, image: str, image_cuda: str, gpu_name: str,
                   compat: bool) -> tuple[bool, str]:
    """A driver older than `image`'s CUDA needs: CUDA forward compatibility where it applies, else a new driver."""
    branch = _ver(driver, 1)[0]
    old = (f"NVIDIA driver {driver} is too old for {image} (CUDA {image_cuda}): it needs driver >= {need} "
           f"(R{need.split('.')[0]}+)")
    if not datacenter_gpu(gpu_name):
        return False, (f"{old}, and {gpu_name or 'this GPU'} is not a datacenter GPU: consumer GPUs (GeForce/RTX) have "
                       f"no CUDA forward compatibility, so they need the new driver: upgrade it to >= {need}")
    if not FORWARD_COMPAT_BRANCHES[0] <= branch <= FORWARD_COMPAT_BRANCHES[1]:
        return False, (f"{old}; CUDA forward compatibility needs R535-R570 on {gpu_name}: upgrade the driver to >= "
                       f"{need} (or at least R535 and set CUDA_FORWARD_COMPAT=1)")
    if compat:
        return True, (f"{old}; {gpu_name} is a datacenter GPU on R{branch}: CUDA forward compatibility applies and is "
                      "on (CUDA_FORWARD_COMPAT=1: VLLM_ENABLE_CUDA_COMPATIBILITY=1 on vllm, the image's "
                      "/usr/local/cuda/compat first on the trainer's LD_LIBRARY_PATH)")
    return False, (f"{old}; {gpu_name} is a datacenter GPU on R{branch}: CUDA forward compatibility applies: set "
                   f"CUDA_FORWARD_COMPAT=1 in .env (docs/gpu-host.md \"Older drivers\"), or upgrade the driver to >= "
                   f"{need}")


def diagnose(gpus: list[Gpu], method: str | None, dotenv: dict[str, str], mode: "TrainModeVariant", image: str,
             image_cuda: str | None) -> list[tuple[bool, str, str]]:
    """(ok, check, message) rows; message names the fix for every problem. `method`: how Docker hands out
    GPUs (None: it does not)."""
    rows: list[tuple[bool, str, str]] = []
    rows.append((method is not None, "Docker GPU access",
                 f"containers get GPUs through {method}" if method else "Docker cannot hand GPUs to containers: install "
                 "nvidia-container-toolkit, run `sudo nvidia-ctk runtime configure --runtime=docker` (or generate a "
                 "CDI spec: `sudo nvidia-ctk cdi generate --output=/etc/cdi/nvidia.yaml`), restart Docker"))
    n = len(gpus)
    chosen = mode
    if chosen.server:
        if n >= 2:
            rows.append((True, "GPU count", f"{n} GPUs: vLLM and the trainer each get one"))
        elif n == 1:
            rows.append((False, "GPU count", "1 GPU, TRAIN_MODE=gpu needs 2 (vLLM on one, trainer on the other): "
                         "set TRAIN_MODE=colocate in .env (vLLM inside the trainer on the one GPU)"))
        else:
            rows.append((False, "GPU count", "0 GPUs handed out by Docker"))
    else:
        hint = "; TRAIN_MODE=colocate runs vLLM inside the trainer on it" if n == 1 else ""
        rows.append((n >= 1, "GPU count", f"{n} GPU(s){hint}"))
    ids = {g.index for g in gpus} | {g.uuid for g in gpus}
    by_id = {g.index: g for g in gpus} | {g.uuid: g for g in gpus}
    defaults = MODE_SPECS["gpu"]
    wanted = {"VLLM_GPU": dotenv.get("VLLM_GPU") or defaults.vllm_gpu_default,
              "TRAINER_GPU": dotenv.get("TRAINER_GPU") or defaults.trainer_gpu_default}
    if chosen.colocated:
        trainer_gpu, note = gpu_layout.colocate_trainer_gpu(dotenv.get("TRAINER_GPU"), n)
        wanted = {"TRAINER_GPU": trainer_gpu}
        if note:
            rows.append((True, "TRAINER_GPU", note))
    lists: dict[str, list[str]] = {}
    for var, value in wanted.items():
        try:
            lists[var] = gpu_layout.parse_gpu_ids(value, var)
        except gpu_layout.LayoutError as exc:
            rows.append((False, var, str(exc)))
            continue
        missing = [d for d in lists[var] if d not in ids]
        rows.append((not missing, var, f"{var}={value}: " + ", ".join(by_id[d].name for d in lists[var]) if not missing
                     else f"{var}={value}: GPU {', '.join(missing)} is not here (have "
                     f"{', '.join(sorted(g.index for g in gpus)) or 'none'}): edit .env"))
    shared = set(lists.get("VLLM_GPU", [])) & set(lists.get("TRAINER_GPU", []))
    if chosen.server and shared:
        rows.append((False, "GPU assignment", f"VLLM_GPU and TRAINER_GPU share GPU {', '.join(sorted(shared))}: give "
                     "them different GPUs, or use TRAIN_MODE=colocate"))
    if gpus:
        ok, msg = check_driver(gpus[0].driver, image, image_cuda, gpus[0].name, forward_compat_on(dotenv))
        rows.append((ok, "driver vs image", msg))
    try:
        share = float(dotenv.get("VLLM_GPU_MEMORY_UTILIZATION") or chosen.vllm_memory_share)
    except ValueError:
        share = 0.9
    vllm_devs = set(lists.get("VLLM_GPU" if chosen.server else "TRAINER_GPU", []))
    for g in gpus:
        role = " (vLLM)" if g.index in vllm_devs or g.uuid in vllm_devs else ""
        need = int(g.total_mib * share) if role else 0
        ok = g.free_mib >= need
        msg = f"GPU {g.index} {g.name}: {g.free_mib} MiB free of {g.total_mib}{role}"
        if not ok:
            msg += (f"; vLLM will claim {need} MiB (VLLM_GPU_MEMORY_UTILIZATION={share}): stop what uses the GPU "
                    "(`nvidia-smi`) or lower VLLM_GPU_MEMORY_UTILIZATION")
        rows.append((ok, f"free memory GPU {g.index}", msg))
        if role and chosen.server:  # server mode: each weight push lands in buffers outside vLLM's share
            from contract.memory import vllm_push_room

            short = vllm_push_room(g.total_mib * 1024 ** 2, share)
            rows.append((short is None, f"weight-push room GPU {g.index}", short or
                         f"{g.total_mib} MiB at VLLM_GPU_MEMORY_UTILIZATION={share} leaves room for a push's receive "
                         "buffers"))
    return rows


# ------------------------------------------------------------------ the trainer's memory
def hf_cache_volume() -> str:
    """The stack's Hugging Face cache volume: its project + compose.yaml's `hf-cache` (HF_HOME of model-download)."""
    return f"{settings.load().project}_hf-cache"


def trainer_gpu_ids(dotenv: dict[str, str], mode: "TrainModeVariant", count: int) -> list[str]:
    """The GPUs the trainer's processes get (one each), as .env names them; [] when the list is bad (diagnose says)."""
    try:
        if mode.colocated:
            return gpu_layout.parse_gpu_ids(gpu_layout.colocate_trainer_gpu(dotenv.get("TRAINER_GPU"), count)[0],
                                            "TRAINER_GPU")
        return gpu_layout.parse_gpu_ids(dotenv.get("TRAINER_GPU") or MODE_SPECS["gpu"].trainer_gpu_default,
                                        "TRAINER_GPU")
    except gpu_layout.LayoutError:
        return []


def model_config(cfg, runner: Runner | None = None, volume: str | None = None) -> tuple[dict | None, str]:
    """(config.json, where it was read) of the run's model: MODEL_NAME as a folder here, else the snapshot at
    MODEL_REVISION in the stack's HF cache volume (read by a throw-away container; never creates the volume).
    (None, why) before the model-download job has run."""
    from contract import memory
    from contract.config import is_hub_id

    runner, volume = runner or run, volume or hf_cache_volume()
    name, revision = cfg.model_id, cfg.model_revision or "main"
    if not is_hub_id(name):
        found = memory.read_config(name)
        return (found, name) if found else (None, f"{name}/config.json not found")
    if runner(["docker", "volume", "inspect", "--", volume]).returncode != 0:
        return None, f"{name} not downloaded yet (`make up` downloads it)"
    script = ('d="/c/hub/models--$(printf %s "$REPO" | sed "s#/#--#g")"; r="$REV"; '
              '[ -f "$d/refs/$r" ] && r="$(cat "$d/refs/$r")"; cat "$d/snapshots/$r/config.json"')
    r = runner(["docker", "run", "--rm", "--network", "none", "-v", f"{volume}:/c:ro", "-e", f"REPO={name}",
                "-e", f"REV={revision}", "--entrypoint", "sh", "--", probe_image(runner), "-c", script])
    try:
        return (json.loads(r.stdout), f"{name}@{revision[:12]} in volume {volume}") if r.returncode == 0 \
            else (None, f"{name}@{revision[:12]} not downloaded yet (`make up` downloads it)")
    except ValueError:
        return None, f"{name}@{revision[:12]}: unreadable config.json in volume {volume}"


def memory_rows(gpus: list[Gpu], dotenv: dict[str, str], mode: "TrainModeVariant", cfg, config: dict | None,
                where: str, judge_share: dict[str, float] | None = None) -> list[tuple[bool, str, str]]:
    """One row per trainer GPU: contract.memory's estimate for this model, layout and lengths next to the GPU's memory;
    a FAIL names what to change. The host does not know the prompts: DEFAULT_PROMPT_TOKENS stands in (the trainer's
    preflight measures them). `judge_share`: GPU index -> the judge's share of it (colocate, judge on the trainer's
    GPU: counted with the colocated vLLM's)."""
    from contract import memory

    if config is None:
        return [(True, "trainer memory", f"not estimated: {where}; the trainer's preflight prints it")]
    ids = trainer_gpu_ids(dotenv, mode, len(gpus))
    by_id = {g.index: g for g in gpus} | {g.uuid: g for g in gpus}
    base_share = float(cfg.vllm_gpu_memory_utilization or mode.vllm_memory_share)
    rows = []
    for gpu in [by_id[i] for i in ids if i in by_id]:
        share = base_share + (judge_share or {}).get(gpu.index, 0.0)
        try:
            est, problem = memory.check(config, gpu.total_mib * 1024 ** 2, mode=mode, processes=len(ids),
                                        sharding=cfg.trainer_sharding, batch=cfg.per_device_train_batch_size,
                                        prompt_tokens=memory.DEFAULT_PROMPT_TOKENS,
                                        completion_tokens=cfg.max_completion_length, vllm_share=share,
                                        method=memory.method_of(cfg.lora), lora_r=cfg.lora_r)
        except memory.ShapeError as exc:
            return [(True, "trainer memory", f"not estimated ({where}): {exc}")]
        rows.append((True, f"trainer memory GPU {gpu.index}", f"{est.breakdown()} (prompts assumed "
                     f"{memory.DEFAULT_PROMPT_TOKENS} tokens; {where}); GPU {gpu.index} has {gpu.total_mib} MiB"))
        rows.append((True, f"trainer memory GPU {gpu.index} by method", memory.compare(
            config, gpu.total_mib * 1024 ** 2, mode=mode, processes=len(ids), sharding=cfg.trainer_sharding,
            batch=cfg.per_device_train_batch_size, prompt_tokens=memory.DEFAULT_PROMPT_TOKENS,
            completion_tokens=cfg.max_completion_length, vllm_share=share, lora_r=cfg.lora_r)))
        if problem:
            rows.append((False, f"trainer memory GPU {gpu.index}", problem))
    return rows


# ------------------------------------------------------------------ probing the host
Runner = Callable[[list[str]], subprocess.CompletedProcess]


def run(cmd: list[str], timeout: float = 120) -> subprocess.CompletedProcess:
    try:
        return subprocess.run(cmd, capture_output=True, text=True, timeout=timeout)
    except (OSError, subprocess.TimeoutExpired) as exc:
        return subprocess.CompletedProcess(cmd, 127, "", str(exc))


@dataclass
class DockerGpus:
    """The GPUs a container gets, and how (None: Docker hands out none)."""
    method: str | None
    gpus: list[Gpu] = field(default_factory=list)
    detail: str = ""

    @property
    def count(self) -> int:
        return len(self.gpus)

    @property
    def cdi(self) -> bool:
        return self.method == "CDI"


def nvidia_host() -> bool:
    """Any sign of an NVIDIA driver on this host: only then is a probe container worth starting."""
    return bool(shutil.which("nvidia-smi") or Path("/dev/nvidiactl").exists() or Path("/dev/dxg").exists())


def probe_image(runner: Runner = run, vllm_image: str | None = None) -> str:
    """A local image to run nvidia-smi in (the hook / CDI inject it); pulled fallback when none is here."""
    for image in (vllm_image, *map(images.image_of, PROBE_BUILDS), PROBE_PUBLIC_IMAGE):
        if image and runner(["docker", "image", "inspect", "--", image]).returncode == 0:
            return image
    return PROBE_FALLBACK_IMAGE


def probe_docker_gpus(runner: Runner = run, image: str | None = None) -> DockerGpus:
    """Ask Docker for every GPU, first as `--gpus all`, then as CDI devices, and list what the container saw."""
    info = runner(["docker", "info", "--format", "{{json .Runtimes}}"])
    runtime = info.returncode == 0 and "nvidia" in info.stdout
    image = image or probe_image(runner)
    smi = ["nvidia-smi", f"--query-gpu={QUERY}", "--format=csv,noheader,nounits"]
    attempts = [("--gpus all", ["--gpus", "all"]), ("CDI", ["--device", "nvidia.com/gpu=all"])]
    errors = []
    for method, flags in attempts:
        # NVIDIA_DISABLE_REQUIRE: a CUDA base image (the vLLM image is one) sets NVIDIA_REQUIRE_CUDA, and on a driver
        # too old for it the container would not start: the GPUs would go uncounted (a CPU fallback) instead of
        # reaching check_driver, which names the driver to install.
        r = runner(["docker", "run", "--rm", *flags, "-e", "NVIDIA_DISABLE_REQUIRE=1", "--entrypoint", smi[0], "--", image,
                    *smi[1:]])
        gpus = parse_gpu_csv(r.stdout) if r.returncode == 0 else []
        if gpus:
            name = ("the nvidia runtime (`--gpus`)" if runtime else "the NVIDIA container hook (`--gpus`, no nvidia "
                    "runtime in `docker info`)") if method != "CDI" else "CDI (nvidia.com/gpu devices)"
            return DockerGpus("CDI" if method == "CDI" else name, gpus, f"{len(gpus)} GPU(s) via {name}")
        errors.append(f"{method}: {(r.stderr.strip().splitlines() or ['no GPU listed'])[-1][:200]}")
    return DockerGpus(None, [], "Docker hands out no GPU (" + "; ".join(errors) + ")")


def cuda_of_image(image: str, runner: Runner = run) -> str | None:
    """The image's CUDA: from the image when it is on this machine, else from the known tags."""
    insp = runner(["docker", "image", "inspect", "--format", "{{json .Config.Env}}", "--", image])
    if insp.returncode == 0 and insp.stdout.strip():
        found = image_cuda_version(json.loads(insp.stdout))
        if found:
            return found
    return KNOWN_IMAGE_CUDA.get(image)


def probe(runner: Runner = run, dotenv: dict[str, str] | None = None) -> DockerGpus | None:
    """The host's GPUs as Docker hands them out, or None on a host with no sign of an NVIDIA driver."""
    if os.environ.get("STACK_FAKE_NO_GPU") or not nvidia_host():
        return None
    dotenv = dotenv if dotenv is not None else load_env()
    return probe_docker_gpus(runner, probe_image(runner, dotenv.get("VLLM_IMAGE") or DEFAULT_VLLM_IMAGE))


def print_report(found: DockerGpus, dotenv: dict[str, str]) -> bool:
    """Print one ok/FAIL row per GPU check for GPUs already detected; True when all pass."""
    from contract.config import train_mode_variant
    from contract.train_mode import resolve_train_mode

    want = (dotenv.get("TRAIN_MODE") or "auto").lower()
    mode = train_mode_variant(resolve_train_mode("auto", found.count)[0] if want == "auto" else want)
    image = dotenv.get("VLLM_IMAGE") or DEFAULT_VLLM_IMAGE
    rows = diagnose(found.gpus, found.method, dotenv, mode, image, cuda_of_image(image))
    for ok, name, msg in rows:
        print(f"  {'ok  ' if ok else 'FAIL'} {name}: {msg}")
    return all(ok for ok, _, _ in rows)


def main() -> int:
    dotenv = load_env()
    found = probe(dotenv=dotenv)
    if found is None:
        print(f"  ok   GPU checks: {NO_GPU} (no nvidia-smi, no /dev/nvidiactl); the CPU profile runs, "
              "GPU checks skipped")
        return 0
    return 0 if print_report(found, dotenv) else 1


if __name__ == "__main__":
    sys.exit(main())
