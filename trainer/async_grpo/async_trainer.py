"""ROLLOUTS=async: TRL 1.16's `AsyncGRPOTrainer` against the stack's vllm service and env servers.

TRL's trainer, rollout worker (a spawned, CUDA-free child process that keeps generating while the trainer
trains) and protocols do the work; this module plugs the stack in where TRL leaves a seam:

- `build_async_config`: RunConfig -> `AsyncGRPOConfig` (the same knobs as the sync trainer's GRPOConfig).
- `ReloadWeightTransfer`: TRL's `WeightTransferProtocol` for WEIGHT_TRANSFER=reload (server mode rehearsed on
  CPU): pause vLLM as TRL does (`/pause?mode=keep`), write the weights and have vLLM reload them
  (trainer.gpu.trl_hooks.reload_weights, shared with the sync trainer), resume.
- `StackRolloutLoop`: TRL's rollout loop (`_AsyncRolloutLoop`, in the child) with TOOL_TIMEOUT_S,
  TOOL_CONCURRENCY and the neutral sampling penalties meaning what they mean in sync mode.
- `make_async_trainer_class`: a thin `AsyncGRPOTrainer` subclass that runs on CPU (no CUDA peak-FLOPs lookup),
  hands the rollout worker `StackRolloutLoop` and bounds the loss by OFF_POLICY_CORRECTION
  (trainer.async_grpo.off_policy_loss).
- WEIGHT_TRANSFER=nccl: TRL's own `WeightTransferClient`, its manifest and stream cast to vLLM's dtype together and
  each push marked in flight (trainer.gpu.trl_hooks.async_nccl_push), as the sync trainer's pushes are.
- LORA_R: TRL's own adapter-only sync (trainer/modeling/lora.py says how); no weight-transfer backend is passed then
  (TRL probes vLLM's /server_info only without one), whatever WEIGHT_TRANSFER says: the adapter goes by a shared
  folder and HTTP on a GPU host and in the rehearsal alike.

Everything the child gets is pickled: env factories (trainer.rollouts.envs_binding.EnvFactory), reward functions
(functools.partial, trainer.rollouts.rewards) and this module's classes, all module-level.
"""

from __future__ import annotations

import asyncio
import functools
import inspect
import logging
import os
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from typing import Any

from envs.core.tool import abandon_session
from trainer.gpu import trl_hooks
from trainer.async_grpo.admission import AdmittedRollouts
from trainer.async_grpo.async_budget import BudgetedRollouts, turn_cap
from trainer.async_grpo.async_run import AfterRun, TracedRollouts, drain_on_stop, stop_on_env_or_vllm_down
from trainer.async_grpo.off_policy_loss import OffPolicyLoss
from contract.config import RunConfig

logger = logging.getLogger("trainer.async")

# The TRL privates this module relies on (`_AsyncRolloutLoop` and its `_execute_tool_calls`, `_post`, `_tool_pool`;
# the worker's `_loop_cls` and `_loop_kwargs`; `check_health` wrapped: `_failed_event`,
# `_exception_info_queue`, `_process`; get_peak_flops_per_device;
# LORA_R: `_lora_sync` read, `_lora_dir` and `_lora_name` logged, `_sync_weight_lora` does the push) are pinned in
# trainer/core/trl_privates.py.


