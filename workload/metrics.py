"""SLO metrics and their presentation, shared by bench.py and sim.py (pure Python, no torch).

Metrics follow vLLM's benchmark_serving: TTFT = first token - arrival; TBT = every gap between
consecutive tokens, pooled over requests (as the paper's client does); TPOT = (e2e - TTFT) /
(n - 1); goodput = requests/s meeting both the TTFT and the TPOT SLO.
"""
from __future__ import annotations

import math
import statistics
import time

from tqdm import tqdm

LEGEND = ("TTFT: arrival to first token. TBT: each gap between two tokens of a request, pooled. "
          "E2E: arrival to last token.\nattainment: share of requests with TTFT <= SLO, share of "
          "gaps <= TBT SLO. goodput: requests/s meeting the TTFT and TPOT SLOs.\nrot: rotations "
          "(KV parked on host and back); pre: preemptions by recompute; GiB: KV moved between "
          "tiers, write-backs included.")
UNEVEN = 0.03  # compared runs whose machine speed differs more than this are not level


def percentile(xs: list[float], p: float) -> float:
    """Linear-interpolated percentile (numpy's default); nan for no data."""
    if not xs:
        return math.nan
    s = sorted(xs)
    k = (len(s) - 1) * p / 100
    lo, hi = math.floor(k), math.ceil(k)
    return s[lo] + (s[hi] - s[lo]) * (k - lo)


def stats(name: str, xs: list[float]) -> dict:
    return {f"{name}_mean_s": sum(xs) / len(xs) if xs else math.nan,
            f"{name}_p50_s": percentile(xs, 50), f"{name}_p99_s": percentile(xs, 99)}


def summarize(records: list[tuple[float, list[float]]], ttft_slo: float, tbt_slo: float,
              tpot_slo: float | None = None) -> dict:
    """records: (arrival, token times) per request. The TPOT SLO defaults to the TBT SLO."""
    tpot_slo = tbt_slo if tpot_slo is None else tpot_slo
    ttft, tbt, e2e, good, n_tok = [], [], [], 0, 0
    for arrival, times in records:
        if not times:
            continue
        first = times[0] - arrival
        tpot = (times[-1] - times[0]) / (len(times) - 1) if len(times) > 1 else 0.0
        ttft.append(first)
        tbt += [b - a for a, b in zip(times, times[1:])]
        e2e.append(times[-1] - arrival)
        n_tok += len(times)
        good += first <= ttft_slo and tpot <= tpot_slo
    n = len(records)
    start = min((a for a, _ in records), default=0.0)
    end = max((t[-1] for _, t in records if t), default=start)
    duration = max(end - start, 1e-9)
    return {"num_requests": n, "completed": len(ttft), "duration_s": duration,
            **stats("ttft", ttft), **stats("tbt", tbt), **stats("e2e", e2e),
            "ttft_attainment": sum(x <= ttft_slo for x in ttft) / n if n else math.nan,
            "tbt_attainment": sum(g <= tbt_slo for g in tbt) / len(tbt) if tbt else 1.0,
            "goodput_req_s": good / duration, "throughput_tok_s": n_tok / duration,
            "request_throughput": len(ttft) / duration}


# ---------------------------------------------------------------- the table

COLUMNS = ("  rate   mean   p50   p99   mean   p50   p99    p99   TTFT    TBT goodput  tok/s"
           "    rot  pre     GiB")
GROUPS = "        |-- TTFT (s) ------| |-- TBT (ms) -----|  E2E s |attainment|"


