"""`make nccl-check FULL=1`: do what training does against the running vllm service, stage by stage.

    python -m trainer.sync_check [--url http://vllm:8000] [--model NAME]

Runs in the trainer container (`tools/nccl_check.py --full` starts it there): vLLM healthy with
dev mode and NCCL weight transfer -> a GPU on both ends -> TRL's own
`VLLMClient.init_communicator()` (the rendezvous, under the watchdog) -> the model loaded as training
holds it (fp32 master weights, the run's LoRA/QLoRA) and pushed through training's own path
(trainer.gpu.push_path: TRL's `sync_weights` and iterator, the served-dtype cast) with the prefix-cache
reset that must succeed -> proof the weights land (trainer.gpu.weight_check:
perturbed weights change the served output and match the trainer's own forward, the originals pushed
back give the same greedy tokens and the trainer's logprobs). Prints one line per stage with its time,
and the push's bytes and bytes/s. Stops at the first failure with what to do; exit 0 all passed, 1 a
stage failed. With WEIGHT_TRANSFER=reload (server mode rehearsed on CPU) the same stages run with the
weights pushed by reload (trl_hooks.use_weight_reload) instead of NCCL, and no GPU stage.
"""

from __future__ import annotations

import argparse
import sys
import time
from typing import Callable

from contract.config import ConfigError, RunConfig
from contract.config import GpuMode, Rollouts, SyncRollouts
from trainer.gpu import weight_check
from trainer.gpu.nccl import prepare_rendezvous
from trainer.gpu.server import VLLMPreflightError, check_vllm_server, explain_init_failure, version_skew
from trainer.gpu.watchdog import rendezvous_diagnosis, watchdog


class StageFailed(RuntimeError):
    """A stage of the check failed; the message says why and what to do."""


def line(ok: bool, stage: str, detail: str, seconds: float | None = None) -> None:
    took = f" ({seconds:.2f}s)" if seconds is not None else ""
    print(f"  {'ok  ' if ok else 'FAIL'} {stage}: {detail}{took}", flush=True)


def timed(stage: str, fn: Callable[[], str]) -> None:
    """Run one stage; print its line; raise StageFailed (already printed) on failure."""
    start = time.perf_counter()
    try:
        detail = fn()
    except StageFailed as exc:
        line(False, stage, str(exc))
        raise
    except Exception as exc:  # noqa: BLE001 - any other failure of a stage: name it, stop
        line(False, stage, f"{type(exc).__name__}: {exc}")
        raise StageFailed(str(exc)) from exc
    line(True, stage, detail, time.perf_counter() - start)


def human_bytes(n: float) -> str:
    for unit in ("B", "KB", "MB", "GB"):
        if n < 1000:
            return f"{n:.1f} {unit}"
        n /= 1000
    return f"{n:.1f} TB"


def training_model(model_name: str, cfg: RunConfig | None, device: str):
    """The model as training holds it when it pushes (trainer.modeling.model.load_model: fp32 master weights, QLoRA's 4-bit
    base), wrapped in the run's LoRA adapter as TRL's GRPOTrainer wraps it (`get_peft_model(model,
    lora.peft_config(cfg))`, adapters back in fp32). `cfg` None: the settings in the environment (RunConfig.load)."""
    from trainer.modeling import lora
    from trainer.modeling.model import load_model

    cfg = cfg or RunConfig.load([])
    model = load_model(cfg, model_name)
    if not cfg.qlora:  # a 4-bit base is placed on the GPU by from_pretrained
        model = model.to(device)
    if lora.peft_config(cfg) is not None:
        from peft import get_peft_model

        model = get_peft_model(model, lora.peft_config(cfg))
        lora.keep_adapters_fp32(model)
    return model.eval()


