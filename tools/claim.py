"""The paper's claim, swept: RotaSched raises TTFT SLO attainment "while maintaining comparable
TBT and throughput", judged at every rate from calm to twice saturation, in the simulator.

    python -m tools.claim                                four GH200 settings x four workloads
    python -m tools.claim --settings gh200-96:qwen2.5-32b --workloads conv --factors 1,1.5

For each setting (hardware x model) and workload class (the trace's conversation lengths,
prefill-heavy, decode-heavy, and the conversation lengths with bursty arrivals) it runs fcfs,
fcfs-swap, rotasched-lvf, rotasched and rotasched-released on the same arrivals at multiples of
the setting's saturation rate, writes one JSON file per (setting, workload) whose rows carry
every setting they were run with, one PNG per workload (rows: settings; columns: TTFT
attainment, TBT attainment, TBT p99 against rate), and prints the verdict of the claim's rules
per file: do no harm at every rate (workload.metrics.harms) and, at the best rate, a TTFT gain
over fcfs and fcfs-swap (GAINS). --table prints the files' figures as a markdown table.
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import time
from concurrent.futures import ProcessPoolExecutor
from dataclasses import replace

from superinfer import EngineConfig, Parser
from tools.sim import (MODELS, PROFILES, CostModel, azure_lengths, deep_queue, requests_at,
                       run_policy, saturation_rate)
from workload.metrics import harms
from workload.trace import SHARING, WORKLOADS, reshape

SETTINGS = ("gh200-96:llama-3-8b", "gh200-96:qwen2.5-32b", "gh200-144:llama-3-8b",
            "gh200-144:qwen2.5-32b")
CLASSES = {**{w: (w, 1.0) for w in WORKLOADS if w not in SHARING},  # -> lengths, burstiness
           "bursty": ("conv", 0.1)}
POLICIES = ("fcfs", "fcfs-swap", "rotasched-lvf", "rotasched", "rotasched-released")
# best-rate TTFT gain goals (points over fcfs, over fcfs-swap): where KV capacity binds, and on
# GH200-144 with Llama-3-8B, which is mostly compute-bound with these lengths
GAINS = {"gh200-144:llama-3-8b": (25.0, 10.0)}
DEFAULT_GAIN = (40.0, 10.0)
MAX_LEN = 8192  # tokens a request holds in all; longer ones are cut, in runs and calibration


def config() -> EngineConfig:
    return EngineConfig(policy="fcfs", max_num_seqs=1024, max_num_batched_tokens=8192,
                        xfer_budget=2400, ttft_slo=5.0, tbt_slo=0.1, swap_in_overlap=True)


def run_one(job: tuple) -> dict:
    setting, workload, policy, rate, factor, duration, seed = job
    hw, model = setting.split(":")
    kind, burst = CLASSES[workload]
    cost, cfg = CostModel(MODELS[model], PROFILES[hw]), config()
    reqs = requests_at(rate, duration, reshape(azure_lengths(), kind), seed, MAX_LEN, burst)
    row = run_policy(policy, reqs, cost, cfg)
    return row | {"rate": rate, "saturation_factor": factor, "setting": setting, "hw": hw,
                  "model": model, "workload": workload, "burstiness": burst,
                  "trace": "azure_llm_2023_conv.csv", "arrivals_s": duration, "seed": seed,
                  "ttft_slo_s": cfg.ttft_slo, "tbt_slo_s": cfg.tbt_slo,
                  "max_num_seqs": cfg.max_num_seqs,
                  "max_num_batched_tokens": cfg.max_num_batched_tokens,
                  "xfer_budget": cfg.xfer_budget, "device_blocks": cost.device_blocks}


def saturation(setting: str, workload: str, seed: int) -> float:
    hw, model = setting.split(":")
    queue = deep_queue(reshape(azure_lengths(), CLASSES[workload][0]), seed, MAX_LEN)
    return saturation_rate(CostModel(MODELS[model], PROFILES[hw]), queue, config())


def score(rows: list[dict], policy: str = "rotasched") -> dict:
    """One policy against fcfs and fcfs-swap over a file's rates: its best TTFT gains (points),
    worst TBT p99 and throughput ratios to fcfs's, and every do-no-harm shortfall."""
    by = {(r["policy"], r["rate"]): r for r in rows}
    out = {"gain": -100.0, "gain_swap": -100.0, "p99": 0.0, "throughput": 9.0, "harms": [],
           "ttft_p99": 0.0}
    for rate in sorted({r["rate"] for r in rows if r["policy"] == policy}):
        mine, base, swap = by[(policy, rate)], by[("fcfs", rate)], by.get(("fcfs-swap", rate))
        out["harms"] += [f"rate {rate:g}: {h}" for h in harms(base, mine, swap)]
        out["gain"] = max(out["gain"], 100 * (mine["ttft_attainment"] - base["ttft_attainment"]))
        if swap:
            out["gain_swap"] = max(out["gain_swap"],
                                   100 * (mine["ttft_attainment"] - swap["ttft_attainment"]))
        out["p99"] = max(out["p99"], mine["tbt_p99_s"] / max(base["tbt_p99_s"], 1e-9))
        out["ttft_p99"] = max(out["ttft_p99"], mine["ttft_p99_s"] / max(base["ttft_p99_s"], 1e-9))
        out["throughput"] = min(out["throughput"],
                                mine["throughput_tok_s"] / max(base["throughput_tok_s"], 1e-9))
    return out