def print_table(rows: list[dict], slos: tuple[float, float], title: str = "Serving benchmark",
                legend: bool = True) -> None:
    width = min(24, max([6] + [len(r["policy"]) for r in rows]))
    head = f"{'policy':<{width}}{COLUMNS}"
    print(f"\n== {title}: TTFT SLO {slos[0]:.2f} s, TBT SLO {slos[1] * 1e3:.0f} ms ==")
    print(" " * width + GROUPS)
    print(head)
    print("-" * len(head))
    for r in rows:
        name = r["policy"]
        if len(name) > width:
            print(name)
            name = ""
        print(f"{name:<{width}}{r['rate']:6.2f}{r['ttft_mean_s']:7.2f}{r['ttft_p50_s']:6.2f}"
              f"{r['ttft_p99_s']:6.2f}{r['tbt_mean_s'] * 1e3:7.0f}{r['tbt_p50_s'] * 1e3:6.0f}"
              f"{r['tbt_p99_s'] * 1e3:6.0f}{r['e2e_p99_s']:7.1f}{r['ttft_attainment']:7.1%}"
              f"{r['tbt_attainment']:7.1%}{r['goodput_req_s']:8.2f}{r['throughput_tok_s']:7.1f}"
              f"{r.get('rotations', 0):7d}{r.get('recomputes', 0):5d}"
              f"{r.get('bytes_moved', 0) / 2**30:8.1f}")
    if legend:
        print(LEGEND)


# ---------------------------------------------------------------- the verdict

def harms(base: dict, row: dict, swap: dict | None = None) -> list[str]:
    """Where a rotating policy breaks the claim's do-no-harm rules against fcfs (base) and, if
    given, fcfs-swap on the same arrivals: TBT attainment more than 5 points below fcfs's; TBT
    p99 above both 2x fcfs's and the TBT SLO (a pause within the SLO is what rotation may
    spend); throughput below 95% of fcfs's; TTFT attainment more than 2 points below either."""
    out = []
    slo = row.get("tbt_slo_s") or 0.0
    if row["tbt_p99_s"] > max(2 * base["tbt_p99_s"], slo):
        out.append(f"TBT p99 {row['tbt_p99_s'] * 1e3:.0f} ms is "
                   f"{row['tbt_p99_s'] / base['tbt_p99_s']:.1f}x fcfs's")
    if row["tbt_attainment"] < base["tbt_attainment"] - 0.05:
        out.append(f"TBT attainment {100 * (row['tbt_attainment'] - base['tbt_attainment']):+.1f}"
                   " points")
    if row["throughput_tok_s"] < 0.95 * base["throughput_tok_s"]:
        out.append(f"throughput {row['throughput_tok_s'] / base['throughput_tok_s'] - 1:+.1%}")
    for other in (base, swap):
        if other is not None and row["ttft_attainment"] < other["ttft_attainment"] - 0.02:
            d = 100 * (row["ttft_attainment"] - other["ttft_attainment"])
            out.append(f"TTFT attainment {d:+.1f} points vs {other['policy']}")
    return out


def kv_pressure(base: dict, row: dict) -> bool:
    """Did the KV pool bind at all: fcfs preempted, or the other policy rotated for room?"""
    return base.get("recomputes", 0) > 0 or row.get("rotations", 0) > 0


def verdict(rows: list[dict], base: str = "fcfs") -> list[str]:
    """The paper's claim judged in words, per rate and rotating policy, against `base` (and
    fcfs-swap where it ran) on the same arrivals: TTFT attainment raised, TBT and throughput
    comparable, each held or fell short against its rule (harms). Whether the runs were level
    (the machine's speed, the A/A gap of a policy run twice) comes first: a verdict on uneven
    runs says so."""
    groups = tier_groups(rows)
    if len(groups) > 1 or "" not in groups:
        return [f"prefix caching {tier}: {line}" for tier, group in groups.items()
                for line in verdict(group, base)]
    lines = []
    for rate in sorted({r["rate"] for r in rows}):
        by = {r["policy"]: r for r in rows if r["rate"] == rate}
        rotating = [r for p, r in by.items() if p.startswith("rotasched") and policy_of(p) == p]
        if base not in by or not rotating:
            continue
        lines += uneven_speed(rate, by) + same_policy_twice(rate, by)
        for r in rotating:
            lines += judge_row(rate, by[base], r, by.get("fcfs-swap"))
    return lines


