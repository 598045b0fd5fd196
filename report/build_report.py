"""Builds report/REPORT.md from the JSON results kept under report/results/, and nothing else.

    python3 report/build_report.py           # write REPORT.md, the figures and REPORT.pdf; trim the traces
    python3 report/build_report.py --check   # exit 1 if REPORT.md or README.md's results are not what the JSON gives

Every number in the report is read from a JSON file named in SOURCES, all made by one version of the script, and
every figure is drawn from those JSON files or a profiler trace named in TRACES. The sources are listed at the end of
the report, with the script version (sha256 of offload_llama.py, and of report/peers.py for the peers). The figures
and the PDF need matplotlib; the check does not.
"""

from __future__ import annotations

import argparse
import json
import sys
from collections import Counter
from itertools import pairwise
from pathlib import Path
from statistics import median

HERE = Path(__file__).resolve().parent
GiB = 2**30
BUDGETS = (4, 6, 8, 11, 16, 24, 80)  # GiB: run_benchmarks.sh's part budget, one run per cap
PAIRS = 3  # its part budget_ab: the 11 GiB cap against every unit streamed, each in a process of its own
ABLATION_RUNS = ("share_0", "share_0.3", "share_0.4", "share_0_prefetch3", "fsdp2", "share_0.3_again")
SOURCES = {  # name -> JSON file, relative to report/; all made by `bash report/run_benchmarks.sh OUTDIR PART...`
    "inference_bf16": "results/inference_bf16.json",
    "inference_bf16_prefetch2": "results/inference_bf16_prefetch2.json",
    "inference_bf16_prefetch3": "results/inference_bf16_prefetch3.json",
    "inference_fp32": "results/inference_fp32.json",
    "train_bf16": "results/train_bf16.json",
    "train_bf16_gpu": "results/train_bf16_gpu.json",
    "train_bf16_blocked": "results/train_bf16_blocked.json",
    "train_bf16_overlapped": "results/train_bf16_overlapped.json",
    "train_bf16_cpu": "results/train_bf16_cpu.json",
    "train_fp32": "results/train_fp32.json",
    "train_bf16_accum16": "results/train_bf16_accum16.json",
    "train_bf16_offload_acts": "results/train_bf16_offload_acts.json",
    "train_bf16_accum16_offload_acts": "results/train_bf16_accum16_offload_acts.json",
    "train_bf16_eager": "results/train_bf16_eager.json",
    "largest_llama7b": "results/largest_llama7b.json",
    "train_llama7b_65k": "results/train_llama7b_65k.json",
    "peers_bf16": "results/peers_bf16.json",
    # the disk tier (parts disk and largest_disk, with NVME_DIR on the machine's own disk)
    "largest_llama7b_disk": "results/disk/largest_llama7b_disk.json",
    "disk_7b8l_host": "results/disk/disk_7b8l_host.json",
    "disk_7b8l_half": "results/disk/disk_7b8l_half.json",
    # time against the GPU budget (parts budget and budget_ab)
    "budget_ends": "results/budget/budget_ends.json",
    **{f"budget_{b}": f"results/budget/budget_{b}.json" for b in BUDGETS},
    **{
        f"budget_ab_{arm}_{i}": f"results/budget/ab/budget_ab_{arm}_{i}.json"
        for i in range(1, PAIRS + 1)
        for arm in ("streamed", "11")
    },
    # each acceleration on and off, and what clipping costs (parts ablations and clip)
    **{f"ablation_{name}": f"results/ablations/ablation_{name}.json" for name in ABLATION_RUNS},
    "clip_7b8l_unclipped": "results/ablations/clip_7b8l_unclipped.json",
    "clip_7b8l_clipped": "results/ablations/clip_7b8l_clipped.json",
}
# made by a later version of the script than SOURCES, one version for the group: the small host of section 5, measured
# once the host cap held (issue 43), while the rest still stands for the version before
LATER_SOURCES = {"small_host_7b8l": "results/small_host/small_host_7b8l.json"}
# made by the version that trains on text (issue 45), one version for the group: section 12
TEXT_SOURCES = {name: f"results/text/{name}.json" for name in ("text_stdlib", "text_steps_data", "text_steps_random")}
# made on the two-GPU machine by the several-GPU versions (issue 46), each run beside its one-GPU run by one version:
# section 13, which names each row's version; host_probe (report/host_probe.py) ran in the 7b-8l rows' call
# made on the four-GPU machine (four H200s each time): calls A-B by one version, D-F by a later one and G by the one
# whose bound times the compute at settled clocks, each call's rows compared with each other: section 14
FOUR_SOURCES = {
    f"four_{call}_{name}" if call > "c" else f"four_{name}": f"results/four_gpus/{call}_{name}.json"
    for call, names in (
        ("a", ("inf_1", "inf_2", "inf_4", "l7_1", "l7_2", "l7_4", "s_1", "s_4", "s_16")),
        ("b", ("q32_1", "q32_4")),
        ("d", ("l7_4t", "l7_4c2", "inf_2", "inf_4")),
        ("e", ("base", "prio", "carve16", "prio_carve8", "ctas32", "simple", "prio_simple")),
        ("f", ("g1", "g1_share0", "g2_share0", "g4", "g4_share0")),
        ("g", ("g1", "g2", "g4", "g4_share0")),
        ("n", ("g1", "g1_accum4", "g2", "g4")),
    )
    for name in names
}
NCCL_VARIANTS = {  # call E's runs: the environment each ran under (report/results/four_gpus/calls/x5b.sh)
    "base": "none",
    "prio": "the compute on a stream of the highest priority",
    "carve16": "cuBLAS leaves 16 SMs out",
    "prio_carve8": "both, 8 SMs",
    "ctas32": "NCCL_MIN_CTAS=32",
    "simple": "NCCL_PROTO=Simple",
    "prio_simple": "highest priority and NCCL_PROTO=Simple",
}
RANK_SOURCES = {
    name: f"results/ranks/{name}.json"
    for name in ("7b8l_1gpu", "7b8l_2gpus", "7b8l_2gpus_share06", "llama7b_1gpu", "llama7b_2gpus", "largest_2gpus")
    + ("zero3_1gpu", "zero3_2gpus", "host_probe")
}
MACHINES = (  # the run_benchmarks.sh parts each machine ran (report/results/README.md gives the calls)
    ("disk",),
    ("peers", "alone", "bf16", "prefetch", "train", "eager", "fp32", "train_fp32", "clip", "activations", "accum")
    + ("largest", "scale", "budget_ab"),
    ("budget", "ablations"),
    ("largest_disk",),
    ("small_host",),
    ("text",),
)
TRACES = {  # figure -> profiler trace (Chrome JSON) it is drawn from
    "timeline_training.png": "results/trace_bf16.train.json",
    "timeline_inference.png": "results/trace_overlapped_bf16.json",
}
BOUND_NAMES = {
    "gpu_compute": "the GPU compute",
    "h2d": "the host-to-device copies",
    "d2h": "the device-to-host copies",
    "cpu_adam": "the CPU Adam",
    "host_memory": "host memory (the CPU Adam's and the copies' bytes)",
    "disk": "the disk tier's reads and writes",
    "held_updates": "the backward, then the CPU Adam (updates held for every gradient)",
}
LABELS = {"gpu": "w/o offload (gpu)", "blocked": "blocked offload", "overlapped": "overlapped offload", "cpu": "cpu"}


def load(sources: dict[str, str] | None = None) -> dict[str, dict]:
    """name -> the JSON of each file in `sources` (default: SOURCES, LATER_SOURCES, TEXT_SOURCES, RANK_SOURCES,
    FOUR_SOURCES)."""
    sources = sources or {**SOURCES, **LATER_SOURCES, **TEXT_SOURCES, **RANK_SOURCES, **FOUR_SOURCES}
    return {name: json.loads((HERE / path).read_text()) for name, path in sources.items()}


def table(header: list[str], rows: list[list[str]]) -> list[str]:
    """A markdown table: the first column left-aligned, "bound by" centred, "implementation" left, the rest right."""
    align = ["---"] + [":---:" if h == "bound by" else "---" if h == "implementation" else "---:" for h in header[1:]]
    return ["| " + " | ".join(header) + " |", "|" + "|".join(align) + "|"] + ["| " + " | ".join(r) + " |" for r in rows]


def num(x, spec: str) -> str:
    """`x` formatted by `spec`, or empty for None."""
    return "" if x is None else format(x, spec)


def gib(x) -> str:
    """Bytes as GiB with two decimals, or empty for None."""
    return "" if x is None else f"{x / GiB:.2f}"


def results(runs: dict, name: str, part: str) -> dict[str, dict]:
    """mode -> that mode's `part` ("inference" or "training") results in run `name`."""
    return {mode: r[part] for mode, r in runs[name]["results"].items() if part in r}


def alone(runs: dict) -> dict[str, dict]:
    """mode -> its bfloat16 training result from a process of its own (no gpu-mode state kept for a comparison)."""
    return {
        mode: results(runs, f"train_bf16_{mode}", "training")[mode] for mode in ("gpu", "blocked", "overlapped", "cpu")
    }


def param_count(c: dict, layers: int | None = None) -> int:
    """LlamaForCausalLM's parameters from its config: embeddings and head, final norm, and per decoder layer the
    attention projections, the MLP and two norms."""
    h, kv = c["hidden_size"], c["num_key_value_heads"] * c["head_dim"]
    layer = 2 * h * h + 2 * h * kv + 3 * h * c["intermediate_size"] + 2 * h
    return 2 * c["vocab_size"] * h + h + (c["num_hidden_layers"] if layers is None else layers) * layer


def layer_params(c: dict) -> int:
    """The parameters of one decoder layer."""
    return param_count(c, 1) - param_count(c, 0)


def gradient_itemsize(run: dict) -> int:
    """The bytes of a gradient on the host (offload_llama.gradient_dtype): bfloat16 with one micro-batch, else
    float32."""
    return 2 if run["dtype"] == "bfloat16" and run["grad_accum"] == 1 else 4


def gradient_buffer_bytes(c: dict, run: dict) -> int:
    """One buffer of the gradient pool: the gradients of the largest unit (a decoder layer, or the embeddings or
    head)."""
    return gradient_itemsize(run) * max(layer_params(c), c["vocab_size"] * c["hidden_size"])


def activation_pool_bytes(r: dict) -> int:
    """The pinned pool of the units' saved inputs in run `r`: per unit after the embeddings, every micro-batch's
    hidden states in the compute dtype."""
    c, run = r["config"], r["run"]
    itemsize = {"bfloat16": 2, "float16": 2, "float32": 4}[run["dtype"]]
    return (
        (c["num_hidden_layers"] + 2)
        * run["grad_accum"]
        * run["batch_size"]
        * run["seq_len"]
        * c["hidden_size"]
        * itemsize
    )


def host_parts(t: dict, c: dict, run: dict, params: int, acts: int = 0) -> list[tuple[str, int]]:
    """Where an offloaded training run's peak host bytes go when it trains alone (`--no-inference`): the CPU
    model's embeddings, head and norm in bfloat16 (its decoder layers are freed once the masters hold them), the
    float32 masters, the Adam moments of the streamed units (the resident units' live on the GPU, and their host
    pages are never touched), the masters' bfloat16 copy where the host had room for it (the Adam's bytes per
    parameter say: 24 for master and moments, the gradient's, the copy's), the pools of gradient buffers and saved
    inputs, and the rest."""
    pool, itemsize = t["gradient_pool"], gradient_itemsize(run)
    resident = t["predicted_parts"]["resident masters and moments"] // 12  # parameters: float32 master, 2 moments
    grads = pool["buffers"] * gradient_buffer_bytes(c, run) if not pool["per_unit"] else itemsize * params
    buffers = "one buffer per unit" if pool["per_unit"] else f"{pool['buffers']} shared buffers"
    dtype = "bfloat16" if itemsize == 2 else "float32"
    copy = t["adam_bytes_per_param"] - 24 - itemsize
    parts = [
        ("embeddings, head and norm in bfloat16 (the CPU model)", 2 * param_count(c, 0)),
        ("float32 masters, pinned", 4 * params),
        ("Adam moments, float32" + (", of the streamed units" if resident else ""), 8 * (params - resident)),
        *([("the masters' bfloat16 copy, pinned", copy * params)] if copy else []),
        (f"gradient pool, pinned, {dtype}: {buffers}", grads),
    ]
    if acts:
        parts.append(("saved-input pool, pinned (activation offload)", acts))
    parts.append(("the rest: CUDA runtime, libraries, interpreter", t["peak_host_bytes"] - sum(b for _, b in parts)))
    return parts


def where_table(t: dict, parts: list[tuple[str, int]], params: int) -> list[str]:
    """The host bytes of `parts` in GiB and per parameter, and the peak they add up to."""
    rows = [[what, f"{b / GiB:.2f}", f"{b / params:.2f}"] for what, b in parts]
    rows.append(["peak resident set", gib(t["peak_host_bytes"]), f"{t['peak_host_bytes'] / params:.2f}"])
    return table(["", "GiB", "bytes per parameter"], rows)


def how_to_run(runs: dict) -> list[str]:
    """Section 1: the commands that test, run, measure and build this report, and the script version that made it."""
    return [
        "## 1. How to run",
        "",
        "```",
        "pip install -r requirements.txt",
        "python3 -m pytest -q tests",
        "python3 offload_llama.py --mode overlapped --train",
        "bash report/run_benchmarks.sh report/results   # on a GPU machine: every result below, as JSON,",
        "                                               # tables, logs and profiler traces",
        "python3 report/build_report.py                 # this report, its figures and REPORT.pdf, from them",
        "```",
        "",
        "`report/run_benchmarks.sh` names each run's command line; `report/results/README.md` says where and when "
        f"they ran. Every run but the small host's was made by `offload_llama.py` sha256 `{script_version(runs)[:12]}`,"
        f" part by part (`bash report/run_benchmarks.sh OUT PART...`), on {len(MACHINES)} H100 machines of one kind; "
        f"the small host's (part `small_host`, section 5) by the later `{script_version(runs, LATER_SOURCES)[:12]}` "
        "(the command line checked first, the host cap kept, the plan of the path that casts float32 masters on the "
        "GPU, a lean run's random model drawn unit by unit). Those changes leave the other parts' GPU work and steps "
        "as they were; a lean run (`--no-inference`) of the later version holds less host memory before its steps, "
        "not during them; training on text (part `text`, section 12) by the later "
        f"`{script_version(runs, TEXT_SOURCES)[:12]}`, which reads text (`--data`) and measures the held-out loss:",
        "",
        *[f"- machine {i}: " + ", ".join(f"`{part}`" for part in parts) for i, parts in enumerate(MACHINES, 1)],
        "",
        "Host memory's speed differs between machines, and between processes on one (sections 9 to 11): compare "
        "times within a machine. Several GPUs (section 13) ran on a machine with two, by the versions its table names.",
        "",
    ]


def machine_of(part: str) -> int:
    """The machine (numbered from 1, as MACHINES lists them) that ran run_benchmarks.sh's `part`."""
    return next(i for i, parts in enumerate(MACHINES, 1) if part in parts)


def script_version(runs: dict, group: dict[str, str] = SOURCES) -> str:
    """The sha256 of the offload_llama.py that made every run of `group` (SOURCES, or LATER_SOURCES): one version."""
    versions = {runs[name]["script_sha256"] for name in group}
    if len(versions) != 1:
        raise SystemExit(f"the results were made by {len(versions)} versions of offload_llama.py: run them again")
    return versions.pop()


