"""Catch on open-spiel 2.0.2, upstream OpenEnv openspiel_env's wire schema."""
