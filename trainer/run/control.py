"""Stopping a run cleanly: save at the last step, and on SIGTERM (docker stop) or Ctrl-C save after the current step
and stop, every process after the same step; a checkpoint that the disk cannot hold is not started."""

from __future__ import annotations

import signal
from pathlib import Path

from trainer.run import checkpoints
from trainer.core.dist import log


def make_control_callback():
    from transformers import TrainerCallback

    class RunControl(TrainerCallback):
        """Save at the last step (not only every SAVE_STEPS) and on SIGTERM (docker stop), then stop."""

        def __init__(self) -> None:
            self.stop_requested = False
            self.disk_short: str | None = None  # why a save could not start (trainer.run.checkpoints.check_free_space)

        def request_stop(self, signum, frame) -> None:
            if self.stop_requested and signum == signal.SIGINT:
                raise KeyboardInterrupt  # second Ctrl-C: stop now, resume from the last saved checkpoint
            self.stop_requested = True
            log(f"{signal.Signals(signum).name}: saving a checkpoint after this step, then stopping "
                "(run again to resume" + ("; Ctrl-C again to stop without saving)" if signum == signal.SIGINT else ")"))

        def on_step_end(self, args, state, control, **kwargs):
            from trainer.core import dist

            if state.global_step >= state.max_steps:
                control.should_save = True
            # Each process gets the signal on its own, maybe a step apart: all stop after the same step, or the
            # ones still training would wait in a collective for the others until the launcher kills them.
            if dist.any_rank(self.stop_requested, args.device):
                control.should_save = True
                control.should_training_stop = True
            if control.should_save:  # the same on every process (by step, or agreed above)
                short = self._check_disk(args, kwargs.get("model")) if state.is_world_process_zero else None
                if dist.any_rank(short is not None, args.device):
                    self.disk_short = short or "rank 0 found too little disk for the checkpoint"
                    control.should_save = False  # a half-written checkpoint would cost more than this step
                    control.should_training_stop = True
            return control

        @staticmethod
        def _check_disk(args, model) -> str | None:
            run_dir = Path(args.output_dir)
            # what a checkpoint holds: every weight, or the adapter alone (LoRA: the frozen base is not saved)
            params = (sum(p.numel() * p.element_size() for p in model.parameters() if p.requires_grad)
                      if model is not None else 0)
            try:
                checkpoints.check_free_space(run_dir, checkpoints.save_estimate(run_dir, params, args.save_only_model))
            except checkpoints.CheckpointError as exc:
                return str(exc)
            return None

        def on_save(self, args, state, control, **kwargs):
            # The weights are saved owner-only (a temp file renamed); like the rest of the run folder they are for
            # readers under other uids too: `make export` runs as the host user, `vllm serve` as its own.
            from trainer.core import dist

            dist.any_rank(False, args.device)  # a barrier: every process has written its files (rng_state_<rank>)
            if state.is_world_process_zero:
                folder = Path(args.output_dir) / f"{checkpoints.PREFIX}{state.global_step}"
                for path in folder.rglob("*"):
                    path.chmod(path.stat().st_mode | 0o444)
                checkpoints.seal(folder, state.global_step)  # complete only now: synced, then marked

    return RunControl()



def stop_on_signals(control) -> None:
    """SIGTERM (docker stop, compose down) and SIGINT (Ctrl-C in `make train`) ask `control` to stop after this step."""
    signal.signal(signal.SIGTERM, control.request_stop)
    signal.signal(signal.SIGINT, control.request_stop)
