"""Every part of TRL the stack relies on beyond its documented API, pinned in one place.

The trainer subclasses TRL's trainers and rollout loop, overrides and calls their underscored methods, reads their
underscored attributes and replaces a few of TRL's functions in place. None of that is TRL's promise, so each such
use is one `Pin` below: what (owner and name), its kind, where the stack uses it and what to re-check when TRL
changes it. Where the stack copies or follows TRL's code, the pin carries the sha256 of that source as well.

  * `problems(groups)`: what no longer holds on the installed TRL (gone, another kind, other parameters); the
    trainer's preflight runs it for the run's trainer (trainer.run.preflight.check_trl) and stops with one line.
  * `digest_changes()`: the pinned sources that changed; tests/trainer/test_trl_privates.py checks both, so a TRL
    upgrade names everything to re-check.
  * `environment_pool(trainer)`: TRL's pool of env instances, the one reach into it.

Public members the stack replaces in place (`VLLMClient.generate`, `VLLMGeneration.sync_weights`, ...) are pinned
too: a change there breaks the stack the same way. Light at import (TRL is imported only by the checks).
"""

from __future__ import annotations

import hashlib
import importlib
import inspect
import os
import re
import textwrap
from dataclasses import dataclass
from functools import cache
from typing import Any

from contract.config import Rollouts

TRL_VERSION = "1.16.0"  # the release every pin below was read from (pyproject pins trl to it)

GRPO = "trl.trainer.grpo_trainer.GRPOTrainer"
VLLM_GENERATION = "trl.generation.vllm_generation.VLLMGeneration"
VLLM_CLIENT = "trl.generation.vllm_client.VLLMClient"
ASYNC = "trl.experimental.async_grpo"
ASYNC_LOOP = f"{ASYNC}.async_rollout_worker._AsyncRolloutLoop"
ASYNC_WORKER = f"{ASYNC}.async_rollout_worker.AsyncRolloutWorker"
ASYNC_TRAINER = f"{ASYNC}.async_grpo_trainer.AsyncGRPOTrainer"
ASYNC_TRANSFER = f"{ASYNC}.weight_transfer.WeightTransferClient"
KINDS = ("method", "coroutine", "attribute", "class", "function")


@dataclass(frozen=True)
class Pin:
    owner: str  # dotted path of the TRL class or module
    name: str
    kind: str  # KINDS: a method, an `async def` method, an attribute (of instances or the class), a class, a function
    where: str  # the stack's modules that use it
    why: str  # how they use it: what to re-check when it changes
    params: str | None = None  # methods and functions: the parameter names ("x=" where it has a default)
    digest: str | None = None  # sha256 of the dedented source, where the stack copies or follows TRL's code

    @property
    def dotted(self) -> str:
        return f"{self.owner}.{self.name}"

    @property
    def group(self) -> str:
        """"async" (ROLLOUTS=async: TRL's experimental async trainer), else "sync" (GRPOTrainer and vLLM glue)."""
        return "async" if self.owner.startswith(ASYNC) else "sync"


