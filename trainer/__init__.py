"""GRPO training package. Kept import-light: `contract.config` must load without torch."""
