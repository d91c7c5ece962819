"""Where a step's time goes, from a torch.profiler run: time per kernel (or per CPU op), and the device's idle gaps
charged to the host ops that ended them; shared by `python -m bench stack --profile` and `trainer --profile`."""

from __future__ import annotations


def time_per_name(prof, steps: int, device: bool = True, width: int = 90) -> tuple[float, list[dict]]:
    """(total us per step, rows largest first) of each kernel's own device time (device=True) or each CPU op's own
    host time, per step: mean over the `steps` the profiler saw. A kernel's self device time is its own; CPU ops have
    none of their own, so the device table lists kernels (and copies) only."""
    per: dict[str, list] = {}
    events = prof.key_averages()
    ranges = {ev.key for ev in events if getattr(ev, "is_user_annotation", False)}
    for ev in events:
        if device and (getattr(getattr(ev, "device_type", None), "name", "CUDA") == "CPU" or ev.key in ranges):
            # with host and device activities, a host op's kernels are also the device events' own time, and a
            # record_function range (Lightning's optimizer step around the whole closure) gets a device-side copy
            continue
        if device:
            us = getattr(ev, "self_device_time_total", None)
            us = ev.self_cuda_time_total if us is None else us
        else:
            us = ev.self_cpu_time_total
        if us > 0:
            d = per.setdefault(ev.key[:width], [0.0, 0])
            d[0] += us
            d[1] += ev.count
    rows = sorted(
        ({"name": k, "us_per_step": v[0] / steps, "calls_per_step": v[1] / steps} for k, v in per.items()),
        key=lambda r: -r["us_per_step"],
    )
    return sum(r["us_per_step"] for r in rows), rows


def print_rows(rows: list[dict], total: float, top: int = 25) -> None:
    for r in rows[:top]:
        print(
            f"    {r['us_per_step']:9.0f} us {100 * r['us_per_step'] / max(total, 1e-9):5.1f}%  "
            f"x{r['calls_per_step']:<5.0f} {r['name']}",
            flush=True,
        )


_DEVICE_CATS = ("kernel", "gpu_memcpy", "gpu_memset")
_LAUNCH_CATS = ("cuda_runtime", "cuda_driver")
_HOST_CATS = ("cpu_op", "user_annotation")


def idle_gaps(trace: dict, steps: int, min_us: float = 2.0, top: int = 20) -> dict:
    """Where the device waited on the host, from a Kineto trace (`prof.export_chrome_trace`): every gap of at least
    `min_us` between device work is charged to what the host was inside when it launched the work that ended the
    gap (the innermost op, and the outermost two levels: e.g. an autograd node or Optimizer.step). A gap whose work
    had been launched before the gap opened is not the host's ("queued": a wait on something else).
    Per-step microseconds, largest first."""
    evs = [e for e in trace.get("traceEvents", []) if e.get("ph") == "X" and "dur" in e]
    work = sorted((e for e in evs if e.get("cat") in _DEVICE_CATS), key=lambda e: e["ts"])
    launch = {
        e["args"]["correlation"]: e for e in evs if e.get("cat") in _LAUNCH_CATS and "correlation" in e.get("args", {})
    }
    gaps, end = [], None  # (gap start, gap us, launching host event | None)
    for e in work:
        if end is not None and e["ts"] - end >= min_us:
            gaps.append((end, e["ts"] - end, launch.get(e.get("args", {}).get("correlation"))))
        end = e["ts"] + e["dur"] if end is None else max(end, e["ts"] + e["dur"])
    # the host ops around each launch: per thread, a sweep over ops nested by (ts, -dur) with a stack
    by_tid: dict = {}
    for e in evs:
        if e.get("cat") in _HOST_CATS:
            by_tid.setdefault(e.get("tid"), []).append(e)
    asks: dict = {}
    for i, (_, _, ln) in enumerate(gaps):
        if ln is not None:
            asks.setdefault(ln.get("tid"), []).append((ln["ts"], i))
    stacks: dict = {}
    for tid, qs in asks.items():
        ops = sorted(by_tid.get(tid, []), key=lambda e: (e["ts"], -e["dur"]))
        stack, j = [], 0
        for t, i in sorted(qs):
            while j < len(ops) and ops[j]["ts"] <= t:
                while stack and stack[-1]["ts"] + stack[-1]["dur"] <= ops[j]["ts"]:
                    stack.pop()
                stack.append(ops[j])
                j += 1
            while stack and stack[-1]["ts"] + stack[-1]["dur"] < t:
                stack.pop()
            stacks[i] = [o["name"] for o in stack]
    inner: dict = {}
    outer: dict = {}
    queued = host = 0.0
    for i, (start, us, ln) in enumerate(gaps):
        if ln is None or ln["ts"] + ln["dur"] <= start:
            queued += us
            continue
        host += us
        names = stacks.get(i) or ["(no op)"]
        inner[names[-1][:90]] = inner.get(names[-1][:90], 0.0) + us
        key = " > ".join(n[:60] for n in names[:2])
        outer[key] = outer.get(key, 0.0) + us

    def rows(d):
        return [{"name": k, "us_per_step": v / steps} for k, v in sorted(d.items(), key=lambda kv: -kv[1])[:top]]

    return {
        "gaps_per_step": len(gaps) / steps,
        "host_us_per_step": host / steps,
        "queued_us_per_step": queued / steps,
        "by_inner_op": rows(inner),
        "by_outer_ops": rows(outer),
    }
