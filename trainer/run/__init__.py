"""The training run: its settings turned into TRL's, its processes, folder, checkpoints, metrics and trackers, and the
trainers themselves (sync GRPOTrainer, async AsyncGRPOTrainer)."""
