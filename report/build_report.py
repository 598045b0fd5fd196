"""Builds report/REPORT.md from the JSON results kept under report/, and nothing else.

    python3 report/build_report.py           # write REPORT.md, the figures and REPORT.pdf
    python3 report/build_report.py --check   # exit 1 if REPORT.md is not what the JSON gives

Every number in the report is read from a JSON file named in SOURCES, and every figure from SOURCES or a
profiler trace named in TRACES. The sources are listed at the end of the report, with the script version
(sha256 of offload_llama.py) each was made by where the JSON records it. The figures and the PDF need
matplotlib; the check does not.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent
GiB = 2**30
SOURCES = {  # name -> JSON file, relative to report/
    "inference_bf16": "inference/inference_bf16.json",
    "inference_fp32": "inference/inference_fp32.json",
    "train_bf16": "training/train_bf16.json",
    "train_bf16_cpu": "training/train_bf16_cpu.json",
    "train_bf16_accum16": "training/train_bf16_accum16.json",
    "train_bf16_eager": "training/train_bf16_eager.json",
}
TRACES = {  # figure -> profiler trace (Chrome JSON) it is drawn from
    "timeline_training.png": "training/trace_bf16.train.json",
    "timeline_inference.png": "inference/trace_overlapped_bf16.json",
}
LABELS = {"gpu": "w/o offload (gpu)", "blocked": "blocked offload", "overlapped": "overlapped offload", "cpu": "cpu"}


def load() -> dict[str, dict]:
    return {name: json.loads((HERE / path).read_text()) for name, path in SOURCES.items()}


def table(header: list[str], rows: list[list[str]]) -> list[str]:
    align = ["---"] + [":---:" if h == "bound by" else "---:" for h in header[1:]]
    return ["| " + " | ".join(header) + " |", "|" + "|".join(align) + "|"] + ["| " + " | ".join(r) + " |" for r in rows]


def num(x, spec: str) -> str:
    return "" if x is None else format(x, spec)


def gib(x) -> str:
    return "" if x is None else f"{x / GiB:.2f}"


def results(runs: dict, name: str, part: str) -> dict[str, dict]:
    """mode -> that mode's `part` ("inference" or "training") results in run `name`."""
    return {mode: r[part] for mode, r in runs[name]["results"].items() if part in r}


def how_to_run() -> list[str]:
    return ["## 1. How to run", "",
            "```",
            "pip install -r requirements.txt",
            "python3 -m pytest -q tests",
            "python3 offload_llama.py --mode overlapped --train",
            "bash report/run_benchmarks.sh OUTDIR      # on a GPU machine: every result, as JSON, logs and traces",
            "python3 report/build_report.py            # this report, from the JSON kept under report/",
            "```", ""]


def model_section(runs: dict) -> list[str]:
    r = runs["inference_bf16"]
    c = r["config"]
    rows = [["hidden size", str(c["hidden_size"])], ["intermediate size", str(c["intermediate_size"])],
            ["decoder layers", str(c["num_hidden_layers"])], ["attention heads", str(c["num_attention_heads"])],
            ["KV heads", str(c["num_key_value_heads"])], ["vocabulary", str(c["vocab_size"])],
            ["parameters", f"{r['parameters'] / 1e9:.2f} B"],
            ["bytes per decoder layer (bfloat16)", f"{r['layer_bytes'] / 2**20:.0f} MiB"],
            ["tokens per batch", f"{r['tokens']} ({r['run']['batch_size']} x {r['run']['seq_len']})"]]
    return ["## 2. Model and batch", "", f"Preset `{r['run']['preset']}`: LLaMA-7B's dimensions with fewer layers.", "",
            *table(["", "value"], rows), ""]


def memory_section(runs: dict) -> list[str]:
    inference, training = results(runs, "inference_bf16", "inference"), results(runs, "train_bf16", "training")
    training |= results(runs, "train_bf16_cpu", "training")
    rows = []
    for mode, label in LABELS.items():
        i, t = inference.get(mode, {}), training.get(mode, {})
        on_cpu = "0 (CPU)" if mode == "cpu" else None
        rows.append([label, on_cpu or gib(i.get("peak_gpu_bytes")), on_cpu or gib(t.get("peak_gpu_bytes")),
                     gib(t.get("peak_host_bytes"))])
    return ["## 3. Table 1: memory", "", "bfloat16, one batch of 4096 tokens; training with Adam (float32 masters and "
            "moments). Peak GPU memory is `torch.cuda.max_memory_allocated`, peak host memory the process's peak "
            "resident set.", "",
            *table(["mode", "inference: peak GPU (GiB)", "training: peak GPU (GiB)", "training: peak host (GiB)"],
                   rows), ""]


