"""EngineConfig: every engine setting, its one default, and its validation.

The engine, the LLM API, the CLI, the server, the benchmarks and the simulator all read their
settings from this one dataclass, so a setting has one default and one error message.
"""
from __future__ import annotations

import math
from dataclasses import dataclass, fields

from scheduler import make_policy

DTYPES = {"float32": "float32", "fp32": "float32", "float": "float32", "bfloat16": "bfloat16",
          "bf16": "bfloat16", "float16": "float16", "fp16": "float16", "half": "float16"}


class ConfigError(ValueError):
    """A setting out of range or of the wrong type; the message names the setting."""


def check_int(name: str, value, lo: int | None = None, hi: int | None = None,
              allow_none: bool = False) -> None:
    if value is None and allow_none:
        return
    if not isinstance(value, int) or isinstance(value, bool):
        raise ConfigError(f"{name} must be an integer, got {value!r}")
    if (lo is not None and value < lo) or (hi is not None and value > hi):
        bounds = f">= {lo}" if hi is None else f"in [{lo}, {hi}]"
        raise ConfigError(f"{name} must be {bounds}, got {value}")


def check_float(name: str, value, lo: float = 0.0, hi: float = math.inf,
                lo_open: bool = True) -> None:
    """A finite real in (lo, hi] (or [lo, hi] when lo_open is False); NaN and inf are refused."""
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
        raise ConfigError(f"{name} must be a finite number, got {value!r}")
    if value < lo or (lo_open and value == lo) or value > hi:
        left = "(" if lo_open else "["
        right = "]" if math.isfinite(hi) else ")"
        raise ConfigError(f"{name} must be in {left}{lo:g}, {hi:g}{right}, got {value}")


@dataclass
class EngineConfig:
    model: str | None = None                 # HF checkpoint dir or .gguf; None: embedded SmolLM2
    policy: str = "rotasched"                # may carry parameters: "rotasched:alpha=1"
    device: str | None = None                # None: cuda if available, else cpu
    dtype: object = None                     # None: float32 on CPU, bfloat16 on CUDA
    block_size: int = 16                     # tokens per KV block
    num_device_blocks: int | None = None     # None: 80% of free GPU memory, 256 MiB on CPU
    num_host_blocks: int | None = None       # None: 2x device, within a quarter of free RAM
    max_num_seqs: int = 32                   # requests in one batch
    max_num_batched_tokens: int = 512        # tokens computed in one step
    xfer_budget: int = 2400                  # B_xfer: blocks moved per step
    swap_watermark: int | None = None        # rotasched-released: act below this many free
                                             # blocks (their proactive_swap_budget); None: B_xfer
    ttft_slo: float = 5.0                    # seconds; per-request values override
    tbt_slo: float = 0.1
    host_admit_limit: float = 0.9            # hold new requests while host KV is fuller
    swap_in_overlap: bool | None = None      # a swapped-in request runs one step later, its copy
                                             # under the step's forward; None: on CUDA only
    tensor_parallel_size: int = 1
    seed: int | None = None                  # engine seed for requests without their own
    log_path: str | None = None              # JSON-lines schedule log

    def __post_init__(self):
        if self.model is not None and not isinstance(self.model, str):
            raise ConfigError(f"model must be a path or None, got {self.model!r}")
        if not isinstance(self.policy, str):
            raise ConfigError(f"policy must be a name like 'rotasched', got {self.policy!r}")
        make_policy(self.policy)  # raises a ValueError naming what is wrong
        if self.device is not None and not isinstance(self.device, str):
            self.device = str(self.device)
        self.dtype = dtype_name(self.dtype)
        check_int("block_size", self.block_size, 1, 4096)
        check_int("num_device_blocks", self.num_device_blocks, 1, allow_none=True)
        check_int("num_host_blocks", self.num_host_blocks, 0, allow_none=True)
        check_int("max_num_seqs", self.max_num_seqs, 1)
        check_int("max_num_batched_tokens", self.max_num_batched_tokens, 1)
        if self.max_num_batched_tokens < self.max_num_seqs:
            raise ConfigError(f"max_num_batched_tokens ({self.max_num_batched_tokens}) must be "
                              f">= max_num_seqs ({self.max_num_seqs}): each sequence needs a token")
        check_int("xfer_budget", self.xfer_budget, 0)
        check_int("swap_watermark", self.swap_watermark, 0, allow_none=True)
        check_float("ttft_slo", self.ttft_slo)
        check_float("tbt_slo", self.tbt_slo)
        check_float("host_admit_limit", self.host_admit_limit, 0.0, 1.0)
        if self.swap_in_overlap not in (None, True, False):
            raise ConfigError(f"swap_in_overlap must be true, false or None, got "
                              f"{self.swap_in_overlap!r}")
        check_int("tensor_parallel_size", self.tensor_parallel_size, 1, 64)
        check_int("seed", self.seed, -2**63, 2**64 - 1, allow_none=True)
        if self.log_path is not None and not isinstance(self.log_path, str):
            raise ConfigError(f"log_path must be a file path, got {self.log_path!r}")

    @classmethod
    def from_kwargs(cls, **kw) -> "EngineConfig":
        """Like EngineConfig(**kw) but an unknown keyword is a ConfigError naming it."""
        known = {f.name for f in fields(cls)}
        unknown = sorted(set(kw) - known)
        if unknown:
            raise ConfigError(f"unknown engine setting {unknown[0]!r} "
                              f"(settings: {', '.join(sorted(known))})")
        return cls(**kw)


def dtype_name(dtype) -> str | None:
    """'float32', 'bfloat16' or 'float16' for a name, an alias or a torch dtype; None stays None."""
    if dtype is None:
        return None
    name = str(dtype).removeprefix("torch.") if not isinstance(dtype, str) else dtype
    if name not in DTYPES:
        raise ConfigError(f"dtype must be a floating-point type (float32, bfloat16, float16), "
                          f"got {dtype!r}")
    return DTYPES[name]