def judge(rows: list[dict], setting: str, policy: str = "rotasched") -> tuple[list[str], str]:
    """(shortfalls, summary) of one file's rows by the claim's rules."""
    goal_f, goal_s = GAINS.get(setting, DEFAULT_GAIN)
    sc = score(rows, policy)
    fails = list(sc["harms"])
    if sc["gain"] < goal_f or sc["gain_swap"] < goal_s:
        fails.append(f"best TTFT gain {sc['gain']:+.1f} / {sc['gain_swap']:+.1f} points (goal "
                     f"{goal_f:+g} over fcfs, {goal_s:+g} over fcfs-swap)")
    return fails, (f"best TTFT gain {sc['gain']:+.1f} pts vs fcfs, {sc['gain_swap']:+.1f} vs "
                   f"fcfs-swap; worst TBT p99 {sc['p99']:.2f}x fcfs's, worst throughput "
                   f"{sc['throughput']:.3f}x")


def plot(rows: list[dict], settings: list[str], workload: str, path: str) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    panels = (("ttft_attainment", "TTFT attainment (%)", 100),
              ("tbt_attainment", "TBT attainment (%)", 100), ("tbt_p99_s", "TBT p99 (s)", 1))
    fig, axes = plt.subplots(len(settings), 3, figsize=(13, 3.2 * len(settings)), squeeze=False)
    for i, setting in enumerate(settings):
        mine = [r for r in rows if r["setting"] == setting]
        for j, (key, label, scale) in enumerate(panels):
            ax = axes[i][j]
            for pol in POLICIES:
                pts = sorted((r["saturation_factor"], r[key] * scale) for r in mine
                             if r["policy"] == pol)
                ax.plot([p[0] for p in pts], [p[1] for p in pts], marker="o", label=pol)
            ax.set_xlabel("request rate (x saturation)")
            ax.set_ylabel(label)
            if key == "tbt_p99_s":
                ax.set_yscale("log")
                ax.axhline(mine[0]["tbt_slo_s"], color="grey", linestyle=":", label="TBT SLO")
            ax.grid(alpha=0.3)
            ax.set_title(setting, fontsize=9)
    axes[0][0].legend(fontsize=8)
    fig.suptitle(f"simulated, {workload} workload: TTFT 5 s / TBT 100 ms SLOs")
    fig.tight_layout()
    fig.savefig(path, dpi=90)
    plt.close(fig)


