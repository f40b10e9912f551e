"""GPU checks of `make doctor` (host side, standard library only).

    python tools/gpu_doctor.py          # exit 0 all fine (or no GPU here), 1 problems found

Checks: NVIDIA runtime in Docker, how many GPUs (>= 2 for TRAIN_MODE=gpu; exactly one -> suggest
TRAIN_MODE=colocate), that VLLM_GPU / TRAINER_GPU name GPUs that exist (and differ), the driver's
CUDA version against the vLLM image's, and free memory on each GPU against what vLLM will take.
Reads .env (or .env.example) like the Makefile; STACK_ENV_FILE points elsewhere.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
NO_GPU = "no NVIDIA GPU here"
QUERY = "index,uuid,name,memory.total,memory.used,memory.free,driver_version"


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


def parse_driver_cuda(nvidia_smi_text: str) -> str | None:
    """The highest CUDA version the driver supports, from plain `nvidia-smi`'s header."""
    m = re.search(r"CUDA Version:\s*([0-9]+\.[0-9]+)", nvidia_smi_text)
    return m.group(1) if m else None


def image_cuda_version(image_env: list[str] | None) -> str | None:
    """CUDA_VERSION from an image's Config.Env (NVIDIA's CUDA base images set it)."""
    for item in image_env or []:
        key, _, value = item.partition("=")
        if key == "CUDA_VERSION" and value:
            return value
    return None


def _ver(text: str) -> tuple[int, ...]:
    return tuple(int(x) for x in re.findall(r"[0-9]+", text)[:2])


def diagnose(gpus: list[Gpu], runtime: bool, env: dict[str, str], mode: str, driver_cuda: str | None,
             image: str, image_cuda: str | None) -> list[tuple[bool, str, str]]:
    """(ok, check, message) rows; message names the fix for every problem."""
    rows: list[tuple[bool, str, str]] = []
    rows.append((runtime, "NVIDIA container runtime",
                 "Docker has it" if runtime else "Docker has no `nvidia` runtime: install nvidia-container-toolkit, "
                 "run `sudo nvidia-ctk runtime configure --runtime=docker`, restart Docker"))
    n = len(gpus)
    if mode == "gpu":
        if n >= 2:
            rows.append((True, "GPU count", f"{n} GPUs: vLLM and the trainer each get one"))
        elif n == 1:
            rows.append((False, "GPU count", "1 GPU, TRAIN_MODE=gpu needs 2 (vLLM on one, trainer on the other): "
                         "set TRAIN_MODE=colocate in .env (vLLM inside the trainer on the one GPU)"))
        else:
            rows.append((False, "GPU count", "0 GPUs visible to nvidia-smi"))
    else:
        hint = "; TRAIN_MODE=colocate runs vLLM inside the trainer on it" if n == 1 else ""
        rows.append((n >= 1, "GPU count", f"{n} GPU(s){hint}"))
    ids = {g.index for g in gpus} | {g.uuid for g in gpus}
    by_id = {g.index: g for g in gpus} | {g.uuid: g for g in gpus}
    wanted = {"VLLM_GPU": env.get("VLLM_GPU") or "0", "TRAINER_GPU": env.get("TRAINER_GPU") or "1"}
    if mode == "colocate":
        wanted = {"TRAINER_GPU": env.get("TRAINER_GPU") or "0"}
        if wanted["TRAINER_GPU"] not in ids and "0" in ids:
            rows.append((False, "TRAINER_GPU", f"TRAINER_GPU={wanted['TRAINER_GPU']} does not exist; with one GPU "
                         "set TRAINER_GPU=0 in .env"))
            wanted = {}
    for var, dev in wanted.items():
        ok = dev in ids
        rows.append((ok, var, f"{var}={dev}: {by_id[dev].name}" if ok else
                     f"{var}={dev} is not a GPU here (have {', '.join(sorted(g.index for g in gpus)) or 'none'}): "
                     "edit .env"))
    if mode == "gpu" and wanted.get("VLLM_GPU") == wanted.get("TRAINER_GPU"):
        rows.append((False, "GPU assignment", f"VLLM_GPU and TRAINER_GPU are both {wanted['VLLM_GPU']}: give them "
                     "different GPUs, or use TRAIN_MODE=colocate"))
    if driver_cuda and image_cuda:
        ok = _ver(driver_cuda) >= _ver(image_cuda)
        rows.append((ok, "driver vs image CUDA",
                     f"driver supports CUDA {driver_cuda}, {image} needs {image_cuda}" if ok else
                     f"driver supports CUDA {driver_cuda} but {image} is built for CUDA {image_cuda}: upgrade the "
                     "NVIDIA driver, or set VLLM_IMAGE to a release built for your CUDA (and rebuild: `make build`)"))
    elif driver_cuda:
        rows.append((True, "driver vs image CUDA", f"driver supports CUDA {driver_cuda}; {image} not pulled yet "
                     "(checked again after `make build`)"))
    try:
        share = float(env.get("VLLM_GPU_MEMORY_UTILIZATION") or (0.9 if mode == "gpu" else 0.3))
    except ValueError:
        share = 0.9
    vllm_dev = wanted.get("VLLM_GPU") if mode == "gpu" else wanted.get("TRAINER_GPU")
    for g in gpus:
        role = " (vLLM)" if g.index == vllm_dev or g.uuid == vllm_dev else ""
        need = int(g.total_mib * share) if role else 0
        ok = g.free_mib >= need
        msg = f"GPU {g.index} {g.name}: {g.free_mib} MiB free of {g.total_mib}{role}"
        if not ok:
            msg += (f"; vLLM will claim {need} MiB (VLLM_GPU_MEMORY_UTILIZATION={share}): stop what uses the GPU "
                    "(`nvidia-smi`) or lower VLLM_GPU_MEMORY_UTILIZATION")
        rows.append((ok, f"free memory GPU {g.index}", msg))
    return rows


