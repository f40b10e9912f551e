"""make export (trainer.export) on a real 2-step CPU run's checkpoints: the folder holds the checkpoint's weights
tensor for tensor and nothing of the trainer's, loads and chats in transformers with the run's chat template, and
its card tells base model, envs, steps, reward start/end (as metrics.jsonl logged them), settings and eval table.
The Hub push: the no-token error, a refused connection, and the calls made (a test double for the network only).
Serving an export folder with `vllm serve`: tests/gpu_path/test_lora_twin.py (the merged export)."""

from __future__ import annotations

import json
import shutil
import subprocess

import pytest
import torch
from safetensors.torch import load_file

from tests.helpers import ROOT
from tests.trainer.conftest import free_port
from contract import eval_report
from trainer import train
from trainer.after import export
from trainer.run import run_info
from trainer.core.metrics import read_metrics

RUN = "exp"
TRAINER_FILES = {"optimizer.pt", "scheduler.pt", "rng_state.pth", "trainer_state.json", "training_args.bin"}


@pytest.fixture(scope="module")
def outputs(tmp_path_factory, tiny_model_dir, echo_server):
    out = tmp_path_factory.mktemp("export-run")
    argv = ["--train-mode", "cpu", "--model-name", str(tiny_model_dir), "--output-dir", str(out),
            "--env-urls", f"echo={echo_server.url}", "--run-name", RUN, "--max-steps", "2", "--save-steps", "1",
            "--per-device-train-batch-size", "4", "--num-generations", "4", "--max-completion-length", "48",
            "--trace-every", "0"]
    assert train.main(argv) == 0
    return out


@pytest.fixture(scope="module")
def exported(outputs, tmp_path_factory):
    evaluation = {"run": RUN, "checkpoint": "checkpoint-2", "step": 2, "base_model": "tiny", "threshold": 0.5,
                  "episodes_per_env": 4, "ks": [1, 2], "seeds": {"echo": [0, 1, 2, 3]},
                  "rows": [{"model": m, "env": "echo", "episodes": 4, "mean_reward": r, "success_rate": r,
                            "pass_at_k": {"1": r, "2": r}, "tool_calls_per_episode": 1.0,
                            "tool_failures_per_episode": 0.0, "tokens_per_episode": 20.0}
                           for m, r in (("base", 0.25), ("trained", 0.75))]}
    eval_report.write(outputs / RUN, evaluation)
    folder = tmp_path_factory.mktemp("exports") / RUN
    assert export.main(["--outputs", str(outputs), "--run", RUN, "--out", str(folder)]) == 0
    return folder


def tensors(folder):
    return {k: v for f in sorted(folder.glob("*.safetensors")) for k, v in load_file(f).items()}


def test_the_folder_is_the_last_checkpoints_model_and_nothing_of_the_trainers(outputs, exported):
    names = {p.name for p in exported.iterdir()}
    assert {"config.json", "generation_config.json", "model.safetensors", "tokenizer.json", "tokenizer_config.json",
            "chat_template.jinja", "README.md"} <= names
    assert not names & TRAINER_FILES
    assert TRAINER_FILES <= {p.name for p in (outputs / RUN / "checkpoint-2").iterdir()}  # they were there to leave
    # the trainer leaves its checkpoints readable to others (make export runs as the host user, not the trainer's uid)
    assert all(p.stat().st_mode & 0o004 for p in (outputs / RUN / "checkpoint-2").iterdir())
    ours, ckpt = tensors(exported), tensors(outputs / RUN / "checkpoint-2")
    assert ours.keys() == ckpt.keys()
    assert all(torch.equal(ours[k], ckpt[k]) for k in ckpt)
    assert not all(torch.equal(ours[k], tensors(outputs / RUN / "checkpoint-1")[k]) for k in ckpt)  # trained on
    assert json.loads((exported / "config.json").read_text())["use_cache"] is True  # off while training


def test_fp32_master_weights_go_out_in_the_base_models_published_dtype(outputs, tmp_path):
    """Training keeps fp32 master weights, so a bf16 base's checkpoints are fp32; run.json records the published
    dtype (the tiny CPU model is fp32: copied byte for byte above) and the export casts back to it."""
    assert run_info.read(outputs / RUN)["base_dtype"] == "float32"
    ckpt = outputs / RUN / "checkpoint-2"
    export.write_model(ckpt, tmp_path, "bfloat16")
    ours, master = tensors(tmp_path), tensors(ckpt)
    assert ours.keys() == master.keys()
    assert all(ours[k].dtype == torch.bfloat16 and torch.equal(ours[k], master[k].to(torch.bfloat16)) for k in master)
    assert json.loads((tmp_path / "config.json").read_text())["dtype"] == "bfloat16"