def judge_row(rate: float, b: dict, r: dict, swap: dict | None) -> list[str]:
    """Three lines: TTFT gain, TBT comparable, throughput comparable, each held or fell short."""
    bad = harms(b, r, swap)
    gain = 100 * (r["ttft_attainment"] - b["ttft_attainment"])
    over = f", {100 * (r['ttft_attainment'] - swap['ttft_attainment']):+.1f} over fcfs-swap" \
        if swap else ""
    ok_ttft = gain > 0 and not any(h.startswith("TTFT") for h in bad)
    ok_tbt = not any(h.startswith("TBT") for h in bad)
    ok_thr = not any(h.startswith("throughput") for h in bad)
    word = {True: "held", False: "fell short"}
    head = f"rate {rate:.2f}/s, {r['policy']} vs {b['policy']}:"
    tbt = (f"attainment {100 * (r['tbt_attainment'] - b['tbt_attainment']):+.1f} points (rule: "
           f">= -5), p99 {r['tbt_p99_s'] / b['tbt_p99_s']:.2f}x (rule: <= 2x or within the SLO)")
    out = [f"{head} TTFT attainment raised: {word[ok_ttft]}: {100 * r['ttft_attainment']:.1f}% "
           f"vs {100 * b['ttft_attainment']:.1f}%, {gain:+.1f} points{over} (rule: a gain, and "
           "at most 2 points under either)",
           f"{head} TBT comparable: {word[ok_tbt]}: {tbt}",
           f"{head} throughput comparable: {word[ok_thr]}: "
           f"{r['throughput_tok_s'] / b['throughput_tok_s']:.2f}x (rule: >= 0.95x)"]
    if not kv_pressure(b, r):
        out.append(f"{head} no KV pressure ({b['policy']} never preempted, nothing rotated): "
                   "rotation had nothing to relieve, so the differences are the machine's")
    return out


def policy_of(label: str) -> str:
    """The policy a row label names: bench.py labels a policy's second run 'fcfs-swap#2', and
    a run with its own prefix caching 'fcfs@device' (caching_of)."""
    return label.split("#")[0].split("@")[0]


def caching_of(label: str) -> str | None:
    """The prefix caching a row label sets ('rotasched@both': both), or None."""
    head = label.split("#")[0]
    return head.split("@")[1] if "@" in head else None


def tier_groups(rows: list[dict]) -> dict[str, list[dict]]:
    """Rows by the prefix caching their labels set, each with that part of the label dropped,
    so that 'rotasched@off' is judged against 'fcfs@off' ('' for labels that set none)."""
    groups: dict[str, list[dict]] = {}
    for r in rows:
        tier = caching_of(r["policy"])
        plain = r["policy"].replace(f"@{tier}", "") if tier else r["policy"]
        groups.setdefault(tier or "", []).append(r | {"policy": plain})
    return groups


def same_policy_twice(rate: float, by: dict[str, dict]) -> list[str]:
    """A/A: a policy run again on the same arrivals (bench.py labels it 'fcfs-swap#2'): how far
    apart the machine alone puts two runs, the resolution of every comparison at this rate."""
    lines = []
    for label, again in by.items():
        first = by.get(policy_of(label))
        if first is None or first is again:
            continue
        gap = 100 * abs(again["ttft_attainment"] - first["ttft_attainment"])
        sp = [r.get("speed") for r in (first, again)]
        speeds = f", machine speed {sp[0]:.3f} and {sp[1]:.3f}" if all(sp) else ""
        lines.append(f"rate {rate:.2f}/s: A/A: {label} repeats {first['policy']}: TTFT attainment "
                     f"{first['ttft_attainment']:.1%} and {again['ttft_attainment']:.1%} "
                     f"({gap:.1f} points apart), TBT attainment {first['tbt_attainment']:.1%} and "
                     f"{again['tbt_attainment']:.1%}{speeds}: differences between policies "
                     "within that are the machine's as much as theirs")
    return lines


