"""The rollouts: an env's tools bound to its server for TRL (envs_binding), TRL's tool-call loop with the stack's
changes (rollout_loop), rewards (rewards, infra_failures) and the traces of what the model did (traces).
`python -m trainer.rollouts` prints a run's traces (`make rollouts`)."""
