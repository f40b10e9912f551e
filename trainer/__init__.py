"""GRPO training package. Kept import-light: `trainer.config` must load without torch."""