def time_table(inference: dict, training: dict) -> list[str]:
    """Time per mode, with the inference columns, the training columns or both, as the runs have them."""
    header = ["mode"]
    if inference:
        header += ["inference (ms)", "bound", "efficiency"]
    if training:
        header += ["training step (ms)", "bound", "bound by", "efficiency"]
    rows = []
    for mode, label in LABELS.items():
        if mode not in inference and mode not in training:
            continue
        row, i, t = [label], inference.get(mode, {}), training.get(mode, {})
        if inference:
            row += [num(i.get("time_ms"), ".1f"), num(i.get("bound_ms"), ".1f"), num(i.get("efficiency"), ".3f")]
        if training:
            row += [num(t.get("time_ms"), ".1f"), num(t.get("bound_ms"), ".1f"), t.get("bound_by", ""),
                    num(t.get("efficiency"), ".3f")]
        rows.append(row)
    return table(header, rows)


def time_section(runs: dict) -> list[str]:
    bf16_training = results(runs, "train_bf16", "training") | results(runs, "train_bf16_cpu", "training")
    accum = results(runs, "train_bf16_accum16", "training")
    return ["## 4. Table 2: time", "",
            "Median after warm-up. Each offloaded row has its bound, measured in the same run, and "
            "`efficiency = bound / measured`. Inference's bound comes from copy-only and compute-only runs of the same "
            "layers. Training's is the largest of GPU compute, host-to-device copies, device-to-host copies and the "
            "CPU Adam, each measured alone.", "",
            "bfloat16:", "", *time_table(results(runs, "inference_bf16", "inference"), bf16_training), "",
            "float32 inference, where compute outlasts the copies and overlap hides them:", "",
            *time_table(results(runs, "inference_fp32", "inference"), {}), "",
            "bfloat16 training with `--grad-accum 16` (65,536 tokens per step):", "", *time_table({}, accum), ""]


def gpu_section(runs: dict) -> list[str]:
    r = runs["inference_bf16"]
    overlapped = r["results"]["overlapped"]["inference"]
    t = runs["train_bf16"]["results"]["overlapped"]["training"]
    return ["## 5. The machine", "",
            f"{r['device']}, {r['gpu_memory_bytes'] / GiB:.1f} GiB; {r['cpu_threads']} CPU threads; torch {r['torch']}, "
            f"transformers {r['transformers']}.", "",
            f"- Host to device, pinned, measured alone: {overlapped['h2d_gbps_copy_only']:.1f} GB/s (inference, "
            f"bfloat16 layers), {t['h2d_bytes'] / t['h2d_ms'] / 1e6:.1f} GB/s (training, float32 masters).",
            f"- Device to host, pinned: {t['d2h_bytes'] / t['d2h_ms'] / 1e6:.1f} GB/s (training gradients).", ""]


def figures_section(runs: dict) -> list[str]:
    t = runs["train_bf16"]["results"]["overlapped"]["training"]["trace"]
    h, d = t["h2d"], t["d2h"]
    lanes, _ = trace_lanes(HERE / TRACES["timeline_training.png"])
    gpu_end = max(a + b for lane, spans in lanes.items() if lane != "CPU Adam" for a, b in spans)
    adam = sorted(lanes["CPU Adam"])
    idle, idle_from = max((b[0] - (a[0] + a[1]), a[0] + a[1]) for a, b in zip(adam, adam[1:]))
    return ["## 6. Figures", "",
            "One overlapped training step (bfloat16, 7b-8l, 4096 tokens), from its `--profile` trace. The lanes are the "
            "GPU's compute stream, the host-to-device copies (with the copy stream's casts), the device-to-host copies "
            f"of the gradients, and the CPU Adam thread. {h['overlap_ms']:.1f} of {h['copy_ms']:.1f} ms of "
            f"host-to-device copies and {d['overlap_ms']:.1f} of {d['copy_ms']:.1f} ms of device-to-host copies ran "
            "under compute. The step opens with the CPU Adam finishing the previous step's updates, which the forward "
            f"waits on; from {idle_from:.0f} ms the CPU waits {idle:.0f} ms for this step's first gradients. The "
            f"trace ends when the last update is done, {adam[-1][0] + adam[-1][1] - gpu_end:.0f} ms after the GPU's "
            "last event.", "",
            "![training timeline](figures/timeline_training.png)", "",
            "One overlapped forward pass (bfloat16, inference), from its trace: the copy stream runs ahead of the "
            "compute stream by one layer.", "",
            "![inference timeline](figures/timeline_inference.png)", "",
            "Time per mode against its bound (bfloat16).", "",
            "![time and bound](figures/time_vs_bound.png)", ""]


