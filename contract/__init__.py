"""The rules the host (tools/) and the trainer (trainer/) share, below both: a run's typed settings (config/: RunConfig in
sections, with the ROLLOUTS / TRAIN_MODE variants), the TRAIN_MODE table, shared defaults, the stage lines, the eval report, the
memory estimate, the sampling-health bounds, tracker names and LoRA settings rules. Light on purpose: pydantic, the
standard library and envs' light modules only, never an ML library (tests/test_layers.py checks both)."""