def build_async_config(cfg: RunConfig):
    """AsyncGRPOConfig with the sync trainer's settings (trainer.core.grpo_args.grpo_config) where both have them."""
    from trl.experimental.async_grpo import AsyncGRPOConfig

    kwargs: dict[str, Any] = dict(
        cfg.shared_trainer_kwargs(),
        # TRL's async default is constant (it may stop by epochs, an unknown step count); we always stop at
        # MAX_STEPS, so the sync trainer's linear decay applies here too.
        lr_scheduler_type="linear",
        vllm_server_base_url=cfg.vllm_server_url,
        vllm_server_timeout=float(cfg.vllm_server_timeout_s),
        request_timeout=int(cfg.generation_timeout_s),
        weight_sync_timeout=int(cfg.weight_sync_timeout_s),
        max_staleness=cfg.rollouts.max_staleness,
        token_budget=cfg.rollouts.token_budget,  # ASYNC_STEP_SAMPLES: packed (None: max_model_len) or batch (0)
        max_inflight_tasks=cfg.rollouts.max_inflight_rollouts or -1,  # -1: TRL's default, as modes.AsyncRollouts.inflight
        # fp32 master weights, as the sync trainer keeps (trainer.modeling.model.load_model_and_tokenizer says why)
        dtype="float32",
        model_init_kwargs=cfg.model_load_kwargs or None,  # the pinned revision while MODEL_NAME is a hub id
    )
    if cfg.placement.trainer_on_cpu:  # the CPU rehearsal of server mode
        kwargs.update(use_cpu=True, bf16=False)
    else:
        import torch

        kwargs.update(bf16=bool(torch.cuda.is_available() and torch.cuda.is_bf16_supported()))
    from trainer.core.grpo_args import one_gpu_per_process

    return one_gpu_per_process(AsyncGRPOConfig(**kwargs))  # never nn.DataParallel around the packed tree batches


class ReloadWeightTransfer:
    """TRL's WeightTransferProtocol by reload (WEIGHT_TRANSFER=reload): no NCCL group; each sync pauses vLLM
    (`/pause?mode=keep`: in-flight requests freeze and continue after the resume, as with TRL's NCCL client),
    writes the weights to `folder` and has vLLM reload them, then resumes. Rank 0 only, as TRL calls it."""

    def __init__(self, base_url: str, folder: str, timeout_s: float, served_dtype: str | None = None) -> None:
        from trl.experimental.async_grpo.vllm_client import VLLMClient

        self.base_url, self.folder, self.timeout_s = base_url.rstrip("/"), folder, timeout_s
        self.served_dtype = served_dtype
        self.vllm = VLLMClient(self.base_url)
        self.pushes = 0
        self.paused_s: list[float] = []  # how long vLLM stood paused, per sync
        self._paused_at: float | None = None

    def init_weight_transfer(self) -> None:
        from contract import stages
        from trainer.gpu import push_state

        print(f"[weight-sync] WEIGHT_TRANSFER=reload (async): no NCCL group; each sync pauses vLLM, writes "
              f"{self.folder}/model.safetensors, has vLLM reload it and resumes", flush=True)
        stages.mark("rendezvous", 0.0, f"weight transfer by reload from {self.folder} (CPU rehearsal, no NCCL)")
        push_state.group_formed(f"reload from {self.folder}")

    def pause(self) -> None:
        self.vllm.pause(timeout=int(self.timeout_s))
        self._paused_at = time.monotonic()

    def send_weights(self, iterator: Iterator[tuple[str, Any]]) -> None:
        from trainer.gpu import push_state
        from trainer.gpu.trl_hooks import reload_weights, reset_after_async_push

        push_state.push_started(self.pushes)
        reload_weights(self.base_url, self.folder, self._cast(iterator), self.timeout_s)
        reset_after_async_push(self.base_url)  # still paused: no KV from the old weights served after resume
        push_state.push_done(self.pushes)
        self.pushes += 1

    def resume(self) -> None:
        self.vllm.resume(timeout=int(self.timeout_s))
        if self._paused_at is not None:
            self.paused_s.append(time.monotonic() - self._paused_at)
            self._paused_at = None

    def destroy(self) -> None:
        return None

    def _cast(self, iterator):
        """Each tensor in the dtype vLLM serves (the trainer keeps fp32 master weights; trl_hooks.push_in_served_dtype
        does the same for the sync trainer)."""
        from trainer.gpu.trl_hooks import in_dtype, served_torch_dtype

        return in_dtype(iterator, served_torch_dtype(self.served_dtype) if self.served_dtype else None)


def _rollout_loop_base():
    os.environ.setdefault("TRL_EXPERIMENTAL_SILENCE", "1")  # chosen on purpose (ROLLOUTS=async), said once in the log
    from trl.experimental.async_grpo.async_rollout_worker import _AsyncRolloutLoop

    return _AsyncRolloutLoop


