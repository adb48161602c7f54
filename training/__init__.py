"""Training: fine-tune QA checkpoints on the same partitions that serve them."""