PINS: tuple[Pin, ...] = (
    # ------------------------------------------------------------------ GRPOTrainer (ROLLOUTS=sync, make eval)
    Pin(GRPO, "_tool_call_loop", "method", "trainer/rollouts/rollout_loop.py, bench/tool_rounds.py",
        "overridden by the stack's copy of the tool loop: port any change in messages, masks, counts, overlong "
        "rollback or the iteration limit (tests/trainer/test_rollout_loop.py compares both token for token)",
        "self, prompts, prompt_ids, completion_ids, completions, logprobs, images, multimodal_fields",
        "45b10ad512c52ceaa8f3a009ed4c2ded4ed03febb289889d529fafecb23363dd"),
    Pin(GRPO, "_generate_and_score_completions", "method",
        "trainer/rollouts/rollout_loop.py, trainer/run/grpo_trainer.py, trainer/run/held_out.py, bench/env_resets.py, "
        "trainer/rollouts/resample.py",
        "overridden (the batch's resets at once, timers, infra-ended rows out of the loss; ZERO_STD_GROUPS=resample "
        "calls it again on fresh prompts and swaps rows of its output: per-row tensors, prompts left-padded, the rest "
        "right-padded, num_items_in_batch) and called by make eval: "
        "the env pool drawing _reset_batch_at_once repeats (pool cursor per environment, factory call when a pool "
        "runs short) and the reset loop it feeds (reset(**row) on each env in batch order, `environment` dropped in "
        "multi-environment mode)",
        "self, inputs", "3d5cec813b83b3964b0aa9acdbb3f233f4e036ea1a2b0ac5aa521e23f321e7ef"),
    Pin(GRPO, "_generate_single_turn", "method", "trainer/run/grpo_trainer.py, trainer/rollouts/rollout_loop.py, bench/*",
        "overridden (generation timer) and called for each tool round with num_generations=1",
        "self, prompt_ids, images, multimodal_fields, num_generations, has_tool_images="),
    Pin(GRPO, "_calculate_rewards", "method", "trainer/run/grpo_trainer.py, trainer/rollouts/infra_failures.py",
        "overridden: rows of infra-ended episodes set to NaN (TRL's nan-aware baseline), traces written; reward "
        "functions get `completions`, each episode's messages (trainer/rollouts/rewards.py reads the last one)",
        "self, inputs, prompts, completions, completion_ids_list"),
    Pin(GRPO, "_get_per_token_logps_and_entropies", "method", "trainer/run/grpo_trainer.py",
        "replaced on the instance while compute_loss runs: its first call is the policy's forward, result[0] the "
        "per-token log-probs the off_policy/* figures read",
        "self, model, input_ids, attention_mask, logits_to_keep, batch_size=, compute_entropy=, compute_aux_loss=, "
        "pixel_values=, image_grid_thw=, num_images=, pixel_attention_mask=, spatial_shapes=, num_tiles=, "
        "image_sizes=, token_type_ids=, mm_token_type_ids=, image_position_ids="),
    Pin(GRPO, "_compute_loss", "method", "trainer/core/off_policy.py",
        "followed by sync_token_figures / sync_weight (OFF_POLICY_CORRECTION's figures in sync): the PPO coefficients "
        "against old_per_token_logps, `delta` on coef_1, the off-policy mask, vLLM's importance_sampling_ratio",
        "self, model, inputs", "16c4f3917b9fd26418d16176fd0aeb02ae30f3a41708061a5f8aa5bb74e25b26"),
    Pin(GRPO, "get_off_policy_mask", "method", "trainer/core/off_policy.py",
        "called: DeepSeek-V3.2's sequence mask TRL applies with off_policy_mask_threshold (B, 1), 1 = kept",
        "advantages, per_token_logps, sampling_per_token_logps, mask, off_policy_threshold",
        "ef5226a634f1cb50c69f077b8e47bf7ac63c353d34cd7203ea17be9f9d48f998"),
    Pin(GRPO, "_step", "attribute", "trainer/core/off_policy.py",
        "read in compute_loss: micro-steps so far (TRL adds one after each), so a micro-batch's lag behind its "
        "generation batch in optimizer steps is (_step % (steps_per_generation x num_iterations)) // accumulation"),
    Pin(GRPO, "_load_optimizer_and_scheduler", "method", "trainer/run/grpo_trainer.py",
        "overridden: several CPU ranks load the optimizer state on `cpu`, not `cpu:<rank>`", "self, checkpoint"),
    Pin(GRPO, "_generate", "method", "trainer/run/grpo_trainer.py, trainer/rollouts/rollout_loop.py",
        "overridden: each rollout's token count (result[1] = completion_ids, result[2] = tool_mask); calls "
        "_tool_call_loop with the arguments the loop's signature pins", "self, prompts"),
    Pin(GRPO, "_get_tool_suffix_ids", "method", "trainer/rollouts/rollout_loop.py",
        "called: the template's tool block after a round's tool messages", "self, tool_messages"),
    Pin(GRPO, "_is_vlm", "attribute", "trainer/rollouts/rollout_loop.py", "read: a vision model keeps TRL's own loop"),
    Pin(GRPO, "_tokenizer", "attribute", "trainer/rollouts/rollout_loop.py", "read: parse_response of each new turn"),
    Pin(GRPO, "_env_tools", "attribute", "trainer/rollouts/rollout_loop.py",
        "read: the tools each environment exposes ({name: [bound methods]})"),
    Pin(GRPO, "_batch_environments", "attribute", "trainer/rollouts/rollout_loop.py",
        "read: each rollout's environment name in this batch"),
    Pin(GRPO, "_environment_pool", "attribute", "trainer/core/trl_privates.py (environment_pool), trainer/rollouts/rollout_loop.py, "
        "trainer/after/evaluate.py, bench/tool_rounds.py",
        "read and grown: {environment name: [instances]}, the instances TRL draws in batch order"),
    Pin(GRPO, "_multi_environment", "attribute", "trainer/rollouts/rollout_loop.py",
        "read: a dict environment_factory (rows routed by their `environment` column)"),
    Pin(GRPO, "_sync_tool_dicts", "attribute", "trainer/rollouts/rollout_loop.py", "read: each rollout's sync tools by name"),
    Pin(GRPO, "_async_tool_dicts", "attribute", "trainer/rollouts/rollout_loop.py", "read: each rollout's async tools by name"),
    Pin(GRPO, "_metrics", "attribute", "trainer/run/grpo_trainer.py, trainer/rollouts/infra_failures.py, trainer/gpu/trl_hooks.py, "
        "trainer/rollouts/zero_variance.py, trainer/run/evaluation.py (the eval mode's cleared)",
        "appended to: {'train'|'eval': {key: [values]}}, which TRL's log() averages; the last frac_reward_zero_std "
        "value _generate_and_score_completions appended is replaced (zero_variance.log_share)"),
    # ------------------------------------------------------------------ vLLM generation and client (GPU paths)
    Pin(VLLM_GENERATION, "generate", "method", "trainer/rollouts/rollout_loop.py",
        "the generation collective the loop keeps in step (server: gather_object + slice by process_index * "
        "len(prompts); colocate TP: all_gather_object): re-check that equal prompt counts per rank suffice",
        "self, prompts, images, num_generations, profiler=",
        "50190d860bb1870bd877f77bb060d1fe09645d60d2225d81e78030b2ec824e64"),
    Pin(VLLM_GENERATION, "_iter_named_params", "method",
        "trainer/gpu/trl_hooks.py, trainer/modeling/lora.py, trainer/gpu/push_path.py, bench/lora_push.py",
        "replaced on the instance: the one iterator every push reads (cast to the served dtype; QLoRA's merged "
        "weights must equal it name for name: tests/trainer/test_lora.py)", "self",
        "e68f35cf66fe49f6f38d7b7084b66a9a76a0ace2bf1ad7e72836f6bc435bc7aa"),
    Pin(VLLM_GENERATION, "_fix_param_name_to_vllm", "method", "trainer/modeling/lora.py, bench/lora_push.py",
        "called: the vLLM parameter names merged_weights yields", "self, name, extra_prefixes=",
        "35e6cb36995b927d4177adea289e49a1526708ab5005b82e2d7e6a49508a5df5"),
    Pin(VLLM_GENERATION, "_dist", "attribute", "trainer/gpu/push_path.py, bench/lora_push.py",
        "set on a bare instance: the distributed backend _iter_named_params reads"),
    Pin(VLLM_GENERATION, "_weight_metadata", "attribute", "trainer/gpu/push_path.py",
        "set to None on a bare instance: sync_weights builds the server's manifest from the first pass"),
    Pin(VLLM_GENERATION, "enable_sleep_mode", "attribute", "trainer/gpu/push_path.py",
        "set on a bare instance: sync_weights reads it (colocate only)"),
    Pin(VLLM_GENERATION, "sync_weights", "method", "trainer/gpu/trl_hooks.py",
        "replaced on the instance: every weight sync timed and watched", "self"),
    Pin(VLLM_GENERATION, "llm", "attribute", "trainer/rollouts/rollout_loop.py, trainer/gpu/trl_hooks.py",
        "read (colocate): llm.llm_engine.model_config's max_model_len and dtype"),
    Pin(VLLM_CLIENT, "init_communicator", "method", "trainer/gpu/trl_hooks.py",
        "replaced: the NCCL rendezvous under a watchdog; WEIGHT_TRANSFER=reload's no-op", "self, device="),
    Pin(VLLM_CLIENT, "update_named_params", "method", "trainer/gpu/trl_hooks.py",
        "replaced for WEIGHT_TRANSFER=reload: weights written to a folder vLLM reloads",
        "self, metadata, named_params"),
    Pin(VLLM_CLIENT, "close_communicator", "method", "trainer/gpu/trl_hooks.py",
        "replaced for WEIGHT_TRANSFER=reload (no group to close)", "self"),
    Pin(VLLM_CLIENT, "reset_prefix_cache", "method", "trainer/gpu/trl_hooks.py",
        "replaced: vLLM's `success: false` becomes an error", "self"),
    Pin(VLLM_CLIENT, "generate", "method", "trainer/gpu/trl_hooks.py",
        "replaced: one generation request under the GENERATION_TIMEOUT_S watchdog",
        "self, prompts, features=, n=, repetition_penalty=, temperature=, top_p=, top_k=, min_p=, max_tokens=, "
        "logprobs=, structured_outputs_regex=, generation_kwargs="),
    # ------------------------------------------------------------------ AsyncGRPOTrainer (ROLLOUTS=async)
    Pin(f"{ASYNC}.async_rollout_worker", "_AsyncRolloutLoop", "class", "trainer/async_grpo/async_trainer.py, trainer/async_grpo/async_run.py",
        "subclassed: StackRolloutLoop and TracedRolloutLoop (the worker pickles the loop class by name)"),
    Pin(ASYNC_LOOP, "__init__", "method", "trainer/async_grpo/async_trainer.py",
        "`_tool_pool` (TOOL_CONCURRENCY resizes it) and the probe instance of each env factory",
        digest="69b0c04bd6725a1183b7c1b1fe6204422509c56b054d364f480ac6a8776daf29"),
    Pin(ASYNC_LOOP, "_execute_tool_calls", "coroutine", "trainer/async_grpo/async_trainer.py",
        "overridden: StackRolloutLoop wraps the tools it is handed (TOOL_TIMEOUT_S): still awaited when a coroutine "
        "function, an exception still becomes the model's {'error': ...}", "self, tool_calls, tool_dict",
        "89feb747a530221790466cfc758761ca210279e83ab19bfdc412016686165cf9"),
    Pin(ASYNC_LOOP, "_post", "coroutine", "trainer/async_grpo/async_trainer.py",
        "overridden: StackRolloutLoop._post adds the neutral penalties, drops the seed on the CPU twin, caps "
        "max_tokens by the episode budget and, for /v1/completions, does TRL's request itself "
        "(async_budget.BudgetedRollouts._post_completion) so a 400 for the context length is not retried",
        "self, path, payload, timeout, max_retries=",
        "d879b18016b977be20b1057c2023be613ee093caeeba2078f8ab0db004c1c73e"),
    Pin(ASYNC_LOOP, "_generate_one_turn", "coroutine", "trainer/async_grpo/async_trainer.py, trainer/async_grpo/async_budget.py",
        "called by BudgetedRollouts for each turn: the completion payload (`seed`, no presence/frequency penalty, "
        "max_tokens) StackRolloutLoop edits in _post; its vLLM call goes through _retry(_post), which lets "
        "ContextFull through",
        "self, prompt_ids", "cc52b73f459a70923cbc305102f559d33f1b67204e2c24924a7124c173b31d8b"),
    Pin(ASYNC_LOOP, "_generate_one", "coroutine", "trainer/async_grpo/async_run.py, trainer/async_grpo/async_budget.py, "
        "trainer/async_grpo/async_eval.py, trainer/async_grpo/admission.py",
        "copied by BudgetedRollouts with the episode budget (port any change); wrapped by TracedRollouts: returns "
        "the completion list first, the env is the tools' __self__",
        "self, prompt, tool_dict, tools, group_id=",
        "f80db0d978b44fb5fb313b1f5ab37d800474601e4cb656fe71b9d04ca37ff10b"),
    Pin(ASYNC_LOOP, "_push_rollout_metrics", "method", "trainer/async_grpo/async_budget.py",
        "called by the copied _generate_one, as TRL calls it",
        "self, turns, sequences, completion_ids, tally, loop_exhausted, duration_s"),
    Pin(f"{ASYNC}.async_rollout_worker", "_chain_to_sequences", "function", "trainer/async_grpo/async_budget.py",
        "called by the copied _generate_one: a conversation's turns to training rows", "turns, rollout_id, fork_threshold"),
    Pin(f"{ASYNC}.async_rollout_worker", "TurnRecord", "class", "trainer/async_grpo/async_budget.py",
        "built by the copied _generate_one: TurnRecord(prompt_ids, output_ids, output_log_probs)"),
    Pin(ASYNC_LOOP, "_fork_threshold_tokens", "attribute", "trainer/async_grpo/async_budget.py",
        "read by the copied _generate_one (and chat_template, chat_template_kwargs, tokenizer, "
        "max_tool_calling_iterations, which TRL assigns in __init__, pinned by its digest)"),
    Pin(ASYNC_LOOP, "_retry", "coroutine", "trainer/async_grpo/async_trainer.py",
        "called: retries aiohttp transport errors only (a 400 for the context length is ContextFull, passed through)",
        "self, coro_factory, label, max_attempts=",
        "25bc3ee3d0893d5f05a108059aba726b7d20b56c43f88441c7bbe087187ea5ae"),
    Pin(ASYNC_LOOP, "session", "attribute", "trainer/async_grpo/async_budget.py",
        "read: the aiohttp session _post_completion posts with (set by TRL's _run_loops)"),
    Pin(ASYNC_LOOP, "vllm_server_url", "attribute", "trainer/async_grpo/async_budget.py",
        "read: the vLLM base URL _post_completion posts to"),
    Pin(ASYNC_LOOP, "max_tokens", "attribute", "trainer/async_grpo/async_budget.py",
        "read: max_completion_length, TRL's per-turn cap, which BudgetedRollouts applies to the whole episode"),
    Pin(ASYNC_LOOP, "_score_group", "coroutine", "trainer/async_grpo/async_run.py, trainer/async_grpo/admission.py",
        "overridden: RolloutSamples whose `completion` is the group's list object; reward funcs get "
        "`**group.reward_kwargs` (TracedRollouts adds `environments`) and `completions`, each episode's messages "
        "(trainer/rollouts/rewards.py reads the last one), samples' `completion` is the group's list "
        "(infra_failures.leave_out_samples)", "self, group",
        "41085b660a42b4854930aae7aa0e8e5330d006b50567a11915c781f1fa12ef63"),
    Pin(ASYNC_LOOP, "run", "method", "trainer/async_grpo/async_run.py",
        "overridden (TracedRollouts.run closes the process's env sessions after it); the child puts (type name, "
        "str(e), traceback) before setting `_failed_event` (stop_on_env_or_vllm_down reads it)",
        digest="7680ad1113f78ef0a0e0ba608542be0c3f883677c467873cf0a71d67239e0d4b"),
    Pin(ASYNC_LOOP, "_generate_loop", "coroutine", "trainer/async_grpo/async_run.py, trainer/rollouts/envs_binding.py",
        "the rollout lifecycle the stack's async side assumes: an env drawn from `_environment_pool[name]` (factory "
        "when empty), `reset(**row)` (`environment` dropped in multi-env mode) with its observation appended to the "
        "prompt, `_generate_one(prompt, tool_dict=, tools=, group_id=)` with the env's bound methods as tools, "
        "`get_reward` before the env goes back to the pool, a group queued for `_score_group` once num_generations "
        "rollouts are in", "self, stop_event", "f2e8c6c7493e1a1d7512b7db87344e1f8d1ad310402b315eb3919fc3c551d482"),
    Pin(ASYNC_LOOP, "_run_loops", "coroutine", "trainer/async_grpo/async_trainer.py",
        "overridden (StackRolloutLoop): gathers the generate and score loops in an aiohttp session; cancelled on a stop, "
        "the generate loop's `finally` cancels the rollouts in flight", "self, stop_event",
        "896509bdc1abec4c01fbf25e5246938ec849378f2b31ccbc6e4b6f031470e019"),
    Pin(ASYNC_LOOP, "_repeat_iterator", "method", "envs/generic/task.py, trainer/rollouts/traces.py",
        "each dataset row yielded num_generations times in a row under one group id: a group shares its row's reset "
        "kwargs, so its `seed` (#43 item 1)", "self",
        "c199044c82c73dce8cdc1b7294599dcd616cf2f632042dbc1280151a0c41a7e4"),
    Pin(ASYNC_LOOP, "_push_metrics", "method", "trainer/async_grpo/async_run.py",
        "called: floats and (numerator, denominator) rates to the trainer's log()", "self, values"),
    Pin(ASYNC_LOOP, "_rates", "attribute", "trainer/async_grpo/admission.py, trainer/async_grpo/async_run.py",
        "added to: (numerator, denominator) rates, sent with the next _push_metrics (async/generated_*, "
        "async/admission_wait_s, zero_std/extra_generation)"),
    Pin(ASYNC_LOOP, "rollout_buffer", "attribute", "trainer/async_grpo/admission.py",
        "its qsize() read: rows queued and not yet taken by the trainer (ASYNC_ADMISSION=bounded's ledger)"),
    Pin(ASYNC_LOOP, "model_version", "attribute", "trainer/async_grpo/admission.py",
        "read: the trainer's policy version (the shared mp.Value); RolloutGroup.model_version is set again by "
        "AdmittedRollouts before TRL's _score_group stamps it on the samples"),
    Pin(ASYNC_LOOP, "_tool_pool", "attribute", "trainer/async_grpo/async_trainer.py, trainer/async_grpo/async_eval.py",
        "replaced: the thread pool for env calls, sized by TOOL_CONCURRENCY; the evaluation's resets and rewards run in it"),
    # EVAL_EVERY with ROLLOUTS=async (trainer/async_grpo/async_eval.py): a greedy copy of the worker's loop in the
    # trainer's process plays each held-out row as _generate_loop plays a rollout
    Pin(ASYNC_LOOP, "_loop", "attribute", "trainer/async_grpo/async_eval.py",
        "run: the loop's own asyncio event loop (made in __init__), which the evaluation runs its episodes on"),
    Pin(ASYNC_LOOP, "_env_tools", "attribute", "trainer/async_grpo/async_eval.py",
        "read: {env name (None for one env): the tools shown with that env's rows}, as _generate_loop passes them"),
    Pin(ASYNC_LOOP, "_standalone_tools", "attribute", "trainer/async_grpo/async_eval.py",
        "read: tools outside any env, added to each rollout's tool dict as _generate_loop adds them"),
    Pin(ASYNC_WORKER, "_model_version_value", "attribute", "trainer/run/evaluation.py",
        "shared with the evaluation's loop: the policy version its requests name (a LoRA adapter's -v<N>)"),
    Pin(ASYNC_WORKER, "start", "method", "trainer/async_grpo/async_trainer.py, trainer/async_grpo/async_run.py",
        "spawns `self._loop_cls(**self._loop_kwargs)`: the per-instance loop class and kwargs the stack sets", "self",
        "e18c56d86e4e0bf4ed77c7a551a731b5a70406421be38991c1ab203a9e414f10"),
    Pin(ASYNC_WORKER, "check_health", "method", "trainer/async_grpo/async_run.py",
        "wrapped (stop_on_env_or_vllm_down): an EnvDown in the worker stops the trainer with exit 6; a worker that died "
        "silently is noticed at once", digest="0161c9f376e7bbf8fb976c65d1fe66908a0c2faecbbff97c2b0d534bcad3cdae"),
    Pin(ASYNC_WORKER, "stop", "method", "trainer/async_grpo/async_run.py",
        "wrapped (drain_on_stop): sets the stop event and joins the process for 15 s, then terminates it; the wrapper "
        "reads `rollout_buffer` and `metrics_queue` meanwhile so the process can exit by itself", "self",
        "4b77a5109822655d09a28ca22bbf49255987ec6c78588183cc21684bb75b9b7e"),
    Pin(ASYNC_WORKER, "rollout_buffer", "attribute", "trainer/async_grpo/async_run.py",
        "read while the worker stops (drain_on_stop): the samples queue the child puts into"),
    Pin(ASYNC_WORKER, "metrics_queue", "attribute", "trainer/async_grpo/async_run.py",
        "read while the worker stops (drain_on_stop): the child's metrics queue"),
    Pin(ASYNC_WORKER, "_failed_event", "attribute", "trainer/async_grpo/async_run.py",
        "read: set by the child when its loop raised (stop_on_env_or_vllm_down)"),
    Pin(ASYNC_WORKER, "_exception_info_queue", "attribute", "trainer/async_grpo/async_run.py",
        "read and put back: (type name, message, traceback) of the child's failure, which TRL's check chains"),
    Pin(ASYNC_WORKER, "_process", "attribute", "trainer/async_grpo/async_run.py",
        "read: the spawned worker process, whose silent death is noticed without TRL's heartbeat"),
    Pin(ASYNC_WORKER, "_loop_cls", "attribute", "trainer/async_grpo/async_trainer.py, trainer/async_grpo/async_run.py, "
        "trainer/run/evaluation.py", "set: the loop class the spawned worker runs (read: the evaluation's copy)"),
    Pin(ASYNC_WORKER, "_loop_kwargs", "attribute", "trainer/async_grpo/async_trainer.py, trainer/async_grpo/async_run.py, "
        "trainer/run/evaluation.py", "updated: TOOL_TIMEOUT_S, TOOL_CONCURRENCY, request seeds, the served model id, "
        "max_model_len, trace settings (read: the evaluation's copy of the loop is made from them)"),
    Pin(f"{ASYNC}.async_grpo_trainer", "get_peak_flops_per_device", "function", "trainer/async_grpo/async_trainer.py",
        "replaced while AsyncGRPOTrainer.__init__ runs: None on a CPU trainer", "accelerator, dtype"),
    Pin(ASYNC_TRAINER, "__init__", "method", "trainer/async_grpo/async_trainer.py",
        "get_peak_flops_per_device (replaced while it runs, CPU), the worker's `model_name` kwarg (the served id), "
        "`weight_transfer` taking over the sync",
        digest="3da8098371b3142c38b7fd81c3bca3322e24b6930b3962d3f479d7dbe64f84e6"),
    Pin(ASYNC_TRAINER, "_sync_weight_merged", "method", "trainer/async_grpo/async_trainer.py",
        "the order ReloadWeightTransfer relies on: pause, send_weights (rank 0; others iterate for FSDP2), resume",
        "self, t0", "b9b5fa4dd30ac95069bb757fc152e6e28545e490b5cc2037553f3488e78920a4"),
    Pin(ASYNC_TRAINER, "_sync_weight_lora", "method", "trainer/async_grpo/async_trainer.py",
        "LORA_R's push: the adapter saved under `_lora_dir`, loaded by /v1/load_lora_adapter as `_lora_name`-v<N> "
        "(the folder the vllm service mounts read-only, tools/compose_file.add_lora_serving), stale ones unloaded",
        digest="53cbb57049aec244d2a83cf0261b87db2123655b0c3bd7be355b2adfb25edccf"),
    Pin(ASYNC_TRAINER, "_init_lora_sync", "method", "trainer/async_grpo/async_trainer.py",
        "`_lora_sync` decided from /server_info (--enable-lora, --max-lora-rank, --max-loras >= max_staleness + 2: "
        "contract/lora_rules.vllm_lora_flags)",
        digest="14ba429a133512b36eb12326c2343c21a21a49a13d875eee2992d5b424dcda32"),
    Pin(ASYNC_TRAINER, "_lora_sync", "attribute", "trainer/async_grpo/async_trainer.py",
        "read: TRL's decision to sync the adapter alone (the trainer stops if it fell back to merged weights)"),
    Pin(ASYNC_TRAINER, "_lora_dir", "attribute", "trainer/async_grpo/async_trainer.py", "read and logged: where adapters go"),
    Pin(ASYNC_TRAINER, "_lora_name", "attribute", "trainer/async_grpo/async_trainer.py",
        "read: the adapter name prefix requests use (earlier runs' adapters of that prefix are unloaded)"),
    Pin(ASYNC_TRAINER, "_sync_weight", "method", "trainer/async_grpo/async_run.py",
        "overridden (AfterRun): the method the weight-sync callback calls; the first trained push's stage", "self"),
    Pin(ASYNC_TRAINER, "_metrics", "attribute", "trainer/async_grpo/async_run.py",
        "read: one `sample/staleness_mean` value per trained sample until log() reduces them"),
    Pin(ASYNC_TRAINER, "log", "method", "trainer/async_grpo/async_run.py",
        "overridden (AfterRun): lag figures from _metrics before TRL averages them", "self, logs, start_time="),
    Pin(ASYNC_TRAINER, "compute_loss", "method", "trainer/async_grpo/tree_attention.py, trainer/async_grpo/off_policy_loss.py",
        "the tree kwargs the model gets (tree_max_seqlen_q/_k from tree_max_seqlens); OFF_POLICY_CORRECTION's hook "
        "runs it with its `model` captured (called once, `.log_probs` per packed position, trained tokens "
        "`token_index >= 0`) and rebuilds the policy term normalised as it is (sum / (global_n_tokens / processes) / "
        "accumulation steps, + router aux loss)",
        "self, model, inputs, return_outputs=, num_items_in_batch=",
        "4fad05bf0e8bb74090dc902b988afd9782b52bd42cf2931ffb690cb43381a255"),
    Pin(ASYNC_TRAINER, "epsilon_low", "attribute", "trainer/async_grpo/off_policy_loss.py",
        "read: the PPO clip's lower epsilon, as TRL's compute_loss clips"),
    Pin(ASYNC_TRAINER, "epsilon_high", "attribute", "trainer/async_grpo/off_policy_loss.py",
        "read: the PPO clip's upper epsilon"),
    Pin(ASYNC_TRAINER, "aux_loss_enabled", "attribute", "trainer/async_grpo/off_policy_loss.py",
        "read: MoE router loss added to the rebuilt loss as TRL adds it"),
    Pin(f"{ASYNC}.async_grpo_trainer", "register_tree_attention", "function", "trainer/async_grpo/tree_attention.py",
        "replaced: AsyncGRPOTrainer.__init__ registers the stack's tree attention through this name", ""),
    Pin(ASYNC_TRANSFER, "_weight_update_info", "attribute", "trainer/gpu/trl_hooks.py",
        "its `dtype_names` rewritten to the served dtype (async_nccl_push): the manifest vLLM sizes its receive "
        "buffers by, cast together with the stream"),
    Pin(ASYNC_TRANSFER, "send_weights", "method", "trainer/gpu/trl_hooks.py",
        "replaced on the instance: the stream cast to the served dtype, the push marked in flight", "self, iterator"),
    Pin(ASYNC_TRANSFER, "init_weight_transfer", "method", "trainer/gpu/trl_hooks.py",
        "replaced on the instance: the weight-push marker written once the group forms", "self"),
    Pin(f"{ASYNC}.async_grpo_trainer", "_iter_vllm_named_params", "function", "trainer/gpu/push_path.py",
        "called: the names, dtypes and shapes the async weight transfer announces, then streams", "model"),
    Pin(ASYNC_TRAINER, "_streaming_iter", "method", "trainer/gpu/push_path.py",
        "called on a stand-in holding only `model` and `accelerator`: what the async merged sync sends (nccl-check)",
        "self"),
    Pin(f"{ASYNC}.packing", "tree_attention", "function", "trainer/async_grpo/tree_attention.py",
        "the kernel call tree_attention.py reproduces (gathered K/V, causal=True bottom-right, window, softcap)",
        "module, query, key, value, attention_mask, tree_kv_index, tree_cu_seqlens_q, tree_cu_seqlens_k, "
        "tree_max_seqlen_q, tree_max_seqlen_k, scaling=, sliding_window=, softcap=, kwargs",
        "558ae72eccb3310e9a4f0a35e4f16a865351183a41fd824af9eb250e552af1cb"),
    Pin(f"{ASYNC}.packing.TreeRow", "pack", "method", "trainer/async_grpo/tree_attention.py",
        "the tree layout tree_mask reads (segments contiguous, kv_index = root-to-segment paths)", "self",
        "c7379352296e55f529b5ae455e74fb17110acdc7b01f4113285c348562f67713"),
    Pin(f"{ASYNC}.packing", "_flash_attn", "function", "trainer/async_grpo/tree_attention.py",
        "the FA3 kernel TRL fetches (FA3_REPO, FA3_VERSION): tree_attention fetches the same one", "",
        "26d2f930796627debe5d25e2cb5550bdf9fb7797abc07e2a896d78e5a93b6263"),
    Pin(f"{ASYNC}.async_grpo_trainer", "_reduce_metric", "function", "trainer/core/async_metrics.py",
        "how log() reduces a key: a `total` word sums (the env episode counts), a rate is sum/sum, else the mean",
        "key, values", "87342ac2f9c63f116d9162ec14e3c17150452ab5e2a4afe50e34387fd22ae47a"),
    Pin(f"{ASYNC}.packing", "register_tree_attention", "function", "trainer/async_grpo/tree_attention.py",
        "what register() mirrors (attention + no-op mask function under TREE_ATTENTION)", "",
        "da79c546d534d80d001536da39fba0953ff6f14556e45d8f48a4c9c5dd977ab1"),
)


