"""The judge service (#64, docs/judge.md "Serving the judge"), as `make` resolves it for a .env: the plan (tools/plan.py,
tools/judge.py), its generated compose file and `docker compose config` (parsed, never grepped; no container started),
the preflight refusals and `make doctor`'s lines. The trainer's side of the judge: tests/trainer/."""

from __future__ import annotations

import json
import subprocess

import pytest

from tests.gpu_path.test_gpu_layouts import host_with
from tests.helpers import ROOT
from tools.errors import StackError
from tools.images import TRAINER_CPU_BUILD, TWIN_BUILD, image_of

PINNED = "\nJUDGE_MODEL=Qwen/Qwen3-1.7B\nJUDGE_MODEL_REVISION=70d244cc86ccca08cf5af4e1e306ecf908b1ad5e\n"
TINY = "\nJUDGE_MODEL=/models/tiny-qwen3\n"


@pytest.fixture(scope="module", autouse=True)
def docker_cli():
    if subprocess.run(["docker", "compose", "version"], capture_output=True).returncode != 0:
        pytest.fail("`docker compose` (v2) is missing: run `bash .ci/provision`")


def stack(tmp_path, monkeypatch, lines: str, mode: str = "gpu", gpus: int = 2, rehearse: bool = False):
    """(`docker compose config` of the stack `make train` (`make rehearse`) runs for .env.example + `lines` on a host
    with `gpus` GPUs, its text, the plan)."""
    from tools import docker_host, settings
    from tools.plan import make_plan, rehearsal_plan
    from tools.prepare import compose_vars_for

    env_file = tmp_path / "stack.env"
    env_file.write_text((ROOT / ".env.example").read_text() + lines)
    monkeypatch.setattr(settings, "ENV_FILE", env_file)
    if rehearse:
        plan, name = rehearsal_plan(settings.load()), "compose.rehearse"
    else:
        values = settings.StackEnv.load(env_file).values
        plan, name = make_plan({**values, "TRAIN_MODE": mode}, host_with(gpus) if gpus else None), "compose.envs"
    cmd, env = docker_host.compose_command(compose_vars_for(plan, name), "config", "--format", "json")
    out = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True)
    assert out.returncode == 0, out.stderr
    return json.loads(out.stdout), out.stdout, plan


def flags(service: dict) -> dict[str, str]:
    return dict(a.split("=", 1) for a in service["command"] if a.startswith("--") and "=" in a)


def healthy(service: dict, dependency: str) -> bool:
    return service["depends_on"][dependency]["condition"] == "service_healthy"


def test_a_served_judge_is_vllm_serve_of_the_pinned_model_on_agentnet_only_non_root_and_unpublished(tmp_path, monkeypatch):
    config, _, plan = stack(tmp_path, monkeypatch, PINNED)
    judge, services = config["services"]["judge"], config["services"]
    assert "judge" in plan.profiles and plan.services[-1] == "judge"  # `make up` starts it and waits for it healthy
    assert judge["image"] == "vllm/vllm-openai:v0.31.0"
    assert judge["entrypoint"] == ["vllm", "serve", "Qwen/Qwen3-1.7B"]
    f = flags(judge)
    assert f["--served-model-name"] == "Qwen/Qwen3-1.7B"  # the `model` of the trainer's calls
    assert f["--revision"] == f["--tokenizer-revision"] == "70d244cc86ccca08cf5af4e1e306ecf908b1ad5e"
    assert f["--port"] == "8000"  # contract/config/judge.py SERVED_URL: http://judge:8000/v1
    # an ordinary OpenAI server: no dev routes, no weight transfer, no NCCL, no pooling runner (rubric is the default)
    assert "VLLM_SERVER_DEV_MODE" not in judge["environment"]
    assert not any(k.startswith("NCCL") for k in judge["environment"])
    assert not {"--weight-transfer-config", "--runner", "--convert"} & set(f)
    assert set(judge["networks"]) == {"agentnet"}
    assert judge["user"] == "10001:10001" and judge["cap_drop"] == ["ALL"]
    assert "no-new-privileges:true" in judge["security_opt"]
    assert not judge.get("ports") and judge["expose"] == ["8000"]
    assert "/health" in " ".join(judge["healthcheck"]["test"])
    assert [v["read_only"] for v in judge["volumes"] if v["target"] == "/cache/huggingface"] == [True]
    assert healthy(services["trainer"], "judge")  # the trainer waits for it
    assert judge["depends_on"]["model-download"]["condition"] == "service_completed_successfully"
    download = services["model-download"]["environment"]  # the same init job fetches it, at its revision
    assert (download["JUDGE_MODEL"], download["JUDGE_MODEL_REVISION"]) == ("Qwen/Qwen3-1.7B", f["--revision"])
    assert "judge" in services["trainer"]["environment"]["NO_PROXY"].split(",")


