"""Where a step's time goes, from a torch.profiler run: one table of time per kernel (or per CPU op), shared by
bench_mhc.py (--profile, a stack step) and bench_ddp.py (--profile, a trainer step)."""
from __future__ import annotations


def time_per_name(prof, steps: int, device: bool = True, width: int = 90) -> tuple[float, list[dict]]:
    """(total us per step, rows largest first) of each kernel's own device time (device=True) or each CPU op's own
    host time, per step: mean over the `steps` the profiler saw. A kernel's self device time is its own; CPU ops have
    none of their own, so the device table lists kernels (and copies) only."""
    per: dict[str, list] = {}
    for ev in prof.key_averages():
        if device:
            us = getattr(ev, "self_device_time_total", None)
            us = ev.self_cuda_time_total if us is None else us
        else:
            us = ev.self_cpu_time_total
        if us > 0:
            d = per.setdefault(ev.key[:width], [0.0, 0])
            d[0] += us
            d[1] += ev.count
    rows = sorted(({"name": k, "us_per_step": v[0] / steps, "calls_per_step": v[1] / steps} for k, v in per.items()),
                  key=lambda r: -r["us_per_step"])
    return sum(r["us_per_step"] for r in rows), rows


def print_rows(rows: list[dict], total: float, top: int = 25) -> None:
    for r in rows[:top]:
        print(f"    {r['us_per_step']:9.0f} us {100 * r['us_per_step'] / max(total, 1e-9):5.1f}%  "
              f"x{r['calls_per_step']:<5.0f} {r['name']}", flush=True)