# ---------------------------------------------------------------------------------------------- the one reach
def environment_pool(trainer: Any) -> dict[Any, list]:
    """TRL's env instances of `trainer` ({environment name (None for a single env): [instances]}), the very dict
    TRL draws from; {} when the trainer has no environment_factory."""
    return getattr(trainer, "_environment_pool", None) or {}


# ---------------------------------------------------------------------------------------------- the checks
def import_dotted(dotted: str) -> Any:
    """The object a dotted path names: the longest importable module, then attributes (class, then member)."""
    parts = dotted.split(".")
    for split in range(len(parts) - 1, 0, -1):
        try:
            obj = importlib.import_module(".".join(parts[:split]))
        except ImportError:
            continue
        for name in parts[split:]:
            obj = inspect.getattr_static(obj, name) if inspect.isclass(obj) else getattr(obj, name)
        return obj
    raise ImportError(f"no module in {dotted}")


def source_digest(obj: Any) -> str:
    """sha256 of an object's dedented source (the pins' `digest`)."""
    source = textwrap.dedent(inspect.getsource(obj))
    return hashlib.sha256(source.encode()).hexdigest()


def parameters(func: Any) -> str:
    """A function's parameter names, `x=` where it has a default (what a pin's `params` holds)."""
    return ", ".join(p.name + ("=" if p.default is not inspect.Parameter.empty else "")
                     for p in inspect.signature(func).parameters.values())