def model_section(runs: dict) -> list[str]:
    """Section 2: the two presets' dimensions and the batch."""
    small, large = runs["inference_bf16"], runs["largest_llama7b"]
    a, b = small["config"], large["config"]
    layer_params = param_count(a, 1) - param_count(a, 0)
    rows = [
        [field, str(a[key]), str(b[key])]
        for field, key in (
            ("hidden size", "hidden_size"),
            ("intermediate size", "intermediate_size"),
            ("decoder layers", "num_hidden_layers"),
            ("attention heads", "num_attention_heads"),
            ("KV heads", "num_key_value_heads"),
            ("vocabulary", "vocab_size"),
        )
    ]
    rows += [
        ["parameters", f"{small['parameters'] / 1e9:.2f} B", f"{param_count(b) / 1e9:.2f} B"],
        ["parameters per decoder layer", f"{layer_params / 1e6:.1f} M", f"{layer_params / 1e6:.1f} M"],
        [
            "bytes per decoder layer, bfloat16 / float32",
            *[f"{small['layer_bytes'] / 2**20:.0f} / {2 * small['layer_bytes'] / 2**20:.0f} MiB"] * 2,
        ],
    ]
    return [
        "## 2. Model and batch",
        "",
        f"Every run uses the preset `{small['run']['preset']}` (LLaMA-7B's dimensions with "
        f"{a['num_hidden_layers']} decoder layers) except section 5's largest models, which stack as many LLaMA-7B "
        "layers as will train, and section 6's first table, which trains LLaMA-7B itself on 64 sequences a step. "
        "The "
        f"weights are random (HF's LLaMA initialisation, seed {small['run']['seed']}). One batch is "
        f"{small['run']['batch_size']} x {small['run']['seq_len']} = {small['tokens']} tokens. The compute dtype is "
        "bfloat16 unless a table says float32; training keeps float32 master weights, gradients and Adam moments "
        f"(lr {small['run']['lr']:g}, betas {tuple(small['run']['betas'])}).",
        "",
        *table(["", small["run"]["preset"], large["run"]["preset"]], rows),
        "",
    ]


def host_note(t: dict, c: dict, run: dict, params: int) -> list[str]:
    """Where the overlapped mode's host bytes go when it trains alone, and what inference in the same process adds."""
    store = 2 * (params - param_count(c, 0))
    return [
        "Training alone (`--no-inference`), an offloaded mode keeps on the host the float32 masters and Adam "
        "moments (12 bytes per parameter, for the whole run), the masters' bfloat16 copy that the GPU streams and "
        "the Adam rewrites (2 more, where the host has room), a pool of pinned gradient buffers (one per unit when "
        "the host has room, as here; bfloat16 with one micro-batch: 2 more) and the CPU model's embeddings and "
        "head in bfloat16; the bfloat16 decoder layers go once the masters hold them. The overlapped mode's "
        "peak:",
        "",
        *where_table(t, host_parts(t, c, run, params), params),
        "",
        "Where inference runs in the same process, its pinned bfloat16 store of the decoder layers "
        f"({store / GiB:.2f} GiB, 2 bytes per parameter of the layers) stays while it trains.",
    ]


def memory_section(runs: dict) -> list[str]:
    """Section 3: peak GPU and host memory per mode, and where the host bytes go."""
    i16, i32 = results(runs, "inference_bf16", "inference"), results(runs, "inference_fp32", "inference")
    t16, t32 = alone(runs), results(runs, "train_fp32", "training")
    rows = []
    for mode, label in LABELS.items():
        gpu = [
            ("0 (CPU)" if mode in r else "not run") if mode == "cpu" else gib(r[mode]["peak_gpu_bytes"])
            for r in (i16, i32, t16, t32)
        ]
        rows.append([label, *gpu, gib(t16[mode]["peak_host_bytes"])])
    params, config = runs["inference_bf16"]["parameters"], runs["train_bf16_overlapped"]["config"]
    return [
        "## 3. Table 1: memory",
        "",
        "Peak GPU memory in GiB, and in the last column peak host memory. Peak GPU memory is "
        "`torch.cuda.max_memory_allocated`; peak host memory is the process's peak resident set "
        "(pinned memory included) over the training steps, each bfloat16 training mode run alone "
        f"(`--no-inference`) in a process of its own. The cpu mode trains at {t16['cpu']['time_ms'] / 1e3:.0f} s "
        "a step, in bfloat16 only, and with inference.",
        "",
        *table(
            ["mode (GiB)", "inference bf16", "inference fp32", "training bf16", "training fp32", "training bf16: host"],
            rows,
        ),
        "",
        *gpu_adam_memory_note(t16["overlapped"]),
        *host_note(t16["overlapped"], config, runs["train_bf16_overlapped"]["run"], params),
        "",
    ]


def gpu_adam_memory_note(t: dict) -> list[str]:
    """What the GPU's Adam over streamed state adds to a training peak on the GPU, where it has units."""
    staging = t["predicted_parts"].get("GPU Adam staging", 0)
    if not staging:
        return []
    return [
        f"Of the overlapped mode's {gib(t['peak_gpu_bytes'])} GiB training peak on the GPU, {gib(staging)} GiB "
        f"is staging for the GPU's Adam, which steps {gpu_adam_note(t)} over their state kept on the host "
        "(section 9): a unit's gradients, and two chunks of float32 master and moments with their bfloat16 copy, "
        "one stepped while the other crosses PCIe.",
        "",
    ]


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
            row += [
                num(t.get("time_ms"), ".1f"),
                num(t.get("bound_ms"), ".1f"),
                t.get("bound_by", ""),
                num(t.get("efficiency"), ".3f"),
            ]
        rows.append(row)
    return table(header, rows)


def prefetch_table(runs: dict) -> list[str]:
    """Overlapped bfloat16 inference at prefetch depths 1 to 3: time, bound and GPU peak."""
    depths = [results(runs, "inference_bf16", "inference")["overlapped"]]
    depths += [results(runs, f"inference_bf16_prefetch{d}", "inference")["overlapped"] for d in (2, 3)]
    return table(
        ["--prefetch", "inference (ms)", "bound", "peak GPU (GiB)"],
        [[str(r["prefetch"]), f"{r['time_ms']:.1f}", f"{r['bound_ms']:.1f}", gib(r["peak_gpu_bytes"])] for r in depths],
    )


def time_section(runs: dict) -> list[str]:
    """Section 4: time per mode against its bound, and the correctness checks of the same runs."""
    bf16_training = results(runs, "train_bf16", "training") | results(runs, "train_bf16_cpu", "training")
    fp32 = results(runs, "inference_fp32", "inference")
    fp32_training = results(runs, "train_fp32", "training")
    eager = results(runs, "train_bf16_eager", "training")["overlapped"]
    same = alone(runs)["overlapped"]
    same_run = runs["train_bf16_overlapped"]["run"]
    equal = all(
        results(runs, name, "inference")[m]["equal_to_gpu"]
        for name in ("inference_bf16", "inference_fp32")
        for m in ("blocked", "overlapped")
    )
    run, short = runs["train_bf16"]["run"], runs["train_fp32"]["run"]
    accum, ref = results(runs, "train_bf16_accum16", "training"), runs["train_bf16_accum16"]["fwd_bwd_reference"]
    return [
        "## 4. Table 2: time",
        "",
        f"Medians: inference over {run['repeat']} passes after {run['warmup']} warm-up passes, training over the "
        f"steps after the first {run['warmup']} of {run['steps']} (float32 and `--grad-accum 16`: after "
        f"{short['warmup']} of {short['steps']}"
        + (
            "; the offloaded modes leave out the step after each round of their bound's parts"
            if "timed_steps" in same
            else ""
        )
        + "); the cpu mode runs once (training: 2 steps, the second timed). "
        "Each offloaded row has its bound, "
        "measured in the same run, and `efficiency = bound / measured`. Inference's bound comes from copy-only "
        "and compute-only runs of the same layers, timed in rounds with the passes, best of each. Training's is "
        "the largest of GPU compute, host-to-device copies, device-to-host copies, the CPU Adam, each measured alone, "
        "and host memory: the bytes that cross it in a step over the rate it reaches with the Adam and both copy "
        "engines running together"
        + (
            ", each the best of rounds run between blocks of steps (the step after a round is not timed)."
            if "bound_parts_ms" in same
            else "."
        ),
        "",
        "bfloat16:",
        "",
        *time_table(results(runs, "inference_bf16", "inference"), bf16_training),
        "",
        f"The same overlapped step training alone (`--no-inference`) in a process of its own "
        f"(`{SOURCES['train_bf16_overlapped']}`) took "
        f"{same['time_ms']:.1f} ms (the median of {len(timed_steps(same, same_run))} of its {same_run['steps']} "
        "steps) against a bound "
        f"of {same['bound_ms']:.1f} ms (efficiency "
        f"{same['efficiency']:.3f}; the CPU Adam alone {same['cpu_adam_ms']:.1f} ms there, "
        f"{results(runs, 'train_bf16', 'training')['overlapped']['cpu_adam_ms']:.1f} ms here).",
        "",
        "float32, where compute outlasts the copies and overlap hides them:",
        "",
        *time_table(fp32, fp32_training),
        "",
        "bfloat16 training with `--grad-accum 16` (65,536 tokens per step):",
        "",
        *time_table({}, accum),
        "",
        f"Plain forward and backward of the same model and micro-batches resident on the GPU, without optimizer "
        f"(`--fwd-bwd-reference`, same run), took {ref['time_ms']:.1f} ms: the overlapped step runs at "
        f"{ref['time_ms'] / accum['overlapped']['time_ms']:.2f}x its speed.",
        "",
        "Overlapped inference by prefetch depth (bfloat16): one layer ahead already keeps the copy engine busy, "
        "and each further slot costs a layer of GPU memory.",
        "",
        *prefetch_table(runs),
        "",
        f"Correctness, checked in these runs: the blocked and overlapped logits are `torch.equal` to the gpu "
        f"mode's in bfloat16 and float32: {'yes' if equal else 'NO'}. With `--attention eager` (a deterministic "
        f"backward), the overlapped mode's first-step gradients are `torch.equal` to the gpu mode's: "
        f"{'yes' if eager['grads_equal_to_gpu'] else 'NO'}, and its masters after that step differ by at most "
        f"{eager['masters_step1_max_abs_diff']:.2g} (float32 rounding allows {eager['masters_tolerance']:.2g}); "
        f"`{SOURCES['train_bf16_eager']}`.",
        "",
    ]


def largest_section(runs: dict) -> list[str]:
    """Section 5: the machine's copy rates, and the most LLaMA-7B layers each mode trains under the cap."""
    r = runs["largest_llama7b"]
    found, cap = r["find_largest"], r["run"]["max_gpu_memory"]
    rows = []
    for mode, f in found.items():
        t = f["training"]
        rows.append(
            [
                LABELS[mode],
                str(f["layers"]),
                f"{f['parameters'] / 1e9:.2f}",
                f"{t['time_ms']:.1f}",
                gib(t["peak_gpu_bytes"]),
                gib(t["peak_host_bytes"]),
            ]
        )
    big = found["overlapped"]
    t, params, c = big["training"], big["parameters"], r["config"]
    layers, pool = big["layers"], t["gradient_pool"]
    probes = "; ".join(
        f"{LABELS[mode]}: " + ", ".join(f"{n} ({probe_outcome(p)})" for n, p in f["probes"].items())
        for mode, f in found.items()
    )
    steps = ", ".join(f"{ms:.0f}" for ms in t["step_ms"])
    return [
        "## 5. The GPU, and the largest model it trains",
        "",
        f"{r['device']}, {r['gpu_memory_bytes'] / GiB:.1f} GiB; {r['cpu_threads']} CPU threads; torch {r['torch']}, "
        f"transformers {r['transformers']}. Measured by the runs above, each copy alone:",
        "",
        *copy_rates(runs),
        "",
        f"`python3 report/find_largest.py --preset {r['run']['preset']} --max-gpu-memory {cap:g} --steps "
        f"{r['run']['steps']} --warmup {r['run']['warmup']}` searches the number of LLaMA-7B-sized decoder layers "
        f"that train ({r['run']['steps']} full steps of {r['run']['batch_size'] * r['run']['seq_len']} tokens, "
        f"no OOM) with the GPU capped at {cap:g} GiB. Each count is tried in a fresh process; the probes were "
        f"{probes}.",
        "",
        *table(["mode", "layers", "parameters (B)", "step (ms)", "peak GPU (GiB)", "peak host (GiB)"], rows),
        "",
        f"Without offload, what stops one more layer is {found['gpu']['limited_by']}. With overlapped offload, "
        f"{layers} layers ({params / 1e9:.2f} B parameters, more than LLaMA-7B's {param_count(c) / 1e9:.2f} B) "
        f"train in {gib(t['peak_gpu_bytes'])} GiB of GPU memory, at steps of {steps} ms (the table gives the "
        f"median of {step_list(timed_steps(t, r['run']))}; the bound, "
        f"{BOUND_NAMES[t['bound_by']]}"
        f" alone, is {t['bound_ms']:.1f} ms).{placement_note(t)} What stops one more layer is {big['limited_by']}. "
        "Each probe trains alone, so the host keeps no bfloat16 copy of the decoder layers; with the rest of "
        f"host memory taken by the masters and Adam state, the gradients land in {pool['buffers']} shared pinned "
        "buffers "
        f"that the CPU Adam hands back as it finishes a unit, and the backward waited {pool['waited_ms'] / 1e3:.1f}"
        f" s in all over the {r['run']['steps']} steps for one to be free. Where the host's bytes go at {layers} "
        "layers (over the training steps; the bound's scratch Adam state comes after):",
        "",
        *where_table(t, host_parts(t, c, r["run"], params), params),
        "",
    ]


def disk_tier_note(runs: dict) -> list[str]:
    """Section 5's disk tier: the largest model with the Adam moments of the last layers on the disk, what a disk as
    large as needed would give (find_largest.py's arithmetic), and 7b-8l with half its layers' moments on the disk
    against none."""
    r = runs["largest_llama7b_disk"]
    found = r["find_largest"]["overlapped"]
    t, large = found["training"], found["large_disk"]
    disk = t["disk_tier"]
    host, half = (runs[name]["results"]["overlapped"]["training"] for name in ("disk_7b8l_host", "disk_7b8l_half"))
    return [
        "With the disk tier (`--nvme DIR`; `bash report/run_benchmarks.sh OUT largest_disk disk`), "
        f"{found['layers']} layers "
        f"({found['parameters'] / 1e9:.2f} B parameters) train under the {r['run']['max_gpu_memory']:g} GiB cap, "
        f"the Adam moments of {disk['units']} of them ({gib(disk['bytes'])} GiB) in files on the disk, read and "
        f"written back every step: {t['time_ms'] / 1e3:.1f} s a step against a bound of {t['bound_ms'] / 1e3:.1f} s "
        f"({BOUND_NAMES[t['bound_by']]} alone; efficiency {t['efficiency']:.2f}), peak host "
        f"{gib(t['peak_host_bytes'])} GiB, peak GPU {gib(t['peak_gpu_bytes'])} GiB. The bound's disk part moves a "
        f"step's {t['disk_bytes'] / 1e9:.1f} GB each way through the tier's own buffers, at "
        f"{t['disk_gbps']:.2f} GB/s together; alone, the disk measured {disk['write_gbps']:.2f} GB/s written and "
        f"{disk['read_gbps']:.2f} read when the tier was set up. One more layer does not fit this host and disk "
        f"together: {found['limited_by'].split(': ', 1)[-1]}.",
        "",
        f"Arithmetic, not measured: with a disk as large as needed, {large['layers']} layers "
        f"({large['parameters'] / 1e9:.2f} B parameters) would fit this host, {large['disk_layers']} of them with "
        f"their moments on the disk ({gib(large['disk_bytes'])} GiB), at about {large['step_ms'] / 1e3:.0f} s a step "
        "(the step above, scaled by the bytes on the disk); a faster drive shortens the step in proportion to its "
        "rate.",
        "",
        f"7b-8l with the moments of half its decoder layers on the disk: {half['time_ms']:.1f} ms a step against a "
        f"bound of {half['bound_ms']:.1f} ms ({BOUND_NAMES[half['bound_by']]} alone; efficiency "
        f"{half['efficiency']:.2f}), {gib(half['disk_tier']['bytes'])} GiB read and written back a "
        f"step; with all of them in host memory, {host['time_ms']:.1f} ms.",
        "",
    ]


