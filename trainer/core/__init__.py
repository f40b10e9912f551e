"""What the rest of the trainer reads, at the bottom of it (imports nothing else of trainer/): the TRL privates the stack
uses, pinned (trl_privates), the run's settings as TRL's GRPOConfig and TRAIN_MODE=auto resolved (grpo_args), which
process this is (dist), the STATS counter and the metrics.jsonl records (metrics, async_metrics), the trackers
REPORT_TO names (trackers) and the rate/ETA lines (progress)."""