def run(url: str, model_name: str, group_port: int, server_timeout_s: float, sync_timeout_s: float,
        reload_dir: str | None = None, rollouts: Rollouts = SyncRollouts(), cfg: RunConfig | None = None) -> int:
    """`reload_dir`: WEIGHT_TRANSFER=reload's folder (the CPU rehearsal); None: NCCL, as on a GPU host.
    `rollouts`: async checks the path ROLLOUTS=async trains with (AsyncTransfer: TRL's async WeightTransferClient,
    vLLM's own NCCL trainer engine, pause -> send -> resume) instead of the sync client's init_communicator.
    `cfg`: the run's settings (LORA_R, QLORA); the model is loaded and pushed as training does (trainer.gpu.push_path)."""
    state: dict = {}
    if rollouts.is_async and not reload_dir:
        return _run_async(url, model_name, group_port, server_timeout_s, sync_timeout_s)
    how = f"weights by reload from {reload_dir}" if reload_dir else f"rendezvous port {group_port}"
    print(f"nccl-check --full: {url}, model {model_name}, {how}", flush=True)

    def server() -> str:
        try:
            rep = check_vllm_server(url, timeout_s=server_timeout_s)
        except VLLMPreflightError as exc:
            raise StageFailed(str(exc)) from None
        state["report"] = rep
        return (f"healthy, dev mode on, NCCL weight transfer configured; serves {rep.model}, world size "
                f"{rep.world_size}, vllm {rep.vllm_version}, torch {rep.torch_version}")

    def server_gpu() -> str:  # the first GPU-only step
        rep = state["report"]
        if rep.server_has_cuda is False:
            raise StageFailed(explain_init_failure(None, "", rep))
        return "the server runs on CUDA"

    def trainer_side() -> str:
        import torch

        if not torch.cuda.is_available():
            raise StageFailed("this container has no CUDA device (torch sees none): the trainer pushes weights from "
                              "its GPU; run the check in the trainer service (`make nccl-check FULL=1`), with "
                              "TRAINER_GPU set in .env")
        try:
            import vllm
        except Exception as exc:  # noqa: BLE001
            raise StageFailed(f"vllm does not import here ({exc}); rebuild the trainer image (`make build`)") from None
        problems = version_skew(state["report"], getattr(vllm, "__version__", None), torch.__version__)
        if problems:
            raise StageFailed("; ".join(problems))
        return f"{torch.cuda.get_device_name(0)}, vllm {vllm.__version__}, torch {torch.__version__}"

    def rendezvous() -> str:
        from trl.generation.vllm_client import VLLMClient

        from trainer.gpu.trl_hooks import require_prefix_cache_reset

        require_prefix_cache_reset()  # as in training: vLLM's {"success": false} is an error, not ignored
        if reload_dir:  # the CPU rehearsal: TRL's client, its weight push replaced by a reload from reload_dir
            from trainer.gpu.trl_hooks import use_weight_reload

            use_weight_reload(reload_dir, sync_timeout_s)
            client = VLLMClient(base_url=url, connection_timeout=server_timeout_s)
            client.init_communicator()
            state["client"] = client
            return f"no NCCL group: each push writes {reload_dir}/model.safetensors and vLLM reloads it"

        host_ip = prepare_rendezvous(url)
        client = VLLMClient(base_url=url, group_port=group_port, connection_timeout=server_timeout_s)
        with watchdog(sync_timeout_s, lambda s: rendezvous_diagnosis(host_ip, group_port, s)):
            try:
                client.init_communicator(device=0)
            except NotImplementedError as exc:
                raise StageFailed(explain_init_failure(None, str(exc), state["report"])) from None
            except Exception as exc:  # noqa: BLE001 - trl raises bare Exception("Request failed: 500, ...")
                status = 500 if "Request failed: 500" in str(exc) else None
                raise StageFailed(explain_init_failure(status, str(exc), state["report"])) from None
        state["client"] = client
        return f"trainer (rank 0) listened on {host_ip}:{group_port}; {state['report'].world_size} vLLM worker(s) joined"

    def load_model() -> str:
        from transformers import AutoTokenizer

        from trainer.gpu import push_path

        # as training: fp32 masters (the rehearsal's trainer on the CPU), the run's LoRA/QLoRA, pushes cast to the
        # served dtype through TRL's own iterator and sync (push_path), the prefix-cache reset checked
        model = state["model"] = training_model(model_name, cfg, "cpu" if reload_dir else "cuda")
        state["gen"] = gen = push_path.generation(model, state["report"].dtype, qlora=bool(cfg and cfg.qlora),
                                                  client=state["client"])
        state["prompt_ids"] = AutoTokenizer.from_pretrained(model_name)(weight_check.PROBE_TEXT)["input_ids"]
        state["bytes"] = sum(t.numel() * t.element_size() for _, t in gen._iter_named_params())
        trainable = "LoRA adapter, " if hasattr(model, "peft_config") else ""
        return (f"{sum(p.numel() for p in model.parameters()) / 1e6:.0f}M parameters ({trainable}"
                f"{next(model.parameters()).dtype} master weights), {human_bytes(state['bytes'])} per push in "
                f"{state['report'].dtype or 'the trainer dtype'}")

    def push() -> str:
        import torch

        start = time.perf_counter()
        with watchdog(sync_timeout_s, lambda s: rendezvous_diagnosis(None, group_port, s, what="weight sync")):
            state["gen"].sync_weights()  # training's push: metadata, stream, checked prefix-cache reset
            if torch.cuda.is_available():
                torch.cuda.synchronize()
        seconds = time.perf_counter() - start
        return (f"pushed {human_bytes(state['bytes'])} in {seconds:.2f}s = "
                f"{human_bytes(state['bytes'] / max(seconds, 1e-9))}/s; prefix cache reset")

    def weights_land() -> str:
        import requests

        client, model, ids = state["client"], state["model"], state["prompt_ids"]
        session = requests.Session()
        served_name = state["report"].model or model_name
        with watchdog(sync_timeout_s * 3, lambda s: rendezvous_diagnosis(None, group_port, s, what="weight sync")):
            try:
                figures = weight_check.check_weights_land(
                    model, ids, push=state["gen"].sync_weights,
                    reset=client.reset_prefix_cache,
                    ask=lambda: weight_check.query(session, url, served_name, ids),
                    say=lambda text: print(f"       {text}", flush=True))
            except weight_check.WeightCheckFailed as exc:
                raise StageFailed(str(exc)) from None
        return (f"perturbed weights changed the output ({figures['perturbed_moved']}) and matched the trainer's; "
                f"the originals pushed back match the trainer's own logprobs ({figures['restored_vs_trainer']}) "
                f"with the same {len(figures['tokens'])} greedy tokens")

    stages = [("vLLM server", server), ("server GPU", server_gpu), ("trainer GPU", trainer_side),
              ("rendezvous", rendezvous), ("model", load_model), ("weight push", push), ("weights land", weights_land)]
    if reload_dir:  # the rehearsal has no GPU on either side
        stages = [stage for stage in stages if stage[0] not in ("server GPU", "trainer GPU")]
    try:
        for name, fn in stages:
            timed(name, fn)
    except StageFailed:
        print("nccl-check --full: FAILED (first failing stage above)", flush=True)
        return 1
    finally:
        client = state.get("client")
        if client is not None:
            client.close_communicator()
    print("nccl-check --full: OK: rendezvous, weight push, prefix-cache reset work as in training, and the pushed "
          "weights land in every layer", flush=True)
    return 0


