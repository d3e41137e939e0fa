"""RotaSched's trade-off, per setting: the best TTFT gain over fcfs of each variant tried against
its worst TBT p99 (as a multiple of fcfs's), and whether every do-no-harm rule held.

    python -m tools.frontier            reads the sweep and the ablation in docs/claim, replays the
                                        CPU bench's workloads in the simulator, writes
                                        docs/claim/frontier.json and frontier.png

GH200 points come from `python -m tools.claim` (the default `rotasched`) and every
`ablation_conv*.json` of `python -m tools.claim --ablate ...` there (the variants), conversation
workload, every rate each was run at. The CPU point of a variant replays a recorded `python
bench.py --json` run (its pool, limits, SLOs, rate and request count) on the first --slices trace
slices that `--repeat` would take, on the simulator's `cpu` profile at --flops rather than on
this machine: its gain is the median over slices, its p99 the worst, and it keeps the rules
only where every slice does.
"""
from __future__ import annotations

import argparse
import glob
import json
import os
import statistics
from dataclasses import replace

from sched import Request
from superinfer import Parser
from tools import claim, sim
from workload.metrics import harms
from workload.trace import with_rate

CPU = "cpu bench (simulated)"


def sweep_points(folder: str) -> dict[str, dict[str, dict]]:
    """{setting: {variant: score}} from the conversation sweep and its ablation."""
    rows, settings = [], []
    for s in claim.SETTINGS:
        path = os.path.join(folder, f"{s.replace(':', '_')}_conv.json")
        if os.path.exists(path):
            with open(path) as f:
                rows += json.load(f)
            settings.append(s)
    if not settings:
        raise OSError(f"no conversation sweep in {folder}")
    for path in sorted(glob.glob(os.path.join(folder, "ablation_conv*.json"))):
        with open(path) as f:  # every ablation of the conversation sweep kept there
            rows += json.load(f)
    out = {}
    for s in settings:
        mine = [r for r in rows if r["setting"] == s]
        variants = sorted({r["policy"] for r in mine if r["policy"].startswith("rotasched")
                           and r["policy"] != "rotasched-released"})
        out[s] = {v: claim.score(mine, v) for v in variants}
    return out


def cpu_setup(bench, ap, args, run: dict, flops: float):
    """The engine settings, SLOs, rate and cost model of a recorded `python bench.py --json` run
    (its first row), with the simulator's `cpu` profile at `flops` FLOP/s."""
    cfg = replace(bench.bench_config(ap, args, policy="fcfs"), ttft_slo=run["ttft_slo_s"],
                  tbt_slo=run["tbt_slo_s"], num_device_blocks=run["num_device_blocks"],
                  num_host_blocks=run["num_host_blocks"])
    hw = replace(sim.cpu_profile(measure=False), flops=flops)
    return cfg, sim.CostModel(sim.MODELS["smollm2-135m"], hw, cfg.block_size,
                              cfg.num_device_blocks, cfg.num_host_blocks)


def cpu_points(variants: list[str], bench_json: str, slices: int, flops: float) -> dict:
    """Each variant on the workloads of `slices` repeats of the recorded bench run: the same
    trace slices, rate, request count, pool and SLOs, in the simulator."""
    import bench  # the bench's own workload and defaults
    with open(bench_json) as f:
        data = json.load(f)
    run = (data["runs"] if isinstance(data, dict) else data)[0]
    argv = ["--seed", str(run["seed"]), "--trace-offset", str(run["trace_offset"]),
            "--workload", run.get("workload") or "conv"]
    if run.get("burstiness") is not None:
        argv += ["--burstiness", str(run["burstiness"])]
    ap, args = bench.parse_args(argv)
    cfg, cost = cpu_setup(bench, ap, args, run, flops)
    per = {v: [] for v in variants}
    for k in range(slices):
        items, _, _ = bench.build_workload(args, 49152, k)
        reqs = [Request(f"v{i}", it.prompt_len, it.output_len, it.arrival)
                for i, it in enumerate(with_rate(items[:run["num_requests"]], run["rate"]))]
        rows = {p: sim.run_policy(p, reqs, cost, cfg) | {"tbt_slo_s": cfg.tbt_slo}
                for p in ["fcfs", "fcfs-swap", *variants]}
        for v in variants:
            r, f, s = rows[v], rows["fcfs"], rows["fcfs-swap"]
            per[v].append((100 * (r["ttft_attainment"] - f["ttft_attainment"]),
                           100 * (r["ttft_attainment"] - s["ttft_attainment"]),
                           r["tbt_p99_s"] / max(f["tbt_p99_s"], 1e-9), harms(f, r, s)))
    return {v: {"gain": statistics.median(x[0] for x in p),
                "gain_swap": statistics.median(x[1] for x in p), "p99": max(x[2] for x in p),
                "harms": [f"slice {k}: {h}" for k, x in enumerate(p) for h in x[3]],
                "slices_kept": sum(not x[3] for x in p), "slices": slices}
            for v, p in per.items()}


