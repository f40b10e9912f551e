"""`python -m trainer.evaluate` (`make eval`): score a run against its base model on held-out episodes; trainer.after.evaluate."""

from trainer.after.evaluate import main

if __name__ == "__main__":
    raise SystemExit(main())
