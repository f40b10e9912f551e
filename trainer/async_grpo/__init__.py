"""ROLLOUTS=async: TRL's AsyncGRPOTrainer, thin (async_trainer), its episodes under MAX_COMPLETION_LENGTH
(async_budget), the after-run checks and the rollout worker's loop (async_run), and the tree attention its packed
batches need (tree_attention). Above gpu/ and rollouts/, below run/ (run.training builds it)."""