@cache
def _assigned(owner: str) -> frozenset[str]:
    """Instance attributes TRL's code assigns in the owner class or its TRL bases (`self.x = ...`)."""
    names: set[str] = set()
    for cls in inspect.getmro(import_dotted(owner)):
        if cls.__module__.split(".")[0] == "trl":
            names |= set(re.findall(r"self\.(\w+)\s*(?::[^=\n]+)?=(?!=)", inspect.getsource(cls)))
    return frozenset(names)


def kind_of(pin: Pin, obj: Any) -> str:
    if pin.kind == "attribute":
        return "attribute"
    obj = inspect.unwrap(obj) if callable(obj) and not inspect.isclass(obj) else obj  # @cache, functools.wraps
    if inspect.isclass(obj):
        return "class"
    if inspect.iscoroutinefunction(obj):
        return "coroutine"
    if inspect.isfunction(obj):
        return "method" if inspect.isclass(import_dotted(pin.owner)) else "function"
    return type(obj).__name__


def problem(pin: Pin) -> str | None:
    """What no longer holds for `pin` on the installed TRL (None: it holds)."""
    try:
        if pin.kind == "attribute":  # an instance attribute TRL's code assigns, or a class attribute
            held = pin.name in _assigned(pin.owner) or hasattr(import_dotted(pin.owner), pin.name)
            return None if held else "no longer assigned by TRL"
        obj = import_dotted(pin.dotted)
    except (ImportError, AttributeError):
        return "gone"
    kind = kind_of(pin, obj)
    if kind != pin.kind:
        return f"a {kind} now, not a {pin.kind}"
    if pin.params is not None and parameters(obj) != pin.params:
        return f"parameters ({parameters(obj)}), not ({pin.params})"
    return None