def test_it_loads_and_chats_in_transformers_with_the_runs_template(exported, tiny_model_dir, outputs):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(exported)
    assert tokenizer.chat_template == AutoTokenizer.from_pretrained(tiny_model_dir).chat_template
    model = AutoModelForCausalLM.from_pretrained(exported)
    messages = [{"role": "user", "content": "Echo the word: hello"}]
    ids = tokenizer.apply_chat_template(messages, add_generation_prompt=True, return_tensors="pt", return_dict=True)
    new = model.generate(**ids, max_new_tokens=4, do_sample=False)[0, ids["input_ids"].shape[1]:]
    assert 1 <= len(new) <= 4
    trained = AutoModelForCausalLM.from_pretrained(outputs / RUN / "checkpoint-2")
    assert torch.equal(new, trained.generate(**ids, max_new_tokens=4, do_sample=False)[0, ids["input_ids"].shape[1]:])


def test_the_card_tells_base_model_envs_steps_reward_settings_and_eval(exported, outputs, tiny_model_dir):
    card = (exported / "README.md").read_text()
    rows = read_metrics(outputs / RUN)
    assert [r["step"] for r in rows] == [1, 2]
    assert f"**Base model**: `{tiny_model_dir}`" in card
    assert "**Environments**: `echo`" in card and "- echo\n" in card  # in the text and the card's tags
    assert "**Steps**: 2 optimizer steps" in card
    start, end = rows[0]["reward"], rows[-1]["reward"]
    assert f"| reward | {start:.3f} (step 1) | {end:.3f} (step 2) |" in card
    assert "| num_generations | 4 |" in card and "| max_completion_length | 48 |" in card
    assert eval_report.markdown_table(eval_report.read(outputs / RUN)) in card
    assert "Measured on" not in card  # eval.json is of the exported checkpoint
    info = run_info.read(outputs / RUN)  # what the card read: the run's own record, no addresses in it
    assert info["envs"] == ["echo"] and info["settings"]["num_generations"] == 4 and "env_urls" not in info["settings"]


def test_a_named_checkpoint_and_an_earlier_export_replaced(outputs, exported):
    assert export.main(["--outputs", str(outputs), "--run", RUN, "--checkpoint", "1", "--out", str(exported)]) == 0
    ckpt = tensors(outputs / RUN / "checkpoint-1")
    assert all(torch.equal(tensors(exported)[k], ckpt[k]) for k in ckpt)
    card = (exported / "README.md").read_text()
    assert "**Steps**: 1 optimizer steps" in card and "exported checkpoint-1" in card  # eval.json is of step 2
    first = read_metrics(outputs / RUN)[0]["reward"]
    assert f"| reward | {first:.3f} (step 1) | {first:.3f} (step 1) |" in card
    assert export.main(["--outputs", str(outputs), "--run", RUN, "--out", str(exported)]) == 0  # back to the last
    assert not list(exported.parent.glob(f".{RUN}.*"))  # no partial or old folder left next to it


def one_line_error(capsys) -> str:
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1, err
    return err


def test_bad_run_or_checkpoint_is_a_one_line_error(outputs, tmp_path, capsys):
    copy = tmp_path / "outputs"
    shutil.copytree(outputs, copy)
    out = ["--out", str(tmp_path / "x")]
    assert export.main(["--outputs", str(copy), "--run", "nope", *out]) == 1
    assert f"no run 'nope' under {copy}; runs there: {RUN}" in one_line_error(capsys)
    assert export.main(["--outputs", str(copy), "--run", RUN, "--checkpoint", "7", *out]) == 1
    assert "has no checkpoint-7 (checkpoints there: checkpoint-1, checkpoint-2)" in one_line_error(capsys)
    (copy / RUN / "checkpoint-2" / "trainer_state.json").unlink()  # as a kill mid-save leaves it
    assert export.main(["--outputs", str(copy), "--run", RUN, "--checkpoint", "checkpoint-2", *out]) == 1
    assert "checkpoint-2 of run exp is incomplete" in one_line_error(capsys)
    assert export.main(["--outputs", str(copy), "--run", RUN, *out]) == 0  # the default skips it
    assert "exp/checkpoint-1 (step 1)" in capsys.readouterr().out
    for ckpt in ("checkpoint-1", "checkpoint-2"):
        shutil.rmtree(copy / RUN / ckpt)
    assert export.main(["--outputs", str(copy), "--run", RUN, *out]) == 1
    assert "run exp has no complete checkpoint yet (checkpoints there: none)" in one_line_error(capsys)


def test_export_adapter_of_a_full_fine_tune_is_a_one_line_error(outputs, tmp_path, capsys):
    assert export.main(["--outputs", str(outputs), "--run", RUN, "--out", str(tmp_path / "x"), "--adapter"]) == 1
    assert "EXPORT_ADAPTER=1: checkpoint-2 holds full weights, not an adapter" in one_line_error(capsys)
    assert not (tmp_path / "x").exists()


