"""The host side: what `make` runs on your machine (`python -m tools COMMAND`: tools/cli.py runs tools/commands/<command>.py).

Floors, top first, each importing only those below it (tests/test_layers.py TOOLS_FLOORS; 0 circles):
cli -> commands/<name> (one file per command) -> fleet (Swarm) -> prepare (what every command does first) -> plan
(StackPlan: what runs, decided once) -> docker_host (the calls that touch Docker), rehearsal, judge (the judge service)
-> compose_file (the
generated file), derive (pure: mode, replica counts, the trainer's config), nccl_check (the nccl-check command's body)
-> env_replicas, gpu_doctor -> env_ports, gpu_layout, images (each image tag), env_keys -> env_kinds (.env's envs by
kind), settings (the one .env reader) -> errors (StackError, say, the .env parser).
host_python.py stands apart: the Makefile runs it as a script with $(PYTHON), before the venv exists.
Rules shared with the trainer live below both, in contract/ (RunConfig, the TRAIN_MODE table, shared defaults, ...)
and envs/naming.py: tools/ imports nothing from trainer/ (tests/test_layers.py).
"""