class AsyncTransfer:
    """ROLLOUTS=async's weight path as training drives it (PINNED: TRL 1.16's AsyncGRPOTrainer builds
    `WeightTransferClient(vllm_client, weight_update_info=<manifest of _iter_vllm_named_params>)`, the stack casts
    manifest and stream to the served dtype (trl_hooks.async_nccl_push), `_sync_weight_merged` pauses, sends
    `_streaming_iter()` and resumes); trainer.gpu.push_path gives the same objects, so `make nccl-check FULL=1`
    covers it."""

    def __init__(self, url: str, model, server_timeout_s: float, sync_timeout_s: float,
                 served_dtype: str | None = None) -> None:
        from accelerate.state import PartialState
        from trl.experimental.async_grpo.vllm_client import VLLMClient
        from trl.experimental.async_grpo.weight_transfer import WeightTransferClient

        from trainer.gpu import push_path
        from trainer.gpu.trl_hooks import async_nccl_push

        PartialState()  # TRL's async client logs through accelerate, which refuses to before this exists
        self.model, self.url = model, url
        self.client = WeightTransferClient(VLLMClient(url, server_timeout_s),
                                           weight_update_info=push_path.async_manifest(model),
                                           weight_sync_timeout=int(sync_timeout_s))
        async_nccl_push(self.client, served_dtype)  # as StackAsyncGRPOTrainer.__init__ does
        self.paused_s = 0.0

    def push(self) -> None:
        from trainer.gpu import push_path

        self.client.pause()
        paused = time.perf_counter()
        try:
            self.client.send_weights(push_path.async_stream(self.model))
        finally:
            self.client.resume()
            self.paused_s = time.perf_counter() - paused

    def reset_prefix_cache(self) -> None:
        """Nothing of its own: each push resets the cache (trl_hooks.reset_after_async_push), as training's does, so the
        check is no greener than training."""


