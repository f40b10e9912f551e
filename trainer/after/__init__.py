"""What comes after a run: scoring a model on held-out episodes (first_turn, evaluation), and exporting it."""
