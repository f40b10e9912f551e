"""`python -m trainer.export` (`make export`): a checkpoint as a standalone model folder; trainer.after.export."""

from trainer.after.export import main

if __name__ == "__main__":
    raise SystemExit(main())
