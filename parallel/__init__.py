"""Tensor parallelism over torch.distributed: a model sharded over N ranks, the scheduler on
rank 0 (tp.py)."""