def test_by_default_the_judge_shares_vllms_gpu_with_a_split_and_starts_after_vllm(tmp_path, monkeypatch):
    config, _, plan = stack(tmp_path, monkeypatch, PINNED)
    judge, vllm = config["services"]["judge"], config["services"]["vllm"]
    devices = lambda s: [i for d in s["deploy"]["resources"]["reservations"]["devices"] for i in d["device_ids"]]  # noqa: E731
    assert devices(judge) == devices(vllm) == ["0"]
    assert (flags(judge)["--gpu-memory-utilization"], flags(vllm)["--gpu-memory-utilization"]) == ("0.3", "0.6")
    assert healthy(judge, "vllm")  # two engines must not measure one GPU's free memory at once
    assert any("shared with vLLM" in note for note in plan.notes)


def test_a_judge_on_a_gpu_of_its_own_takes_most_of_it_and_leaves_vllms_share_alone(tmp_path, monkeypatch):
    config, _, _ = stack(tmp_path, monkeypatch, PINNED + "JUDGE_GPU=2\n", gpus=3)
    judge, vllm = config["services"]["judge"], config["services"]["vllm"]
    assert judge["deploy"]["resources"]["reservations"]["devices"][0]["device_ids"] == ["2"]
    assert (flags(judge)["--gpu-memory-utilization"], flags(vllm)["--gpu-memory-utilization"]) == ("0.9", "0.9")
    assert "vllm" not in judge["depends_on"]


def test_a_reward_model_is_served_by_vllms_pooling_runner(tmp_path, monkeypatch):
    config, _, _ = stack(tmp_path, monkeypatch, PINNED + "JUDGE_METHOD=reward_model\n")
    f = flags(config["services"]["judge"])
    # vLLM 0.31 picks the conversion from the model's architectures (*ForSequenceClassification: classify); a forced
    # --convert=classify would turn a causal LM into a classifier with an uninitialised head (bench/reward_model.py)
    assert f["--runner"] == "pooling" and "--convert" not in f
    assert f["--served-model-name"] == "Qwen/Qwen3-1.7B"


@pytest.mark.parametrize("lines,says", [
    ("\nJUDGE_METHOD=reward_model\nJUDGE_MODEL=/models/tiny-judge\n", "is a causal LM"),
    ("\nJUDGE_METHOD=reward_model\nJUDGE_MODEL=/models/tiny-qwen3\n", "JUDGE_MODEL=/models/tiny-reward-model"),
    ("\nJUDGE_MODEL=/models/tiny-reward-model\n", "set JUDGE_METHOD=reward_model"),
    ("\nJUDGE_METHOD=ranking\nJUDGE_MODEL=/models/tiny-reward-model/\n", "JUDGE_METHOD=ranking cannot serve"),
])
def test_the_cpu_profiles_own_judges_must_match_judge_method(lines, says):
    from tools import judge

    values = dict(line.split("=", 1) for line in lines.strip().splitlines())
    problems = judge.problems(values, on_cpu=True)
    assert len(problems) == 1 and says in problems[0] and "edit .env" in problems[0], problems
    assert judge.problems({"JUDGE_METHOD": "reward_model", "JUDGE_MODEL": "/models/tiny-reward-model"}, True) == []