def _run_async(url: str, model_name: str, group_port: int, server_timeout_s: float, sync_timeout_s: float) -> int:
    """The async path's stages: the same server, GPU, model and weights-land checks around TRL's async transfer."""
    from trainer.gpu.nccl import pin_async_rendezvous_port

    state: dict = {}
    print(f"nccl-check --full (ROLLOUTS=async): {url}, model {model_name}, rendezvous port {group_port}", flush=True)

    def server() -> str:
        try:
            state["report"] = rep = check_vllm_server(url, timeout_s=server_timeout_s)
        except VLLMPreflightError as exc:
            raise StageFailed(str(exc)) from None
        return f"healthy, dev mode on, NCCL weight transfer configured; serves {rep.model}, world size {rep.world_size}"

    def server_gpu() -> str:  # the first GPU-only step: stop before any NCCL call could hang
        if state["report"].server_has_cuda is False:
            raise StageFailed(explain_init_failure(None, "", state["report"]))
        return "the server runs on CUDA"

    def load_model() -> str:
        import torch
        from transformers import AutoTokenizer

        if not torch.cuda.is_available():
            raise StageFailed("this container has no CUDA device: run the check in the trainer service "
                              "(`make nccl-check FULL=1`), with TRAINER_GPU set in .env")
        # async NCCL pushes full weights (LORA_R's async sync sends the adapter by path instead): fp32 masters
        full = RunConfig.load([]).model_copy(update={"lora_r": 0, "qlora": False})
        state["model"] = training_model(model_name, full, "cuda")
        state["prompt_ids"] = AutoTokenizer.from_pretrained(model_name)(weight_check.PROBE_TEXT)["input_ids"]
        state["bytes"] = sum(p.numel() * p.element_size() for p in state["model"].parameters())
        return f"{human_bytes(state['bytes'])} on {torch.cuda.get_device_name(0)}"

    def rendezvous() -> str:
        host_ip = prepare_rendezvous(url)
        port = pin_async_rendezvous_port(group_port)
        state["transfer"] = AsyncTransfer(url, state["model"], server_timeout_s, sync_timeout_s,
                                          state["report"].dtype)
        with watchdog(sync_timeout_s, lambda s: rendezvous_diagnosis(host_ip, port, s)):
            state["transfer"].client.init_weight_transfer()
        return f"trainer (rank 0) listened on {host_ip}:{port} or the next free port; vLLM's NCCL engine joined"

    def push() -> str:
        import torch

        start = time.perf_counter()
        with watchdog(sync_timeout_s, lambda s: rendezvous_diagnosis(None, group_port, s, what="weight sync")):
            state["transfer"].push()
            torch.cuda.synchronize()
        seconds = time.perf_counter() - start
        return (f"pause -> {human_bytes(state['bytes'])} sent -> resume in {seconds:.2f}s "
                f"({human_bytes(state['bytes'] / max(seconds, 1e-9))}/s); vLLM paused {state['transfer'].paused_s:.2f}s")

    def weights_land() -> str:
        import requests

        transfer, ids = state["transfer"], state["prompt_ids"]
        session = requests.Session()
        served_name = state["report"].model or model_name
        try:
            figures = weight_check.check_weights_land(
                state["model"], ids, push=transfer.push, reset=transfer.reset_prefix_cache,
                ask=lambda: weight_check.query(session, url, served_name, ids),
                say=lambda text: print(f"       {text}", flush=True))
        except weight_check.WeightCheckFailed as exc:
            raise StageFailed(str(exc)) from None
        return (f"perturbed weights changed the output ({figures['perturbed_moved']}); the originals pushed back "
                f"match the trainer's logprobs ({figures['restored_vs_trainer']})")

    try:
        for name, fn in [("vLLM server", server), ("server GPU", server_gpu), ("model", load_model),
                         ("rendezvous (async)", rendezvous),
                         ("weight push (async)", push), ("weights land", weights_land)]:
            timed(name, fn)
    except StageFailed:
        print("nccl-check --full: FAILED (first failing stage above)", flush=True)
        return 1
    finally:
        if state.get("transfer") is not None:
            state["transfer"].client.destroy()
    print("nccl-check --full: OK: ROLLOUTS=async's rendezvous, pause/send/resume and the pushed weights work as in "
          "training", flush=True)
    return 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m trainer.sync_check", description=__doc__.splitlines()[0])
    parser.add_argument("--url", help="vLLM server (default: VLLM_SERVER_URL)")
    parser.add_argument("--model", help="model whose weights are pushed (default: MODEL_NAME)")
    args = parser.parse_args(argv)
    try:
        cfg = RunConfig.load([])
    except ConfigError as exc:
        print(f"config error:\n{exc}", file=sys.stderr)
        return 2
    cfg = cfg.resolved(GpuMode())  # the check of server mode's push, whatever TRAIN_MODE says
    return run(args.url or cfg.vllm_server_url, args.model or cfg.model_path, cfg.vllm_group_port,
               cfg.vllm_server_timeout_s, cfg.weight_sync_timeout_s,
               reload_dir=cfg.placement.reload_dir,
               rollouts=cfg.rollouts, cfg=cfg)


if __name__ == "__main__":
    raise SystemExit(main())
