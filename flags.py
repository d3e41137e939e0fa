"""Command-line flags for EngineConfig, shared by the CLI, the server, bench.py and sim.py.

A flag per setting, with EngineConfig's default; a bad value is a one-line error (argparse's
usage block is left out), found before anything loads.
"""
from __future__ import annotations

import argparse
import os
from dataclasses import fields

from config import EngineConfig


class Parser(argparse.ArgumentParser):
    """argparse whose errors are one line (no usage block): what is wrong, and where to look."""

    def error(self, message: str):
        self.exit(2, f"{self.prog}: error: {message} (see --help)\n")


FLAGS = {  # EngineConfig field -> (type, help)
    "model": (str, "HF Llama checkpoint directory or .gguf file (default: the embedded "
                   "SmolLM2-135M-Instruct)"),
    "policy": (str, "fcfs, fcfs-swap, priority, rotasched, rotasched-released; parameters as in "
                    "'rotasched:quantum=0.5'"),
    "device": (str, "cpu, cuda or cuda:N (default: cuda if available)"),
    "dtype": (str, "float32, bfloat16 or float16 (default: float32 on CPU, bfloat16 on GPU)"),
    "block_size": (int, "tokens per KV block"),
    "num_device_blocks": (int, "KV blocks on the device (default: 80%% of free GPU memory, "
                               "256 MiB on a CPU)"),
    "num_host_blocks": (int, "KV blocks in host memory (default: twice the device pool)"),
    "max_num_seqs": (int, "requests in one batch"),
    "max_num_batched_tokens": (int, "tokens computed in one step"),
    "xfer_budget": (int, "B_xfer: KV blocks moved per step"),
    "swap_watermark": (int, "rotasched-released: swap out when fewer blocks are free (default: "
                            "B_xfer, as in the authors' code)"),
    "ttft_slo": (float, "time-to-first-token SLO, seconds"),
    "tbt_slo": (float, "time-between-tokens SLO, seconds"),
    "host_admit_limit": (float, "hold new requests while host KV usage is above this fraction"),
    "swap_in_overlap": (lambda v: {"on": True, "off": False}[v],
                        "on: a swapped-in request runs one step later, its copy under the "
                        "forward; off: it runs at once and compute waits (default: on for CUDA)"),
    "tensor_parallel_size": (int, "ranks to shard the model over"),
    "seed": (int, "engine seed for requests without their own"),
    "log_path": (str, "write the JSON-lines schedule log here"),
}


def add_engine_flags(ap: argparse.ArgumentParser, skip: tuple[str, ...] = (), **defaults) -> None:
    """--model, --policy, ... one flag per EngineConfig field; defaults are EngineConfig's."""
    group = ap.add_argument_group("engine")
    for f in fields(EngineConfig):
        if f.name in skip:
            continue
        kind, text = FLAGS[f.name]
        default = defaults.get(f.name, f.default)
        flag = "--log" if f.name == "log_path" else "--" + f.name.replace("_", "-")
        group.add_argument(flag, dest=f.name, type=kind, default=default,
                           help=f"{text} (default: {default})" if default is not None else text)


def engine_config(ap: argparse.ArgumentParser, args, **override) -> EngineConfig:
    """The EngineConfig the flags describe; a bad value is a one-line error, before any loading."""
    values = {f.name: getattr(args, f.name) for f in fields(EngineConfig) if hasattr(args, f.name)}
    if values.get("model") is not None and not os.path.exists(os.path.expanduser(values["model"])):
        ap.error(f"--model: no such file or directory: {values['model']}")
    try:
        return EngineConfig(**(values | override))
    except ValueError as e:
        ap.error(str(e))