def test_judge_url_starts_no_container_and_its_key_is_a_secret_never_in_the_config(tmp_path, monkeypatch):
    from contract.config.judge import API_KEY_SECRET

    key = tmp_path / "judge_key"
    key.write_text("sk-judge-do-not-print-4242\n")
    config, text, plan = stack(tmp_path, monkeypatch, f"\nJUDGE_URL=https://judge.example.org/v1\n"
                               f"JUDGE_API_KEY_FILE={key}\n")
    assert "judge" not in config["services"] and "judge" not in plan.profiles and "judge" not in plan.services
    assert "judge" not in config["services"]["trainer"]["depends_on"]
    assert config["secrets"]["judge_api_key"]["file"] == str(key)
    mounted = {s["source"]: s["target"] for s in config["services"]["trainer"]["secrets"]}
    assert mounted["judge_api_key"] == API_KEY_SECRET  # where the trainer reads it
    for name, service in config["services"].items():  # only the trainers hold it
        if name not in ("trainer", "trainer-cpu"):
            assert "judge_api_key" not in {s["source"] for s in service.get("secrets") or []}, name
    assert "sk-judge-do-not-print-4242" not in text + "\n".join(plan.notes)  # `make config` shows the file, not the key
    assert any("no judge container starts" in note for note in plan.notes)


def test_the_cpu_profiles_judge_is_the_vllm_cpu_twin_serving_the_tiny_model(tmp_path, monkeypatch):
    config, _, plan = stack(tmp_path, monkeypatch, TINY, mode="cpu", gpus=0)
    judge = config["services"]["judge"]
    assert judge["image"] == image_of(TWIN_BUILD, plan.settings.stack_name)
    assert judge["entrypoint"] == ["vllm-serve", "/models/tiny-qwen3"]
    assert flags(judge)["--served-model-name"] == "/models/tiny-qwen3"
    assert "deploy" not in judge  # no GPU
    assert "VLLM_SERVER_DEV_MODE" not in judge["environment"]  # the twin's image does not set it either
    assert {v["target"]: v["read_only"] for v in judge["volumes"]} == {"/models": True}
    assert judge["depends_on"] == {"model-init": {"condition": "service_completed_successfully", "required": True}}
    assert healthy(config["services"]["trainer-cpu"], "judge")
    assert set(judge["networks"]) == {"agentnet"} and judge["user"] == "10001:10001"
    assert TWIN_BUILD in plan.images and TWIN_BUILD in plan.build_profiles  # `make train` builds the twin


def test_make_rehearse_serves_a_hub_judge_on_the_twin_fetched_by_model_download(tmp_path, monkeypatch):
    config, _, plan = stack(tmp_path, monkeypatch, PINNED, rehearse=True)
    services = config["services"]
    judge, download, trainer = services["judge"], services["model-download"], services["trainer"]
    assert judge["image"] == image_of(TWIN_BUILD, plan.settings.stack_name) and "deploy" not in judge
    assert judge["entrypoint"] == ["vllm-serve", "Qwen/Qwen3-1.7B"]
    assert judge["depends_on"] == {"model-download": {"condition": "service_completed_successfully", "required": True}}
    # the download on the CPU trainer's image (no GPU image on a CPU host), the judge alone (MODEL_NAME empty)
    assert download["image"] == image_of(TRAINER_CPU_BUILD, plan.settings.stack_name)
    assert download["environment"]["MODEL_NAME"] == "" and download["environment"]["JUDGE_MODEL"] == "Qwen/Qwen3-1.7B"
    assert set(trainer["depends_on"]) == {"vllm", "env-echo", "judge"} and healthy(trainer, "judge")


@pytest.mark.parametrize("case", ["gpu", "cpu", "rehearse"])
def test_no_env_container_shares_a_network_with_the_judge(tmp_path, monkeypatch, case):
    """An env image is code the user did not write, and the judge reads its transcripts: envnet never reaches it."""
    lines, mode, gpus, rehearse = {"gpu": (PINNED, "gpu", 2, False), "cpu": (TINY, "cpu", 0, False),
                                   "rehearse": (TINY, "gpu", 0, True)}[case]
    config, _, _ = stack(tmp_path, monkeypatch, lines + "ENV_NAME=echo,wordle\n", mode=mode, gpus=gpus,
                         rehearse=rehearse)
    judge_networks = set(config["services"]["judge"]["networks"])
    assert judge_networks == {"agentnet"}
    envs = {n: s for n, s in config["services"].items() if n.startswith("env-") or n == "model-init"}
    assert {"env-echo", "env-wordle"} <= set(envs)
    for name, service in envs.items():
        assert not set(service["networks"]) & judge_networks, (name, service["networks"])


