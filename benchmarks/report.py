"""Print the markdown tables of BENCHMARKS.md from benchmarks/results/*.json.

    python benchmarks/report.py          # every table
    python benchmarks/report.py runs     # one row per throughput.py run on record (section 1)
    python benchmarks/report.py throughput_link_r13a   # the tables of one throughput.py run (results/NAME.json)
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

R = Path(__file__).resolve().parent / "results"


def load(name: str):
    p = R / f"{name}.json"
    return json.loads(p.read_text()) if p.exists() else None


def fmt(x, d=1):
    return "-" if x is None else f"{x:.{d}f}"


def throughput(name: str = "throughput") -> None:
    d = load(name)
    if not d:
        return
    print(f"### {name}\n")
    runs, roof = d["runs"], d["rooflines"]
    if "cpu_memory_budget_bytes" in d:
        print(f"CPU memory budget (both schedules): {d['cpu_memory_budget_bytes'] / 2**20:.0f} MiB")

    def cell(r):
        it = r["iteration_seconds"]
        tok = r["tokens_per_iteration"]
        return f"{r['tokens_per_s']:.0f} [{tok / it['max']:.0f}-{tok / it['min']:.0f}]"

    def pl(r):
        p = r.get("plan", {}).get("placement") or r["placement"]
        return f"{p['param']:.2f}/{p['ckpt']:.2f}/{p['opt']:.2f}"

    for prefix in ("", "fixed_"):
        for label in ("capped", "uncapped"):
            if f"{prefix}vertical_{label}" not in runs:
                continue
            summ = d["summary"][prefix + label]
            print(f"\n{prefix or 'planned '}{label}: tokens/s, median of timed steps [min-max]\n")
            print("| M | vertical | horizontal | v/h | v plan p/c/o, alpha | h plan p/c/o | PyTorch | PyTorch+ckpt | compute roof (profile) | compute roof (torch+ckpt fwd/bwd) | I/O roof | vertical / min(compute torch+ckpt, I/O) | vertical / own SSD traffic at cap |")
            print("|---|---|---|---|---|---|---|---|---|---|---|---|---|")
            for i, rv in enumerate(runs[f"{prefix}vertical_{label}"]):
                rh = runs[f"{prefix}horizontal_{label}"][i]
                rt, rc = runs["torch"][i], runs["torch+ckpt"][i]
                rr = (d.get("rooflines_fixed", roof) if prefix else roof)[label][i]
                vr = summ["vertical_vs_roofline"][i]
                print(f"| {rv['micro_batches']} | {cell(rv)} | {cell(rh)} | {rv['tokens_per_s'] / rh['tokens_per_s']:.2f} | "
                      f"{pl(rv)}, {rv['alpha']:.2f} | {pl(rh)} | "
                      f"{cell(rt)} | {cell(rc)} | {rr['compute_roofline_profile']:.0f} | {rr['compute_roofline_torch_ckpt']:.0f} | "
                      f"{rr['io_roofline']:.0f} | {rv['tokens_per_s'] / rr['roofline']:.2f} | {fmt(rv['tokens_per_s'] / vr['ssd_traffic_roofline'] if vr['ssd_traffic_roofline'] else None, 2)} |")
            print(f"\n{prefix}{label}: model TFLOP/s and bytes per iteration (MB)\n")
            print("| M | vertical TFLOP/s | horizontal TFLOP/s | vertical SSD MB | horizontal SSD MB | vertical cpu->gpu MB | horizontal cpu->gpu MB | vertical gpu->cpu MB | horizontal gpu->cpu MB |")
            print("|---|---|---|---|---|---|---|---|---|")
            for i, rv in enumerate(runs[f"{prefix}vertical_{label}"]):
                rh = runs[f"{prefix}horizontal_{label}"][i]
                lv, lh = rv["traffic"]["links"], rh["traffic"]["links"]
                print(f"| {rv['micro_batches']} | {rv['tflops']:.4f} | {rh['tflops']:.4f} | {rv['traffic']['ssd_bytes'] / 1e6:.0f} | "
                      f"{rh['traffic']['ssd_bytes'] / 1e6:.0f} | {lv.get('cpu->gpu', 0) / 1e6:.0f} | {lh.get('cpu->gpu', 0) / 1e6:.0f} | "
                      f"{lv.get('gpu->cpu', 0) / 1e6:.0f} | {lh.get('gpu->cpu', 0) / 1e6:.0f} |")
    pooled = d["summary"].get("capped", {}).get("vertical_vs_roofline_pooled")
    if pooled:
        print(f"\ncapped: vertical / min(roofs), {pooled[0]['rounds']} back-to-back pairs per M, timed steps pooled\n")
        link = pooled[0].get("link_roofline") is not None  # an emulated host<->device link: its roof too
        print(f"| M | vertical tok/s | compute roof (torch+ckpt fwd/bwd) | SSD roof |{' link roof |' if link else ''} "
              "vertical / min(roofs) | per pair |")
        print("|---|---|---|---|---|---|" + ("---|" if link else ""))
        for x in pooled:
            print(f"| {x['M']} | {x['vertical']:.0f} | {x['compute_roofline_torch_ckpt']:.0f} | {x['io_roofline']:.0f} | "
                  + (f"{x['link_roofline']:.0f} | " if link else "")
                  + f"{x['ratio']:.2f} | {' / '.join(f'{y:.2f}' for y in x['ratio_per_round'])} |")
    print("\nsummary:", json.dumps({k: v for k, v in d["summary"].items()}, indent=1))


def _min_ratio(points) -> str:
    """The lowest vertical / min(roofs) over a sweep, with its M, and how many points reach 0.9."""
    if not points:
        return "-"
    low = min(points, key=lambda x: x["ratio"])
    ok = sum(x["ratio"] >= 0.9 for x in points)
    return f"{low['ratio']:.2f} (M={low['M']}), {ok}/{len(points)}"


def run_row(name: str, d: dict) -> str:
    """One throughput.py run: its setting and where it stands against issue 4's first three targets."""
    c = d["summary"]["capped"]
    m = d["model"]
    budget = d.get("cpu_memory_budget_bytes")
    link = d.get("device_link_bytes_per_s")
    cpu = d["machine"].get("cpu", "?").replace("(R)", "")
    setting = (f"{m['n_layer']}x{m['n_embd']} seq {m['seq']}, {d['machine']['cores']} cores {cpu}{', ' + d['device'] if d.get('device') else ''}; "
               f"{budget / 2**20:.0f} MiB, {d['cap_bytes_per_s'] / 1e6:.0f} MB/s" if budget else "-")
    if link:
        setting += f", link {link / 1e6:.0f} MB/s"
    mv, mh = c["M_to_90pct_vertical"], c["M_to_90pct_horizontal"]
    mv16, mh16 = c["M_to_90pct_vertical_upto16"], c["M_to_90pct_horizontal_upto16"]
    pooled = c.get("M_to_90pct_vertical_pooled")
    unc = d["summary"].get("uncapped", {}).get("saturated_vertical_over_horizontal")
    return (f"| {name} | {setting} | {max(d['Ms'])} | {c['saturated_vertical_over_horizontal']:.2f} | "
            f"{c['saturated_vertical_over_horizontal_upto16']:.2f} | {mv} vs {mh}{' (pooled ' + str(pooled) + ')' if pooled else ''} | "
            f"{mv16} vs {mh16} | {_min_ratio(c['vertical_vs_roofline'])} | "
            f"{_min_ratio(c.get('vertical_vs_roofline_pooled', []))} | "
            f"{_min_ratio(c.get('vertical_vs_roofline_back_to_back', []))} | {fmt(unc, 2)} |")