def uneven_speed(rate: float, by: dict[str, dict]) -> list[str]:
    """A warning where the machine ran the compared runs at speeds further apart than UNEVEN
    (the rows' `speed`: step time for the same work, bench.py measures it)."""
    speeds = {p: r["speed"] for p, r in by.items() if r.get("speed")}
    if not speeds:
        return []
    slow, fast = max(speeds, key=speeds.get), min(speeds, key=speeds.get)
    ratio = speeds[slow] / speeds[fast] - 1
    if ratio <= UNEVEN:
        return []
    return [f"rate {rate:.2f}/s: NOT LEVEL: the machine ran {slow} {ratio:.1%} slower than "
            f"{fast} for the same work; near saturation that alone moves TTFT attainment by "
            "points, so rerun (or --clock own, --repeat) before trusting the lines below"]


def plot(rows: list[dict], path: str, title: str) -> None:
    """Attainment vs request rate, one line per policy, like the paper's figures."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    fig, axes = plt.subplots(1, 2, figsize=(10, 4))
    for ax, key, name in ((axes[0], "ttft_attainment", "TTFT SLO attainment"),
                          (axes[1], "tbt_attainment", "TBT SLO attainment")):
        for pol in dict.fromkeys(r["policy"] for r in rows):
            pts = sorted((r["rate"], r[key]) for r in rows if r["policy"] == pol)
            ax.plot([p[0] for p in pts], [100 * p[1] for p in pts], marker="o", label=pol)
        ax.set_xlabel("request rate (req/s)")
        ax.set_ylabel(f"{name} (%)")
        ax.set_ylim(0, 105)
        ax.grid(alpha=0.3)
    axes[0].legend()
    fig.suptitle(title)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


SPREAD = (("TTFT att", "ttft_attainment", 100, "%"), ("TBT att", "tbt_attainment", 100, "%"),
          ("TBT p99", "tbt_p99_s", 1e3, " ms"), ("tok/s", "throughput_tok_s", 1, ""))


def print_spread(rows: list[dict]) -> None:
    """min / median / max over the repeats of each figure, per policy and rate (and the TTFT
    attainment gain over fcfs in the same repeat)."""
    print(f"\n== spread over {len({r['repeat'] for r in rows})} repeats: min / median / max ==")
    for pol in dict.fromkeys(r["policy"] for r in rows):
        for rate in sorted({r["rate"] for r in rows}):
            mine = [r for r in rows if r["policy"] == pol and r["rate"] == rate]
            if not mine:
                continue
            parts = [f"{name} " + " / ".join(f"{x * scale:.1f}" for x in spread(
                [r[key] for r in mine])) + unit for name, key, scale, unit in SPREAD]
            base = {r["repeat"]: r for r in rows if r["policy"] == "fcfs" and r["rate"] == rate}
            gains = [100 * (r["ttft_attainment"] - base[r["repeat"]]["ttft_attainment"])
                     for r in mine if r["repeat"] in base and pol != "fcfs"]
            if gains:
                parts.append("TTFT gain " + " / ".join(f"{g:+.1f}" for g in spread(gains)))
            print(f"{pol:<24} {rate:6.2f}: " + "; ".join(parts))


def spread(xs: list[float]) -> tuple[float, float, float]:
    return min(xs), statistics.median(xs), max(xs)


# ---------------------------------------------------------------- progress and timing

def progress(total: int, desc: str, unit: str = "req") -> tqdm:
    """A labelled progress bar with an ETA on a terminal; silent when output is piped."""
    return tqdm(total=total, desc=desc, unit=unit, leave=False, dynamic_ncols=True, disable=None)


def best_time(fn, repeat: int = 3, sync=None) -> float:
    """Best wall time of fn() over `repeat` runs, after one warm-up (sync() waits for a device)."""
    sync = sync or (lambda: None)
    fn()
    sync()
    best = math.inf
    for _ in range(repeat):
        t = time.perf_counter()
        fn()
        sync()
        best = min(best, time.perf_counter() - t)
    return best