@pytest.mark.parametrize("lines,says", [
    ("\nJUDGE_MODEL=a/b\nJUDGE_URL=https://x.example/v1\n", "JUDGE_MODEL and JUDGE_URL are both set"),
    (PINNED + "JUDGE_GPU=1\n", "JUDGE_GPU=1 is the trainer's GPU"),
    (PINNED + "JUDGE_GPU=0,2\n", "the judge runs on one GPU"),
    (PINNED + "JUDGE_GPU=x\n", "'x' is not a GPU id"),
    (PINNED + "JUDGE_GPU_MEMORY_SHARE=0.5\nVLLM_GPU_MEMORY_UTILIZATION=0.6\n", "JUDGE_GPU_MEMORY_SHARE=0.3 or lower"),
    (PINNED + "JUDGE_GPU_MEMORY_SHARE=0.85\n", "leaves vLLM 0.05 of it"),
    (PINNED + "JUDGE_GPU_MEMORY_SHARE=1.5\n", "JUDGE_GPU_MEMORY_SHARE"),
    (TINY, "only the CPU profile and `make rehearse` serve a local model"),
    ("\nJUDGE_URL=https://user:pw@x.example/v1\n", "JUDGE_URL holds a user or password"),
    ("\nJUDGE_URL=http://judge:8000/v1\n", "names the stack's own judge service"),
])
def test_a_judge_setting_that_cannot_run_stops_preflight_in_one_line_with_its_fix(tmp_path, monkeypatch, lines, says):
    with pytest.raises(StackError) as stop:
        stack(tmp_path, monkeypatch, lines, gpus=3)
    line = str(stop.value)
    assert len(line.strip().splitlines()) == 1 and says in line and "edit .env" in line, line
    assert "pw@" not in line


# ------------------------------------------------------------------ make doctor
def doctor(values: dict[str, str], mode: str = "gpu", gpus: int = 2, total_mib: int = 81559, used_mib: int = 0):
    from contract.config import train_mode_variant
    from tools import derive, gpu_doctor, judge

    csv = "".join(f"{i}, GPU-{i:08d}-aaaa, NVIDIA TEST, {total_mib}, {used_mib}, {total_mib - used_mib}, 580.95.05\n"
                  for i in range(gpus))
    found = gpu_doctor.parse_gpu_csv(csv)
    chosen = train_mode_variant(mode)
    layout = derive.gpu_layout_for(values, chosen, gpu_doctor.DockerGpus("nvidia", found, "")) if gpus else None
    return judge.doctor_rows(values, chosen, layout, found, on_cpu=not chosen.uses_vllm)


def test_doctor_warns_of_an_unpinned_judge_and_checks_its_gpu_and_split():
    rows = doctor({"JUDGE_MODEL": "Qwen/Qwen3-1.7B"})
    assert ("WARN", "JUDGE_MODEL_REVISION") in {(s, n) for s, n, _ in rows}
    assert [s for s, n, _ in rows if n == "judge GPU split"] == ["ok"]
    missing = doctor({"JUDGE_MODEL": "a/b", "JUDGE_MODEL_REVISION": "c", "JUDGE_GPU": "5"}, gpus=2)
    assert [(s, n) for s, n, m in missing if s == "FAIL"] == [("FAIL", "JUDGE_GPU")]
    # a 24 GB card at judge 0.3 + vLLM 0.6 keeps 2.3 GiB outside both, short of a weight push's ~2.5 GiB
    small = doctor({"JUDGE_MODEL": "a/b", "JUDGE_MODEL_REVISION": "c"}, total_mib=24564)
    fails = [m for s, n, m in small if s == "FAIL"]
    assert len(fails) == 1 and "JUDGE_GPU_MEMORY_SHARE" in fails[0], small
    busy = doctor({"JUDGE_MODEL": "a/b", "JUDGE_MODEL_REVISION": "c", "JUDGE_GPU": "1"}, mode="colocate", gpus=2,
                  used_mib=20000)  # another process holds 20 GB of the judge's GPU: 0.9 of it is not free
    assert [(s, n) for s, n, _ in busy if s == "FAIL"] == [("FAIL", "judge free memory")], busy


