from trainer.rollouts.traces import main

raise SystemExit(main())
