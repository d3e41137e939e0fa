"""Operator kinds in a torch profile: where a step's time goes, in words both engines share.

Standard library only: tools/speed_compare.py reads vLLM's traces in vLLM's own environment.
"""
from __future__ import annotations

import glob
import json
import time

# operator -> kind, ours and vLLM's CPU backend: vLLM reads KV in place (no gather) and runs
# what is not a GEMM or attention through inductor's compiled kernels
KINDS = {"aten::mm": "GEMMs", "aten::addmm": "GEMMs", "aten::bmm": "GEMMs",
         "mkldnn::_linear_pointwise": "GEMMs", "_C::onednn_mm": "GEMMs",
         "aten::index_select": "KV gather", "aten::index": "KV gather",
         "aten::_scaled_dot_product_flash_attention_for_cpu": "attention",
         "_C::cpu_attention_with_kv_cache": "attention",
         "aten::_index_put_impl_": "KV write", "_C::cpu_attn_reshape_and_cache": "KV write",
         "## Call CompiledFxGraph None ##": "compiled kernels"}


def kind(op: str) -> str:
    return KINDS.get(op, "other ops")


def trace_ops(pattern: str, wait: float = 0.0) -> dict:
    """Seconds of operator self time by kind in the chrome trace the path pattern names; waits
    up to `wait` seconds for a trace that another process is still writing."""
    deadline = time.monotonic() + wait
    while True:
        try:
            with open((glob.glob(pattern) or [pattern])[0]) as f:
                doc = json.load(f)
            break
        except (OSError, ValueError):
            if time.monotonic() > deadline:
                raise
            time.sleep(0.5)
    events = [e for e in doc["traceEvents"] if e.get("ph") == "X" and e.get("cat") == "cpu_op"]
    events.sort(key=lambda e: (e["tid"], e["ts"], -e["dur"]))
    kinds: dict = {}
    stack: list = []
    for e in events:  # self time: an operator's time less that of the operators it calls
        while stack and (stack[-1]["tid"] != e["tid"]
                         or stack[-1]["ts"] + stack[-1]["dur"] <= e["ts"]):
            stack.pop()
        if stack:
            kinds[kind(stack[-1]["name"])] -= e["dur"] / 1e6
        kinds[kind(e["name"])] = kinds.get(kind(e["name"]), 0.0) + e["dur"] / 1e6
        stack.append(e)
    return kinds
