"""Run by tests/trainer/test_loopback_rendezvous.py under trainer.launch's launcher: rank 0 leaves with the exit code
given in RANK0_EXIT (as trainer.train does when vLLM went away: 77) while rank 1 waits for it in a collective, as a
rank of a training step would."""

import os
import sys

import torch.distributed as dist
from accelerate import PartialState

state = PartialState(cpu=True)
dist.barrier()  # both ranks are up
if state.is_main_process:
    sys.exit(int(os.environ["RANK0_EXIT"]))
dist.barrier()  # rank 0 is gone: gloo reports the closed peer, or the agent stops this rank
