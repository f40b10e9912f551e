"""The GRPO trainer: `python -m trainer.<command>` entrypoints here (train, launch, evaluate, export, report, baseline,
tiny_model, download_model, dashboard, gpu_selfcheck, sync_check), over what comes after a run (trainer.after), the run
(trainer.run), the async trainer (trainer.async_grpo), the GPU side (trainer.gpu) and the rollouts (trainer.rollouts),
which stand on the model (trainer.modeling) and what every part reads (trainer.core). Imports only run down that list
(tests/test_layers.py). The rules it shares with the host live below it, in contract/."""
