"""The host side: what `make` runs on your machine (`python -m tools COMMAND`, tools/cli.py).

Layers, each importing only those below it: cli (commands) -> fleet (Swarm) -> stack (settings, services, compose
files, checks) -> env_replicas, gpu_doctor, gpu_layout; nccl_check is its own command (`python -m tools.nccl_check`).
"""