class StackRolloutLoop(AdmittedRollouts, TracedRollouts, BudgetedRollouts, _rollout_loop_base()):  # admission outermost
    """TRL's rollout loop (it runs in the spawned child) with the sync trainer's meanings:

    - TOOL_TIMEOUT_S: a tool call that runs longer fails; the model reads the rollout loop's message
      (trainer.rollouts.rollout_loop.TIMEOUT_ERROR) and the rollout's env session is closed (envs.core.tool.abandon_session).
    - TOOL_CONCURRENCY: the most env calls (tools, resets, rewards) in flight at once, the size of TRL's thread
      pool for them (TRL's default: one per in-flight rollout).
    - vLLM's presence/frequency penalties sent as 0 (trainer.gpu.grpo_kwargs.NEUTRAL_SAMPLING), as the sync
      trainer sends them: the server's generation-config defaults would otherwise apply.
    - MAX_COMPLETION_LENGTH: a budget for the whole episode, tool results included, as in sync mode; a round that
      does not fit ends the episode (scored), and so does vLLM's 400 for the context length, never retried
      (trainer.async_grpo.async_budget.BudgetedRollouts).
    - ASYNC_ADMISSION: which episodes start, and the generated-vs-trained figures (trainer.async_grpo.admission).
    - `request_seeds=False` (the CPU rehearsal): no per-request `seed`. TRL seeds every request (so data-parallel
      engines do not draw alike); vLLM 0.31's CPU runner kills its engine on a seeded request
      (gpu_model_runner._bookkeeping_sync: "CPU Generator does not use offset"). The sync trainer sends none.
    """

    def __init__(self, *, tool_timeout_s: float | None = None, tool_concurrency: int | None = None,
                 request_seeds: bool = True, max_model_len: int | None = None, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.tool_timeout_s = tool_timeout_s
        self.request_seeds = request_seeds
        self.max_model_len = max_model_len  # the vLLM server's, as preflight read it (None: the 400 backstop only)
        if tool_concurrency:
            self._tool_pool.shutdown(wait=False)
            self._tool_pool = ThreadPoolExecutor(max_workers=tool_concurrency, thread_name_prefix="grpo-tool")

    async def _run_loops(self, stop_event: asyncio.Event) -> None:
        """TRL's loops, except that a stop ends the rollouts in flight at once. TRL's generate loop returns only once
        none is in flight, so at the end of every run it finished them all (the run is over: their samples are never
        trained) until TRL's `stop()` gave up after 15 s and terminated the process. Cancelled, TRL's loop cancels
        them itself (its `finally`), and `run` then closes their env sessions. Measured on `make rehearse` (2026-12-04):
        from the stop to the worker's exit 10-15 s before, 5 s after (0.01 s of it the loops, the rest the process's
        own exit: its queues flushed, drain_on_stop, and the interpreter's teardown)."""
        loops = asyncio.ensure_future(super()._run_loops(stop_event))
        stopped = asyncio.ensure_future(stop_event.wait())
        await asyncio.wait({loops, stopped}, return_when=asyncio.FIRST_COMPLETED)
        stopped.cancel()
        if not loops.done():
            loops.cancel()
        try:
            await loops
        except asyncio.CancelledError:
            if not stop_event.is_set():
                raise

    async def _execute_tool_calls(self, tool_calls, tool_dict):
        if self.tool_timeout_s is None:
            return await super()._execute_tool_calls(tool_calls, tool_dict)
        bounded = {name: self._bounded(tool) for name, tool in tool_dict.items()}
        return await super()._execute_tool_calls(tool_calls, bounded)

    def _bounded(self, tool):
        from trainer.rollouts.rollout_loop import TIMEOUT_ERROR

        seconds, pool = self.tool_timeout_s, self._tool_pool

        @functools.wraps(tool)
        async def call(**arguments):
            if inspect.iscoroutinefunction(tool):
                work = tool(**arguments)
            else:
                work = asyncio.get_running_loop().run_in_executor(pool, functools.partial(tool, **arguments))
            try:
                return await asyncio.wait_for(work, seconds)
            except (asyncio.TimeoutError, TimeoutError):
                abandon_session(getattr(tool, "__self__", None))  # the env whose call it was (envs.core.tool)
                raise RuntimeError(TIMEOUT_ERROR.format(name=tool.__name__, seconds=seconds)) from None

        return call

    async def _post(self, path: str, payload: dict, timeout: float, max_retries: int = 3) -> dict:
        if path != "/v1/completions":
            return await super()._post(path, payload, timeout, max_retries)
        from trainer.gpu.grpo_kwargs import NEUTRAL_SAMPLING

        payload = {**NEUTRAL_SAMPLING, **payload}
        if not self.request_seeds:
            payload.pop("seed", None)
        cap = turn_cap()  # this episode's budget left (trainer.async_grpo.async_budget)
        if cap is not None:
            payload["max_tokens"] = min(payload["max_tokens"], cap)
        return await self._retry(lambda: self._post_completion(payload, timeout), label=f"POST {path}",
                                 max_attempts=max_retries)


def _peak_flops_or_none(original):
    """TRL reads the device's peak FLOPs with torch.cuda.get_device_name, which raises on a CPU trainer (the
    rehearsal): MFU is then not reported; throughput and timings still are."""

    @functools.wraps(original)
    def peak_flops(accelerator, dtype):
        if getattr(accelerator.device, "type", None) != "cuda":
            return None
        return original(accelerator, dtype)

    return peak_flops


def make_async_trainer_class():
    from trl.experimental.async_grpo import AsyncGRPOTrainer
    from trl.experimental.async_grpo import async_grpo_trainer as trl_async

    class StackAsyncGRPOTrainer(AfterRun, OffPolicyLoss, AsyncGRPOTrainer):  # after-run hooks, then the loss's
        """TRL's AsyncGRPOTrainer; differs only where the stack needs it (module docstring)."""

        def __init__(self, *args, tool_timeout_s: float | None = None, tool_concurrency: int | None = None,
                     served_model: str | None = None, request_seeds: bool = True, zero_std_groups: str = "keep",
                     zero_std_resample_max: float = 1.0, admission: str = "free",
                     served_dtype: str | None = None, max_model_len: int | None = None, off_policy=None, **kwargs):
            original = trl_async.get_peak_flops_per_device
            trl_async.get_peak_flops_per_device = _peak_flops_or_none(original)
            try:
                super().__init__(*args, **kwargs)
            finally:
                trl_async.get_peak_flops_per_device = original
            if off_policy is not None:  # OFF_POLICY_CORRECTION (trainer.async_grpo.off_policy_loss)
                self.off_policy = off_policy
            if kwargs.get("peft_config") is not None:
                _check_adapter_sync(self)
            # TRL's NCCL client (rank 0): manifest and stream in vLLM's dtype, pushes marked (trl_hooks says why)
            trl_hooks.async_nccl_push(getattr(self, "weight_transfer", None), served_dtype)
            worker = self.rollout_worker
            if isinstance(worker, trl_async.AsyncRolloutWorker):  # rank 0: the worker is spawned at train begin
                worker._loop_cls = StackRolloutLoop
                # a dead env (exit 6) or vLLM (77): one line; no sample in GENERATION_TIMEOUT_S: never a silent wait
                stop_on_env_or_vllm_down(worker, self.args.vllm_server_base_url, float(self.args.request_timeout))
                drain_on_stop(worker)  # the worker exits at the run's end, not 15 s later
                step_samples = (self.args.per_device_train_batch_size * self.args.gradient_accumulation_steps
                                * self.accelerator.num_processes)  # one optimizer step's (as TRL counts it)
                worker._loop_kwargs.update(tool_timeout_s=tool_timeout_s, tool_concurrency=tool_concurrency,
                                           request_seeds=request_seeds, zero_std_groups=zero_std_groups,
                                           zero_std_resample_max=zero_std_resample_max, admission=admission,
                                           max_staleness=self.args.max_staleness, step_samples=step_samples,
                                           max_model_len=max_model_len)
                if served_model:  # TRL names the trainer's model path; vLLM answers 404 to any id it does not serve
                    worker._loop_kwargs["model_name"] = served_model

    return StackAsyncGRPOTrainer


def _check_adapter_sync(trainer) -> None:
    """LORA_R: TRL chose the adapter-only sync (every rank got rank 0's probe of vLLM), or the run stops here, before
    any step: its fallback would push merged weights over NCCL, which the vllm service was not started for."""
    from contract import stages

    if not getattr(trainer, "_lora_sync", False):
        raise RuntimeError(
            f"vLLM at {trainer.args.vllm_server_base_url} does not take LoRA adapters (started without --enable-lora, "
            "or a layout TRL's adapter sync refuses: see TRL's warning above); `make train` and `make rehearse` start "
            "it with the flags LORA_R needs (contract/lora_rules.py vllm_lora_flags): restart the vllm service")
    where = os.path.join(trainer._lora_dir, f"{trainer._lora_name}-v<N>")
    print(f"[weight-sync] LoRA adapter-only (async): no NCCL group, no base weight pushed; each sync pauses vLLM, "
          f"saves the adapter to {where}, loads it by /v1/load_lora_adapter and resumes; requests name "
          f"{trainer._lora_name}-v<N>", flush=True)
    if trainer.accelerator.is_main_process:
        _unload_earlier_adapters(trainer.args.vllm_server_base_url, f"{trainer._lora_name}-v")
        stages.mark("rendezvous", 0.0, f"async LoRA: adapters by /v1/load_lora_adapter from {trainer._lora_dir}")


def _unload_earlier_adapters(base_url: str, prefix: str) -> None:
    """Unload the policy adapters an earlier run left in the vllm service (it outlives runs): TRL numbers a fresh run's
    versions from v1 again, and vLLM refuses a name it already holds (HTTP 400: the run would stop at its second sync);
    they would also take --max-loras slots. A resumed run goes on numbering from its checkpoint, past them."""
    import requests

    models = requests.get(f"{base_url.rstrip('/')}/v1/models", timeout=60).json().get("data", [])
    earlier = [m["id"] for m in models if str(m.get("id", "")).startswith(prefix)]
    for name in earlier:
        requests.post(f"{base_url.rstrip('/')}/v1/unload_lora_adapter", json={"lora_name": name}, timeout=60)
    if earlier:
        print(f"[weight-sync] unloaded {len(earlier)} adapter(s) an earlier run left in vLLM: {', '.join(earlier)}",
              flush=True)


def build_trainer(cfg: RunConfig, *, tokenizer, dataset, factories, reward_funcs, callbacks,
                  served_dtype: str | None, served_model: str | None, server_max_model_len: int | None = None):
    """The async trainer for this run: tree attention installed first (TRL loads the model with it), the weight
    push by reload where WEIGHT_TRANSFER=reload (else TRL's own NCCL client)."""
    from trainer.async_grpo import tree_attention

    backend = tree_attention.install()
    print(f"[train] ROLLOUTS=async: TRL's AsyncGRPOTrainer, max staleness {cfg.rollouts.max_staleness}; tree attention "
          f"backend {backend}", flush=True)
    from trainer.modeling import lora

    peft = lora.peft_config(cfg)
    weight_transfer = None
    reload_dir = cfg.placement.reload_dir
    if reload_dir and peft is None:  # LORA_R: TRL's adapter sync, the same on GPU (module doc)
        weight_transfer = ReloadWeightTransfer(cfg.vllm_server_url, reload_dir,
                                               float(cfg.weight_sync_timeout_s), served_dtype)
    trainer_cls = make_async_trainer_class()
    return trainer_cls(
        model=cfg.model_path,
        reward_funcs=reward_funcs,
        args=build_async_config(cfg),
        train_dataset=dataset,
        processing_class=tokenizer,
        environment_factory=factories,
        callbacks=callbacks,
        weight_transfer=weight_transfer,
        peft_config=peft,
        tool_timeout_s=cfg.tool_timeout_s,
        tool_concurrency=cfg.tool_concurrency,
        served_model=served_model,
        served_dtype=served_dtype,
        request_seeds=not cfg.placement.trainer_on_cpu,  # the rehearsal's vLLM runs on CPU (StackRolloutLoop says why)
        zero_std_groups=cfg.zero_std_groups,
        zero_std_resample_max=cfg.zero_std_resample_max,
        admission=cfg.rollouts.async_admission,
        max_model_len=server_max_model_len,  # each turn's max_tokens stays within it (StackRolloutLoop)
        off_policy=cfg.off_policy(),
    )
