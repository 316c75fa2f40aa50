"""The peers table (TPOT, TTFT, tokens/s, weight memory, ratios against llama.cpp and vLLM) and
its PNG plots.

python bench/report.py bench/results/<run> [--plots bench/plots]
python bench/report.py bench/results/<run> --rounds    # an interleaved run (ROUNDS=N peers.sh)
python bench/report.py --from-vllm RESULT.json --label L --workload W --out SUMMARY.json

Ratios (issue 22's targets): at c=1 each pagedserve row against llama.cpp, on the same GGUF type
where that llama.cpp server ran, else against the fastest llama.cpp row (lowest median TPOT):
TPOT at most 0.7x and output tokens/s at least 1.5x; at c=32 against vLLM's CPU build, output
tokens/s at least 1.5x on std and prefix.

The --from-vllm form turns a `vllm bench serve --save-result` file into bench/serve.py's summary
shape, so runs driven by vLLM's own client (CLIENT=vllm bash bench/peers.sh) share the table.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

BASELINE = "pagedserve"
PEER_ORDER = ("pagedserve", "vllm-cpu", "hf-static")
TPOT_TARGET_VS_LLAMACPP = 0.7  # at c=1, at most
TOKS_TARGET_VS_LLAMACPP = 1.5  # at c=1, at least
TOKS_TARGET_VS_VLLM = 1.5  # at c=32 on std and prefix, at least


def cell_key(summary: dict) -> str:
    c = summary.get("max_concurrency")
    return f"{summary['workload']} c={c}" if c else summary["workload"]


def load_results(run_dir: Path) -> dict[str, dict[str, dict]]:
    """cell ("std c=32") -> label -> summary."""
    table: dict[str, dict[str, dict]] = {}
    for f in sorted(run_dir.glob("*.json")):
        # bench/machine_probe.py's readings and peers.sh's per-server memory records
        if f.name.startswith("machine-") or f.name.endswith(".server.json"):
            continue
        s = json.loads(f.read_text())
        table.setdefault(cell_key(s), {})[s["label"]] = s
    return dict(sorted(table.items(), key=lambda kv: _cell_order(kv[0])))


def load_servers(run_dir: Path) -> dict[str, dict]:
    """label -> peers.sh's record of the server (RSS after load, weight file size)."""
    out = {}
    for f in sorted(run_dir.glob("*.server.json")):
        s = json.loads(f.read_text())
        out[s["label"]] = s
    return out


def _cell_order(key: str) -> tuple:
    workload, _, c = key.partition(" c=")
    rank = {"std": 0, "prefix": 1, "repeat": 2, "mixed": 3}.get(workload, 9)
    return (rank, workload, int(c) if c.isdigit() else 0)


def _order(labels) -> list[str]:
    def rank(label: str) -> tuple:
        for i, family in enumerate(("pagedserve", "llamacpp", "vllm", "hf-static")):
            if label.startswith(family):
                return (i, label)
        return (9, label)

    return sorted(labels, key=rank)


def _baseline(labels) -> str | None:
    if BASELINE in labels:
        return BASELINE
    return next((lab for lab in _order(labels) if lab.startswith(BASELINE)), None)


def format_table(table: dict[str, dict[str, dict]]) -> str:
    """Every row against pagedserve (the rounds view)."""
    head = (
        f"| cell | peer | ok/sent | out tok/s | x pagedserve | req/s | TTFT med ms | "
        f"TTFT p90 | TTFT p99 | ITL med ms | ITL p90 | ITL p99 | steal % |\n|{'---|' * 13}"
    )
    lines = [head]
    for cell, by_label in table.items():
        base_label = _baseline(by_label)
        base = by_label[base_label]["output_throughput"] if base_label else None
        for label in _order(by_label):
            s = by_label[label]
            ratio = f"{s['output_throughput'] / base:.2f}" if base else "-"
            t, i = s["ttft_ms"], s["itl_ms"]
            lines.append(
                f"| {cell} | {label} | {s['num_completed']}/{s['num_requests']} | "
                f"{s['output_throughput']:.1f} | {ratio} | {s['request_throughput']:.2f} | "
                f"{t['median']:.0f} | {t['p90']:.0f} | {t['p99']:.0f} | "
                f"{i['median']:.1f} | {i['p90']:.1f} | {i['p99']:.1f} | {_steal(s)} |"
            )
    return "\n".join(lines)


def _steal(s: dict) -> str:
    """The cell's steal share (bench/serve.py), '-' in summaries from before it was kept."""
    share = s.get("steal_share")
    return "-" if share is None else f"{100 * share:.0f}"


def _tpot(s: dict, key: str = "median") -> float | None:
    t = s.get("tpot_ms")
    return t[key] if t and t.get(key) else None


def _llamacpp_ref(label: str, by_label: dict[str, dict]) -> str | None:
    """The llama.cpp row a pagedserve row is held against: the same GGUF type, else the
    fastest llama.cpp row of the cell."""
    base = label.removeprefix("pagedserve-").split("+")[0]
    if base.startswith("gguf-") and f"llamacpp-{base[5:]}" in by_label:
        return f"llamacpp-{base[5:]}"
    rows = [(_tpot(s) or float("inf"), lab) for lab, s in by_label.items()]
    rows = [r for r in rows if r[1].startswith("llamacpp")]
    return min(rows)[1] if rows else None


def _memory(server: dict | None) -> str:
    if not server:
        return "-"
    return f"{server['rss_mb']:.0f} ({server['weights_file_mb']:.0f})"


