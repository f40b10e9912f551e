# GRPO agent training stack. `make` (or `make help`) lists every target.
SHELL := /bin/bash
.DEFAULT_GOAL := help

PYTHON ?= python3
VENV := .venv
# A small host venv: pydantic-settings for validating .env with the trainer's own config class.
HOST_PY := $(VENV)/bin/python
# pip install into the venv, by uv with pip's settings when uv can be had (several times faster), else pip
VENV_INSTALL := $(HOST_PY) tools/venv_install.py
STACK := $(HOST_PY) -m tools
PYTEST_ARGS ?=
# pytest with PYTEST_ARGS as one single-quoted word that pytest splits itself (PYTEST_ADDOPTS, shell-like): `-k 'a or
# (b and c)'` works, and `; touch x` is a pytest argument, never a command. After a command's own VAR=value words.
PYTEST_RUN = PYTEST_ADDOPTS="$${PYTEST_ADDOPTS:-} "$(call shq,$(PYTEST_ARGS)) $(VENV)/bin/python -m pytest
# Build one of compose.yaml's build-only image services (profile `build`), quietly.
BUILD_IMAGE := $(STACK) compose --progress quiet --profile build build
# A make variable as ONE shell word, single-quoted: `make export PUSH='x;id'` must not run `id`.
shq = '$(subst ','"'"',$(1))'
# Checked before anything is expanded (#44, #63): make runs a `$(shell ...)` in a value even under -n (one given in the
# environment too), a newline splits a recipe into two commands, and ARGS (several shell words, quotes allowed)
# reaches the shell unquoted. Every variable a user sets that a recipe reads is in this list; PYTEST_ARGS reaches
# pytest as one quoted word (PYTEST_RUN), so it may hold any shell character but `$`.
define NEWLINE


