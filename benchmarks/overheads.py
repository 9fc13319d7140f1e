"""Runtime overheads while training: event-loop lag, busy fraction per actor, peak RSS,
and the cost of one actor message.

    python benchmarks/overheads.py        # ~1 min on 2 cores

- loop lag: a task in the trainer's event loop sleeps 1 ms in a loop and records how late
  it wakes (p50 / p99 / max; target p99 < 20 ms), over a run of the throughput.py model
  (uncapped and capped SSD, mixed placement);
- busy fractions per actor and link bandwidths from `trainer.trace.summary()`;
- peak RSS of the process (resource.getrusage), next to the planner's host-memory model;
- message cost: a ping-pong through two snake.channels.Mailbox (bounded asyncio queues),
  microseconds per message, and the spans (operations) per iteration of the trace.
Writes benchmarks/results/overheads.json and overheads.png.
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
import time

from common import (  # type: ignore[import-not-found]
    RESULTS,
    add_model_args,
    checked_device,
    figure,
    gpt_config,
    machine,
    peak_rss_mib,
    save,
    snake_run,
)

from planner.profile import shape_of
from snake import Placement
from snake.channels import Mailbox
from snake.memory import host_memory


async def lag_probe(stop: asyncio.Event) -> dict:
    lags = []
    while not stop.is_set():
        t0 = time.perf_counter()
        await asyncio.sleep(0.001)
        lags.append(time.perf_counter() - t0 - 0.001)
    lags.sort()
    q = lambda f: lags[min(len(lags) - 1, int(f * len(lags)))] * 1e3  # noqa: E731
    return {"samples": len(lags), "p50_ms": q(0.5), "p90_ms": q(0.9), "p99_ms": q(0.99),
            "max_ms": lags[-1] * 1e3, "hist_ms": [round(x * 1e3, 3) for x in lags[:: max(1, len(lags) // 400)]]}


async def loop_cpu_probe(stop: asyncio.Event) -> list[tuple[float, float]]:
    """(wall, CPU time of the event loop's thread) every 100 ms: what the loop itself costs,
    measured apart from the lag probe (whose 1 ms wake-ups cost CPU of their own)."""
    samples = [(time.perf_counter(), time.thread_time())]
    while not stop.is_set():
        await asyncio.sleep(0.1)
        samples.append((time.perf_counter(), time.thread_time()))
    return samples


def loop_cpu(run: dict) -> dict:
    """The loop thread's CPU over the timed steps (the first step, with setup, left out)."""
    samples = run["probe"]
    timed = sum(run["step_seconds"][1:])
    t_end, c_end = samples[-1]
    t0, c0 = next((t, c) for t, c in samples if t >= t_end - timed)
    share = (c_end - c0) / (t_end - t0)
    per_it = share * statistics.median(run["step_seconds"][1:])
    return {"loop_cpu_share_of_one_core": share, "loop_cpu_s_per_iteration": per_it,
            "loop_cpu_us_per_traced_operation": per_it / run["spans_per_iteration"] * 1e6,
            "window_s": t_end - t0}


class Msg:
    __slots__ = ("key",)

    def __init__(self, key: int) -> None:
        self.key = key


async def mailbox_cost(n: int = 20000) -> dict:
    """Round trips through two Mailboxes (put + get each way), in microseconds per message."""
    a, b = Mailbox("a", 4), Mailbox("b", 4)

    async def echo() -> None:
        for _ in range(n):
            m = await a.get()
            await b.put(m)

    t = asyncio.create_task(echo())
    t0 = time.perf_counter()
    for i in range(n):
        await a.put(Msg(i))
        await b.take(i)
    dt = time.perf_counter() - t0
    await t
    return {"messages": 2 * n, "us_per_message": dt / (2 * n) * 1e6}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--quick", action="store_true")
    add_model_args(ap, layers=4, width=512, seq=32)
    args = ap.parse_args()
    device = checked_device(args)
    L, C, T, MB, M = args.layers, args.width, args.seq, 1, 8
    steps = 2 if args.quick else 6
    cfg = gpt_config(L, C, T)
    t_start = time.perf_counter()
    rss0 = peak_rss_mib()
    runs = {}
    for label, cap in (("uncapped", None), ("capped_300MBps", 300e6)):
        r = snake_run(cfg, micro_batches=M, micro_batch_size=MB, seq=T, steps=steps,
                      placement=Placement(param=0.5, ckpt=1.0, opt=0.0), alpha=0.25, cap=cap,
                      probe=lag_probe, device=device)
        r["peak_rss_mib_after"] = peak_rss_mib()
        runs[label] = r
        print(label, {k: round(v, 2) for k, v in r["probe"].items() if k != "hist_ms"},
              r["busy_fraction"], f"peak RSS {r['peak_rss_mib_after']:.0f} MiB", flush=True)
    cpu = {}
    for label, cap in (("uncapped", None), ("capped_300MBps", 300e6)):
        r = snake_run(cfg, micro_batches=M, micro_batch_size=MB, seq=T, steps=steps,
                      placement=Placement(param=0.5, ckpt=1.0, opt=0.0), alpha=0.25, cap=cap,
                      probe=loop_cpu_probe, device=device)
        cpu[label] = {"iteration_seconds": r["iteration_seconds"], "spans_per_iteration": r["spans_per_iteration"],
                      **loop_cpu(r)}
        print(label, "event loop CPU", {k: round(v, 4) if isinstance(v, float) else v for k, v in cpu[label].items()},
              flush=True)
    shape = shape_of(cfg, MB, T, "float32")
    model_mem = host_memory(shape, n_micro=M, alpha=0.25, schedule="vertical", workers=2).at(0.5, 1.0, 0.0)
    msg = asyncio.run(mailbox_cost(2000 if args.quick else 20000))
    spans_per_it = {k: r["spans_per_iteration"] for k, r in runs.items()}
    result = {
        "machine": machine(), "model": {"n_layer": L, "n_embd": C, "seq": T, "micro_batches": M},
        "runs": runs, "peak_rss_mib_before_runs": rss0, "peak_rss_mib": peak_rss_mib(),
        "planner_host_memory_model_mib": model_mem / 2**20,
        "mailbox": msg, "spans_per_iteration": spans_per_it, "event_loop_cpu": cpu,
        "targets": {"loop_lag_p99_ms": 20},
        "seconds_total": time.perf_counter() - t_start,
    }
    name = "overheads_quick" if args.quick else "overheads"
    print(save(name, result))
    print("mailbox", msg)
    fig, (a1, a2) = figure(1, 2, size=(12, 4.5))
    for label, r in runs.items():
        h = r["probe"]["hist_ms"]
        a1.plot([i / max(1, len(h) - 1) for i in range(len(h))], h, label=label)
    a1.set_yscale("log")
    a1.axhline(20, color="k", ls="--", label="target p99 20 ms")
    a1.set_xlabel("quantile")
    a1.set_ylabel("1 ms sleep overshoot (ms)")
    a1.legend()
    a1.grid(alpha=0.3)
    labels = sorted(set().union(*(r["busy_fraction"] for r in runs.values())))
    w = 0.4
    for j, (label, r) in enumerate(runs.items()):
        a2.bar([i + (j - 0.5) * w for i in range(len(labels))], [r["busy_fraction"].get(k, 0) for k in labels], w, label=label)
    a2.set_xticks(range(len(labels)), labels, rotation=45, fontsize=7)
    a2.set_ylabel("busy fraction of wall time")
    a2.legend()
    fig.tight_layout()
    fig.savefig(RESULTS / f"{name}.png", dpi=110)


if __name__ == "__main__":
    main()
