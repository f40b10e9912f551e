"""What comes after a run: scoring a model on held-out episodes (evaluate, first_turn), the run's curves (report), and
the model exported as a standalone folder (export). Entrypoints: `python -m trainer.evaluate|report|export`."""
