"""Tensor parallelism (placeholder while the engine is reworked)."""


class TPRunner:
    def __init__(self, cfg, model=None):
        raise NotImplementedError("tensor_parallel_size > 1 is not available yet")