endef
LPAREN := (
RPAREN := )
SHELL_OPERATORS := ; & | < > ` $(LPAREN) $(RPAREN)
UNSAFE_VALUE = $(1) holds a newline or a '$$': make would expand or split it; pass the value without them
UNSAFE_ARGS = ARGS holds a shell operator ($(SHELL_OPERATORS)); pass only options and values, quoted if they hold spaces
$(foreach v,RUN CHECKPOINT PUSH STEP TASKS THRESHOLD ARGS SUITE FULL EXPORT_ADAPTER PYTEST_ARGS PYTHON VENV,$(if \
	$(findstring $$,$(value $(v)))$(findstring $(NEWLINE),$(value $(v))),$(error $(call UNSAFE_VALUE,$(v)))))
$(if $(strip $(foreach c,$(SHELL_OPERATORS),$(findstring $(c),$(value ARGS)))),$(error $(UNSAFE_ARGS)))

.PHONY: help up train down logs ps config build test clean doctor report rollouts eval export baseline dashboard nccl-check gpu-smoke gpu-selfcheck rehearse soak bench test-host \
	fleet-up fleet-ps fleet-logs fleet-down bench-fleet bench-learning bench-async bench-async-stress bench-upstream bench-ors chaos config-docs check-python

help: ## List every target with one line each
	@awk 'BEGIN {FS = ":.*## "} /^[a-zA-Z_-]+:.*## / {printf "  \033[36m%-12s\033[0m %s\n", $$1, $$2}' $(MAKEFILE_LIST)

# Python 3.10 to 3.13. tools/host_python.py first: an interpreter out of range, or one whose venv has no ensurepip
# (Debian/Ubuntu without python3-venv), is one line naming what to install, not venv's message or pip's traceback.
$(VENV)/.host-ok: pyproject.toml
	@$(PYTHON) tools/host_python.py
	@$(PYTHON) -m venv $(VENV)
	@$(VENV_INSTALL) -q -e . >/dev/null
	@touch $@

up: $(VENV)/.host-ok ## Build what is missing and start env servers (and vLLM on GPU hosts), health-gated
	@$(STACK) up

train: $(VENV)/.host-ok ## Train: brings the stack up itself (CPU profile with a tiny model when no NVIDIA GPU)
	@$(STACK) train $(ARGS)

down: $(VENV)/.host-ok ## Stop and remove every container of the stack (volumes are kept)
	@$(STACK) compose --profile '*' down --remove-orphans

logs: $(VENV)/.host-ok ## Follow the logs of running services
	@$(STACK) compose logs -f --tail=100

ps: $(VENV)/.host-ok ## Show the stack's containers and their health
	@$(STACK) compose ps -a

config: $(VENV)/.host-ok ## Print the whole resolved stack (compose.yaml + the services generated from .env)
	@$(STACK) compose config

config-docs: $(VENV)/.host-ok ## Regenerate docs/configuration.md (every .env variable) from the typed settings
	@$(STACK) config-docs --write

fleet-up: $(VENV)/.host-ok ## Swarm manager: deploy/update the env servers of .env as a fleet across the swarm's nodes (docs/fleets.md)
	@$(STACK) fleet up

fleet-ps: $(VENV)/.host-ok ## The fleet's services and tasks: node, state, errors
	@$(STACK) fleet ps

fleet-logs: $(VENV)/.host-ok ## The last log lines of every fleet service
	@$(STACK) fleet logs

fleet-down: $(VENV)/.host-ok ## Remove the fleet: services, tasks and its network
	@$(STACK) fleet down

build: $(VENV)/.host-ok ## Build the images this mode needs
	@$(STACK) build

doctor: $(VENV)/.host-ok ## Check Docker, Compose, NVIDIA runtime and GPUs, ports and .env values; say how to fix
	@$(STACK) doctor

report: $(VENV)/.host-ok ## Plot reward and tool-call curves of a run to reports/<run>.png (RUN=name, default latest)
	@$(STACK) report $(if $(RUN),--run $(call shq,$(RUN)))

rollouts: $(VENV)/.host-ok ## Print a run's traced rollouts: turns, tool calls, results, rewards (RUN=name, STEP=n; default latest)
	@$(STACK) rollouts $(if $(RUN),--run $(call shq,$(RUN))) $(if $(STEP),--step $(call shq,$(STEP)))

eval: $(VENV)/.host-ok ## Score a run's checkpoint and its base model on held-out episodes: reward, success, pass@k, tool use; <run>/eval.json (RUN=, CHECKPOINT=, TASKS=32, THRESHOLD=0.5)
	@$(STACK) eval $(if $(RUN),--run $(call shq,$(RUN))) $(if $(CHECKPOINT),--checkpoint $(call shq,$(CHECKPOINT))) $(if $(TASKS),--tasks $(call shq,$(TASKS))) $(if $(THRESHOLD),--threshold $(call shq,$(THRESHOLD))) $(ARGS)

export: $(VENV)/.host-ok ## Write a run's checkpoint as a model folder in exports/<run>/ (RUN=name CHECKPOINT=N or best, default the last; PUSH=org/name also uploads it; EXPORT_ADAPTER=1: a LoRA run's adapter alone)
	@$(STACK) export $(if $(RUN),--run $(call shq,$(RUN))) $(if $(CHECKPOINT),--checkpoint $(call shq,$(CHECKPOINT))) $(if $(PUSH),--push $(call shq,$(PUSH))) $(if $(filter 1 true,$(EXPORT_ADAPTER)),--adapter)

baseline: $(VENV)/.host-ok ## Play each env with a random/scripted policy; print mean reward and episode length
	@$(STACK) baseline

dashboard: $(VENV)/.host-ok ## Start TensorBoard on 127.0.0.1:$DASHBOARD_PORT (opt-in)
	@$(STACK) dashboard

nccl-check: $(VENV)/.host-ok ## GPU hosts: NCCL broadcast as the weight sync does; FULL=1: TRL's rendezvous + weight push + generation against the running vllm
	@$(STACK) nccl-check $(if $(FULL),--full) $(ARGS)

gpu-selfcheck: ## GPU owners, no Docker, vLLM server or Hub: the trainer's CUDA path checked in a plain env (PYTHON=/path/to/python; docs/gpu-host.md "GPU self-check")
	@$(PYTHON) -m trainer.gpu_selfcheck $(ARGS)

rehearse: $(VENV)/.host-ok ## No GPU needed: TRAIN_MODE=gpu's layout on this CPU (vLLM CPU twin, trainer on CPU, weights by reload), sync or async by .env (docs/gpu-host.md "Rehearse the GPU layout on a laptop")
	@$(STACK) rehearse $(ARGS)

gpu-smoke: $(VENV)/.host-ok ## GPU hosts, first thing: 3 steps on the default model, pass/FAIL with timings per stage (docs/gpu-host.md "First run on a GPU host")
	@$(STACK) smoke --gpu

soak: $(VENV)/.test-ok ## Long soak of the env servers at full capacity (minutes; SOAK_MINUTES=10)
	@SOAK_MINUTES=$${SOAK_MINUTES:-10} $(PYTEST_RUN) -q tests/reliability -k soak

bench: $(VENV)/.test-ok ## Env-server figures next to their goals: Wordle, echo vs stock OpenEnv, Catch, zero-code adapter, tool rounds vs TRL's loop (a few minutes)
	@$(BUILD_IMAGE) env-server-image
	@$(VENV)/bin/python bench/env_figures.py $(ARGS)
	@$(VENV)/bin/python bench/adapter_overhead.py
	@$(VENV)/bin/python bench/tool_rounds.py

bench-learning: $(VENV)/.test-ok ## The CPU profile's learning curve on echo (seeds 42 and 7) next to its goals, then learning from the tiny judge alone on the twin (ARGS="--judge only|no"; a few minutes)
	@$(VENV)/bin/python bench/learning_curve.py $(ARGS)

bench-async: $(VENV)/.test-ok ## Which learns sooner, sync or async rollouts, on make rehearse (twin and trainer on CPU sets of their own), slow env (250 ms tool calls) and instant, 2 seeds: time to learn, samples/min, busy shares, staleness, reward plots (ARGS="--seeds 42 --max-steps 20")
	@$(VENV)/bin/python bench/async_figures.py $(ARGS)

bench-async-stress: $(VENV)/.test-ok ## Async under stress on make rehearse (slow env, MAX_STALENESS=8, higher learning rate) beside sync, 2 seeds: each OFF_POLICY_CORRECTION's ratio max, clipped share, KL, reward curve; ASYNC_ADMISSION free vs bounded: trained-vs-generated reward and length (ARGS="--seeds 42 --max-steps 8")
	@$(VENV)/bin/python bench/async_stress.py $(ARGS)

bench-upstream: $(VENV)/.test-ok ## Upstream OpenEnv images you built (openenv build) trained 3 CPU steps each through .env alone: one table (docs/upstream-envs.json; ARGS="--envs connect4_env")
	@$(VENV)/bin/python bench/upstream_envs.py $(ARGS)

bench-ors: $(VENV)/.test-ok ## An ORS env imported (openenv import --type ors), built as the import lays it out, trained 3 CPU steps through .env alone (ARGS="--source DIR --name N")
	@$(VENV)/bin/python bench/ors_image.py $(ARGS)

bench-fleet: $(VENV)/.test-ok ## Fleet figures on this machine's swarm: 4,096 sessions on 16 tasks; steps/s on 1, 2, 4 tasks
	@$(BUILD_IMAGE) env-server-image
	@$(VENV)/bin/python bench/fleet_figures.py $(ARGS)

chaos: $(VENV)/.test-ok ## A CPU training run through injected faults, planned by step, each kind twice (env kills, stops, dropped/half-open/slow links, control-frame floods, trainer kills): the count of each and the fault figures next to their goals (several minutes; ARGS="--steps 60 --per-kind 3 --seed 7"; ARGS="--rollouts async" on make rehearse, + a vLLM twin restart)
	@$(BUILD_IMAGE) env-server-image
	@$(VENV)/bin/python bench/chaos.py $(ARGS)

# each env folder's own dependencies (envs/<name>/requirements.txt) beside the env-server extra, as the image installs them
ENV_REQS := $(sort $(wildcard envs/*/requirements.txt))

$(VENV)/.test-ok: $(VENV)/.host-ok pyproject.toml $(ENV_REQS)
	@$(HOST_PY) tools/host_python.py --tests
	@$(STACK) setup
	@# torch's CPU build: the local wheel `setup` copied if it is this Python's (cp311...), else PyTorch's CPU index
	@# (PyPI's torch is CUDA)
	@$(VENV_INSTALL) -q --find-links .wheels \
		$$(ls .wheels/torch-*-$$($(HOST_PY) -c 'import sys; print("cp%d%d" % sys.version_info[:2])')-*.whl >/dev/null 2>&1 || echo --extra-index-url "$${TORCH_INDEX_URL:-https://download.pytorch.org/whl/cpu}") \
		-e '.[test,trainer,env-server]' $(addprefix -r ,$(ENV_REQS))
	@touch $@

# Host-only tests run with no engine reachable, so a test that needs one without the `docker` marker fails.
NO_ENGINE := DOCKER_HOST=unix:///nonexistent/host-tests-start-no-container.sock
# A command run on the CPU time nothing else wants: an idle cgroup where it may, else autogroup nice 10 (the script says why)
LOW_PRIORITY := tests/low-priority env
# pytest exits 5 when a selection holds no test (a PYTEST_ARGS="-k ..." that picks from one part only)
# ($(2): variables for that pytest alone)
PYTEST_SOME = { $(2) $(PYTEST_RUN) $(1) || [ $$? = 5 ]; }

# The tiny models the tests make (tests/helpers.py), kept between runs under a key of their recipe (the code that makes
# them, the torch, transformers and tokenizers it runs on): one made by the same recipe is reused, as Docker's build cache
# reuses layers (~2.5 CPU-minutes a run; TINY_MODEL_DIR, TINY_JUDGE_DIR: folders of your own instead)
TEST_MODELS_CACHE := $${XDG_CACHE_HOME:-$$HOME/.cache}/grpo-stack-tests

test: $(VENV)/.test-ok ## Run every test: the host-only part (no engine reachable) beside the real containers (needs Docker)
	@# Both parts at once: the container tests in one stream (a second stream beside the twin's was tried, 2026-12-08:
	@# 1,615 s, but a rehearsal's twin was once recreated under it mid-test), the host-only part beside them at low
	@# priority (LOW_PRIORITY) on the CPU time they leave. The host part's output follows. Either red fails the target.
	@# The tiny model is made once, by the first test to need it (tests/helpers.py make_tiny_model: another waits); the
	@# tiny judge (one container test's, ~2 CPU-minutes) beside the tests on idle CPU, and its test waits for it
	@# (TINY_JUDGE_DONE: make_tiny_judge). Both kept in TEST_MODELS_CACHE under a hash of their recipe.
	@tmp=$$(mktemp -d -t grpo-tests.XXXXXX); trap 'rm -rf "$$tmp"' EXIT; host_log=$$tmp/host-tests.log; \
	recipe=$$({ cat trainer/tiny_model.py trainer/tiny_judge.py; $(HOST_PY) -c 'from importlib.metadata import version as v; print(v("torch"), v("transformers"), v("tokenizers"))'; } | sha256sum | cut -c1-16); \
	cache=$(TEST_MODELS_CACHE); mkdir -p "$$cache/$$recipe"; find "$$cache" -mindepth 1 -maxdepth 1 ! -name "$$recipe" -exec rm -rf {} +; \
	export TINY_MODEL_DIR=$${TINY_MODEL_DIR:-$$cache/$$recipe/tiny-qwen3}; \
	export TINY_JUDGE_DIR=$${TINY_JUDGE_DIR:-$$cache/$$recipe/tiny-judge}; judge_done=$$tmp/tiny-judge.done; \
	{ $(LOW_PRIORITY) $(VENV)/bin/python -c 'import sys; from pathlib import Path; from tests.helpers import make_tiny_judge; make_tiny_judge(Path(sys.argv[1]))' "$$TINY_JUDGE_DIR" >$$tmp/tiny-judge.log 2>&1; echo $$? >$$judge_done.part; mv $$judge_done.part $$judge_done; } & judge=$$!; \
	export TINY_JUDGE_DONE=$$judge_done; \
	{ $(call PYTEST_SOME,-m "not docker",$(LOW_PRIORITY) $(NO_ENGINE)) >$$host_log 2>&1; echo $$? >$$host_log.rc; } & host=$$!; \
	trap 'kill $$host $$judge 2>/dev/null; rm -rf "$$tmp"' INT TERM; \
	rc=0; $(call PYTEST_SOME,-m docker) || rc=1; wait $$host; \
	echo "[test] the host-only part (-m 'not docker'), run beside the container part:"; cat $$host_log; \
	[ "$$(cat $$host_log.rc)" = 0 ] || rc=1; wait $$judge 2>/dev/null; exit $$rc

test-host: $(VENV)/.test-ok ## The host-only tests alone: unit, compose config, in-process servers; no container (minutes)
	@# two workers (pytest-xdist): many of these tests wait on timers and subprocesses, so two overlap well on 2 cores
	@$(NO_ENGINE) $(PYTEST_RUN) -m "not docker" -n $${HOST_TEST_WORKERS:-2}

check-python: ## The host side on another Debian's Python in a container (trixie: 3.13, or SUITE=a later Debian; TEST_VENV=1: make test's venv too; docs/tests.md "Other host Pythons")
	@bash .ci/check-python $(if $(SUITE),$(call shq,$(SUITE)),trixie)

clean: $(VENV)/.host-ok ## Remove containers, volumes (outputs, models, caches) and the images built here
	@$(STACK) clean
