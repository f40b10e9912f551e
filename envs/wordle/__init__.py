"""Wordle on textarena 0.7.4, upstream OpenEnv textarena_env's wire schema."""
