"""Run by tests/trainer/test_loopback_rendezvous.py under trainer.launch's launcher: rank 0 prints every TCP
socket that this run's processes (the launcher agent and both ranks) listen on, after gloo has connected; each rank
prints its device and loads a saved optimizer state onto it as HF's Trainer does when it resumes several processes
(torch.load's map_location: the rank's device)."""

import io
import os
import subprocess

import torch
import torch.distributed as dist
from accelerate import PartialState

state = PartialState(cpu=True)
saved = io.BytesIO()
torch.save({"state": {0: {"exp_avg": torch.zeros(2)}}}, saved)
saved.seek(0)
torch.load(saved, map_location=state.device, weights_only=True)
# one write(2) of the whole line: both ranks share the pipe, and print() writes its pieces apart (a clean-clone run
# read "RESTORED onRESTORED on cpu\n cpu\n")
os.write(1, f"RESTORED on {state.device}\n".encode())
pids = [None] * state.num_processes
dist.all_gather_object(pids, os.getpid())
if state.is_main_process:
    mine = {os.getppid(), *pids}  # the agent (torchrun, inside `python -m trainer.run.loopback_launch`) and the ranks
    for line in subprocess.run(["ss", "-ltnpH"], capture_output=True, text=True, check=True).stdout.splitlines():
        if any(f"pid={pid}," in line for pid in mine):
            print("LISTEN", line.split()[3], flush=True)
    print("GLOO_SOCKET_IFNAME", os.environ.get("GLOO_SOCKET_IFNAME"), flush=True)
dist.barrier()
# torch warns and gloo can abort ("terminate called without an active exception") when a process exits with its
# group still up: close it first
dist.destroy_process_group()