def small_host_note(runs: dict) -> list[str]:
    """Section 5's small host: 7b-8l on 64 x 1024 tokens a step under an 11 GiB GPU cap and a 16 GiB host cap, the
    moments the host cannot hold on the disk, and the process's peak resident set against the host cap."""
    r = runs["small_host_7b8l"]
    run, t = r["run"], r["results"]["overlapped"]["training"]
    disk, tokens = t["disk_tier"], run["grad_accum"] * run["batch_size"] * run["seq_len"]
    row = [
        f"{t['time_ms'] / 1e3:.2f}",
        f"{t['bound_ms'] / 1e3:.2f} ({t['bound_by']})",
        f"{t['efficiency']:.3f}",
        f"{gib(t['peak_gpu_bytes'])} ({gib(t['predicted_peak_bytes'])})",
        f"{gib(r['peak_host_bytes_process'])} ({run['max_host_memory']:g})",
        f"{t['losses'][0]:.4f} -> {t['losses'][-1]:.4f}",
    ]
    header = ["step (s)", "bound (s)", "efficiency", "peak GPU (predicted), GiB", "peak host (cap), GiB", "loss"]
    return [
        f"A small host (part `small_host`, `--max-host-memory {run['max_host_memory']:g} --nvme DIR`): 7b-8l, "
        f"{r['parameters'] / 1e9:.2f} B parameters (more than GPT2-XL's 1.5 B), on {run['grad_accum']} x "
        f"{run['batch_size']} x {run['seq_len']} = {tokens} tokens a step under a GPU cap of "
        f"{run['max_gpu_memory']:g} GiB and a host cap of {run['max_host_memory']:g} GiB. The host has no room for "
        "a bfloat16 copy of the masters, so the GPU streams the float32 masters and casts them; the random model is "
        "drawn unit by unit into its masters, never whole on the host; the Adam moments of "
        f"{disk['units']} layers ({gib(disk['bytes'])} GiB) live on the disk. The peak host is the process's "
        "resident set over the whole run (the kernel's VmHWM), against the cap; the step, the median of "
        f"{step_list(timed_steps(t, run))}:",
        "",
        *table(header, [row]),
        "",
        f"The disk bounds the step: it reads and writes back {t['disk_bytes'] / 1e9:.1f} GB a step, at "
        f"{t['disk_gbps']:.2f} GB/s together in the bound's timing, while the GPU's compute alone takes "
        f"{t['gpu_compute_ms'] / 1e3:.2f} s. The loss is of one fixed batch of random token ids, learnt by heart.",
        "",
    ]


def budget_rows(runs: dict) -> list[tuple[str, float | None, dict, dict]]:
    """(label, cap in GiB or None, inference result, training result) from gpu mode through every unit streamed to
    each cap of the budget part."""
    ends = runs["budget_ends"]["results"]
    rows = [
        ("gpu mode (resident model)", None, ends["gpu"]["inference"], ends["gpu"]["training"]),
        (
            "overlapped, no cap (every unit streamed)",
            None,
            ends["overlapped"]["inference"],
            ends["overlapped"]["training"],
        ),
    ]
    for b in BUDGETS:
        r = runs[f"budget_{b}"]
        cap, o = r["run"]["max_gpu_memory"], r["results"]["overlapped"]
        rows.append((f"overlapped, `--max-gpu-memory {cap:g}`", cap, o["inference"], o["training"]))
    return rows


def budget_section(runs: dict) -> list[str]:
    """Section 10 from the budget and budget_ab runs."""
    ends, layers = runs["budget_ends"], runs["budget_ends"]["config"]["num_hidden_layers"]
    rows = budget_rows(runs)
    gpu, streamed = rows[0], rows[1]
    table_rows = []
    for label, _cap, i, t in rows:
        resident = (
            "all"
            if label.startswith("gpu")
            else (f"{len(i['resident_layers'])} of {layers} / {len(t['resident_units'])} of {t['units']}")
        )
        table_rows.append(
            [
                label,
                f"{i['time_ms']:.1f}",
                f"{t['time_ms']:.1f}",
                num(t.get("bound_ms"), ".1f"),
                resident,
                gib(t["peak_gpu_bytes"]),
                gib(t.get("predicted_peak_bytes")),
            ]
        )
    capped = [(cap, i, t) for _, cap, i, t in rows if cap is not None]
    error = max(abs(t["peak_gpu_bytes"] - t["predicted_peak_bytes"]) for *_, t in capped)
    i11, t11 = next((i, t) for cap, i, t in capped if cap == 11)
    run = ends["run"]
    return [
        "## 10. Time against the GPU budget",
        "",
        f"`bash report/run_benchmarks.sh OUT budget budget_ab`: {ends['parameters'] / 1e9:.2f} B parameters "
        f"({run['preset']}), {run['dtype']}, "
        f"{ends['tokens']} tokens; inference and {run['steps']} training steps (median after the "
        f"{steps_word(run['warmup'])}) in each run. Under `--max-gpu-memory`, overlapped keeps resident on the GPU "
        "what the cap holds: decoder layers spread among the streamed ones for inference, the longest run of units "
        "from the embeddings for training, whose resident units the GPU's fused Adam steps. The predicted peak "
        "is the plan's bytes plus one unit's measured working set. The training bound is the run's own: the longest of "
        "the GPU compute, the copies each way, the CPU Adam and the host memory traffic, each timed alone in the "
        f"run. The all-streamed inference pass ran at {streamed[2]['efficiency']:.2f} of its own bound here.",
        "",
        *table(
            [
                "run",
                "inference (ms)",
                "training step (ms)",
                "training bound (ms)",
                "resident: layers / units",
                "peak GPU, training (GiB)",
                "predicted (GiB)",
            ],
            table_rows,
        ),
        "",
        f"Under 11 GiB inference takes {i11['time_ms'] / gpu[2]['time_ms']:.2f}x gpu mode's time and a training "
        f"step {t11['time_ms'] / streamed[3]['time_ms']:.2f}x the all-streamed one's; every peak is within "
        f"{error / GiB:.2f} GiB of its prediction.",
        *same_placement_note(rows),
        "",
        "![time against budget](figures/time_vs_budget.png)",
        "",
        *pairs_table(runs),
    ]


def same_placement_note(rows: list) -> list[str]:
    """How far apart two capped runs that stream every unit, as the uncapped one does, came out: the noise between
    processes, next to how far their own bounds moved."""
    streamed = rows[1][3]
    same = [(cap, t) for _, cap, _, t in rows[2:] if not t["resident_units"]]
    if not same:
        return []
    cap, t = max(same, key=lambda ct: abs(ct[1]["time_ms"] - streamed["time_ms"]))
    return [
        f"Under {cap:g} GiB every unit is streamed, as with no cap, and the step took {t['time_ms']:.1f} ms "
        f"against {streamed['time_ms']:.1f}; its own bound moved too ({t['bound_ms']:.1f} ms against "
        f"{streamed['bound_ms']:.1f}, the CPU Adam alone {t['cpu_adam_ms']:.1f} ms against "
        f"{streamed['cpu_adam_ms']:.1f}): the host's speed differs between processes, not the placement's."
    ]


def ab_pair(runs: dict, i: int) -> tuple[dict, dict]:
    """The budget_ab part's pair i: the training results with every unit streamed and under the 11 GiB cap."""
    return tuple(overlapped_training(runs, f"budget_ab_{arm}_{i}") for arm in ("streamed", "11"))


def pairs_table(runs: dict) -> list[str]:
    """The budget_ab pairs: training under 11 GiB against every unit streamed, each run a process of its own."""
    rows, pairs = [], [ab_pair(runs, i) for i in range(1, PAIRS + 1)]
    for i, (s, c) in enumerate(pairs, 1):
        rows.append(
            [
                str(i),
                f"{s['time_ms']:.1f}",
                f"{c['time_ms']:.1f}",
                f"{c['time_ms'] / s['time_ms']:.2f}",
                f"{len(c['resident_units'])} of {c['units']}",
                gib(c["peak_gpu_bytes"]),
            ]
        )
    streamed, capped = ([t["time_ms"] for t in arm] for arm in zip(*pairs, strict=True))
    return [
        "Training alone (`--no-inference`), every unit streamed and then under 11 GiB, one process after the "
        f"other, {PAIRS} times (part `budget_ab`, `results/budget/ab/`, on machine {machine_of('budget_ab')}; the "
        f"sweep above ran on machine {machine_of('budget')}). The streamed steps took {min(streamed):.1f} to "
        f"{max(streamed):.1f} ms, the capped ones {min(capped):.1f} to {max(capped):.1f} ms.",
        "",
        *table(["pair", "every unit streamed (ms)", "11 GiB (ms)", "ratio", "units resident", "peak GPU (GiB)"], rows),
        "",
    ]


def budget_figure(runs: dict, out: Path) -> None:
    """The figure of section 10: inference and training time against the GPU cap."""
    import matplotlib.pyplot as plt

    rows = budget_rows(runs)
    caps = [cap for _, cap, _, _ in rows if cap is not None]
    fig, axes = plt.subplots(1, 2, figsize=(11, 4))
    for ax, (title, part) in zip(axes, (("inference", 2), ("training step", 3)), strict=True):
        ax.plot(caps, [r[part]["time_ms"] for r in rows if r[1] is not None], "o-", label="overlapped, capped")
        for r, style in zip(rows[:2], ("--", ":"), strict=True):  # the two ends: gpu mode and every unit streamed
            ax.axhline(r[part]["time_ms"], linestyle=style, color="gray", label=r[0].split(" (")[0])
        ax.set_xscale("log")
        ax.set_xticks(caps, [f"{c:g}" for c in caps])
        ax.minorticks_off()
        ax.set_xlabel("--max-gpu-memory (GiB)")
        ax.set_ylabel("ms")
        ax.set_title(title)
        ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(out, dpi=150, metadata={"Software": None})
    plt.close(fig)


def probe_outcome(p: dict) -> str:
    """What a --find-largest probe met."""
    return "trains" if "time_ms" in p else "OOM" if p.get("oom") else "refused" if p.get("refused") else "fails"


def scale_section(runs: dict) -> list[str]:
    """Section 6: LLaMA-7B on 65,536-token steps under 11 GiB, against the resident forward and backward."""
    r = runs["train_llama7b_65k"]
    run, c, params, ref = r["run"], r["config"], r["parameters"], r["fwd_bwd_reference"]
    t = results(runs, "train_llama7b_65k", "training")["overlapped"]
    sequences = run["grad_accum"] * run["batch_size"]
    speed = sequences / t["time_ms"] * 1e3
    acts = activation_pool_bytes(r)
    parts = host_parts(t, c, run, params, acts)
    pools = sum(b for what, b in parts if "pool" in what)
    rows = [
        [
            "forward and backward, resident (no optimizer, no cap)",
            f"{ref['time_ms']:.1f}",
            f"{ref['sequences_per_s']:.2f}",
            "1.00",
            gib(ref["peak_gpu_bytes"]),
            "",
        ],
        [
            f"overlapped offload, Adam, capped at {run['max_gpu_memory']:g} GiB",
            f"{t['time_ms']:.1f}",
            f"{speed:.2f}",
            f"{speed / ref['sequences_per_s']:.2f}",
            gib(t["peak_gpu_bytes"]),
            gib(t["peak_host_bytes"]),
        ],
    ]
    return [
        "## 6. LLaMA-7B on 65,536-token steps under 11 GiB",
        "",
        f"`offload_llama.py --preset {run['preset']} --mode "
        f"overlapped --train --no-inference --grad-accum {run['grad_accum']} --batch-size {run['batch_size']} "
        f"--seq-len {run['seq_len']} --max-gpu-memory {run['max_gpu_memory']:g} "
        + ("" if run["resident_layers"] is None else f"--resident-layers {run['resident_layers']} ")
        + f"--steps {run['steps']} --warmup {run['warmup']} --fwd-bwd-reference`: {sequences} sequences of "
        f"{run['seq_len']} tokens a step, Adam with "
        f"float32 masters, {params / 1e9:.2f} B parameters. The inputs the units keep for their backward, "
        f"{acts / GiB:.1f} GiB, would not fit the cap, so activation offload turned itself on: each unit's "
        "inputs leave for pinned host memory while the unit runs and come back on the copy stream ahead of its "
        "backward, as the weights do. The reference is plain forward and backward of the same model and "
        "micro-batches resident on the GPU in bfloat16, without optimizer or cap, timed in the same run."
        + placement_note(t),
        "",
        *table(["run", "step (ms)", "sequences/s", "x reference", "peak GPU (GiB)", "peak host (GiB)"], rows),
        "",
        f"The loss went {t['losses'][0]:.4f} -> {t['losses'][-1]:.4f} in {len(t['losses'])} steps. The step's "
        f"bound is {BOUND_NAMES[t['bound_by']]} ({t['bound_ms']:.1f} ms: forward, recompute and backward of "
        f"every unit; the host-to-device copies take {t['h2d_ms']:.1f} ms, the device-to-host "
        f"{t['d2h_ms']:.1f} ms and the CPU Adam {t['cpu_adam_ms']:.1f} ms, each alone), efficiency "
        f"{t['efficiency']:.3f}; the checkpointed recompute is what the reference does not pay. The gradients "
        f"land in {t['gradient_pool']['buffers']} shared pinned buffers, as many as host memory holds, and the "
        f"backward waited {t['gradient_pool']['waited_ms']:.0f} ms in all for one. Where the host's bytes go: "
        f"without the two pools, {(t['peak_host_bytes'] - pools) / params:.2f} bytes per parameter.",
        "",
        *where_table(t, parts, params),
        "",
        *activation_cost(runs),
    ]


def placement_note(t: dict) -> str:
    """What a capped training run's placement kept on the GPU, and its predicted peak against the measured one."""
    resident = t["resident_units"]
    return (
        f" Under the cap, the placement keeps {len(resident)} of the {t['units']} units resident ("
        + ", ".join(f"`{u}`" for u in resident)
        + f"; their float32 masters and moments on the GPU take "
        f"{gib(t['predicted_parts']['resident masters and moments'])} GiB)"
        + (
            f", and the GPU's Adam steps {gpu_adam_note(t)} over their state on the host"
            if t.get("gpu_adam_units")
            else ""
        )
        + f"; it predicted a peak of {gib(t['predicted_peak_bytes'])} GiB, and "
        f"{gib(t['peak_gpu_bytes'])} GiB was measured."
    )


