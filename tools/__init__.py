"""Tools beside the engine, each run as `python -m tools.NAME`: the GPU-scale simulator (sim),
the speed and copy benchmark (bench_speed), schedule-log replay and diff (schedlog), and the
prepared GPU check (gpu_check)."""