# ------------------------------------------------------------------ probing the host
def run(cmd: list[str]) -> subprocess.CompletedProcess:
    try:
        return subprocess.run(cmd, capture_output=True, text=True, timeout=60)
    except (OSError, subprocess.TimeoutExpired) as exc:
        return subprocess.CompletedProcess(cmd, 127, "", str(exc))


def load_env() -> dict[str, str]:
    path = Path(os.environ.get("STACK_ENV_FILE") or ROOT / ".env")
    if not path.exists():
        path = ROOT / ".env.example"
    env: dict[str, str] = {}
    for raw in path.read_text().splitlines():
        line = raw.strip()
        if line and not line.startswith("#") and "=" in line:
            key, _, value = line.removeprefix("export ").partition("=")
            env[key.strip()] = value.strip().strip("'\"")
    env.update({k: v for k, v in os.environ.items() if k in ("TRAIN_MODE", "VLLM_GPU", "TRAINER_GPU", "VLLM_IMAGE")})
    return env


def probe() -> tuple[list[Gpu], bool, str | None] | None:
    """(gpus, runtime, driver_cuda), or None when this host has no NVIDIA GPU."""
    if os.environ.get("STACK_FAKE_NO_GPU") or not shutil.which("nvidia-smi"):
        return None
    q = run(["nvidia-smi", f"--query-gpu={QUERY}", "--format=csv,noheader,nounits"])
    gpus = parse_gpu_csv(q.stdout) if q.returncode == 0 else []
    if not gpus:
        return None
    info = run(["docker", "info", "--format", "{{json .Runtimes}}"])
    runtime = info.returncode == 0 and "nvidia" in info.stdout
    return gpus, runtime, parse_driver_cuda(run(["nvidia-smi"]).stdout)


def main() -> int:
    env = load_env()
    mode = (env.get("TRAIN_MODE") or "auto").lower()
    found = probe()
    if found is None:
        print(f"  ok   GPU checks: {NO_GPU} (nvidia-smi missing or lists no GPU); the CPU profile runs, "
              "GPU checks skipped")
        return 0
    gpus, runtime, driver_cuda = found
    if mode == "auto":
        mode = "gpu" if len(gpus) >= 2 else "colocate"
    image = env.get("VLLM_IMAGE") or "vllm/vllm-openai:v0.31.0"
    insp = run(["docker", "image", "inspect", image, "--format", "{{json .Config.Env}}"])
    image_cuda = image_cuda_version(json.loads(insp.stdout)) if insp.returncode == 0 and insp.stdout.strip() else None
    rows = diagnose(gpus, runtime, env, mode, driver_cuda, image, image_cuda)
    for ok, name, msg in rows:
        print(f"  {'ok  ' if ok else 'FAIL'} {name}: {msg}")
    return 0 if all(ok for ok, _, _ in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