def activation_cost(runs: dict) -> list[str]:
    """What activation offload costs on 7b-8l, where the saved inputs would fit the GPU anyway."""
    pairs = (
        ("1", "train_bf16_overlapped", "train_bf16_offload_acts"),
        ("16", "train_bf16_accum16", "train_bf16_accum16_offload_acts"),
    )
    rows = []
    for k, without, with_ in pairs:
        a, b = (results(runs, name, "training")["overlapped"] for name in (without, with_))
        rows.append(
            [
                k,
                f"{a['time_ms']:.1f}",
                f"{b['time_ms']:.1f}",
                f"{b['time_ms'] / a['time_ms']:.3f}",
                gib(a["peak_gpu_bytes"]),
                gib(b["peak_gpu_bytes"]),
            ]
        )
    return [
        "What activation offload costs where it is not needed (7b-8l, bfloat16, micro-batches of 4096 tokens; "
        "each column from a run of its own, `"
        + "`, `".join(SOURCES[n] for _, *names in pairs for n in names)
        + "`): the inputs cross PCIe on the device-to-host and copy streams beside the weights and gradients.",
        "",
        *table(
            [
                "micro-batches",
                "step, inputs on the GPU (ms)",
                "step, inputs offloaded (ms)",
                "ratio",
                "peak GPU, on the GPU (GiB)",
                "peak GPU, offloaded (GiB)",
            ],
            rows,
        ),
        "",
    ]


def timed_steps(t: dict, run: dict) -> list[int]:
    """The steps a training median is over: the runs that time their bound between steps leave some out."""
    return t.get("timed_steps", list(range(run["warmup"], run["steps"])))


def step_list(steps: list[int]) -> str:
    """Steps counted from 0 as words counted from 1: 'step 3', 'steps 3 and 4', 'steps 2, 3 and 4'."""
    named = [str(i + 1) for i in steps]
    return f"step {named[0]}" if len(named) == 1 else f"steps {', '.join(named[:-1])} and {named[-1]}"


def steps_word(n: int) -> str:
    """ "first" or "first n": the warm-up steps a median leaves out."""
    return "first" if n == 1 else f"first {n}"


def copy_rates(runs: dict) -> list[str]:
    """The measured copy rates each way and the CPU Adam's rate, as a list."""
    i = results(runs, "inference_bf16", "inference")["overlapped"]
    t = results(runs, "train_bf16", "training")["overlapped"]
    state = t.get("gpu_adam_params")  # the GPU's Adam's float32 state crosses PCIe beside the bfloat16 copies
    return [
        f"- host to device, pinned: {i['h2d_gbps_copy_only']:.1f} GB/s (inference's bfloat16 layers), "
        f"{t['h2d_bytes'] / t['h2d_ms'] / 1e6:.1f} GB/s (training's bfloat16 copies of the masters"
        + (", and the float32 state the GPU's Adam steps" if state else "")
        + ");",
        f"- device to host, pinned: {t['d2h_bytes'] / t['d2h_ms'] / 1e6:.1f} GB/s (training's bfloat16 "
        + ("gradients, and the stepped state" if state else "gradients")
        + ");",
        f"- the fused CPU Adam (torch.compile'd, {t['adam_bytes_per_param']} bytes per parameter): "
        f"{t['cpu_adam_ms'] * 1e6 / (runs['train_bf16']['parameters'] - t.get('gpu_adam_params', 0)):.3f} ns per "
        "parameter it steps, alone; host memory "
        f"with the Adam and both copy engines running together: {t['host_gbps']:.0f} GB/s.",
    ]


def gpu_adam_note(t: dict) -> str:
    """How many parameters a training run's GPU Adam stepped over streamed state, and in which units."""
    return f"{t['gpu_adam_params'] / 1e9:.2f} B parameters (" + ", ".join(f"`{u}`" for u in t["gpu_adam_units"]) + ")"


def figures_section(runs: dict) -> list[str]:
    """Section 7: the timelines of one training step and one forward pass, and time against bound."""
    training = runs["train_bf16"]["results"]["overlapped"]["training"]
    h, d = training["trace"]["h2d"], training["trace"]["d2h"]
    lanes, _ = trace_lanes(HERE / TRACES["timeline_training.png"])
    gpu_end = max(a + b for lane, spans in lanes.items() if lane != "CPU Adam" for a, b in spans)
    adam = sorted(lanes["CPU Adam"])
    idle, idle_from = max((b[0] - (a[0] + a[1]), a[0] + a[1]) for a, b in pairwise(adam))
    gpu_adam = sorted(lanes.get("GPU Adam", []))
    return [
        "## 7. Figures",
        "",
        "One overlapped training step (bfloat16, 7b-8l, 4096 tokens), from its `--profile` trace. The lanes are the "
        "GPU's compute stream, the host-to-device copies (with the copy stream's casts), the device-to-host copies "
        + (
            "(the gradients, and the state the GPU's Adam has stepped), the GPU's Adam's stream"
            if gpu_adam
            else "of the gradients"
        )
        + f", and the CPU Adam thread. {h['overlap_ms']:.1f} of {h['copy_ms']:.1f} ms of "
        f"host-to-device copies and {d['overlap_ms']:.1f} of {d['copy_ms']:.1f} ms of device-to-host copies ran "
        "under compute. The step opens with the CPU Adam finishing the previous step's updates, which the forward "
        f"waits on; from {idle_from:.0f} ms the CPU waits {idle:.0f} ms for this step's first gradients. "
        + (
            f"The GPU's Adam steps {gpu_adam_note(training)} from {gpu_adam[0][0]:.0f} to "
            f"{gpu_adam[-1][0] + gpu_adam[-1][1]:.0f} ms, a chunk at a time as their float32 state comes in, while "
            "the CPU Adam steps the others. "
            if gpu_adam
            else ""
        )
        + f"The trace ends when the last update is done, {adam[-1][0] + adam[-1][1] - gpu_end:.0f} ms after the "
        "GPU's last event.",
        "",
        "![training timeline](figures/timeline_training.png)",
        "",
        "One overlapped forward pass (bfloat16, inference), from its trace: the copy stream runs ahead of the "
        "compute stream by one layer.",
        "",
        "![inference timeline](figures/timeline_inference.png)",
        "",
        "Time against bound for each offloaded run.",
        "",
        "![time and bound](figures/time_vs_bound.png)",
        "",
    ]


def peers_section(runs: dict) -> list[str]:
    """Section 8: accelerate's cpu_offload, FSDP2 with CPUOffloadPolicy and (where run) DeepSpeed's ZeRO-3 and ZeRO-2
    offload against the script's modes."""
    p = runs["peers_bf16"]["peers"]
    inference, training, own = (
        results(runs, "inference_bf16", "inference"),
        results(runs, "train_bf16", "training"),
        alone(runs),
    )
    rows = [
        [
            "inference",
            "offload_llama gpu (resident)",
            f"{inference['gpu']['time_ms']:.1f}",
            gib(inference["gpu"]["peak_gpu_bytes"]),
            "",
        ],
        [
            "inference",
            "offload_llama overlapped",
            f"{inference['overlapped']['time_ms']:.1f}",
            gib(inference["overlapped"]["peak_gpu_bytes"]),
            "",
        ],
        [
            "inference",
            "accelerate cpu_offload",
            f"{p['accelerate']['time_ms']:.1f}",
            gib(p["accelerate"]["peak_gpu_bytes"]),
            gib(p["accelerate"]["peak_host_bytes"]),
        ],
        *(
            ["training step", f"offload_llama {mode}", f"{own[mode]['time_ms']:.1f}", *peaks(own[mode])]
            for mode in ("gpu", "overlapped")
        ),
        *(peer_row(p[name], label) for name, (label, _) in TRAINING_PEERS.items() if name in p),
    ]
    fsdp, ours = p["fsdp2"], training["overlapped"]
    same_loss = fsdp["losses"][-1] == ours["losses"][-1]
    return [
        "## 8. Peers",
        "",
        "The same model, batch and Adam settings, run by `report/peers.py` (report tooling: `offload_llama.py` "
        "imports neither package) in the same call as the `alone` part, whose runs give this project's training "
        "rows (each mode training alone in a process of its own, `results/train_bf16_{gpu,overlapped}.json`); the "
        "inference rows are section 4's, on the same machine. accelerate's `cpu_offload` keeps the "
        "weights in CPU memory and a hook on each module copies them in when it runs. FSDP2 on one GPU with "
        "`CPUOffloadPolicy` and bfloat16 `MixedPrecisionPolicy` keeps float32 parameters, gradients and Adam "
        "state in pinned CPU memory, one `fully_shard` group per decoder layer, and steps the fused CPU Adam "
        "after the backward pass.",
        "",
        *table(["run", "implementation", "time (ms)", "peak GPU (GiB)", "peak host (GiB)"], rows),
        "",
        *slower_than_overlapped(p, own["overlapped"]),
        f"accelerate's logits are `torch.equal` to the resident model's: "
        f"{'yes' if p['accelerate']['equal_to_gpu'] else 'NO'}; it copies each module's weights from pageable "
        f"memory on the compute stream, {runs['peers_bf16']['parameters'] * 2 / p['accelerate']['time_ms'] / 1e6:.1f}"
        f" GB/s of weights per pass against {inference['overlapped']['h2d_gbps']:.1f} for the overlapped mode, "
        "and holds one module at a time, hence its smaller GPU peak. FSDP2's loss went "
        f"{fsdp['losses'][0]:.4f} -> {fsdp['losses'][-1]:.4f} in {len(fsdp['losses'])} steps "
        f"({'the same' if same_loss else 'against'} {ours['losses'][0]:.4f} -> {ours['losses'][-1]:.4f} for the "
        "overlapped mode); its step waits for the whole CPU Adam after the backward pass, where the overlapped "
        "mode updates each layer as soon as its gradients land.",
        "",
        *deepspeed_note(p, runs["peers_bf16"]["run"]["dtype"]),
    ]


def deepspeed_note(p: dict, dtype: str) -> list[str]:
    """What DeepSpeed's rows run, where the peers' JSON has them."""
    ran = [p[name] for name in ("zero3", "zero2") if "time_ms" in p.get(name, {})]
    if not ran:
        return []
    return [
        f"DeepSpeed {ran[0]['deepspeed']} (`report/peers.py`, one process as rank 0 of 1) trains the same model "
        f"with {dtype} compute: ZeRO-3 with `offload_param` and `offload_optimizer` to pinned CPU memory (the model "
        "built under `deepspeed.zero.Init`), ZeRO-2 with `offload_optimizer` only, both with DeepSpeed's CPU Adam, "
        "which steps after the whole backward pass.",
        "",
    ]


TRAINING_PEERS = {  # report/peers.py's training peers, as section 8's table and its text name them
    "fsdp2": ("FSDP2 fully_shard + CPUOffloadPolicy", "FSDP2"),
    "zero3": ("DeepSpeed ZeRO-3, parameters and optimizer offloaded", "DeepSpeed ZeRO-3"),
    "zero2": ("DeepSpeed ZeRO-2, optimizer offloaded", "DeepSpeed ZeRO-2"),
}


def peer_row(r: dict, label: str) -> list[str]:
    """A training peer's row: its step and peaks, or why it did not run."""
    if "missing" in r:
        return ["training step", label, "", "", r["missing"]]
    return ["training step", label, f"{r['time_ms']:.1f}", *peaks(r)]


def peaks(r: dict) -> list[str]:
    """A run's peak GPU and peak host memory in GiB."""
    return [gib(r["peak_gpu_bytes"]), gib(r["peak_host_bytes"])]


def slower_than_overlapped(p: dict, overlapped: dict) -> list[str]:
    """How many times the overlapped step each training peer's step took, in the same call."""
    ratios = [
        f"{label} {p[name]['time_ms'] / overlapped['time_ms']:.2f}x"
        for name, (_, label) in TRAINING_PEERS.items()
        if "time_ms" in p.get(name, {})
    ]
    if not ratios:
        return []
    return [f"Each training peer's step against the overlapped one in the same call: {', '.join(ratios)}.", ""]


def analysis_section(runs: dict) -> list[str]:
    """Section 9: when overlap hides the copies, where training time goes, and the limits that remain."""
    i16 = results(runs, "inference_bf16", "inference")["overlapped"]
    i32 = results(runs, "inference_fp32", "inference")["overlapped"]
    g32 = results(runs, "inference_fp32", "inference")["gpu"]
    tokens = runs["inference_bf16"]["tokens"]
    t = results(runs, "train_bf16", "training")["overlapped"]
    a = results(runs, "train_bf16_accum16", "training")
    f = results(runs, "train_fp32", "training")
    params = runs["train_bf16"]["parameters"]
    own, own_run = alone(runs)["overlapped"], runs["train_bf16_overlapped"]["run"]
    busy, idle = cpu_adam_busy_and_idle(own, own_run)
    big = runs["largest_llama7b"]["find_largest"]["overlapped"]
    return [
        "## 9. What the numbers mean",
        "",
        f"When overlap hides the copies. A decoder layer's weights take the same time to copy whatever the batch; "
        f"its compute grows with the tokens. At {tokens} tokens in bfloat16 a layer copies in "
        f"{i16['copy_ms_per_layer']:.2f} ms and computes in {i16['compute_ms_per_layer']:.2f} ms: the pass is bound "
        f"by PCIe, and overlap can only hide the compute under the copies (efficiency "
        f"{i16['efficiency']:.3f} against that bound). Compute would match the copy at about "
        f"{tokens * i16['copy_ms_per_layer'] / i16['compute_ms_per_layer']:,.0f} tokens per batch. In float32 the "
        f"layer copies in {i32['copy_ms_per_layer']:.2f} ms and computes in {i32['compute_ms_per_layer']:.2f} ms "
        f"({i32['compute_ms_per_layer'] / i16['compute_ms_per_layer']:.0f}x bfloat16's compute), so from about "
        f"{tokens * i32['copy_ms_per_layer'] / i32['compute_ms_per_layer']:,.0f} tokens the copies are hidden: the "
        f"overlapped pass took {i32['time_ms']:.1f} ms against {g32['time_ms']:.1f} ms resident. In general a layer "
        "of N parameters of b bytes is hidden once its 2NT FLOPs at the achieved rate F outlast the bN bytes at "
        "the PCIe rate B, that is from T = bF / 2B tokens.",
        "",
        f"Where training time goes. The overlapped bfloat16 step ({t['time_ms']:.1f} ms) is bound by host memory: "
        f"{t['host_bytes'] / 1e9:.1f} GB cross it per step, {t['host_bytes_per_param']:.1f} bytes per parameter. "
        + host_bytes_note(t, params)
        + f" At the rate host memory reached with the Adam and "
        f"both copy engines running together, {t['host_gbps']:.0f} GB/s, those bytes take "
        f"{t['host_memory_ms']:.1f} ms, against {t['cpu_adam_ms']:.1f} ms for the Adam alone, "
        f"{t['gpu_compute_ms']:.1f} ms of GPU compute, {t['h2d_ms']:.1f} ms of host-to-device and "
        f"{t['d2h_ms']:.1f} ms of device-to-host copies. The step reached {t['efficiency']:.3f} of that bound "
        f"in this run and {own['efficiency']:.3f} in the run alone (section 4), whose "
        f"bound measured the host at {own['host_gbps']:.0f} GB/s: the host's rate varies "
        "between processes, and so the bound. What keeps the step above it: in the run alone the CPU Adam was "
        f"busy a median of {busy:.1f} ms a step, against the {own['host_memory_ms']:.1f} ms that bound gives "
        "host memory (beside the copies the Adam runs at the pace host memory allows), and a step took a median "
        f"of {idle:.0f} ms more than the Adam's busy time: once a step the CPU Adam idles from "
        "its last update until the next backward's first gradients (the head's) land, while the last updated "
        "units are copied in and the head runs forward and backward (the gap in the figure of section 7). "
        f"More tokens per step amortise the optimizer: with 16 micro-batches the bound is the GPU compute "
        f"({a['overlapped']['bound_ms']:.1f} ms), and the overlapped step runs at "
        f"{a['gpu']['time_ms'] / a['overlapped']['time_ms']:.2f}x the resident one's speed. In float32 the GPU "
        f"compute ({f['overlapped']['gpu_compute_ms']:.1f} ms) bounds a single micro-batch, and the overlapped step "
        f"reaches {f['overlapped']['efficiency']:.3f} of it.",
        "",
        "The limits that remain. (1) Host memory capacity: the float32 master and the two Adam moments, 12 bytes "
        "per parameter, must live for the whole run, and with two gradient buffers this machine's host memory "
        f"holds {big['layers']} LLaMA-7B layers and no more (section 5), while their training takes "
        f"{gib(big['training']['peak_gpu_bytes'])} GiB of the {runs['largest_llama7b']['run']['max_gpu_memory']:g} "
        "GiB GPU cap. (2) Host memory bandwidth: the bytes the CPU Adam and the copies move through it, not "
        "PCIe or the GPU, bound a one-micro-batch step; the 16-bit copies and gradients took its bytes per "
        f"parameter from 40 to {overlapped_training(runs, 'ablation_share_0')['host_bytes_per_param']:.0f} "
        f"(`{SOURCES['ablation_share_0']}`, every unit on the CPU Adam)"
        + (
            f", and the GPU's Adam to {t['host_bytes_per_param']:.1f}, by taking the cores' work on "
            f"{t['gpu_adam_params'] / params:.0%} of the parameters to the copy engines"
            if t.get("gpu_adam_params")
            else ""
        )
        + "; only fewer bytes still (for example 16-bit moments, outside the torch.optim.Adam recipe this "
        "project keeps) would move it further. "
        f"(3) PCIe: bfloat16 inference at {tokens} tokens is copy-bound ({i16['h2d_gbps']:.1f} GB/s of weights over "
        f"the pass), so offloaded inference runs at "
        f"{results(runs, 'inference_bf16', 'inference')['gpu']['time_ms'] / i16['time_ms']:.2f}x the resident "
        f"speed. (4) Noise: the CPU Adam and so the step vary from run to run on this machine (the same "
        f"overlapped step took {t['time_ms']:.1f} and {alone(runs)['overlapped']['time_ms']:.1f} ms in two runs, "
        "section 4); every figure here is one run's median.",
        "",
    ]


