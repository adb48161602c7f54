"""Partitioning: pipeline stages and Megatron tensor parallelism, shard loading, the gang runtime."""