def undominated(variants: dict[str, dict]) -> set[str]:
    """The variants no other beats on both axes (as much gain or more at as low a p99 or lower,
    better on one): the frontier the plot labels."""
    def beats(b, a):
        return b["gain"] >= a["gain"] and b["p99"] <= a["p99"] and (
            b["gain"], b["p99"]) != (a["gain"], a["p99"])
    return {v for v, a in variants.items() if not any(beats(b, a) for b in variants.values())}


def plot(points: dict[str, dict[str, dict]], path: str) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    fig, axes = plt.subplots(1, len(points), figsize=(4.2 * len(points), 4.6), squeeze=False)
    for ax, (setting, variants) in zip(axes[0], points.items()):
        labelled = undominated(variants) | {"rotasched"}
        for v, sc in variants.items():
            kept = not sc["harms"]
            ax.scatter(sc["p99"], sc["gain"], marker="o" if v == "rotasched" else "s",
                       facecolors="tab:green" if kept else "none",
                       edgecolors="tab:green" if kept else "tab:red", s=60)
            if v in labelled:
                ax.annotate(v.partition(":")[2] or "default", (sc["p99"], sc["gain"]),
                            fontsize=6, xytext=(3, 3), textcoords="offset points")
        ax.axvline(2.0, color="grey", linestyle=":")
        ax.set_xscale("log")
        ax.set_xlabel("worst TBT p99 / fcfs's")
        ax.set_ylabel("best TTFT gain over fcfs (points)")
        ax.set_title(setting, fontsize=9)
        ax.grid(alpha=0.3)
    fig.suptitle("RotaSched variants: filled = every do-no-harm rule holds (every rate, or on "
                 "the CPU every slice); circle = the default; labelled: the default and those "
                 "no other beats on both axes (all: frontier.json)", fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=90)
    plt.close(fig)


def main(argv=None) -> None:
    ap = Parser(prog="python -m tools.frontier", description=__doc__,
                formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--dir", default="docs/claim", help="the sweep's and the ablation's folder")
    ap.add_argument("--slices", type=int, default=8, help="CPU bench repeats to replay")
    ap.add_argument("--bench-json", default="docs/claim/frontier_cpu_run.json",
                    help="a python bench.py --json file: the CPU run whose settings are replayed "
                         "(default: the conversation run the committed frontier replays)")
    ap.add_argument("--flops", type=float, default=190e9,
                    help="the simulated CPU's matmul FLOP/s (default: this machine's, measured)")
    args = ap.parse_args(argv)
    if args.slices < 1:
        ap.error("--slices must be >= 1")
    try:
        points = sweep_points(args.dir)
        open(args.bench_json).close()
    except OSError as e:
        ap.error(f"{e} (run python -m tools.claim and python bench.py --json first)")
    variants = sorted({v for s in points.values() for v in s})
    points[CPU] = cpu_points(variants, args.bench_json, args.slices, args.flops)
    with open(os.path.join(args.dir, "frontier.json"), "w") as f:
        json.dump(points, f, indent=1)
    plot(points, os.path.join(args.dir, "frontier.png"))
    for setting, variants in points.items():
        for v, sc in sorted(variants.items(), key=lambda kv: -kv[1]["gain"]):
            print(f"{setting:24} {v:48} gain {sc['gain']:+6.1f} (vs fcfs-swap "
                  f"{sc['gain_swap']:+6.1f})  p99 {sc['p99']:5.2f}x  "
                  + ("every rule holds" if not sc["harms"] else f"{len(sc['harms'])} harms"))


if __name__ == "__main__":
    main()