def problems(groups: tuple[str, ...] = ("sync", "async")) -> list[str]:
    """One entry per pin of `groups` that no longer holds: "<dotted>: <what> (re-check <where>: <why>)"."""
    os.environ.setdefault("TRL_EXPERIMENTAL_SILENCE", "1")  # importing trl.experimental is on purpose here
    out = []
    for pin in PINS:
        if pin.group in groups:
            found = problem(pin)
            if found:
                out.append(f"{pin.dotted}: {found} (re-check {pin.where}: {pin.why})")
    return out


def digest_changes() -> list[str]:
    """One entry per pinned source that differs from the installed TRL's."""
    os.environ.setdefault("TRL_EXPERIMENTAL_SILENCE", "1")
    out = []
    for pin in PINS:
        if pin.digest and problem(pin) is None and source_digest(import_dotted(pin.dotted)) != pin.digest:
            out.append(f"{pin.dotted} changed (re-check {pin.where}: {pin.why})")
    return out


def installed_version() -> str:
    import trl

    return trl.__version__


def startup_problem(rollouts: Rollouts) -> str | None:
    """The trainer's check before it starts (trainer.run.preflight): one line naming every pin of this run's trainer
    that the installed TRL breaks, and what to do; None when they all hold."""
    found = problems(("async",) if rollouts.is_async else ("sync",))
    if not found:
        return None
    return (f"trl {installed_version()} breaks what the trainer relies on (pinned for trl {TRL_VERSION} in "
            f"trainer/core/trl_privates.py): " + "; ".join(found) + f". Install trl=={TRL_VERSION}, or re-check those "
            "and update the pins")