def runs_table() -> None:
    """Every throughput.py run whose JSON is kept (results/ and results/logs/), one row each."""
    files = [*R.glob("throughput*.json"), *(R / "logs").glob("throughput*.json")]
    print("\n### throughput runs on record\n")
    print("| run | setting (model, cores, CPU, device; budget, SSD cap) | max M | v/h saturated | v/h, M <= 16 | M to 90 % v vs h | same, M <= 16 "
          "| v / min(roofs): lowest (M), points >= 0.9 | same, pairs pooled | same, back-to-back pairs | v/h uncapped |")
    print("|---|---|---|---|---|---|---|---|---|---|---|")
    for f in sorted(files, key=lambda f: f.stem):
        d = json.loads(f.read_text())
        if "summary" in d and "capped" in d["summary"]:
            print(run_row(f.stem, d))


def rounds(r) -> str:
    xs = r.get("tokens_per_s_rounds") or [r["tokens_per_s"]]
    return f"{r['tokens_per_s']:.0f}" + (f" [{min(xs):.0f}-{max(xs):.0f}]" if len(xs) > 1 else "")


def delay() -> None:
    d = load("delay_and_ssd")
    if not d:
        return
    print("\n### delay_and_ssd\n")
    print("| M | alpha=0 tok/s | planned alpha | planned-alpha tok/s | ratio | all-SSD tok/s (alpha) | planned placement (param/ckpt/opt, alpha) | planned tok/s | ratio | SSD MB all-SSD / planned |")
    print("|---|---|---|---|---|---|---|---|---|---|")
    for r in d["rows"]:
        rr = r["runs"]
        pb = r["planned_budget"]
        pl = pb["placement"]
        print(f"| {r['M']} | {rounds(rr['alpha0'])} | {r['planned_alpha_opt_on_ssd']:.2f} | "
              f"{rounds(rr['alpha_planned'])} | {r['alpha_planned_over_alpha0']:.2f} | "
              f"{rounds(rr['all_ssd'])} ({r['all_ssd_alpha']:.2f}) | {pl['param']:.2f}/{pl['ckpt']:.2f}/{pl['opt']:.2f}, {pb['alpha']:.2f} | "
              f"{rounds(rr['planned_placement'])} | {r['planned_over_all_ssd']:.2f} | "
              f"{rr['all_ssd']['traffic']['ssd_bytes'] / 1e6:.0f} / {rr['planned_placement']['traffic']['ssd_bytes'] / 1e6:.0f} |")