def ratios(cell: str, label: str, by_label: dict[str, dict]) -> tuple[str, list[str]]:
    """The ratio text for one pagedserve row and the target lines it meets or misses."""
    if not label.startswith("pagedserve"):
        return "", []
    workload, _, c = cell.partition(" c=")
    s = by_label[label]
    if c == "1":
        ref = _llamacpp_ref(label, by_label)
        if ref is None or not _tpot(s) or not _tpot(by_label[ref]):
            return "", []
        tpot = _tpot(s) / _tpot(by_label[ref])
        toks = s["output_throughput"] / by_label[ref]["output_throughput"]
        ok_t, ok_s = tpot <= TPOT_TARGET_VS_LLAMACPP, toks >= TOKS_TARGET_VS_LLAMACPP
        text = f"TPOT {tpot:.2f}x, tok/s {toks:.2f}x {ref}"
        return text, [
            f"{'met ' if ok_t else 'MISS'} {workload} c=1 {label}: TPOT {tpot:.2f}x {ref} "
            f"(target <= {TPOT_TARGET_VS_LLAMACPP})",
            f"{'met ' if ok_s else 'MISS'} {workload} c=1 {label}: tok/s {toks:.2f}x {ref} "
            f"(target >= {TOKS_TARGET_VS_LLAMACPP})",
        ]
    if c == "32" and "vllm-cpu" in by_label:
        toks = s["output_throughput"] / by_label["vllm-cpu"]["output_throughput"]
        text = f"tok/s {toks:.2f}x vllm-cpu"
        if workload not in ("std", "prefix"):
            return text, []
        ok = toks >= TOKS_TARGET_VS_VLLM
        return text, [
            f"{'met ' if ok else 'MISS'} {workload} c=32 {label}: tok/s {toks:.2f}x vllm-cpu "
            f"(target >= {TOKS_TARGET_VS_VLLM})"
        ]
    return "", []


def format_peers(table: dict[str, dict[str, dict]], servers: dict[str, dict]) -> str:
    head = (
        "| workload | c | peer | ok/sent | out tok/s | TPOT med ms | TPOT p90 | TTFT p50 ms | "
        "TTFT p90 | RSS MiB (weights file MiB) | ratio |\n|" + "---|" * 11
    )
    lines, targets, copied = [head], [], []
    for cell, by_label in table.items():
        workload, _, c = cell.partition(" c=")
        for label in _order(by_label):
            s = by_label[label]
            t = s["ttft_ms"]
            tpot, tpot90 = _tpot(s), _tpot(s, "p90")
            ratio, hits = ratios(cell, label, by_label)
            targets += hits
            if "copied_share" in s:
                copied.append(f"{label} c={c}: {s['copied_share']:.2f}")
            lines.append(
                f"| {workload} | {c or '-'} | {label} | {s['num_completed']}/{s['num_requests']} | "
                f"{s['output_throughput']:.1f} | {f'{tpot:.1f}' if tpot else '-'} | "
                f"{f'{tpot90:.1f}' if tpot90 else '-'} | {t['median']:.0f} | {t['p90']:.0f} | "
                f"{_memory(servers.get(label))} | {ratio} |"
            )
    text = "\n".join(lines)
    text += (
        "\n\nRSS: the server's resident memory after load and one short request (all its "
        "processes; it includes the runtime and touched KV cache, not only weights). Weights "
        "file: what it read (llama.cpp maps it; pagedserve's HF folder of the default model holds "
        "float32, served as bf16)."
    )
    if copied:
        text += "\n\nrepeat workload, share of output word 4-grams copied from the prompt: "
        text += "; ".join(copied)
    if targets:
        text += "\n\nTargets (issue 22):\n" + "\n".join(f"- {t}" for t in targets)
    return text


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
        base = _baseline(labels)
        for label in labels:
            runs = [t[w].get(label) for t in tables]
            tps = " / ".join(f"{r['output_throughput']:.1f}" if r else "-" for r in runs)
            ttft = " / ".join(f"{r['ttft_ms']['median']:.0f}" if r else "-" for r in runs)
            per_round = [
                t[w][base]["output_throughput"] / r["output_throughput"]
                for t, r in zip(tables, runs)
                if r and base in t[w]
            ]
            each = " / ".join(f"{x:.2f}" for x in per_round) if label != base else "-"
            med = f"{statistics.median(per_round):.2f}" if per_round and label != base else "-"
            lines.append(f"| {w} | {label} | {tps} | {each} | {med} | {ttft} |")
    return "\n".join(lines)


def format_round_targets(tables: list[dict[str, dict[str, dict]]]) -> str:
    """The issue's target checks (as a one-round run prints them), round by round."""
    lines = [
        f"round {r}: {hit}"
        for r, table in enumerate(tables, 1)
        for cell, by_label in table.items()
        for label in _order(by_label)
        for hit in ratios(cell, label, by_label)[1]
    ]
    if not lines:
        return ""
    return "\n\nTargets (issue 22), each round:\n" + "\n".join(f"- {x}" for x in lines)


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
    fig.suptitle("SmolLM2-135M, same prompts, one run (bench/peers.sh)")
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
        "tpot_ms": stats("tpot") if "median_tpot_ms" in result else None,
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
        text = format_rounds(tables) + format_round_targets(tables) + format_machine(dirs)
        table = tables[0]  # the plots: round 1, which has every peer
    else:
        table = load_results(args.run_dir)
        text = format_peers(table, load_servers(args.run_dir))
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