def test_it_never_replaces_a_folder_that_is_no_export(outputs, tmp_path, capsys):
    (tmp_path / "mine").mkdir()
    (tmp_path / "mine" / "notes.txt").write_text("keep me")
    assert export.main(["--outputs", str(outputs), "--run", RUN, "--out", str(tmp_path / "mine")]) == 1
    assert "exists and is not an earlier export" in one_line_error(capsys)
    assert (tmp_path / "mine" / "notes.txt").read_text() == "keep me"


def test_push_without_a_token_says_where_to_put_one_before_any_work(outputs, tmp_path, capsys):
    empty = tmp_path / "hf_token"
    empty.write_text("\n")
    for token_file in (empty, tmp_path / "absent"):
        assert export.main(["--outputs", str(outputs), "--run", RUN, "--out", str(tmp_path / "x"),
                            "--push", "org/name", "--token-file", str(token_file)]) == 1
        assert "no Hugging Face token to push with" in one_line_error(capsys)
    assert not (tmp_path / "x").exists()


class HubDouble:
    """Test double of huggingface_hub.HfApi for the network step only: records the calls."""
    calls: list = []

    def __init__(self, token=None):
        HubDouble.calls.append(("token", token))

    def create_repo(self, repo_id, **kwargs):
        HubDouble.calls.append(("create_repo", repo_id, kwargs))
        return f"https://huggingface.co/{repo_id}"

    def upload_folder(self, **kwargs):
        HubDouble.calls.append(("upload_folder", kwargs))


def test_push_creates_a_private_repo_and_uploads_the_folder(outputs, tmp_path, monkeypatch, capsys):
    import huggingface_hub

    monkeypatch.setattr(huggingface_hub, "HfApi", HubDouble)
    HubDouble.calls = []
    token = tmp_path / "hf_token"
    token.write_text("hf_secret\n")
    folder = tmp_path / "out"
    assert export.main(["--outputs", str(outputs), "--run", RUN, "--out", str(folder), "--push", "org/tiny-echo",
                        "--token-file", str(token)]) == 0
    assert HubDouble.calls == [
        ("token", "hf_secret"),
        ("create_repo", "org/tiny-echo", {"repo_type": "model", "private": True, "exist_ok": True}),
        ("upload_folder", {"folder_path": str(folder), "repo_id": "org/tiny-echo", "repo_type": "model",
                           "commit_message": f"Export {folder.name} (trainer.export)"})]
    assert "pushed to https://huggingface.co/org/tiny-echo" in capsys.readouterr().out
    assert 'from_pretrained("org/tiny-echo")' in (folder / "README.md").read_text()
    assert export.main(["--outputs", str(outputs), "--run", RUN, "--out", str(folder), "--push", "org/../x",
                        "--token-file", str(token)]) == 1
    assert "PUSH='org/../x' is not a Hub repo id" in one_line_error(capsys)


def test_a_failed_push_is_one_line_and_keeps_the_folder(outputs, tmp_path, monkeypatch, capsys):
    """The real HfApi against an endpoint that refuses the connection (no Hub here)."""
    import huggingface_hub.constants

    monkeypatch.setattr(huggingface_hub.constants, "ENDPOINT", f"http://127.0.0.1:{free_port()}")
    token = tmp_path / "hf_token"
    token.write_text("hf_secret\n")
    folder = tmp_path / "out"
    assert export.main(["--outputs", str(outputs), "--run", RUN, "--out", str(folder), "--push", "org/tiny-echo",
                        "--token-file", str(token)]) == 1
    err = one_line_error(capsys)
    assert "push to org/tiny-echo failed" in err and "hf_secret" not in err
    assert (folder / "model.safetensors").exists()


def test_the_export_service_mounts_the_exports_folder_and_the_token_as_a_secret():
    cfg = json.loads(subprocess.run(
        ["docker", "compose", "--env-file", str(ROOT / ".env.example"), "--profile", "export", "config",
         "--format", "json"], cwd=ROOT, capture_output=True, text=True, check=True).stdout)["services"]["export"]
    assert cfg["entrypoint"][:3] == ["python3", "-m", "trainer.export"]
    mounts = {m["target"]: m for m in cfg["volumes"]}
    assert mounts["/outputs"]["read_only"] is True and mounts["/outputs"]["type"] == "volume"
    assert mounts["/exports"]["source"] == str(ROOT / "exports") and not mounts["/exports"].get("read_only")
    assert [s["source"] for s in cfg["secrets"]] == ["hf_token"]
    # a LoRA run's base, read-only, where the trainer read it: the export merges the adapter into it
    assert mounts["/models"]["read_only"] is True and mounts["/cache/huggingface"]["read_only"] is True
    assert not any("TOKEN" in k for k in cfg.get("environment") or {})
