"""The host side: what `make` runs on your machine (`python -m tools COMMAND`: tools/cli.py runs tools/commands/<command>.py).

Layers, each importing only those below it: cli -> commands/<name> (one file per command) -> prepare, fleet (Swarm)
-> plan (StackPlan: what runs, decided once) -> docker_host (the calls that touch Docker) -> compose_file (compose.yaml
and the generated file) -> derive (pure: .env's envs by kind, mode, replica counts) -> env_replicas, gpu_doctor ->
gpu_layout, settings (the one .env reader), and errors (StackError, say, the .env parser) under all; nccl_check is the nccl-check command's body.
host_python.py stands apart: the Makefile runs it as a script with $(PYTHON), before the venv exists.
Rules shared with the trainer live below both, in contract/ (RunConfig, the TRAIN_MODE table, shared defaults, ...)
and envs/naming.py: tools/ imports nothing from trainer/ (tests/test_layers.py).
"""