def host_bytes_note(t: dict, params: int) -> str:
    """Who moves a training step's host bytes: the CPU Adam, the copies, and the GPU's Adam's state where it has
    units."""
    on_gpu = t.get("gpu_adam_params", 0)
    adam = (
        f"{t['adam_bytes_per_param']} bytes per parameter in one compiled pass (the float32 master and moments "
        "read and written, the bfloat16 gradient read, the bfloat16 copy of the new master written)"
    )
    if not on_gpu:
        return (
            f"The CPU Adam moves {adam}, the copies {(t['h2d_bytes'] + t['d2h_bytes']) / params:.0f} (that copy "
            "in twice, the gradients out)."
        )
    return (
        f"The CPU Adam steps {(params - on_gpu) / 1e9:.2f} B of the {params / 1e9:.2f} B parameters and moves "
        f"{adam}. The GPU's Adam steps the other {gpu_adam_note(t)} over streamed state: their float32 master "
        "and moments come in over PCIe (12 bytes per parameter) and go back stepped, with their bfloat16 copy "
        "(14): about as many bytes of host memory as the CPU Adam's update and gradient would take (28 and 2), "
        "but moved by the copy engines, which have time to spare, and not by the cores. With the bfloat16 "
        "copies in (twice, but for the units still in their slots, among them those the GPU's Adam rewrites "
        "there) and the CPU Adam's units' gradients out, the copies move "
        f"{t['h2d_bytes'] / 1e9:.1f} GB in and {t['d2h_bytes'] / 1e9:.1f} GB out."
    )


def cpu_adam_busy_and_idle(t: dict, run: dict) -> tuple[float, float]:
    """The medians over a training run's timed steps of the CPU Adam's busy time and of the rest of the step (ms)."""
    steps = timed_steps(t, run)
    return (
        median(t["cpu_adam_busy_ms"][i] for i in steps),
        median(t["step_ms"][i] - t["cpu_adam_busy_ms"][i] for i in steps),
    )


def trace_lanes(path: Path) -> tuple[dict[str, list[tuple[float, float]]], float]:
    """(lane -> [(start ms, duration ms)], end ms) of a profiler trace, from the first event on its lanes."""
    events = [e for e in json.loads(path.read_text())["traceEvents"] if e.get("ph") == "X"]
    gpu = [e for e in events if e.get("cat") in ("kernel", "gpu_memcpy")]
    copy_streams = {e["tid"] for e in gpu if "HtoD" in e["name"]}
    kernel_us = Counter()
    for e in gpu:
        if e["cat"] == "kernel":
            kernel_us[e["tid"]] += e["dur"]
    compute = max(kernel_us, key=kernel_us.get, default=None)  # the stream with the most kernel time
    # the GPU's Adam over streamed state has a stream of its own, which runs torch's fused Adam (multi_tensor_apply)
    adam_streams = {e["tid"] for e in gpu if "multi_tensor_apply" in e["name"]} - {compute}
    launched = {e["args"].get("External id") for e in gpu}  # ops that ran on the GPU: not the CPU Adam's
    lanes = {"CPU Adam": [], "GPU Adam": [], "D2H copies": [], "H2D copies + casts": [], "GPU compute": []}
    for e in events:
        if is_cpu_adam(e) and e.get("args", {}).get("External id") not in launched:
            lane = "CPU Adam"
        elif e.get("cat") == "gpu_memcpy":
            lane = "H2D copies + casts" if "HtoD" in e["name"] else "D2H copies" if "DtoH" in e["name"] else None
        elif e.get("cat") == "kernel":
            lane = (
                "H2D copies + casts"
                if e["tid"] in copy_streams
                else "GPU Adam"
                if e["tid"] in adam_streams
                else "GPU compute"
            )
        else:
            lane = None
        if lane:
            lanes[lane].append((e["ts"], e["dur"]))
    t0 = min(ts for spans in lanes.values() for ts, _ in spans)
    spans = {lane: [((ts - t0) / 1e3, dur / 1e3) for ts, dur in v] for lane, v in lanes.items() if v}
    return spans, max(a + b for v in spans.values() for a, b in v)


def is_cpu_adam(event: dict) -> bool:
    """Whether a trace event is a step of the CPU Adam (the compiled update, or the fallback's fused kernel); on the
    GPU's lanes too, but trace_lanes tells those apart by their External id."""
    return event["name"].startswith("Torch-Compiled Region") or event["name"] == "aten::_fused_adam_"


def trim_trace(path: Path) -> None:
    """Rewrite a profiler trace with only what the figures and offload_llama.trace_overlap read: the GPU's kernels,
    copies and memsets, the step annotations, the CPU Adam's steps and the metadata that names the lanes (a tenth of
    the events); the CPU ops and the links between them go. Doing it again changes nothing."""
    trace = json.loads(path.read_text())
    kept = ("kernel", "gpu_memcpy", "gpu_memset", "user_annotation", "gpu_user_annotation")
    events = trace["traceEvents"]
    trace["traceEvents"] = [e for e in events if e.get("ph") == "M" or e.get("cat") in kept or is_cpu_adam(e)]
    if len(trace["traceEvents"]) < len(events):
        path.write_text(json.dumps(trace))


def timeline_figure(trace: Path, out: Path, title: str) -> None:
    """A figure of a profiler trace's lanes (trace_lanes) over time."""
    import matplotlib.pyplot as plt

    lanes, end = trace_lanes(trace)
    fig, ax = plt.subplots(figsize=(10, 0.6 * len(lanes) + 1.2))
    colors = {
        "GPU compute": "tab:blue",
        "H2D copies + casts": "tab:orange",
        "D2H copies": "tab:green",
        "GPU Adam": "tab:purple",
        "CPU Adam": "tab:red",
    }
    for y, (lane, spans) in enumerate(lanes.items()):
        ax.broken_barh(spans, (y - 0.35, 0.7), color=colors[lane], linewidth=0)
    ax.set_yticks(range(len(lanes)), list(lanes))
    ax.set_xlim(0, end)
    ax.set_xlabel("ms from the first event drawn")
    ax.set_title(title)
    fig.tight_layout()
    fig.savefig(out, dpi=150, metadata={"Software": None})
    plt.close(fig)