def trace_lanes(path: Path) -> tuple[dict[str, list[tuple[float, float]]], float]:
    """(lane -> [(start ms, duration ms)], end ms) of a profiler trace, from its first GPU event."""
    events = [e for e in json.loads(path.read_text())["traceEvents"] if e.get("ph") == "X"]
    gpu = [e for e in events if e.get("cat") in ("kernel", "gpu_memcpy")]
    copy_streams = {e["tid"] for e in gpu if "HtoD" in e["name"]}
    lanes = {"CPU Adam": [], "D2H copies": [], "H2D copies + casts": [], "GPU compute": []}
    for e in events:
        if e["name"] == "aten::_fused_adam_":
            lane = "CPU Adam"
        elif e.get("cat") == "gpu_memcpy":
            lane = "H2D copies + casts" if "HtoD" in e["name"] else "D2H copies" if "DtoH" in e["name"] else None
        elif e.get("cat") == "kernel":
            lane = "H2D copies + casts" if e["tid"] in copy_streams else "GPU compute"
        else:
            lane = None
        if lane:
            lanes[lane].append((e["ts"], e["dur"]))
    t0 = min(ts for spans in lanes.values() for ts, _ in spans)
    spans = {lane: [((ts - t0) / 1e3, dur / 1e3) for ts, dur in v] for lane, v in lanes.items() if v}
    return spans, max(a + b for v in spans.values() for a, b in v)


def timeline_figure(trace: Path, out: Path, title: str) -> None:
    import matplotlib.pyplot as plt
    lanes, end = trace_lanes(trace)
    fig, ax = plt.subplots(figsize=(10, 0.6 * len(lanes) + 1.2))
    colors = {"GPU compute": "tab:blue", "H2D copies + casts": "tab:orange", "D2H copies": "tab:green",
              "CPU Adam": "tab:red"}
    for y, (lane, spans) in enumerate(lanes.items()):
        ax.broken_barh(spans, (y - 0.35, 0.7), color=colors[lane], linewidth=0)
    ax.set_yticks(range(len(lanes)), list(lanes))
    ax.set_xlim(0, end)
    ax.set_xlabel("ms from the first GPU event")
    ax.set_title(title)
    fig.tight_layout()
    fig.savefig(out, dpi=150, metadata={"Software": None})
    plt.close(fig)


def bound_figure(runs: dict, out: Path) -> None:
    import matplotlib.pyplot as plt
    bars = []  # (label, measured ms, bound ms)
    for part, name in (("inference", "inference_bf16"), ("training", "train_bf16")):
        for mode in ("blocked", "overlapped"):
            r = results(runs, name, part)[mode]
            bars.append((f"{part}\n{mode}", r["time_ms"], r["bound_ms"]))
    r = results(runs, "train_bf16_accum16", "training")["overlapped"]
    bars.append(("training, 16 micro-\nbatches, overlapped", r["time_ms"], r["bound_ms"]))
    fig, axes = plt.subplots(1, len(bars), figsize=(10, 3.2))
    for ax, (label, measured, bound) in zip(axes, bars):
        ax.bar([0, 1], [measured, bound], color=["tab:blue", "tab:gray"])
        ax.set_xticks([0, 1], ["measured", "bound"])
        ax.set_title(f"{label}\n{bound / measured:.2f} of bound", fontsize=9)
        ax.set_ylabel("ms")
    fig.tight_layout()
    fig.savefig(out, dpi=150, metadata={"Software": None})
    plt.close(fig)


