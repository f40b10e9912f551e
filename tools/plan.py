"""The plan: what runs for this .env on this host, decided once and without side effects.

`make_plan(settings, gpus, exposed)` turns the .env settings (tools/settings.py, read once), the GPUs Docker hands out
and the ports the env images EXPOSE into a StackPlan: the mode and why, the envs by kind and their servers' ports, the
GPU layout, the Compose profiles, the services to start, the images to build and what the generated compose file adds. ENV_NAME and ENV_URLS are parsed once, into the plan's EnvKinds
(tools/derive.py), and the host functions take that. Nothing here runs Docker or writes a file; tools/prepare.py runs
the checks that do (tools/docker_host.py), writes the generated compose file from the plan
(compose_file.write_compose_files), and the commands execute it. A bad value raises StackError with its fix.
"""

from __future__ import annotations

import glob
import os
from dataclasses import dataclass, field

from envs import naming
from tools import compose_file, derive, env_ports, gpu_layout, judge, rehearsal
from tools.env_kinds import EnvKinds, env_kinds
from tools.env_ports import EnvPort
from tools.errors import StackError
from tools.gpu_doctor import DockerGpus
from tools.images import ENV_SERVER_BUILD, TRAINER_REHEARSE_BUILD, TWIN_BUILD, image_of
from tools.settings import WHEELS, StackEnv
from contract.config import CpuMode, GpuMode, TrainModeVariant
from contract.train_mode import ModeSpec


