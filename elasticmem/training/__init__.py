"""What the training stages share (``runtime``): stop flag, greedy evaluation, resuming, retrieval
targets, JSONL logs."""
