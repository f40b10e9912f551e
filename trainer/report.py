"""`python -m trainer.report` (`make report`): a run's reward and tool curves as a PNG; trainer.after.report."""

from trainer.after.report import main

if __name__ == "__main__":
    raise SystemExit(main())