@dataclass(frozen=True)
class StackPlan:
    """What runs for this .env on this host: the one parsed object the host functions take."""

    settings: StackEnv              # .env as read (process variables win), typed
    mode: TrainModeVariant          # cpu, gpu or colocate, resolved once (derive.resolve_mode), with its knobs
    why: str                        # one line: how the mode was chosen
    envs: EnvKinds
    layout: gpu_layout.GpuLayout | None  # which GPUs each container gets (None on the CPU profile)
    cdi: bool = False               # Docker hands GPUs out only as CDI devices
    notes: tuple[str, ...] = ()     # what the plan changed or proposes, for the user
    fleet: bool = False             # ENV_FLEET=swarm: the env servers are a Swarm fleet, not services here
    replicas: dict[str, str] = field(default_factory=dict)  # ENV_<NAME>_REPLICAS as Compose reads them
    ports: dict[str, EnvPort] = field(default_factory=dict)  # each served env's server port (tools/env_ports.py)
    rehearsal: bool = False         # `make rehearse`: mode gpu's services on CPU (tools/rehearsal.py)
    judge_gpu: judge.JudgeGpu | None = None  # JUDGE_MODEL on a GPU host: the judge's GPU and split (tools/judge.py)

    @property
    def values(self) -> dict[str, str]:
        """Every .env key as a string (ENV_<NAME>_IMAGE, ...), as the stack's functions take them."""
        return self.settings.values

    @property
    def spec(self) -> ModeSpec:
        return self.mode.spec

    @property
    def judge_served(self) -> bool:
        """JUDGE_MODEL: the stack's judge service runs (JUDGE_URL: a judge elsewhere, no container)."""
        return judge.served(self.values)

    @property
    def judge_on_cpu(self) -> bool:
        """The judge runs on the vLLM CPU twin's image: the CPU profile and `make rehearse`."""
        return self.judge_served and (self.rehearsal or not self.mode.uses_vllm)

    @property
    def profiles(self) -> list[str]:
        """The mode's profile, the judge's when served, and one per env served here (a fleet serves them elsewhere)."""
        ours = [self.mode.name, rehearsal.PROFILE] if self.rehearsal else [self.mode.name]
        ours += [judge.PROFILE] if self.judge_served else []
        return ours if self.fleet else [*ours, *self.envs.names]

    @property
    def services(self) -> list[str]:
        """The long-running services `make up` starts and waits for: env servers here, vLLM in gpu mode, the judge."""
        out = [] if self.fleet else [naming.service_name(n) for n in self.envs.served_here]
        return out + (["vllm"] if self.spec.runs_vllm_service else []) + ([judge.SERVICE] if self.judge_served else [])

    @property
    def images(self) -> list[str]:
        """Build-only services for the images this mode uses; an upstream env image is pulled instead."""
        local = image_of(ENV_SERVER_BUILD, self.settings.stack_name)
        ours = any(self.envs.images.get(n, local) == local for n in self.envs.names)
        if self.rehearsal:  # model-init's CPU image; the twin is built first (the trainer image is built on it)
            return (["env-server-image"] if ours else []) + ["trainer-cpu-image", TRAINER_REHEARSE_BUILD]
        twin = [TWIN_BUILD] if self.judge_on_cpu else []  # the CPU profile's judge runs on the twin's image
        return (["env-server-image"] if ours else []) + [self.spec.trainer_image_service, *twin]

    @property
    def build_profiles(self) -> tuple[str, ...]:
        """The profiles of the build services `images` names (and the twin's, for the rehearsal or a CPU judge)."""
        twin = rehearsal.BUILD_PROFILES if self.rehearsal else (TWIN_BUILD,) if self.judge_on_cpu else ()
        return ("build", "build-gpu", *twin)

    def generated_compose(self) -> dict:
        """What the generated compose file adds to compose.yaml: env services (or the trainers' attachment to the
        fleet's network), and the GPU layouts compose.yaml's one-GPU-each default cannot express."""
        envs = compose_file.env_services(self.envs, fleet=self.fleet)
        trainers = ("trainer",) if self.rehearsal or self.mode.uses_vllm else ("trainer-cpu",)
        # the judge's part first: the rehearsal's trainer keeps these depends_on when it drops model-download's
        envs = compose_file.merge_services(envs, judge.compose_services(self.values, self.judge_on_cpu, trainers,
                                                                        self.judge_gpu))
        services = compose_file.merge_services(envs, compose_file.gpu_services(self.layout, self.cdi))
        if self.rehearsal:
            services = compose_file.merge_services(services, rehearsal.services(envs.get("trainer", {}).get("depends_on", {})))
        if self.spec.runs_vllm_service:  # LoRA adapters synced alone: vLLM's LoRA flags (trainer/modeling/lora.py)
            services = compose_file.add_lora_serving(services, derive.run_config(self.values, self.mode))
        services = compose_file.add_extra_vllm_flags(services, self.values, self.spec.runs_vllm_service)
        if self.mode.uses_vllm and not self.rehearsal:
            services = compose_file.add_cuda_compat(services, self.values)
        if not services:
            return {}
        spec: dict = {"services": services}
        if self.fleet:  # the swarm stack's network (tools/fleet.py), made by `make fleet-up`
            spec["networks"] = {"fleet": {"external": True, "name": derive.fleet_stack_name(self.values)}}
        return spec

    def compose_vars(self, compose_files: list, environ: dict[str, str] | None = None) -> dict[str, str]:
        """The environment `docker compose` runs with: the process's, plus the plan's choices."""
        out = dict(os.environ if environ is None else environ)
        out["STACK_NAME"] = self.settings.stack_name  # the project and image tags (compose.yaml's `name:`)
        # a built-in env with no image of its own runs ours, whatever an older .env.example put in .env (env_kinds)
        out.update({naming.image_var(n): "" for n in self.envs.builtin if n not in self.envs.images})
        out["TRAIN_MODE"] = self.mode.name
        out["COMPOSE_PROFILES"] = ",".join(self.profiles)
        out["COMPOSE_FILE"] = os.pathsep.join(str(f) for f in compose_files)
        if self.layout is not None:
            out.update(self.layout.compose_env())
        if self.cdi:  # compose.yaml's GPU reservations as CDI devices (no NVIDIA hook on this host)
            out["GPU_DEVICE_DRIVER"], out["GPU_DEVICE_PREFIX"] = "cdi", gpu_layout.CDI_PREFIX
        if glob.glob(str(WHEELS / "torch-*.whl")):
            out["TORCH_INDEX_URL"] = ""  # the local wheel is enough; don't wait on an index
        out.update(self.replicas)
        out.update(env_ports.compose_vars(self.ports))
        if self.rehearsal:  # the twin serves a local folder: no Hub revision (vLLM's --revision falls back to main)
            out["MODEL_REVISION"] = ""
        if self.settings.TRAINER_GPU:
            out["TRAINER_GPU"] = self.settings.TRAINER_GPU
        if self.judge_gpu is not None:  # its GPU, its share, and vLLM's lowered share beside it (tools/judge.py)
            out.update(self.judge_gpu.compose_env())
        return out


