"""The GRPO trainer: `python -m trainer.<command>` entrypoints here (train, evaluate, export, launch, ...), over the
run (trainer.run), the rollouts (trainer.rollouts), what comes after a run (trainer.after) and the GPU side
(trainer.gpu). The rules it shares with the host live below it, in contract/."""
