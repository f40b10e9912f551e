"""`python -m trainer.gpu_selfcheck` (`make gpu-selfcheck`): the package's docstring says what it checks."""

from trainer.gpu_selfcheck.runner import main

raise SystemExit(main())