def make_plan(settings: StackEnv | dict[str, str], gpus: DockerGpus | None,
              exposed: dict[str, tuple[str, ...]] | None = None) -> StackPlan:
    """The plan for these .env settings on a host with these GPUs (None: none, not probed, as for TRAIN_MODE=cpu)
    and env images declaring these ports (docker_host.exposed_ports; None: not inspected, the defaults)."""
    settings = settings if isinstance(settings, StackEnv) else StackEnv.from_values(settings)
    values = settings.values
    mode, why = derive.resolve_mode(values, gpus if gpus is not None else DockerGpus(None, [], "not probed"))
    envs = env_kinds(values)
    problem = derive.validate_run_config(values, mode) or derive.colocated_flags_problem(values, mode)
    if problem:
        raise StackError(problem)
    ports, notes = env_ports.resolve(envs, values, exposed or {})
    if mode.colocated:
        trainer_gpu, note = gpu_layout.colocate_trainer_gpu(values.get("TRAINER_GPU"), gpus.count if gpus else 0)
        if note:
            settings = StackEnv.from_values({**values, "TRAINER_GPU": trainer_gpu})
            values = settings.values
            notes.append(note)
    layout = derive.gpu_layout_for(values, mode, gpus)
    judge_gpu = judge_preflight(values, mode, layout, notes, on_cpu=not mode.uses_vllm)
    if layout is not None:
        from contract import lora_rules

        problem = lora_rules.serving_problem(derive.run_config(values, mode), layout.data_parallel)
        if problem:
            raise StackError(problem)
        notes.append(layout.describe())
        used = len(set(layout.vllm) | set(layout.trainer))
        proposal = gpu_layout.propose_split(gpus.count) if gpus and used < gpus.count else None
        if proposal:
            notes.append(f"this host has {gpus.count} GPUs and the run uses {used}; to use all of them set "
                         f"VLLM_GPU={proposal[0]} TRAINER_GPU={proposal[1]} VLLM_PARALLEL=tensor in .env "
                         "(docs/gpu-host.md \"Every GPU of a host\")")
    return StackPlan(settings=settings, mode=mode, why=why, envs=envs, layout=layout, cdi=bool(gpus and gpus.cdi),
                     notes=tuple(notes), fleet=settings.ENV_FLEET == "swarm", replicas=derive.replica_counts(envs, values),
                     ports=ports, judge_gpu=judge_gpu)


def judge_preflight(values: dict[str, str], mode: TrainModeVariant, layout: gpu_layout.GpuLayout | None,
                    notes: list[str], on_cpu: bool) -> judge.JudgeGpu | None:
    """The judge's checks (one StackError line with its fix), its GPU and split on a GPU host, and its notes."""
    problems = judge.problems(values, on_cpu)
    if problems:
        raise StackError(problems[0])
    judge_gpu = None if on_cpu else judge.place(values, mode, layout)
    notes.extend(judge.notes(values, judge_gpu, on_cpu))
    return judge_gpu


def env_servers_plan(values: dict[str, str], exposed: dict[str, tuple[str, ...]] | None = None) -> StackPlan:
    """The env servers of .env as Compose services, and nothing else (no GPU, no check of the training knobs): what
    a Swarm fleet deploys and builds (tools/fleet.py)."""
    values = {**values, "ENV_FLEET": "compose"}
    envs = env_kinds(values)
    ports, notes = env_ports.resolve(envs, values, exposed or {})
    return StackPlan(settings=StackEnv.from_values(values), mode=CpuMode(), why="env servers only", envs=envs,
                     layout=None, notes=tuple(notes), replicas=derive.replica_counts(envs, values), ports=ports)


def rehearsal_plan(settings: StackEnv | dict[str, str], exposed: dict[str, tuple[str, ...]] | None = None) -> StackPlan:
    """`make rehearse`: TRAIN_MODE=gpu's services on this CPU (tools/rehearsal.py says what differs), whatever
    TRAIN_MODE says; .env's other settings (envs, ROLLOUTS, TRAINER_PROCESSES, the training knobs) as `make train`."""
    settings = settings if isinstance(settings, StackEnv) else StackEnv.from_values(settings)
    values = {**settings.values, "WEIGHT_TRANSFER": "reload", "MODEL_NAME": rehearsal.CPU_DEFAULT_MODEL,
              "MODEL_REVISION": ""}  # what the generated file gives the trainer, validated as the trainer reads it
    mode = GpuMode(weight_transfer="reload", weight_reload_dir=values.get("WEIGHT_RELOAD_DIR") or "/weights")
    problem = derive.validate_run_config(values, mode)
    if problem:
        raise StackError(problem)
    why = ("make rehearse: TRAIN_MODE=gpu's services on CPU: the vLLM CPU twin in the vllm service's place, serving "
           f"the tiny model model-init makes ({rehearsal.CPU_DEFAULT_MODEL}), the trainer on CPU pushing weights by "
           "reload (WEIGHT_TRANSFER=reload), no GPU")
    envs = env_kinds(settings.values)
    ports, notes = env_ports.resolve(envs, settings.values, exposed or {})
    judge_preflight(settings.values, mode, None, notes, on_cpu=True)
    return StackPlan(settings=settings, mode=mode, why=why, envs=envs, layout=None, notes=tuple(notes),
                     fleet=settings.ENV_FLEET == "swarm", replicas=derive.replica_counts(envs, settings.values),
                     rehearsal=True, ports=ports)
