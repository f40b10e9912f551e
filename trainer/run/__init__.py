"""A training run, start to end (training): resume, dataset, preflight, the sync GRPOTrainer subclass (grpo_trainer),
SIGTERM/Ctrl-C (control), checkpoints, the run's lock and run.json, the summary, and torchrun's loopback launcher.
The async trainer is trainer.async_grpo; what every part reads (metrics, trackers, TRL pins) is trainer.core."""