def bound_figure(runs: dict, out: Path) -> None:
    """The figure of time against bound for each offloaded run."""
    import matplotlib.pyplot as plt

    bars = []  # (label, measured ms, bound ms)
    for part, name in (("inference", "inference_bf16"), ("training", "train_bf16")):
        for mode in ("blocked", "overlapped"):
            r = results(runs, name, part)[mode]
            bars.append((f"bf16 {part}\n{mode}", r["time_ms"], r["bound_ms"]))
    for label, name, part in (
        ("fp32 inference", "inference_fp32", "inference"),
        ("fp32 training", "train_fp32", "training"),
        ("bf16 training,\n16 micro-batches", "train_bf16_accum16", "training"),
    ):
        r = results(runs, name, part)["overlapped"]
        bars.append((f"{label}\noverlapped" if "\n" not in label else label, r["time_ms"], r["bound_ms"]))
    big = runs["largest_llama7b"]["find_largest"]["overlapped"]
    bars.append(
        (f"bf16 training,\n{big['layers']} LLaMA-7B layers", big["training"]["time_ms"], big["training"]["bound_ms"])
    )
    scale = results(runs, "train_llama7b_65k", "training")["overlapped"]
    bars.append(("bf16 training, LLaMA-7B,\n16 micro-batches", scale["time_ms"], scale["bound_ms"]))
    fig, axes = plt.subplots(2, (len(bars) + 1) // 2, figsize=(12, 5.6))
    for ax in axes.flat[len(bars) :]:
        ax.axis("off")
    for ax, (label, measured, bound) in zip(axes.flat, bars, strict=False):  # the grid may have a panel to spare
        ax.bar([0, 1], [measured, bound], color=["tab:blue", "tab:gray"])
        ax.set_xticks([0, 1], ["measured", "bound"])
        ax.set_title(f"{label}\n{bound / measured:.2f} of bound", fontsize=9)
        ax.set_ylabel("ms")
    fig.tight_layout()
    fig.savefig(out, dpi=150, metadata={"Software": None})
    plt.close(fig)


def table_cells(rows: list[str]) -> tuple[list[list[str]], list[str]]:
    """A markdown table's cells, header first (the rule line left out), and each column's alignment: left, right or
    center, as its rule line says."""
    cells = [[c.strip().replace("`", "").replace("**", "") for c in row.strip().strip("|").split("|")] for row in rows]
    rule = cells[1]
    aligns = [
        "right" if a.endswith(":") and not a.startswith(":") else "center" if a.startswith(":") else "left"
        for a in rule
    ]
    return [cells[0], *cells[2:]], aligns


def wrapped(text: str, width: float, measure) -> list[str]:
    """`text` in lines of at most `width` points by measure(line), broken between words (a longer word stays whole)."""
    lines = []
    for word in text.split():
        if lines and measure(f"{lines[-1]} {word}") <= width:
            lines[-1] += f" {word}"
        else:
            lines.append(word)
    return lines or [""]


def table_layout(rows: list[str], room: float) -> tuple[float, list[list[list[str]]], list[float], list[str]]:
    """How a markdown table is typeset in `room` points of width: the font size, each cell's lines, each column's
    width and alignment. A table too wide wraps its headers to their columns' widest cells, then gets a smaller font,
    down to 5 points, then wraps its widest columns too."""
    from matplotlib.font_manager import FontProperties
    from matplotlib.textpath import text_to_path

    cells, aligns = table_cells(rows)
    pad = 6.0  # points between columns

    def layout(size: float, limits: list[float] | None = None, whole_headers: bool = False):
        fonts = [FontProperties(family="DejaVu Sans", weight=w, size=size) for w in ("bold", "normal")]

        def measure(text: str, bold: bool = False) -> float:
            return text_to_path.get_text_width_height_descent(text, fonts[0 if bold else 1], ismath=False)[0]

        columns = list(zip(*cells, strict=True))
        widths = []
        for i, (head, *body) in enumerate(columns):
            words = measure(head, True) if whole_headers else max((measure(w, True) for w in head.split()), default=0.0)
            width = max([words, *(measure(c) for c in body)]) if body else measure(head, True)
            widths.append(min(width, limits[i]) if limits else width)
        wrapped_cells = [
            [wrapped(c, widths[i], lambda t, r=r: measure(t, r == 0)) for i, c in enumerate(row)]
            for r, row in enumerate(cells)
        ]
        widths = [
            max(max(measure(line, r == 0) for line in row[i]) for r, row in enumerate(wrapped_cells))
            for i in range(len(widths))
        ]
        return wrapped_cells, widths

    size = 7.5
    lines, widths = layout(size, whole_headers=True)
    if sum(widths) + pad * len(widths) <= room:
        return size, lines, [w + pad for w in widths], aligns
    lines, widths = layout(size)
    total = sum(widths) + pad * len(widths)
    if total > room:
        size = max(5.0, size * room / total)
        lines, widths = layout(size)
        total = sum(widths) + pad * len(widths)
    while total > room:  # the widest column wraps to the width it can have
        widest = max(range(len(widths)), key=widths.__getitem__)
        limits = list(widths)
        limits[widest] = max(widths[widest] - (total - room), widths[widest] / 2)
        lines, widths = layout(size, limits)
        if sum(widths) + pad * len(widths) >= total:
            break  # a word wider than its share: the table keeps its width
        total = sum(widths) + pad * len(widths)
    return size, lines, [w + pad for w in widths], aligns


def pdf(markdown: str, out: Path) -> None:
    """REPORT.md as A4 pages: headings, wrapped paragraphs, typeset tables, code in monospace, figures full width."""
    import textwrap

    import matplotlib.image as mpimg
    import matplotlib.pyplot as plt
    from matplotlib.backends.backend_pdf import PdfPages
    from matplotlib.lines import Line2D

    width, height, margin = 8.27, 11.69, 0.6
    plt.rcParams["pdf.fonttype"] = 42  # TrueType subsets: smaller than Type 3 and the text can be searched
    with PdfPages(out, metadata={"CreationDate": None, "Producer": None, "Creator": None}) as pages:
        fig, y = None, 0.0

        def need(inches: float):
            """Start a new page unless `inches` fit above the bottom margin."""
            nonlocal fig, y
            if fig is None or y - inches < margin:
                if fig is not None:
                    pages.savefig(fig)
                    plt.close(fig)
                fig, y = plt.figure(figsize=(width, height)), height - margin

        def text(line: str, size: float, **kw):
            """One line of text at `size` points, then move down a line."""
            nonlocal y
            need(size / 72 * 1.45)
            fig.text(margin / width, y / height, line, fontsize=size, va="top", **kw)
            y -= size / 72 * 1.45

        def rule(x0: float, x1: float, weight: float) -> None:
            """A horizontal line from x0 to x1 inches at the current height."""
            fig.add_artist(Line2D([x0 / width, x1 / width], [y / height] * 2, lw=weight, color="0.3"))

        def typeset(rows: list[str]) -> None:
            """A markdown table as a table: a bold header over a rule, its columns aligned, long cells wrapped."""
            nonlocal y
            size, cells, columns, aligns = table_layout(rows, (width - 2 * margin) * 72)
            lead = size / 72 * 1.35  # a line's height, inches
            edges = [margin + sum(columns[:i]) / 72 for i in range(len(columns) + 1)]

            def row(cells_of: list[list[str]], bold: bool) -> None:
                nonlocal y
                need(lead * max(map(len, cells_of)) + 0.05)
                for i, lines in enumerate(cells_of):
                    left, right = edges[i], edges[i + 1] - 6 / 72
                    x = {"left": left, "right": right, "center": (left + right) / 2}[aligns[i]]
                    for k, line in enumerate(lines):
                        fig.text(
                            x / width,
                            (y - k * lead) / height,
                            line,
                            fontsize=size,
                            va="top",
                            ha=aligns[i],
                            weight="bold" if bold else "normal",
                        )
                y -= lead * max(map(len, cells_of)) + 0.03

            y -= 0.05
            need(lead * (max(map(len, cells[0])) + 2) + 0.1)  # the header and a row on one page
            rule(edges[0], edges[-1] - 6 / 72, 0.8)
            y -= 0.03
            row(cells[0], True)
            rule(edges[0], edges[-1] - 6 / 72, 0.5)
            y -= 0.03
            for body in cells[1:]:
                row(body, False)
            rule(edges[0], edges[-1] - 6 / 72, 0.8)
            y -= 0.1

        in_code, rows = False, []
        for line in markdown.splitlines() + [""]:
            if line.startswith("|"):
                rows.append(line)
                continue
            if rows:
                typeset(rows)
            rows = []
            if line.startswith("```"):
                in_code = not in_code
            elif in_code:
                text(line, 7, family="monospace")
            elif line.startswith("!["):
                image = mpimg.imread(HERE / line[line.index("(") + 1 : -1])
                h = (width - 2 * margin) * image.shape[0] / image.shape[1]
                need(h)
                ax = fig.add_axes([margin / width, (y - h) / height, (width - 2 * margin) / width, h / height])
                ax.imshow(image)
                ax.axis("off")
                y -= h + 0.1
            elif line.startswith("#"):
                level = len(line) - len(line.lstrip("#"))
                need(1.2)  # no heading alone at the foot of a page
                y -= 0.1
                text(line.lstrip("# "), {1: 15, 2: 12}.get(level, 10), weight="bold")
            elif line.strip():
                for piece in textwrap.wrap(line.replace("`", ""), 110):
                    text(piece, 8.5)
            else:
                y -= 0.08
        pages.savefig(fig)
        plt.close(fig)


# the command the ablations part adds its flags to
ABLATION_COMMAND = (
    "python3 offload_llama.py --mode overlapped --train --no-inference "
    "--steps 70 --warmup 5 --repeat 5 --dtype bfloat16"
)


def ablations_section(runs: dict) -> list[str]:
    """Section 11: each acceleration off and on (ablation_rows), then the GPU's Adam with one layer more, the deeper
    prefetch ring, the host's noise between processes and what clipping costs."""
    share = {name: overlapped_training(runs, f"ablation_{name}") for name in ABLATION_RUNS if name != "fsdp2"}
    default, none, more, deep, again = (
        share[name] for name in ("share_0.3", "share_0", "share_0.4", "share_0_prefetch3", "share_0.3_again")
    )
    more_share = runs["ablation_share_0.4"]["run"]["gpu_adam_share"]
    busy, busy_deep = (
        cpu_adam_busy_and_idle(share[name], runs[f"ablation_{name}"]["run"])[0]
        for name in ("share_0", "share_0_prefetch3")
    )
    fsdp, fsdp_peers = (runs[name]["peers"]["fsdp2"]["time_ms"] for name in ("ablation_fsdp2", "peers_bf16"))
    header = ["acceleration", "flag", "step without (ms)", "step with (ms)", "with / without"]
    return [
        "## 11. Ablations",
        "",
        "Each acceleration off and on, on the overlapped bfloat16 training step of 7b-8l (4096 tokens), each step the "
        "median of a run of its own. The `ablations` part adds the flags of the GPU's Adam and of the prefetch depth "
        f"to `{ABLATION_COMMAND}`, on machine {machine_of('ablations')}; the copies' overlap is the blocked and "
        "overlapped modes training alone (part `alone`), activation offload section 6's runs of one micro-batch "
        "(the overlapped run of part `alone` against part `activations`) and the 11 GiB cap section 10's pairs (part "
        f"`budget_ab`), all on machine {machine_of('alone')}. A flag marked off turns the acceleration off; one "
        "marked on turns it on.",
        "",
        *table(header, ablation_rows(runs)),
        "",
        f"- The GPU's Adam with one layer more (`--gpu-adam-share {more_share:g}`, "
        f"{len(more['gpu_adam_units'])} units): {more['time_ms']:.1f} ms a step, against {default['time_ms']:.1f} "
        f"at the default share and {none['time_ms']:.1f} with none. Its bound's CPU Adam went from "
        f"{default['cpu_adam_ms']:.1f} to {more['cpu_adam_ms']:.1f} ms, its host-to-device copies from "
        f"{default['h2d_ms']:.1f} to {more['h2d_ms']:.1f} ms: the float32 state of the layer crosses PCIe both ways.",
        f"- The deeper ring, every unit on the CPU Adam: {deep['time_ms']:.1f} ms a step with `--prefetch 3` against "
        f"{none['time_ms']:.1f} with one slot ahead, peak GPU {gib(deep['peak_gpu_bytes'])} against "
        f"{gib(none['peak_gpu_bytes'])} GiB. The CPU Adam, which bounds the step, was busy a median of "
        f"{busy_deep:.1f} ms a step against {busy:.1f}: copies further ahead run beside it.",
        f"- The host's noise: the default step again, last in the part, minutes after the first, took "
        f"{again['time_ms']:.1f} ms against {default['time_ms']:.1f}, and its own bound moved with it "
        f"({again['bound_ms']:.1f} against {default['bound_ms']:.1f} ms, host memory at {again['host_gbps']:.0f} "
        f"against {default['host_gbps']:.0f} GB/s). FSDP2 in the same part took {fsdp:.1f} ms, against "
        f"{fsdp_peers:.1f} in section 8's call.",
        *clipping_note(runs),
        "",
    ]


def overlapped_training(runs: dict, name: str) -> dict:
    """The overlapped mode's training result in run `name`."""
    return runs[name]["results"]["overlapped"]["training"]


def clipping_note(runs: dict) -> list[str]:
    """What --clip-grad-norm costs (part clip): the step and its bound unclipped and clipped."""
    free, clipped = (overlapped_training(runs, name) for name in ("clip_7b8l_unclipped", "clip_7b8l_clipped"))
    norms = clipped["grad_norms"]
    return [
        f"- What clipping costs (part `clip`, `--gpu-adam-share 0`, on machine {machine_of('clip')}): "
        f"{clipped['time_ms']:.1f} ms a step with "
        f"`--clip-grad-norm {runs['clip_7b8l_clipped']['run']['clip_grad_norm']:g}` against {free['time_ms']:.1f} "
        f"without ({clipped['time_ms'] / free['time_ms'] - 1:+.0%}). Every unit's update waits for the whole "
        f"backward's gradient norm: the bound holding the updates is {clipped['held_updates_ms']:.1f} ms (the "
        f"backward, then the longer of the next forward and the CPU Adam), against {free['bound_ms']:.1f} unclipped. "
        f"The gradient norm went {norms[0]:.3g} -> {norms[-1]:.3g} before clipping."
    ]


# each acceleration on and off, as run_benchmarks.sh's parts measure them (7b-8l, bfloat16, training): what it is,
# the flags that turn it off (or on, where it is off by default), and the runs (name, mode) off and on; the 11 GiB
# cap's pairs come from the budget_ab part
ABLATIONS = (
    (
        "copies overlapped with compute",
        "off: `--mode blocked`",
        ("train_bf16_blocked", "blocked"),
        ("train_bf16_overlapped", "overlapped"),
    ),
    (
        "the GPU's Adam over streamed state",
        "off: `--gpu-adam-share 0`",
        ("ablation_share_0", "overlapped"),
        ("ablation_share_0.3", "overlapped"),
    ),
    (
        "a deeper ring: prefetch 3 units ahead (every unit on the CPU Adam)",
        "on: `--prefetch 3`",
        ("ablation_share_0", "overlapped"),
        ("ablation_share_0_prefetch3", "overlapped"),
    ),
    (
        "activation offload, where the saved inputs fit",
        "on: `--offload-activations`",
        ("train_bf16_overlapped", "overlapped"),
        ("train_bf16_offload_acts", "overlapped"),
    ),
)


def ablation_rows(runs: dict) -> list[list[str]]:
    """One row per acceleration: the step without and with it, and their ratio; the 11 GiB cap's units resident
    against every unit streamed, pair by pair."""
    rows = []
    for what, flags, (off, off_mode), (on, on_mode) in ABLATIONS:
        a, b = (runs[name]["results"][mode]["training"]["time_ms"] for name, mode in ((off, off_mode), (on, on_mode)))
        rows.append([what, flags, f"{a:.1f}", f"{b:.1f}", f"{b / a:.2f}"])
    for i in range(1, PAIRS + 1):
        s, c = ab_pair(runs, i)
        what = f"units resident under an 11 GiB cap ({len(c['resident_units'])} of {c['units']}), pair {i}"
        ratio = c["time_ms"] / s["time_ms"]
        rows.append([what, "on: `--max-gpu-memory 11`", f"{s['time_ms']:.1f}", f"{c['time_ms']:.1f}", f"{ratio:.2f}"])
    return rows


def log_line(name: str, words: str) -> tuple[float, str]:
    """The first progress line of results/text/NAME.log with `words`: (seconds since its process started, the text)."""
    for line in (HERE / "results" / "text" / f"{name}.log").read_text().splitlines():
        if words in line:
            seconds, _, text = line.strip().partition(" s  ")
            return float(seconds), text
    raise SystemExit(f"results/text/{name}.log has no line with {words!r}: run the text part again")


def number_before(text: str, words: str) -> float:
    """The number just before the last `words` in `text` (commas allowed): 2.1 in '... trained in 2.1 s'."""
    return float(text[: text.rindex(words)].split()[-1].replace(",", ""))


def text_section(runs: dict) -> list[str]:
    """Section 12: a LLaMA larger than GPT-2-Large trained from random weights on the Python standard library's own
    .py files under an 11 GiB cap: the held-out loss, the samples before and after, the step against its bound and
    against a step of the same shape on random ids, and what tokenizing and the token cache cost."""
    r = runs["text_stdlib"]
    run, t = r["run"], r["results"]["overlapped"]["training"]
    data, rand = (runs[name]["results"]["overlapped"]["training"] for name in ("text_steps_data", "text_steps_random"))
    _, corpus = log_line("text_stdlib", "tokenized in")
    _, bpe = log_line("text_stdlib", "byte-level BPE of")
    started, _ = log_line("text_steps_data", "imported")
    hit, _ = log_line("text_steps_data", "from the token cache")
    _, blocks = log_line("text_stdlib", "blocks of")
    first, last = t["evaluations"][0], t["evaluations"][-1]
    row = [
        f"{t['time_ms']:.1f}",
        f"{t['bound_ms']:.1f} ({t['bound_by']})",
        f"{t['efficiency']:.3f}",
        f"{t['tokens_per_step'] / t['time_ms'] * 1e3:,.0f}",
        f"{gib(t['peak_gpu_bytes'])} ({gib(t['predicted_peak_bytes'])})",
        f"{first['loss']:.3f} -> {last['loss']:.3f} ({first['perplexity']:,.0f} -> {last['perplexity']:.1f})",
    ]
    header = ["step (ms)", "bound (ms)", "efficiency", "tokens/s", "peak GPU (predicted), GiB", "held-out loss (ppl)"]
    return [
        "## 12. Training on text",
        "",
        f"Part `text`: the corpus is the Python standard library's own `.py` files on the GPU machine (its "
        f"`site-packages` left out): {int(number_before(corpus, 'tokens of')):,} tokens of "
        f"{int(number_before(corpus, 'file(s)'))} files with a byte-level BPE of "
        f"{int(number_before(bpe, 'tokens trained'))} tokens trained on it (`--train-tokenizer`; "
        f"{number_before(bpe, ' s'):.1f} s to train, {number_before(corpus, ' s'):.1f} s to tokenize into the token "
        f"cache; the next run read the cache {hit - started:.1f} s after torch loaded). The model is a LLaMA of "
        f"{r['parameters'] / 1e6:.0f}M parameters (more than GPT-2-Large's 774M), trained from random weights for "
        f"one epoch, {run['steps']} steps of {run['grad_accum']} x {run['batch_size']} blocks of {run['seq_len']} "
        f"tokens, under a GPU cap of {run['max_gpu_memory']:g} GiB ({blocks.split(';')[0].removeprefix('data: ')}). "
        f"Adam at a constant learning rate of {run['lr']:g}; the held-out loss every {run['eval_every']} steps, "
        "through the same offloaded forward without gradients:",
        "",
        *table(header, [row]),
        "",
        f"An evaluation of the held-out blocks takes {median(e['ms'] for e in t['evaluations']):.0f} ms beside a "
        f"step of {t['time_ms']:.0f} ms. Reading the blocks costs the step nothing measurable: 40 steps of the same "
        f"shape took {data['time_ms']:.1f} ms a step on the corpus and {rand['time_ms']:.1f} ms on random ids, one "
        "process after the other (the next step's blocks are gathered while a step runs).",
        "",
        "![Training and held-out loss over the tokens seen](figures/text_held_out.png)",
        "",
        "Greedy samples, before the first step and after the last, through Hugging Face's `generate` on the "
        "offloaded modules (a GPU test shows them equal to `generate` on the resident model, token for token):",
        "",
        "```",
        *sample_lines(run, t),
        "```",
        "",
    ]


def rank_training(r: dict) -> dict:
    """The training result of a RANK_SOURCES run: overlapped's, the largest one find_largest found, or (peers.py's
    JSON) DeepSpeed ZeRO-3's."""
    if "peers" in r:
        return r["peers"]["zero3"]
    found = r["find_largest"]["overlapped"] if "find_largest" in r else r["results"]["overlapped"]
    return found["training"]


def rank_row(label: str, r: dict, one: dict | None) -> list[str]:
    """A row of section 13: the step, its bound (none for DeepSpeed), the peaks (host: every rank's summed), the
    speed-up over `one`, and the version of the script that made it (peers.py's for DeepSpeed)."""
    t = rank_training(r)
    params = r["find_largest"]["overlapped"]["parameters"] if "find_largest" in r else r["parameters"]
    speed = f"{rank_training(one)['time_ms'] / t['time_ms']:.2f}x" if one else ""
    bound, efficiency = "", ""
    if "bound_ms" in t:
        bound = f"{t['bound_ms']:.1f} ({t['bound_by'].replace('_', ' ')})"
        efficiency = f"{t['bound_ms'] / t['time_ms']:.2f}"
    script = f"`{r['peers_sha256'][:8]}` (peers.py)" if "peers" in r else f"`{r['script_sha256'][:8]}`"
    return [
        label,
        str(len(t.get("ranks", [None]))),
        f"{t['time_ms']:.1f}",
        f"{t['tokens_per_step'] / t['time_ms'] * 1e3:,.0f}",
        bound,
        efficiency,
        gib(t["peak_gpu_bytes"]),
        gib(t["peak_host_bytes"]),
        f"{t['peak_host_bytes'] / params:.1f}",
        speed,
        script,
    ]


def ranks_section(runs: dict) -> list[str]:
    """Section 13: data-parallel training under torchrun on two GPUs of one host, each run beside one GPU's; the host
    bytes a parameter; what bounds the step; what several hosts would add, as arithmetic."""
    big = runs["largest_2gpus"]["find_largest"]["overlapped"]
    seven = [runs[name] for name in ("llama7b_1gpu", "llama7b_2gpus")]
    small = [runs[name] for name in ("7b8l_1gpu", "7b8l_2gpus", "7b8l_2gpus_share06")]
    rows = [
        rank_row("7b-8l, 2 x 2 x 4096 tokens", small[0], None),
        rank_row("7b-8l, 2 x 2 x 4096 tokens", small[1], small[0]),
        rank_row("7b-8l, 2 x 2 x 4096 tokens, --gpu-adam-share 0.6", small[2], small[0]),
        rank_row("LLaMA-7B, 64 x 1024 tokens, 11 GiB cap", seven[0], None),
        rank_row("LLaMA-7B, 64 x 1024 tokens, 11 GiB cap", seven[1], seven[0]),
        rank_row(f"{big['layers']} LLaMA-7B layers, 2 x 4096 tokens, 11 GiB cap", runs["largest_2gpus"], None),
        rank_row("DeepSpeed ZeRO-3 offload, 7b-8l, 2 x 2 x 4096 tokens", runs["zero3_1gpu"], None),
        rank_row("DeepSpeed ZeRO-3 offload, 7b-8l, 2 x 2 x 4096 tokens", runs["zero3_2gpus"], runs["zero3_1gpu"]),
    ]
    zero3 = [rank_training(runs[name]) for name in ("zero3_1gpu", "zero3_2gpus")]
    header = ["run", "GPUs", "step (ms)", "tokens/s", "bound (ms)", "efficiency", "peak GPU (GiB)"]
    header += ["peak host (GiB)", "host bytes/parameter", "speed-up", "script"]
    s7, tl = rank_training(small[1]), rank_training(runs["largest_2gpus"])
    per_rank = [r["peak_host_bytes"] / GiB for r in rank_training(seven[1])["ranks"]]
    return [
        "## 13. Several GPUs",
        "",
        "`torchrun --nproc-per-node 2 offload_llama.py --mode overlapped --train --grad-accum K ...` on a machine with "
        "two H100 80GB joined by NVLink (NV18), 32 cores and 251 GiB of host memory (`results/ranks/machine.txt`). "
        "Each rank keeps 1/2 of every unit's host state and trains on half the step's micro-batches; each unit's "
        "shards are all-gathered on the GPUs and its gradients reduce-scattered, so the host's memory is read once "
        "a parameter a step. Each two-GPU run is beside the one-GPU run of the same command, on the same machine, "
        "by the same version (the last column); the largest model ran on two GPUs alone. From version "
        f"`{small[1]['script_sha256'][:8]}` on, every rank starts each part of the bound together, as the ranks "
        "share the host's memory and cores in a step. The peak host memory "
        "sums both ranks' resident sets; the GPU's is the larger rank's.",
        "",
        *table(header, rows),
        "",
        *llama7b_step_lines(seven),
        *small_step_lines(small, runs["host_probe"]),
        f"- Host bytes a parameter: where the host has room, the plan spends it on the masters' bfloat16 copy and "
        f"a gradient buffer per unit (about 6 bytes a parameter more), so LLaMA-7B holds "
        f"{rank_training(seven[0])['peak_host_bytes'] / seven[0]['parameters']:.1f} on one GPU and "
        f"{rank_training(seven[1])['peak_host_bytes'] / seven[1]['parameters']:.1f} on two "
        f"({per_rank[0]:.1f} and {per_rank[1]:.1f} GiB a rank). At the host's limit, the largest model holds "
        f"{rank_training(runs['largest_2gpus'])['peak_host_bytes'] / big['parameters']:.1f}: float32 masters and "
        "moments, sharded, and two gradient buffers a rank. One more layer, in a rank's share of the host: "
        + big["limited_by"]
        + ".",
        "- The NVLink collectives in the bound: in these versions the all-gathers ran on the copy stream after each "
        "shard's H2D copy (later ones run them on a stream of their own, beside the next shard's copy), and the "
        "bound's H2D part, timed by copying a step's units in, waits for them; the reduce-scatters run on the D2H "
        "stream before each unit's gradients leave, and its D2H part queues them the same way.",
        "- Several hosts (arithmetic, not measured): `--nnodes M` with G GPUs each shards the host state over all "
        "M x G ranks, so a host holds 1/M of it and its memory traffic a step falls to 1/M. The collectives then "
        "cross the network: per GPU and step, (M x G - 1)/(M x G) of two passes of the weights and one of the "
        f"float32 gradients, about 8 bytes a parameter ({8 * seven[1]['parameters'] / 1e9:.0f} GB for LLaMA-7B), "
        f"{8 * seven[1]['parameters'] / 50e9:.1f} s at 50 GB/s (a 400 Gb/s link a GPU): under a compute-bound "
        "step of several seconds, if the collectives overlap compute as the copies do.",
        *largest_step_lines(big, tl),
        f"- DeepSpeed {zero3[1]['deepspeed']} ZeRO-3 with parameters and optimizer offloaded (`report/peers.py` under "
        "torchrun, each rank on its share of the micro-batches, as section 8 runs it on one GPU) trains the 7b-8l "
        f"command in {zero3[1]['time_ms']:.1f} ms a step on two GPUs, {zero3[0]['time_ms'] / zero3[1]['time_ms']:.2f}x "
        f"its one GPU's; this script's two-GPU step takes {s7['time_ms']:.1f} ms, "
        f"{zero3[1]['time_ms'] / s7['time_ms']:.2f}x as fast, in "
        f"{s7['peak_gpu_bytes'] / zero3[1]['peak_gpu_bytes']:.2f} of DeepSpeed's peak GPU memory. "
        "The two ran in separate calls, on two-GPU machines of one kind.",
        "",
    ]


def all_ranks(t: dict, key: str) -> float:
    """A training result's `key`, a rank's host bytes or rate as its bound measures them, summed over its ranks: the
    one host's."""
    return t[key] * len(t["ranks"])


def llama7b_step_lines(seven: list[dict]) -> list[str]:
    """What bounds LLaMA-7B's step on two GPUs: the GPUs' compute, with the host's part far under it (its version
    timed each rank's parts alone: both at once, by arithmetic)."""
    one, two = (rank_training(r) for r in seven)
    together = all_ranks(two, "host_bytes") / one["host_gbps"] / 1e6  # ms, at one GPU's host rate
    return [
        f"- LLaMA-7B at 64 x 1024 tokens a step is bound by the GPUs' compute, and two GPUs step "
        f"{one['time_ms'] / two['time_ms']:.2f}x as fast as one. Its version, `{seven[1]['script_sha256'][:8]}`, "
        "timed each rank's bound parts alone; both ranks' host traffic at the rate one GPU's host part reached "
        f"({one['host_gbps']:.0f} GB/s) would take {together:,.0f} ms (arithmetic), far under the compute "
        f"({two['gpu_compute_ms']:,.1f} ms).",
    ]


def small_step_lines(small: list[dict], probe: dict) -> list[str]:
    """What bounds 7b-8l's step on two GPUs: the host memory both ranks share, whose traffic a step does not shrink
    with more GPUs; why 1.8x one GPU is out of reach on this host, measured by the bound and the host's rates."""
    one, two, shared = (rank_training(r) for r in small)
    moved = all_ranks(two, "host_bytes")
    target = one["time_ms"] / 1.8
    gpu_adam = len(shared["gpu_adam_units"])
    return [
        f"- 7b-8l with one micro-batch a GPU: two GPUs step {one['time_ms'] / two['time_ms']:.2f}x as fast as one, "
        "and 1.8x is out of reach on this host. One GPU's step is bound by its "
        f"compute ({one['gpu_compute_ms']:.1f} ms); two halve the compute ({two['gpu_compute_ms']:.1f} ms a rank) but "
        f"not the host's traffic: both ranks' CPU Adams and copies move {moved / 1e9:.1f} GB of the one host's "
        f"memory a step, {moved / small[1]['parameters']:.0f} bytes a parameter, as one GPU's step does. The bound's "
        f"host part, run by both ranks at once, takes {two['host_memory_ms']:.1f} ms "
        f"({all_ranks(two, 'host_gbps'):.0f} GB/s); 1.8x one GPU's step would be {target:.1f} ms, below it. "
        f"With `--gpu-adam-share 0.6` the GPU's Adam steps {gpu_adam} units, whose state crosses PCIe instead of "
        f"being stepped by the CPU: the bound falls to {shared['bound_ms']:.1f} ms "
        f"({shared['bound_by'].replace('_', ' ')}), and 1.8x would need a step at {shared['bound_ms'] / target:.2f} "
        f"of it (that step ran at {shared['bound_ms'] / shared['time_ms']:.2f}).",
        f"- The host's memory is saturated: `report/host_probe.py`, on the same machine in the same call, measured "
        f"{probe['cpu_gbs']:.0f} GB/s for a STREAM add on its {probe['cores']} cores, {probe['copies_gbs']:.0f} GB/s "
        f"for pinned copies both ways on both GPUs, and {probe['together']['sum_gbs']:.0f} GB/s for both together; "
        f"the bound's host part reached {one['host_gbps']:.0f} GB/s on one GPU and "
        f"{all_ranks(two, 'host_gbps'):.0f} and {all_ranks(shared, 'host_gbps'):.0f} on two. "
        "Had the one-GPU step run at its bound, the bounds measured here would allow two GPUs at most "
        f"{one['bound_ms'] / shared['bound_ms']:.2f}x; the speed-up measured rests on one GPU's step running at "
        f"{one['bound_ms'] / one['time_ms']:.2f} of its bound. More micro-batches a step (`--grad-accum`) spread "
        "the host's traffic over more tokens, as the LLaMA-7B rows do.",
    ]


def largest_step_lines(big: dict, t: dict) -> list[str]:
    """Why the largest model's step is slower than its bound: its parts run in turn (arithmetic from its JSON)."""
    rate = t["h2d_bytes"] / t["h2d_ms"]  # bytes a ms, as the bound measured the copies
    forward = big["parameters"] / len(t["ranks"]) * 4 / rate  # a rank's float32 shards, each unit once
    busy = sum(t["cpu_adam_busy_ms"][i] for i in t["timed_steps"]) / len(t["timed_steps"])
    gpu_adam = t["gpu_adam_params"] * 16 / rate  # weights, float32 master and moments in, for the backward
    steps = len(t["cpu_adam_busy_ms"])
    total = forward + busy + gpu_adam
    return [
        f"- The largest model's step runs at {t['bound_ms'] / t['time_ms']:.2f} of its bound. The bound spreads each "
        "part over the whole step; here the parts run in turn (arithmetic from the run's JSON, at the H2D rate its "
        f"bound measured, {rate / 1e6:.1f} GB/s): the forward copies each rank's float32 shards in (no room is left "
        f"for a bfloat16 copy), {forward:,.0f} ms; the backward over the {t['units'] - len(t['gpu_adam_units'])} "
        f"units the CPU Adam steps goes at its pace: it was busy {busy:,.0f} ms a step (measured, rank 0; its part "
        f"of the bound, both ranks' Adams at once, predicts {t['cpu_adam_ms']:,.0f} ms, but in the step the copies "
        f"share the host's memory too), and the backward waited {t['gradient_pool']['waited_ms'] / 1e3:.1f} s in "
        f"the {steps} steps for a gradient buffer the CPU Adam frees; the backward over the "
        f"{len(t['gpu_adam_units'])} units the GPU's Adam steps copies in their weights, float32 masters and "
        f"moments, 16 bytes a parameter, {gpu_adam:,.0f} ms. "
        f"Together {total:,.0f} ms, {total / t['time_ms']:.2f} of the step measured.",
    ]


def sample_lines(run: dict, t: dict) -> list[str]:
    """Each prompt and its continuations before and after, one line each, as Python writes the strings."""
    lines = []
    for i, prompt in enumerate(run["sample"]):
        lines += [f"prompt {prompt!r}", f"  before: {t['samples']['before'][i]!r}"]
        lines += [f"  after:  {t['samples']['after'][i]!r}", ""]
    return lines[:-1]


def text_figure(runs: dict, out: Path) -> None:
    """Section 12's figure: each step's training loss and each held-out loss against the tokens seen."""
    import matplotlib.pyplot as plt

    t = runs["text_stdlib"]["results"]["overlapped"]["training"]
    steps = range(1, len(t["losses"]) + 1)
    fig, ax = plt.subplots(figsize=(7, 4))
    ax.plot([s * t["tokens_per_step"] / 1e6 for s in steps], t["losses"], lw=1, label="training batch")
    held = t["evaluations"]
    ax.plot([e["tokens"] / 1e6 for e in held], [e["loss"] for e in held], "o-", label="held out")
    ax.set_xlabel("tokens seen (millions)")
    ax.set_ylabel("loss")
    ax.legend()
    fig.tight_layout()
    fig.savefig(out, dpi=150, metadata={"Software": None})
    plt.close(fig)


def four_training(r: dict) -> dict:
    """The training result of a FOUR_SOURCES run, whichever offloaded mode it ran."""
    return next(m["training"] for m in r["results"].values() if "training" in m)


def four_row(label: str, r: dict, one: dict | None) -> list[str]:
    """A training row of section 14: the step against one GPU's, its bound a rank, the TFLOPS, the peaks (host: every
    rank's summed) and the set-up."""
    t = four_training(r)
    speed = four_training(one)["time_ms"] / t["time_ms"] if one else 1.0
    return [
        label,
        str(len(t.get("ranks", [None]))),
        f"{t['time_ms']:,.1f}",
        f"{speed:.3f}x",
        f"{t['bound_ms']:,.1f} ({t['bound_by'].replace('_', ' ')})",
        f"{t['bound_ms'] / t['time_ms']:.3f}",
        f"{t['model_tflops']:.1f}",
        gib(t["peak_gpu_bytes"]),
        f"{gib(t['peak_host_bytes'])} ({t['peak_host_bytes'] / r['parameters']:.1f})",
        f"{sum(t['setup_s'].values()):.1f}",
    ]


def four_parts_row(label: str, r: dict) -> list[str]:
    """The parts of a row's bound, a rank's, each timed while the other ranks timed theirs."""
    t = four_training(r)
    host = f"{t['host_memory_ms']:,.1f} ({t['host_bytes'] / 1e9:,.1f} GB at {t['host_gbps']:.0f} GB/s)"
    h2d = f"{t['h2d_ms']:,.1f} ({t['h2d_bytes'] / t['h2d_ms'] / 1e6:.1f} GB/s)"
    return [label, str(len(t.get("ranks", [None]))), f"{t['gpu_compute_ms']:,.1f}", h2d, f"{t['d2h_ms']:,.1f}"] + [
        f"{t['cpu_adam_ms']:,.1f}",
        host,
    ]


def four_inference_row(label: str, r: dict, resident: float) -> list[str]:
    """A row of section 14's forward passes: the time against the resident model's, the bound, a layer's copy (its
    all-gather included) and compute."""
    t = r["results"]["overlapped"]["inference"]
    return [
        label,
        f"{t['time_ms']:.1f}",
        f"{t['time_ms'] / resident:.2f}x",
        f"{t['bound_ms']:.1f}",
        f"{t['bound_ms'] / t['time_ms']:.3f}",
        f"{t['copy_ms_per_layer']:.2f}",
        f"{t['compute_ms_per_layer']:.2f}",
    ]


def four_gpus_section(runs: dict) -> list[str]:
    """Section 14: one, two and four GPUs of the four-GPU machine, each run by one version in one call: LLaMA-7B and
    the 32B shape trained under 11 GiB a GPU, 7b-8l's forward over the ranks, 7b-8l's step shapes on one GPU."""
    one7, one32, inf1 = runs["four_l7_1"], runs["four_q32_1"], runs["four_inf_1"]
    rows = [four_row("LLaMA-7B, 64 x 1024 tokens", runs[f"four_l7_{n}"], None if n == 1 else one7) for n in (1, 2, 4)]
    rows += [four_row("32B shape, 64 x 1024 tokens", runs[f"four_q32_{n}"], None if n == 1 else one32) for n in (1, 4)]
    names = [("LLaMA-7B", f"four_l7_{n}") for n in (1, 2, 4)] + [("32B shape", f"four_q32_{n}") for n in (1, 4)]
    parts = [four_parts_row(label, runs[name]) for label, name in names]
    resident = inf1["results"]["gpu"]["inference"]["time_ms"]
    forward = [["1, resident (gpu mode)", f"{resident:.1f}", "1.00x", "", "", "", ""]]
    forward += [four_inference_row(f"{n}, offloaded", runs[f"four_inf_{n}"], resident) for n in (1, 2, 4)]
    shapes = []
    for k in (1, 4, 16):
        t = four_training(runs[f"four_s_{k}"])
        adam = f"{t['resident_adam_ms']:.1f}" if "resident_adam_ms" in t else ""
        bound = f"{t['bound_ms']:.1f} ({t['bound_by'].replace('_', ' ')})"
        shapes.append([str(k), f"{t['time_ms']:.1f}", bound, adam, f"{t['bound_ms'] / t['time_ms']:.3f}"])
    header = ["run", "GPUs", "step (ms)", "speed-up", "bound a rank (ms)", "efficiency", "model TFLOPS"]
    header += ["peak GPU (GiB)", "peak host (GiB; B / param)", "set-up (s)"]
    device = f"{one7['device']} ({one7['gpu_memory_bytes'] / GiB:.1f} GiB)"
    l7 = [four_training(runs[f"four_l7_{n}"]) for n in (1, 4)]
    q32 = [four_training(runs[f"four_q32_{n}"]) for n in (1, 4)]
    several = [t["bound_ms"] / t["time_ms"] for t in (four_training(runs[n]) for n in ("four_l7_2", "four_l7_4"))]
    several.append(q32[1]["bound_ms"] / q32[1]["time_ms"])
    return [
        "## 14. Four GPUs",
        "",
        f"Four {device} of one host, NVLink (NV18) between every pair, {one7['cpu_threads']} CPU threads and 503 GiB "
        "of host memory, lent as the four-H100 kind: these rows compare with each other, not with the H100 rows above. "
        f"One version, `{one7['script_sha256'][:8]}`, in three calls on one machine; the commands, the host memory "
        "sampled through each run and the GPU tests of several ranks are in `results/four_gpus/README.md`. "
        "Training: `--max-gpu-memory 11`, LLaMA-7B `--mode overlapped --batch-size 4 --grad-accum 16`, the 32B shape "
        "(Qwen2.5-32B's as a LLaMA config, untied) `--mode blocked --batch-size 1 --grad-accum 64`; each rank takes "
        "its share of the step's micro-batches.",
        "",
        *table(header, rows),
        "",
        "Each part of the bound, a rank's (ms), timed while the other ranks time theirs:",
        "",
        *table(["run", "GPUs", "GPU compute", "H2D", "D2H", "CPU Adam", "host memory"], parts),
        "",
        f"- Four GPUs step LLaMA-7B {l7[0]['time_ms'] / l7[1]['time_ms']:.2f}x and the 32B shape "
        f"{q32[0]['time_ms'] / q32[1]['time_ms']:.2f}x as fast as one. The "
        f"several-GPU steps run at {min(several):.2f} to {max(several):.2f} of their bounds, each the GPU's compute: "
        "the NCCL all-gathers and reduce-scatters, which share the GPU's SMs with the compute, are in no part of the "
        "bound yet.",
        f"- One GPU trains the 32B shape under 11 GiB at {q32[0]['model_tflops']:.0f} model TFLOPS "
        f"({q32[0]['bound_ms'] / q32[0]['time_ms']:.2f} of its bound) on this H200, after "
        f"{sum(q32[0]['setup_s'].values()):.0f} s of set-up.",
        "",
        "7b-8l's forward of 4096 tokens (`--batch-size 1 --seq-len 4096`), each rank copying its shard of every layer "
        "and an all-gather the rest; every rank's logits equal one GPU's bit for bit (`tests/test_ranks_gpu.py`):",
        "",
        *table(
            [
                "GPUs",
                "time (ms)",
                "against resident",
                "bound (ms)",
                "efficiency",
                "a layer's copy (ms)",
                "a layer's compute (ms)",
            ],
            forward,
        ),
        "",
        "One GPU's 7b-8l step shapes, `--batch-size 1 --seq-len 4096 --grad-accum K`, the resident units' Adam counted "
        "in the GPU's compute:",
        "",
        *table(["micro-batches", "step (ms)", "bound (ms)", "of it: resident units' Adam (ms)", "efficiency"], shapes),
        "",
        *several_gpu_loss_section(runs),
    ]


def settled_row(call: str, name: str, runs: dict) -> list[str]:
    """A row of the settled-clock table: LLaMA-7B in a run of call F (compute timed from idle) or G (at settled
    clocks), against the one-GPU run of its call."""
    t, one = four_training(runs[f"four_{call}_{name}"]), four_training(runs[f"four_{call}_g1"])
    label = "LLaMA-7B, no GPU Adam" if name.endswith("share0") else "LLaMA-7B"
    ranks = len(t.get("ranks", [None]))
    return [label, call.upper(), str(ranks), f"{t['time_ms']:,.1f}", f"{one['time_ms'] / t['time_ms']:.3f}x"] + [
        f"{t['gpu_compute_ms']:,.1f}",
        f"{t['bound_ms'] / t['time_ms']:.3f}",
    ]


def several_gpu_loss_section(runs: dict) -> list[str]:
    """Section 14's second part: where the several-GPU steps lose (calls D-G, N): the bound at settled clocks, NCCL's
    share of the SMs varied, each rank's traced step, one GPU at a rank of four's per-unit shape."""
    rows = [settled_row("f", name, runs) for name in ("g1", "g1_share0", "g2_share0", "g4", "g4_share0")]
    rows += [settled_row("g", name, runs) for name in ("g1", "g2", "g4", "g4_share0")]
    rows += [settled_row("n", name, runs) for name in ("g1", "g2", "g4")]
    shape = four_training(runs["four_n_g1_accum4"])
    variants = []
    for name, what in NCCL_VARIANTS.items():
        t = four_training(runs[f"four_e_{name}"])
        variants.append([what, f"{t['time_ms']:,.1f}", f"{t['gpu_compute_ms']:,.1f}"])
    traced = [json.loads((HERE / f"results/four_gpus/d_nccl_{r}.json").read_text()) for r in (0, 3)]
    g1, g4 = four_training(runs["four_g_g1"]), four_training(runs["four_g_g4"])
    return [
        "### Where the several-GPU steps lose",
        "",
        "LLaMA-7B as above, 4 to 6 steps, in five more calls on four H200s (`results/four_gpus/README.md`). Call F "
        "timed the bound's GPU compute from an idle GPU, as every bound before it; calls G and N, later versions, run "
        "those parts for 1.5 s before timing them. Under a step's load the GPUs hold their 700 W power cap, their SM "
        "clocks at about 1,600 to 1,700 MHz against 1,980 idle (`f_smi.csv.gz`, `g_smi.csv.gz`, sampled every 250 "
        "ms), and a part timed from idle ran at clocks the steps never have. Speed-up: against the one-GPU run of "
        "the same call.",
        "",
        *table(["run", "call", "GPUs", "step (ms)", "speed-up", "GPU compute a rank (ms)", "efficiency"], rows),
        "",
        f"- At settled clocks one GPU steps at {g1['bound_ms'] / g1['time_ms']:.3f} of its bound: the compute. Four "
        f"ranks step at {g4['bound_ms'] / g4['time_ms']:.3f}, {g4['time_ms'] - g4['bound_ms']:.0f} ms a step short.",
        "- The GPU's Adam over streamed state (the plan's default share) saves no time where the compute bounds the "
        "step: the runs without it are as fast or faster. The plan has since given it no units there (commit "
        "1622c36).",
        "",
        "Call E varied how NCCL's kernels share the GPU with the compute, four ranks each (ms):",
        "",
        *table(["variant", "step", "GPU compute a rank"], variants),
        "",
        "None moves the step by more than 1%. Call D traced each rank's last step (`d_nccl_0.json`, `d_nccl_3.json`, "
        f"by `calls/trace_nccl.py`): rank 0's NCCL kernels ran {traced[0]['nccl_kernel_ms']:.0f} ms and rank 3's "
        f"{traced[1]['nccl_kernel_ms']:.0f} ms, yet their compute streams were busy alike, "
        f"{traced[0]['compute_busy_ms']:,.0f} and {traced[1]['compute_busy_ms']:,.0f} ms of "
        f"{traced[0]['span_ms']:,.0f} and {traced[1]['span_ms']:,.0f}: the collectives' share of the SMs is not where "
        "the four ranks lose. A rank of four runs each unit over 4 micro-batches a step. Call N ran one GPU at that "
        f"shape (`--grad-accum 4`): {shape['time_ms']:,.1f} ms a step, its bound {shape['bound_ms']:,.1f} ms, set by "
        f"{BOUND_NAMES[shape['bound_by']]}: {shape['bound_ms'] / shape['time_ms']:.3f} of the step, what four ranks "
        "lose, with no collective in it. Call o (`results/step_shapes/README.md`) traced that shape on one H200: "
        "the CPU Adam's backlog of the first layers, whose gradients come last, runs into the next forward, which "
        "waits for each.",
        "",
    ]


def sources_section(runs: dict) -> list[str]:
    """The last section: each JSON and trace the report reads, with the script versions that made them."""
    paths = {**SOURCES, **LATER_SOURCES, **TEXT_SOURCES, **RANK_SOURCES, **FOUR_SOURCES}
    rows = [
        [f"`{paths[name]}`", r.get("script_sha256", "(host_probe.py)")[:12], r.get("peers_sha256", "")[:12]]
        for name, r in runs.items()
    ]
    rows += [[f"`{trace}`", "(profiler trace)", ""] for trace in TRACES.values()]
    return [
        "## Sources",
        "",
        "Every number above is read from these files by `report/build_report.py`; each JSON records the sha256 of "
        "the script that made it.",
        "",
        *table(["file", "offload_llama.py sha256", "peers.py sha256"], rows),
        "",
    ]


def build() -> str:
    """REPORT.md's text, section by section."""
    runs = load()
    lines = [
        "# offload_llama: measured report",
        "",
        "Layer-wise parameter offload for LLaMA on one GPU: what it costs in time and saves in memory, "
        "measured by `offload_llama.py`.",
        "",
    ]
    for section in (
        how_to_run(runs),
        model_section(runs),
        memory_section(runs),
        time_section(runs),
        largest_section(runs) + disk_tier_note(runs) + small_host_note(runs),
        scale_section(runs),
        figures_section(runs),
        peers_section(runs),
        analysis_section(runs),
        budget_section(runs),
        ablations_section(runs),
        text_section(runs),
        ranks_section(runs),
        four_gpus_section(runs),
        sources_section(runs),
    ):
        lines += section
    return "\n".join(lines)


README = HERE.parent / "README.md"


def readme_figures(runs: dict) -> list[str]:
    """The figures README.md's results table quotes, each as it must read there, from the JSON the report cites."""
    inference = results(runs, "inference_bf16", "inference")
    training = results(runs, "train_bf16", "training")
    largest = runs["largest_llama7b"]["find_largest"]["overlapped"]
    big = results(runs, "train_llama7b_65k", "training")["overlapped"]
    run, reference = runs["train_llama7b_65k"]["run"], runs["train_llama7b_65k"]["fwd_bwd_reference"]
    speed = run["grad_accum"] * run["batch_size"] / big["time_ms"] * 1e3 / reference["sequences_per_s"]
    peers = runs["peers_bf16"]["peers"]
    figures = []
    for part in (inference, training):
        offloaded, resident = part["overlapped"], part["gpu"]
        figures.append(f"overlapped {offloaded['time_ms']:.1f} ms, efficiency {offloaded['efficiency']:.3f}")
        figures.append(f"peak GPU {gib(offloaded['peak_gpu_bytes'])} GiB ({gib(resident['peak_gpu_bytes'])} resident)")
    size = f"{largest['layers']} LLaMA-7B layers, {largest['parameters'] / 1e9:.2f}B parameters"
    figures.append(f"{size}, {largest['training']['time_ms'] / 1e3:.2f} s")
    figures.append(f"{big['time_ms'] / 1e3:.2f} s a step, {speed:.2f}x plain resident forward and backward")
    figures.append(f"peak GPU {gib(big['peak_gpu_bytes'])} GiB")
    disk = runs["largest_llama7b_disk"]["find_largest"]["overlapped"]
    size = f"{disk['layers']} layers, {disk['parameters'] / 1e9:.2f}B parameters"
    figures.append(f"{size}, {disk['training']['time_ms'] / 1e3:.1f} s a step")
    figures.append(f"FSDP2 with `CPUOffloadPolicy` {peers['fsdp2']['time_ms']:.1f} ms")
    figures.append(f"DeepSpeed ZeRO-3 {peers['zero3']['time_ms']:.1f} ms, ZeRO-2 {peers['zero2']['time_ms']:.1f} ms")
    figures.append(f"overlapped alone {alone(runs)['overlapped']['time_ms']:.1f} ms")
    figures.append(f"accelerate `cpu_offload` {peers['accelerate']['time_ms']:.1f} ms")
    text = runs["text_stdlib"]["results"]["overlapped"]["training"]
    first, last = text["evaluations"][0], text["evaluations"][-1]
    figures.append(f"held-out loss {first['loss']:.2f} -> {last['loss']:.2f}, {text['time_ms']:.0f} ms a step")
    small = runs["small_host_7b8l"]
    t = small["results"]["overlapped"]["training"]
    figures.append(f"{t['time_ms'] / 1e3:.2f} s a step, efficiency {t['efficiency']:.3f}")
    figures.append(
        f"peak host {gib(small['peak_host_bytes_process'])} GiB under the {small['run']['max_host_memory']:g} GiB cap"
    )
    return figures


def readme_mismatches(runs: dict, readme: Path = README) -> list[str]:
    """The figures of readme_figures that README.md's results section does not quote as the JSON gives them."""
    text = readme.read_text()
    start = text.find("## Results")
    section = text[start : text.find("\n## ", start + 1)] if start >= 0 else ""
    return [figure for figure in readme_figures(runs) if figure not in section]


def main(argv=None) -> int:
    """The command line: write REPORT.md, the figures and REPORT.pdf, or with --check compare REPORT.md only."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    check = "exit 1 if REPORT.md, or a figure of README.md's results table, is not what the JSON gives"
    parser.add_argument("--check", action="store_true", help=check)
    args = parser.parse_args(argv)
    text, path = build(), HERE / "REPORT.md"
    if args.check:
        if not path.is_file() or path.read_text() != text:
            print(
                f"{path} is not what the JSON under report/ gives: run python3 report/build_report.py", file=sys.stderr
            )
            return 1
        if missing := readme_mismatches(load()):
            print(f"{README}'s results table does not quote, as the JSON gives: {missing}", file=sys.stderr)
            return 1
        return 0
    path.write_text(text)
    runs, figures = load(), HERE / "figures"
    figures.mkdir(exist_ok=True)
    for name, trace in TRACES.items():
        trim_trace(HERE / trace)
        timeline_figure(
            HERE / trace,
            figures / name,
            f"{Path(trace).name}: one overlapped {'training step' if 'train' in name else 'forward pass'}",
        )
    bound_figure(runs, figures / "time_vs_bound.png")
    text_figure(runs, figures / "text_held_out.png")
    budget_figure(runs, figures / "time_vs_budget.png")
    pdf(text, HERE / "REPORT.pdf")
    return 0


if __name__ == "__main__":
    sys.exit(main())