def aligned(rows: list[str]) -> list[str]:
    """A markdown table as lines of padded columns, numbers right-aligned as its rule line says."""
    if not rows:
        return []
    cells = [[c.strip().replace("`", "") for c in row.strip().strip("|").split("|")] for row in rows]
    rule, body = cells[1], [cells[0], *cells[2:]]
    widths = [max(len(r[i]) for r in body) for i in range(len(rule))]
    lines = ["  ".join(c.rjust(w) if a.endswith(":") and not a.startswith(":") else c.center(w) if a.startswith(":")
                       else c.ljust(w) for c, w, a in zip(r, widths, rule)) for r in body]
    return [lines[0], "-" * len(lines[0]), *lines[1:]]


def pdf(markdown: str, out: Path) -> None:
    """REPORT.md as A4 pages: headings, wrapped paragraphs, tables and code in monospace, figures full width."""
    import textwrap

    import matplotlib.image as mpimg
    import matplotlib.pyplot as plt
    from matplotlib.backends.backend_pdf import PdfPages

    width, height, margin = 8.27, 11.69, 0.6
    with PdfPages(out, metadata={"CreationDate": None, "Producer": None, "Creator": None}) as pages:
        fig, y = None, 0.0

        def need(inches: float):
            nonlocal fig, y
            if fig is None or y - inches < margin:
                if fig is not None:
                    pages.savefig(fig)
                    plt.close(fig)
                fig, y = plt.figure(figsize=(width, height)), height - margin

        def text(line: str, size: float, **kw):
            nonlocal y
            need(size / 72 * 1.45)
            fig.text(margin / width, y / height, line, fontsize=size, va="top", **kw)
            y -= size / 72 * 1.45

        in_code, rows = False, []
        for line in markdown.splitlines() + [""]:
            if line.startswith("|"):
                rows.append(line)
                continue
            for row in aligned(rows):
                text(row, 7, family="monospace")
            rows = []
            if line.startswith("```"):
                in_code = not in_code
            elif in_code:
                text(line, 7, family="monospace")
            elif line.startswith("!["):
                image = mpimg.imread(HERE / line[line.index("(") + 1:-1])
                h = (width - 2 * margin) * image.shape[0] / image.shape[1]
                need(h)
                ax = fig.add_axes([margin / width, (y - h) / height, (width - 2 * margin) / width, h / height])
                ax.imshow(image)
                ax.axis("off")
                y -= h + 0.1
            elif line.startswith("#"):
                level = len(line) - len(line.lstrip("#"))
                y -= 0.1
                text(line.lstrip("# "), {1: 15, 2: 12}.get(level, 10), weight="bold")
            elif line.strip():
                for piece in textwrap.wrap(line.replace("`", ""), 110):
                    text(piece, 8.5)
            else:
                y -= 0.08
        pages.savefig(fig)
        plt.close(fig)


def sources_section(runs: dict) -> list[str]:
    rows = [[f"`{SOURCES[name]}`", r.get("script_sha256", "not recorded")[:12]] for name, r in runs.items()]
    rows += [[f"`{trace}`", "(profiler trace)"] for trace in TRACES.values()]
    return ["## Sources", "", *table(["file", "offload_llama.py sha256"], rows), ""]


def build() -> str:
    runs = load()
    lines = ["# offload_llama: measured report", "",
             "Layer-wise parameter offload for LLaMA on one GPU: what it costs in time and saves in memory, "
             "measured by `offload_llama.py`.", ""]
    for section in (how_to_run(), model_section(runs), memory_section(runs), time_section(runs), gpu_section(runs),
                    figures_section(runs), sources_section(runs)):
        lines += section
    return "\n".join(lines)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--check", action="store_true", help="exit 1 if REPORT.md is not what the JSON gives")
    args = parser.parse_args(argv)
    text, path = build(), HERE / "REPORT.md"
    if args.check:
        if not path.is_file() or path.read_text() != text:
            print(f"{path} is not what the JSON under report/ gives: run python3 report/build_report.py",
                  file=sys.stderr)
            return 1
        return 0
    path.write_text(text)
    runs, figures = load(), HERE / "figures"
    figures.mkdir(exist_ok=True)
    for name, trace in TRACES.items():
        timeline_figure(HERE / trace, figures / name, f"{Path(trace).name}: one overlapped "
                        f"{'training step' if 'train' in name else 'forward pass'}")
    bound_figure(runs, figures / "time_vs_bound.png")
    pdf(text, HERE / "REPORT.pdf")
    return 0


if __name__ == "__main__":
    sys.exit(main())
