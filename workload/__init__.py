"""What the benchmarks feed in and what they measure: traces, arrivals and prompts (trace.py);
SLO metrics, tables, the verdict and plots (metrics.py). Pure Python, no torch."""