def parse_args(argv):
    ap = Parser(prog="python -m tools.claim", description=__doc__,
                formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", default="docs/claim", help="folder for the JSON files and PNGs")
    ap.add_argument("--settings", default=",".join(SETTINGS), help="hw:model, comma list")
    ap.add_argument("--workloads", default=",".join(CLASSES), help="comma list of "
                    + ", ".join(CLASSES))
    ap.add_argument("--factors", default="0.4,0.6,0.8,1.0,1.2,1.5,2.0",
                    help="rates as multiples of each setting's saturation")
    ap.add_argument("--duration", type=float, default=120.0, help="seconds of arrivals")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--jobs", type=int, default=os.cpu_count() or 1, help="processes")
    ap.add_argument("--policies", default=",".join(POLICIES),
                    help="the policies to run; the other rows are read from the JSON files already "
                         "in --out (to rerun rotasched alone after changing it)")
    ap.add_argument("--table", action="store_true",
                    help="print the markdown table of the files in --out (run nothing)")
    ap.add_argument("--ablate", default=None,
                    help="';'-separated policies, e.g. 'rotasched-lvf:alpha=1;rotasched:beta_f=0':"
                         " run each on the arrivals of the files in --out, "
                         "judge it by the same rules against their fcfs and fcfs-swap rows, write "
                         "ablation_WORKLOAD.json there")
    args = ap.parse_args(argv)
    args.settings, args.workloads = args.settings.split(","), args.workloads.split(",")
    for s in args.settings:
        hw, _, model = s.partition(":")
        if hw not in PROFILES or model not in MODELS:
            ap.error(f"--settings: {s!r} is not hw:model ({', '.join(PROFILES)}; "
                     f"{', '.join(MODELS)})")
    if any(w not in CLASSES for w in args.workloads):
        ap.error(f"--workloads: choose from {', '.join(CLASSES)}")
    try:
        args.factors = [float(f) for f in args.factors.split(",")]
    except ValueError as e:
        ap.error(f"--factors: {e}")
    if not all(f > 0 for f in args.factors) or not args.duration > 0 or args.jobs < 1:
        ap.error("--factors and --duration must be > 0, --jobs >= 1")
    args.policies = args.policies.split(",")
    if not set(args.policies) <= set(POLICIES):
        ap.error(f"--policies: choose from {', '.join(POLICIES)}")
    if args.ablate is not None:
        args.ablate = [v for v in args.ablate.split(";") if v]
        for v in args.ablate:
            try:
                replace(config(), policy=v)
            except ValueError as e:
                ap.error(f"--ablate: {v!r}: {e}")
    return args


def kept_rows(args) -> list[dict]:
    """Rows of the policies not being run, from the JSON files already in --out."""
    rows = []
    for s in args.settings:
        for w in args.workloads:
            path = os.path.join(args.out, f"{s.replace(':', '_')}_{w}.json")
            if os.path.exists(path):
                with open(path) as f:
                    rows += [r for r in json.load(f) if r["policy"] not in args.policies
                             and r["saturation_factor"] in args.factors]
    return rows


def ablate(args) -> None:
    """Each variant on the arrivals of the sweep's files, one verdict line per (file, variant)."""
    base = kept_rows(argparse.Namespace(**{**vars(args), "policies": []}))
    keys = sorted({(r["setting"], r["workload"], r["rate"], r["saturation_factor"])
                   for r in base if r["policy"] == "fcfs"})
    if not keys:
        sys.exit(f"claim: --ablate needs the sweep's files in {args.out} for these settings, "
                 "workloads and factors (run python -m tools.claim first)")
    jobs = [(s, w, v, rate, f, args.duration, args.seed) for (s, w, rate, f) in keys
            for v in args.ablate]
    rows = []
    try:
        with ProcessPoolExecutor(args.jobs) as pool:
            rows += pool.map(run_one, jobs)
    except KeyboardInterrupt:
        print(f"\nclaim: interrupted; {len(rows)} finished runs kept", file=sys.stderr)
    for w in args.workloads:
        with open(os.path.join(args.out, f"ablation_{w}.json"), "w") as f:
            json.dump([r for r in rows if r["workload"] == w], f, indent=1)
        for s in args.settings:
            mine = [r for r in base + rows if r["setting"] == s and r["workload"] == w]
            for v in args.ablate:
                if any(r["policy"] == v for r in mine):
                    fails, summary = judge(mine, s, v)
                    print(f"{s.replace(':', '_')}_{w} {v}: {summary}: " + (
                        "every rule holds" if not fails else
                        f"{len(fails)} shortfalls: " + "; ".join(fails[:4])))


def main(argv=None) -> None:
    args = parse_args(sys.argv[1:] if argv is None else argv)
    if args.ablate is not None:
        return ablate(args)
    if args.table:
        return table(kept_rows(argparse.Namespace(**{**vars(args), "policies": []})), args)
    os.makedirs(args.out, exist_ok=True)
    t, rows = time.perf_counter(), kept_rows(args)
    try:
        with ProcessPoolExecutor(args.jobs) as pool:
            pairs = [(s, w) for w in args.workloads for s in args.settings]
            sats = dict(zip(pairs, pool.map(saturation, *zip(*pairs), [args.seed] * len(pairs))))
            jobs = [(s, w, p, round(sats[(s, w)] * f, 2), f, args.duration, args.seed)
                    for (s, w) in pairs for f in args.factors for p in args.policies]
            for row in pool.map(run_one, jobs):
                rows.append(row)
    except KeyboardInterrupt:
        print(f"\nclaim: interrupted; {len(rows)} finished runs kept", file=sys.stderr)
    report(rows, args)
    print(f"{len(rows)} simulated runs in {time.perf_counter() - t:.0f} s; results in {args.out}")


def table(rows: list[dict], args) -> None:
    """Per file and rotating policy, at its best rate: the TTFT attainment gain over fcfs and
    fcfs-swap (points); over all rates: the worst TBT p99, TTFT p99 and throughput ratios to
    fcfs's, and whether every do-no-harm rule held."""
    print("| setting | workload | policy | gain vs fcfs | vs fcfs-swap | TBT p99 | TTFT p99 "
          "| throughput | rules |\n|---|---|---|---|---|---|---|---|---|")
    for s in args.settings:
        for w in args.workloads:
            mine = [r for r in rows if r["setting"] == s and r["workload"] == w]
            for pol in [p for p in POLICIES if p.startswith("rotasched")]:
                if not any(r["policy"] == pol for r in mine):
                    continue
                sc = score(mine, pol)
                rules = "held" if not sc["harms"] else f"{len(sc['harms'])} broken"
                print(f"| {s} | {w} | {pol} | {sc['gain']:+.1f} | {sc['gain_swap']:+.1f} | "
                      f"{sc['p99']:.2f}x | {sc['ttft_p99']:.2f}x | {sc['throughput']:.3f}x | "
                      f"{rules} |")


def report(rows: list[dict], args) -> None:
    """One JSON file per (setting, workload), one PNG per workload, a verdict line per file."""
    for w in args.workloads:
        done = [s for s in args.settings
                if {r["policy"] for r in rows if r["setting"] == s and r["workload"] == w}
                >= set(POLICIES)]
        for s in done:
            mine = [r for r in rows if r["setting"] == s and r["workload"] == w]
            name = f"{s.replace(':', '_')}_{w}"
            with open(os.path.join(args.out, name + ".json"), "w") as f:
                json.dump(mine, f, indent=1)
            fails, summary = judge(mine, s)
            print(f"{name}: {summary}: " + ("every rule holds" if not fails else
                                            f"{len(fails)} shortfalls: " + "; ".join(fails[:4])))
        if done:
            plot([r for r in rows if r["workload"] == w], done, w,
                 os.path.join(args.out, f"sweep_{w}.png"))


if __name__ == "__main__":
    main()
