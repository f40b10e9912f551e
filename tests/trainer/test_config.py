"""contract.config: env vars + CLI parsing, validation messages, GRPOConfig mapping."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from contract import memory
from contract.config import ENV_VARS, ColocateMode, ConfigError, CpuMode, GpuMode, RunConfig, describe
from trainer.core import grpo_args

REPO = Path(__file__).resolve().parents[2]


@pytest.fixture(autouse=True)
def clean_env(monkeypatch):
    for name in ENV_VARS:
        monkeypatch.delenv(name, raising=False)


def load(monkeypatch, argv=(), **env):
    for key, value in env.items():
        monkeypatch.setenv(key, value)
    return RunConfig.load(list(argv))


def test_defaults_are_valid(monkeypatch):
    cfg = load(monkeypatch)
    assert cfg.env_names == ["echo"]
    assert cfg.run_dir == "/outputs/echo"
    assert cfg.resume == "auto"
    assert cfg.generation_batch_size % cfg.num_generations == 0


def test_env_vars_are_read_case_insensitively_and_empty_means_default(monkeypatch):
    cfg = load(monkeypatch, MAX_STEPS="7", learning_rate="0.001", SEED="", TRAIN_MODE="cpu")
    assert (cfg.max_steps, cfg.learning_rate, cfg.seed, cfg.train_mode) == (7, 0.001, 42, "cpu")


def test_cli_overrides_env(monkeypatch):
    cfg = load(monkeypatch, ["--max-steps", "3", "--env-name", "echo,wordle"], MAX_STEPS="9")
    assert cfg.max_steps == 3
    assert cfg.env_names == ["echo", "wordle"]
    assert cfg.resolved_run_name == "echo+wordle"


@pytest.mark.parametrize(
    "env, expected",
    [
        ({"ENV_NAME": "echo,Connect-4"}, "ENV_NAME: 'connect-4' is not an env name: lowercase letters, digits and "
                                          "'_', starting with a letter (built in: catch, echo, wordle; edit .env)"),
        ({"ENV_NAME": "echo,echo"}, "ENV_NAME: 'echo,echo' names an environment twice"),
        ({"MAX_STEPS": "abc"}, "MAX_STEPS: Input should be a valid integer"),
        ({"MAX_STEPS": "0"}, "MAX_STEPS: Input should be greater than or equal to 1 (got '0'"),
        ({"TRAIN_MODE": "tpu"}, "TRAIN_MODE: Input should be 'auto', 'cpu', 'gpu' or 'colocate' (got 'tpu'"),
        ({"RESUME": "maybe"}, "RESUME: Input should be 'auto' or 'fresh'"),
        ({"ENV_URLS": "echo"}, "ENV_URLS: 'echo' is not `name=http://host:port`"),
        ({"ENV_URLS": "catch=http://x:1"}, "ENV_URLS names catch, which ENV_NAME=echo does not train on"),
        ({"NUM_GENERATIONS": "3"}, "not a multiple of NUM_GENERATIONS=3"),
        ({"NUM_GENERATIONS": "1"}, "NUM_GENERATIONS: Input should be greater than or equal to 2"),
        ({"RUN_NAME": "../etc"}, "RUN_NAME: '../etc' is not a folder name"),
        ({"VLLM_SERVER_URL": "vllm:8000"}, "VLLM_SERVER_URL: 'vllm:8000' is not a URL"),
        ({"VLLM_GPU_MEMORY_UTILIZATION": "1.5"}, "VLLM_GPU_MEMORY_UTILIZATION: Input should be less than or equal to 1"),
        ({"UNFINISHED_PENALTY": "-1"}, "UNFINISHED_PENALTY: Input should be greater than or equal to 0 (got '-1'"),
        ({"TOOL_TIMEOUT_S": "0"}, "TOOL_TIMEOUT_S: Input should be greater than 0 (got '0'"),
        ({"TOOL_CONCURRENCY": "0"}, "TOOL_CONCURRENCY: Input should be greater than or equal to 1 (got '0'"),
        ({"TEMPERATURE": "3"}, "TEMPERATURE: Input should be less than or equal to 2 (got '3'"),
        ({"WEIGHT_TRANSFER": "rsync"}, "WEIGHT_TRANSFER: Input should be 'nccl' or 'reload' (got 'rsync'"),
    ],
)
def test_bad_values_give_one_clear_line(monkeypatch, env, expected):
    with pytest.raises(ConfigError) as exc:
        load(monkeypatch, **env)
    message = str(exc.value)
    assert expected in message
    assert len(message.splitlines()) == 1
    assert "edit .env" in message  # every message names the fix


def test_several_problems_are_all_reported(monkeypatch):
    with pytest.raises(ConfigError) as exc:
        load(monkeypatch, ENV_NAME="no pe", MAX_STEPS="x")
    lines = str(exc.value).splitlines()
    assert [line.split(":")[0] for line in lines] == ["ENV_NAME", "MAX_STEPS"]


def test_unknown_cli_flag_is_a_config_error(monkeypatch):
    with pytest.raises(ConfigError, match="unrecognized arguments: --bogus"):
        load(monkeypatch, ["--bogus", "1"])


def test_env_urls_override_and_default(monkeypatch):
    cfg = load(monkeypatch, ENV_NAME="echo,catch", ENV_URLS="catch=http://127.0.0.1:9001/")
    assert cfg.env_url("catch") == "http://127.0.0.1:9001"
    assert cfg.env_url("echo") == "http://env-echo:8000"


def test_model_default_depends_on_mode(monkeypatch):
    cfg = load(monkeypatch)
    assert cfg.resolved(CpuMode()).model_id == "/models/tiny-qwen3"
    assert cfg.resolved(GpuMode()).model_id == "Qwen/Qwen3-0.6B"
    assert load(monkeypatch, MODEL_NAME="/m/x").resolved(CpuMode()).model_id == "/m/x"


def test_to_grpo_config_cpu(monkeypatch, tmp_path):
    cfg = load(monkeypatch, OUTPUT_DIR=str(tmp_path), MAX_STEPS="5", NUM_GENERATIONS="4",
               PER_DEVICE_TRAIN_BATCH_SIZE="4", GRADIENT_ACCUMULATION_STEPS="2", SAVE_STEPS="2",
               MAX_TOOL_CALLING_ITERATIONS="3", TEMPERATURE="0.7")
    args = grpo_args.grpo_config(cfg.resolved(CpuMode()))
    assert args.output_dir == f"{tmp_path}/echo"
    assert (args.max_steps, args.num_generations, args.per_device_train_batch_size) == (5, 4, 4)
    assert args.steps_per_generation == 2  # TRL's default: gradient_accumulation_steps
    assert args.generation_batch_size == 8 == cfg.generation_batch_size
    assert (args.save_steps, args.max_tool_calling_iterations, args.temperature) == (2, 3, 0.7)
    assert args.use_cpu and not args.bf16 and not args.use_vllm


def test_env_var_list_is_the_field_list():
    assert ENV_VARS == tuple(name.upper() for name in RunConfig.model_fields)
    assert {"ENV_NAME", "MAX_CONCURRENT_ENVS", "VLLM_GROUP_PORT", "RESUME"} <= set(ENV_VARS)
    assert [row["name"] for row in describe()] == list(ENV_VARS)
    assert all(row["description"] for row in describe())


def test_config_module_imports_without_torch():
    # `make doctor` validates .env on the host without torch: importing the config must not pull it in.
    code = ("import sys; import contract.config as c; c.RunConfig.load([]); "
            "bad = [m for m in ('torch', 'trl', 'transformers') if m in sys.modules]; "
            "assert not bad, bad")
    subprocess.run([sys.executable, "-c", code], cwd=REPO, check=True)


def test_check_cli_exit_codes(monkeypatch):
    env = {"PATH": "/usr/bin:/bin", "ENV_NAME": "9lives"}
    bad = subprocess.run([sys.executable, "-m", "contract.config", "--check"], cwd=REPO, env=env,
                         capture_output=True, text=True)
    assert bad.returncode == 1 and "ENV_NAME: '9lives' is not an env name" in bad.stderr
    env["ENV_NAME"] = "echo"
    ok = subprocess.run([sys.executable, "-m", "contract.config", "--check"], cwd=REPO, env=env,
                        capture_output=True, text=True)
    assert ok.returncode == 0, ok.stderr


def test_auto_mode_on_a_machine_without_cuda(monkeypatch):
    torch = pytest.importorskip("torch")
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    cfg = load(monkeypatch, TRAIN_MODE="auto")
    assert grpo_args.resolve(cfg).placement == CpuMode()
    assert grpo_args.resolve(cfg).effective_learning_rate == 2e-4  # the tiny model's default
    assert load(monkeypatch, TRAIN_MODE="gpu").effective_learning_rate == 1e-5
    assert load(monkeypatch, LEARNING_RATE="0.002").resolved(GpuMode()).effective_learning_rate == 0.002


def test_auto_mode_with_one_gpu_picks_server_or_colocate(monkeypatch):
    torch = pytest.importorskip("torch")
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    # the gpu profile runs a `vllm` service whose name resolves; colocate has none
    assert grpo_args.resolve(load(monkeypatch, VLLM_SERVER_URL="http://127.0.0.1:8000")).placement == GpuMode()
    assert grpo_args.resolve(load(monkeypatch, VLLM_SERVER_URL="http://vllm.invalid:8000")).placement == ColocateMode()
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 2)
    assert grpo_args.resolve(load(monkeypatch, VLLM_SERVER_URL="http://vllm.invalid:8000")).placement == GpuMode()


def test_accepts_none_tells_a_nullable_setting_from_one_with_a_bounded_default():
    # make eval re-applies an older run.json's settings: its null TOOL_TIMEOUT_S (no bound then) means the default now
    assert not RunConfig.accepts_none("tool_timeout_s")
    assert RunConfig.accepts_none("max_tool_calling_iterations") and RunConfig.accepts_none("tool_concurrency")


@pytest.mark.parametrize("env,expected", [
    ({"LORA_R": "1024"}, "LORA_R=1024: vLLM serves adapters up to rank 512"),
    ({"LORA_R": "-1"}, "LORA_R: Input should be greater than or equal to 0"),
    ({"LORA_R": "16", "LORA_TARGET_MODULES": "q_proj,lm_head"}, "LORA_TARGET_MODULES: lm_head is not a linear layer"),
    ({"LORA_R": "16", "LORA_TARGET_MODULES": "embed_tokens"}, "embed_tokens is not a linear layer of the decoder"),
    ({"LORA_R": "16", "LORA_TARGET_MODULES": "all-linear,q_proj"}, "`all-linear` already takes every linear layer"),
    ({"LORA_DROPOUT": "1"}, "LORA_DROPOUT: Input should be less than 1"),
    ({"QLORA": "true"}, "QLORA=true trains adapters on a 4-bit base, but LORA_R=0"),
    ({"QLORA": "true", "LORA_R": "16", "TRAIN_MODE": "cpu"}, "QLORA=true needs a GPU (bitsandbytes' 4-bit kernels)"),
    ({"QLORA": "true", "LORA_R": "16", "TRAIN_MODE": "gpu", "WEIGHT_TRANSFER": "reload"}, "QLORA=true needs a GPU"),
    ({"QLORA": "true", "LORA_R": "16", "TRAIN_MODE": "colocate"}, "QLORA=true with TRAIN_MODE=colocate"),
    ({"QLORA": "true", "LORA_R": "16", "TRAIN_MODE": "gpu", "TRAINER_SHARDING": "fsdp"},
     "QLORA=true with TRAINER_SHARDING=fsdp"),
    ({"QLORA": "true", "LORA_R": "16", "TRAIN_MODE": "gpu", "ROLLOUTS": "async"}, "QLORA=true with ROLLOUTS=async"),
])
def test_lora_settings_that_cannot_work_stop_with_one_line(monkeypatch, env, expected):
    with pytest.raises(ConfigError) as info:
        load(monkeypatch, **env)
    message = str(info.value)
    assert expected in message and "\n" not in message, message
    assert "edit .env" in message or "Input should" in message


def test_lora_defaults_learning_rate_and_the_adapter_trl_gets(monkeypatch):
    from contract import lora_rules
    from trainer.modeling import lora

    full = load(monkeypatch, TRAIN_MODE="cpu")
    assert (full.lora, memory.method_of(full.lora).name, lora.peft_config(full)) == (None, "full", None)
    cfg = load(monkeypatch, TRAIN_MODE="cpu", LORA_R="8")
    assert memory.method_of(cfg.lora).name == "lora" and cfg.lora.alpha == 16
    assert cfg.effective_learning_rate == 2e-3 and cfg.resolved(GpuMode()).effective_learning_rate == 1e-4
    config = lora.peft_config(cfg)
    assert (config.r, config.lora_alpha, config.lora_dropout, config.target_modules) == (8, 16, 0.0, "all-linear")
    listed = lora.peft_config(load(monkeypatch, TRAIN_MODE="cpu", LORA_R="4", LORA_ALPHA="4",
                                   LORA_TARGET_MODULES=" q_proj , v_proj"))
    assert (listed.lora_alpha, sorted(listed.target_modules)) == (4, ["q_proj", "v_proj"])
    assert memory.method_of(load(monkeypatch, TRAIN_MODE="gpu", LORA_R="16", QLORA="true").lora).name == "qlora"
    assert [lora_rules.served_max_lora_rank(r) for r in (1, 4, 8, 9, 300, 512)] == [1, 8, 8, 16, 320, 512]


def test_qlora_on_auto_mode_is_refused_once_the_trainer_resolves_cpu(monkeypatch, tmp_path, capsys):
    from trainer import train

    monkeypatch.setattr(grpo_args, "resolve", lambda cfg: cfg.resolved(CpuMode()))
    assert train.main(["--lora-r", "8", "--qlora", "true", "--output-dir", str(tmp_path)]) == 2
    assert "QLORA=true needs a GPU" in capsys.readouterr().err
