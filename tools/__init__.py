"""The host side: what `make` runs on your machine (`python -m tools COMMAND`, tools/cli.py).

Layers, each importing only those below it: cli (commands) -> fleet (Swarm) -> stack (settings, services, compose
files, checks) -> env_replicas, gpu_doctor -> gpu_layout, and errors (StackError, say, the .env parser) under all;
nccl_check is the nccl-check command's body. Rules shared with the trainer live below both, in envs/naming.py.
"""