def test_doctor_checks_the_judge_url_and_its_key_file_without_printing_the_key(tmp_path):
    key = tmp_path / "secrets" / "judge_key"
    key.parent.mkdir(mode=0o700)
    key.write_text("sk-never-shown")
    key.chmod(0o600)  # not readable by the trainers' uid 10001
    rows = doctor({"JUDGE_URL": "https://x.example/v1", "JUDGE_API_KEY_FILE": str(key)})
    assert [n for s, n, _ in rows if s == "FAIL"] == ["JUDGE_API_KEY_FILE"]
    key.chmod(0o644)
    rows = doctor({"JUDGE_URL": "https://x.example/v1", "JUDGE_API_KEY_FILE": str(key)})
    assert all(s == "ok" for s, _, _ in rows) and "sk-never-shown" not in repr(rows)
    rows = doctor({"JUDGE_URL": "https://x.example/v1"})
    assert ("WARN", "JUDGE_API_KEY_FILE") in {(s, n) for s, n, _ in rows}
    assert doctor({}) == [("ok", "judge", "none (JUDGE_MODEL and JUDGE_URL empty): every reward is the env's")]


def test_colocate_counts_a_judge_on_the_trainers_gpu_in_its_memory_share():
    from contract.config import train_mode_variant
    from tools import derive, judge
    from tests.gpu_path.test_gpu_layouts import host_with as gpus

    mode = train_mode_variant("colocate")
    values = {"JUDGE_MODEL": "a/b", "JUDGE_MODEL_REVISION": "c", "TRAINER_GPU": "0"}
    layout = derive.gpu_layout_for(values, mode, gpus(1))
    assert judge.trainer_gpu_share(values, mode, layout, "0") == judge.SHARED_SHARE
    assert judge.place(values, mode, layout).shares_with == "trainer"


def test_model_download_fetches_the_judge_at_its_revision_with_a_stand_in_hub(monkeypatch, capsys):
    """A test double for the Hub (no network here): which repos and revisions the init job asks for."""
    import huggingface_hub

    from trainer import download_model

    asked = []
    monkeypatch.setattr(huggingface_hub, "snapshot_download",
                        lambda repo, revision=None, token=None: asked.append((repo, revision)) or f"/cache/{repo}")
    monkeypatch.setattr(download_model, "report_download", lambda *a: None)
    monkeypatch.setenv("MODEL_NAME", "")  # the CPU profile: model-init makes the policy
    monkeypatch.setenv("JUDGE_MODEL", "Qwen/Qwen3-1.7B")
    monkeypatch.setenv("JUDGE_MODEL_REVISION", "70d244cc")
    assert download_model.main() == 0
    assert asked == [("Qwen/Qwen3-1.7B", "70d244cc")]
    monkeypatch.setenv("JUDGE_MODEL", "/models/tiny-qwen3")  # model-init's: nothing to fetch
    assert download_model.main() == 0 and len(asked) == 1
    assert "judge Qwen/Qwen3-1.7B (revision 70d244cc) ready" in capsys.readouterr().out


def test_make_train_on_the_cpu_profile_starts_the_judge_after_model_init_made_its_model(monkeypatch):
    """The CPU judge may serve model-init's tiny model: model-init runs in the foreground first (its messages seen),
    then the judge, health-gated, then the trainer. Docker's calls recorded, not run (a stand-in for Compose)."""
    from tools.commands import train
    from tools.plan import make_plan
    from tools.prepare import Prepared

    calls = []
    monkeypatch.setattr(train, "bring_up", lambda prepared, hold=(): calls.append(("bring_up", *hold)))

    class Recorded(Prepared):
        def compose(self, *args, extra_profiles=()):
            calls.append(args[:4])
            return 0

    plan = make_plan({"TRAIN_MODE": "cpu", "JUDGE_MODEL": "/models/tiny-qwen3"}, None)
    assert train.train(Recorded(plan, {}), []) == 0
    assert calls[:3] == [("bring_up", "judge"), ("run", "--rm", "model-init"), ("up", "-d", "--wait", "judge")]
    assert calls[3][:3] == ("run", "--rm", "--no-deps") and calls[3][3] == "trainer-cpu"
