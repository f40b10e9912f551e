"""Training entrypoint: `python -m trainer.train [--max-steps 3 ...]`. A run, start to end, with its exit codes:
trainer.run.training."""

from trainer.run.training import main

if __name__ == "__main__":
    raise SystemExit(main())
