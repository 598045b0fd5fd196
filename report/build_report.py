"""Builds report/REPORT.md from the JSON results kept under report/, and nothing else.

    python3 report/build_report.py           # write REPORT.md
    python3 report/build_report.py --check   # exit 1 if REPORT.md is not what the JSON gives

Every number in the report is read from a JSON file named in SOURCES; the sources are listed at the end of
the report, with the script version (sha256 of offload_llama.py) each was made by where the JSON records it.
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


def sources_section(runs: dict) -> list[str]:
    rows = [[f"`{SOURCES[name]}`", r.get("script_sha256", "not recorded")[:12]] for name, r in runs.items()]
    return ["## Sources", "", *table(["JSON", "offload_llama.py sha256"], rows), ""]


def build() -> str:
    runs = load()
    lines = ["# offload_llama: measured report", "",
             "Layer-wise parameter offload for LLaMA on one GPU: what it costs in time and saves in memory, "
             "measured by `offload_llama.py`.", ""]
    for section in (how_to_run(), model_section(runs), memory_section(runs), time_section(runs), gpu_section(runs),
                    sources_section(runs)):
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
    return 0


if __name__ == "__main__":
    sys.exit(main())