def storage() -> None:
    d = load("storage")
    if not d:
        return
    print("\n### storage\n")
    print(json.dumps(d["summary"], indent=1))


def overheads() -> None:
    d = load("overheads")
    if not d:
        return
    print("\n### overheads\n")
    for k, r in d["runs"].items():
        print(k, {a: round(b, 2) for a, b in r["probe"].items() if a != "hist_ms"}, r["busy_fraction"],
              "it s", r["iteration_seconds"], "spans/it", r["spans_per_iteration"])
    print("peak rss", d["peak_rss_mib"], "model", d["planner_host_memory_model_mib"], "mailbox", d["mailbox"])


def plan() -> None:
    d = load("plan_accuracy")
    if not d:
        return
    print("\n### plan_accuracy\n")
    print("| setting | n | planner's n | alpha | placement p/c/o | binding | predicted s | measured s [min-max] | error | compute busy s/it | ssd_read busy s/it | model compute s/it |")
    print("|---|---|---|---|---|---|---|---|---|---|---|---|")
    for name, s in d["settings"].items():
        for r in s["rows"]:
            if "predicted_s" not in r:
                print(f"| {name} | {r['n']} | infeasible: {r['infeasible']} |")
                continue
            pl = r["placement"]
            b = r["busy_s_per_iteration"]
            print(f"| {name} | {r['n']} | {'yes' if r['chosen_by_planner'] else ''} | {r['alpha']:.2f} | "
                  f"{pl['param']:.2f}/{pl['ckpt']:.2f}/{pl['opt']:.2f} | {', '.join(r['binding'])} | {r['predicted_s']:.3f} | "
                  f"{r['measured_s']:.3f} [{r['measured_min_s']:.3f}-{r['measured_max_s']:.3f}] | {r['error']:+.0%} | "
                  f"{b.get('compute', 0):.3f} | {b.get('ssd_read', 0):.3f} | {r['model_assumes']['compute_s']:.3f} |")
        print("\nprofile", name, {k: v for k, v in s["profile"].items() if k != "shape"})


if __name__ == "__main__":
    if sys.argv[1:] == ["runs"]:
        runs_table()
        sys.exit(0)
    if len(sys.argv) == 2 and sys.argv[1].startswith("throughput"):
        if not (R / f"{sys.argv[1]}.json").exists():
            sys.exit(f"report.py {sys.argv[1]}: no results/{sys.argv[1]}.json; name a throughput.py run "
                     "(`python benchmarks/report.py runs` lists them)")
        throughput(sys.argv[1])
        sys.exit(0)
    if sys.argv[1:]:
        sys.exit(f"usage: python benchmarks/report.py [runs | throughput_NAME]  (got {' '.join(sys.argv[1:])!r})")
    throughput()
    delay()
    storage()
    overheads()
    plan()
    runs_table()
