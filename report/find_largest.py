"""The largest model that trains: per mode, the most decoder layers of a preset's size that train under a GPU cap,
each count probed by running offload_llama.py in a fresh process (an out-of-memory leaves nothing behind), and what
stops one more layer.

    python3 report/find_largest.py --preset llama-7b --max-gpu-memory 11 --steps 4 --warmup 1 --json largest.json

With --nproc-per-node N, each probe runs under torchrun with N ranks on this host, sharing its memory.

The flags are offload_llama.py's; --mode picks the modes searched (default: gpu and overlapped). Report tooling: it
prints one table and writes the JSON that report/build_report.py reads (key find_largest).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import re
import subprocess
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
import offload_llama as ol  # noqa: E402

SCRIPT = Path(ol.__file__)
MAX_SEARCH_LAYERS = 256  # the largest-model search stops here (52B parameters of LLaMA-7B's layers)
LARGE_DISK_LAYERS = 1024  # how far large_disk looks


def with_layers(run: ol.RunConfig, layers: int) -> ol.RunConfig:
    """`run` with its preset's layer count replaced."""
    return dataclasses.replace(run, sizes=tuple({**dict(run.sizes), "num_hidden_layers": layers}.items()))


def host_layer_limit(
    run: ol.RunConfig, mode: str, free: float | None = None, most: int = MAX_SEARCH_LAYERS
) -> int | None:
    """The most decoder layers (up to `most`) whose plan this machine's host memory holds in `mode`, and with --nvme
    its disk too, with `free` bytes of room there (default: its free space); None: not known."""
    run = dataclasses.replace(run, mode=mode)
    facts = machine(run, free)
    if facts.host_bytes is None:
        return None

    def fits(n: int) -> bool:
        """n layers' plan has room (so have fewer)."""
        return ol.plan_refusal(with_layers(run, n), config_with_layers(run, n), facts) is None

    lo, hi = 0, most + 1  # lo fits (no layers), hi is past the search
    while hi - lo > 1:
        mid = (lo + hi) // 2
        lo, hi = (mid, hi) if fits(mid) else (lo, mid)
    return lo


def machine(run: ol.RunConfig, free: float | None = None) -> ol.Facts:
    """This machine's facts for `run`'s plans, with `free` bytes on the --nvme disk where given."""
    facts = ol.measured_facts(run)
    return facts if free is None else dataclasses.replace(facts, disk_bytes=free)


def config_with_layers(run: ol.RunConfig, layers: int):
    """The LlamaConfig of `run` with `layers` decoder layers."""
    return ol.model_config(with_layers(run, layers))


def gpu_layer_guess(run: ol.RunConfig, config) -> int:
    """Where the search starts for gpu mode: the layers whose resident training state fits the cap (compute-dtype
    weights and gradients, 16 bytes of float32 state); one layer without a cap."""
    if run.max_gpu_memory is None:
        return 1
    per_param = 2 * run.torch_dtype.itemsize + 16
    per_layer = ol.params_with_layers(config, 1) - ol.params_with_layers(config, 0)
    return int((run.max_gpu_memory * ol.GiB / per_param - ol.params_with_layers(config, 0)) // per_layer)


def largest_that_trains(trains, first: int, upper: int) -> int:
    """The largest n in [0, upper] with trains(n), where fewer layers train whenever more do. Probes start at `first`
    and gallop away from it, then bisect: a good first guess costs two probes."""
    lo, hi = 0, upper + 1  # lo trains (no layers, trivially), hi does not
    n, step = min(max(first, 1), upper), 1
    while hi - lo > 1:
        if trains(n):
            lo, n = n, n + step
        else:
            hi, n = n, n - step
        step *= 2
        if not lo < n < hi:
            n = (lo + hi) // 2
    return lo


def cli_args(run: ol.RunConfig) -> list[str]:
    """The command line that offload_llama.parse_args turns back into `run` (without --profile, --save-output,
    --model): the flags whose values are not the defaults, as offload_llama refuses a flag that does nothing in the
    run asked for."""
    args = ["--mode", run.mode, "--preset", run.preset, "--dtype", run.dtype]
    default = ol.RunConfig()
    values = {"--attention": "attention", "--batch-size": "batch_size", "--seq-len": "seq_len", "--seed": "seed"}
    values |= {"--prefetch": "prefetch", "--warmup": "warmup", "--repeat": "repeat", "--steps": "steps"}
    values |= {"--grad-accum": "grad_accum", "--lr": "lr", "--eps": "eps", "--weight-decay": "weight_decay"}
    values |= {"--max-gpu-memory": "max_gpu_memory", "--resident-layers": "resident_layers", "--json": "json"}
    values |= {"--gpu-adam-share": "gpu_adam_share", "--max-host-memory": "max_host_memory", "--nvme": "nvme"}
    values |= {"--nvme-layers": "nvme_layers"}
    for flag, field in values.items():
        value = getattr(run, field)
        if value != getattr(default, field):
            args += [flag, repr(value) if isinstance(value, float) else str(value)]
    if tuple(run.betas) != default.betas:
        args += ["--betas", *map(repr, run.betas)]
    for field, value in run.sizes:
        args += [f"--{ol.SIZE_FLAGS[field]}", str(value)]
    flags = {"--train": run.train, "--no-inference": not run.inference}
    flags |= {"--offload-activations": run.offload_activations, "--fwd-bwd-reference": run.fwd_bwd_reference}
    return args + [flag for flag, on in flags.items() if on]


def probe(run: ol.RunConfig, mode: str, layers: int) -> dict:
    """`mode` with `layers` decoder layers, run by offload_llama.py in a fresh process: its training result, or
    {'oom': True}, {'refused': why} (exit code 2) or {'failed': why}. Its progress lines pass through to stderr."""
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "probe.json"
        child = dataclasses.replace(with_layers(run, layers), mode=mode, json=str(path))
        command = [sys.executable, *launcher(run.ranks), str(SCRIPT), *cli_args(child)]
        with subprocess.Popen(command, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True) as process:
            last = said = ""
            codes = []  # under torchrun, its summary's exit code of each rank that failed, the first failure's last
            try:
                for line in process.stderr:
                    sys.stderr.write(line)
                    last = line.strip() or last
                    said = refusal_in(line) or said
                    codes += [int(code) for code in re.findall(r"^\s*exitcode\s*:\s*(-?\d+)", line)]
            except KeyboardInterrupt:
                process.terminate()  # the probe writes nothing that lasts, so it need not clean up
                raise
        if process.returncode == 0:
            return json.loads(path.read_text())["results"][mode]["training"]
    why = said or last
    code = codes[-1] if codes else process.returncode
    if code == 2:
        return {"refused": why}
    if code < 0:  # SIGKILL, most likely from the kernel's out-of-memory killer: the host ran out
        return {"failed": f"killed by signal {-code} after: {why}"}
    return {"failed": f"exit code {code}: {why}"}


def refusal_in(line: str) -> str:
    """The reason in a line of offload_llama.py's stderr that says `offload_llama.py: error: why`, else ''. The last
    such reason in the line: ranks under torchrun share stderr, and a child that writes its line in two parts lets
    another rank's line run into it."""
    head, prefix, why = line.rpartition("offload_llama.py: error: ")
    return why.strip() if prefix else ""


def launcher(ranks: ol.Ranks) -> list[str]:
    """What runs offload_llama.py after python: torchrun with a rank per GPU where several ranks train, else
    nothing."""
    return ["-m", "torch.distributed.run", "--nproc-per-node", str(ranks.local_world)] * ranks.several


def probe_line(mode: str, layers: int, params: int, r: dict) -> str:
    """One progress line for a probe: trains (step time, peak memory), or why not."""
    head = f"probe {mode}, {layer_count(layers)} ({params / 1e9:.2f}B parameters): "
    if r.get("oom"):
        return head + "out of GPU memory"
    if "refused" in r or "failed" in r:
        return head + r.get("refused", r.get("failed"))
    gpu = f"peak GPU {ol.gib(r['peak_gpu_bytes'])} GiB, " if "peak_gpu_bytes" in r else ""
    return head + f"trains, {r['time_ms']:.0f} ms per step, {gpu}peak host {ol.gib(r.get('peak_host_bytes'))} GiB"


def search(run: ol.RunConfig, mode: str, config) -> dict:
    """The most layers of `mode` that train, the probes made, and what stops one more."""
    host_limit = host_layer_limit(run, mode)
    upper = MAX_SEARCH_LAYERS if host_limit is None else host_limit  # more layers: refused before a probe
    first = gpu_layer_guess(run, config) if mode == "gpu" else upper  # offloaded: GPU memory flat in layers
    probes = {}

    def trains(n: int) -> bool:
        """Probe n layers; they train when the probe ran every step."""
        probes[n] = probe(run, mode, n)
        ol.log(probe_line(mode, n, ol.params_with_layers(config, n), probes[n]))
        return not {"oom", "refused", "failed"} & probes[n].keys()

    n = largest_that_trains(trains, first, upper)
    found = {"layers": n, "parameters": ol.params_with_layers(config, n), "training": probes.get(n)}
    found["limited_by"] = limit(run, mode, config, n, probes.get(n + 1))
    return found | {"probes": {str(k): v for k, v in sorted(probes.items())}}


def limit(run: ol.RunConfig, mode: str, config, n: int, after: dict | None) -> str:
    """Why n + 1 layers do not train: what their probe met, or, unprobed, the plan's refusal (the host memory or the
    disk) or the search's end."""
    if after is not None:
        if after.get("oom"):
            cap = f"the {run.max_gpu_memory:g} GiB cap" if run.max_gpu_memory else "the GPU"
            return f"GPU memory: the model with {layer_count(n + 1)} does not fit {cap}"
        return after.get("refused") or after.get("failed")
    more = dataclasses.replace(with_layers(run, n + 1), mode=mode)
    refusal = ol.plan_refusal(more, ol.model_config(more), machine(more))
    if refusal is None:
        return f"the search stops at {MAX_SEARCH_LAYERS} layers"
    return f"with {layer_count(n + 1)}, {refusal}"


def disk_layers_needed(run: ol.RunConfig, config) -> int:
    """The layers whose moments the plan puts on the disk of --nvme were it as large as needed (all of them where even
    that does not fit the host); 0 without --nvme."""
    return ol.make_plan(run, config, machine(run, math.inf)).disk_layers


def large_disk(run: ol.RunConfig, mode: str, found: dict) -> dict | None:
    """Arithmetic from the run found, not a run: the most layers this host holds were the --nvme disk as large as
    needed, how many keep their moments on the disk, and the step were it the found one's scaled by its disk bytes
    (None without a disk tier)."""
    t = found["training"] or {}
    if "disk_tier" not in t:
        return None
    n = host_layer_limit(run, mode, free=math.inf, most=LARGE_DISK_LAYERS)
    largest, config = dataclasses.replace(with_layers(run, n), mode=mode), config_with_layers(run, n)
    on_disk = disk_layers_needed(largest, config)
    disk_bytes = on_disk * ol.disk_unit_bytes(config)
    step_ms = t["time_ms"] * disk_bytes / t["disk_tier"]["bytes"]
    figures = {"layers": n, "parameters": ol.param_count(config), "disk_layers": on_disk, "disk_bytes": disk_bytes}
    return figures | {"step_ms": step_ms}


def large_disk_line(mode: str, d: dict) -> str:
    """large_disk's figures in a sentence, marked as arithmetic."""
    return (
        f"{ol.MODE_NAMES[mode]} with a disk as large as needed (arithmetic from the run above, not measured): "
        f"{layer_count(d['layers'])} ({d['parameters'] / 1e9:.2f}B parameters) fit this host, {d['disk_layers']} of "
        f"them with their Adam moments on the disk ({ol.gib(d['disk_bytes'])} GiB); the step above, scaled by "
        f"the bytes on the disk, takes about {d['step_ms'] / 1e3:.0f} s."
    )


def layer_count(n: int) -> str:
    """'1 layer', 'n layers'."""
    return f"{n} layer" + "s" * (n != 1)


def largest_table(found: dict, run: ol.RunConfig) -> str:
    """Per mode the layers, parameters, step time, peak memory and what stops one more."""
    cap = f"GPU capped at {run.max_gpu_memory:g} GiB" if run.max_gpu_memory else "the whole GPU"
    cap += f" each, {run.ranks.world} GPUs sharing the host" if run.ranks.several else ""
    title = f"The largest model that trains ({run.preset} layers, {run.dtype}, {run.batch_size}x{run.seq_len} "
    title += f"tokens per micro-batch, Adam, {cap})"
    columns = [("layers", "---:"), ("parameters (B)", "---:"), ("step (ms)", "---:"), ("peak GPU (GiB)", "---:")]
    columns += [("units resident", "---:"), ("peak host (GiB)", "---:"), ("moments on the disk", "---:")]
    columns += [("one more layer", "---")]

    def cells(label: str, r: dict) -> list[str]:
        """A mode's row."""
        t = r["training"] or {}
        resident = f"{len(t['resident_units'])} of {t['units']}" if "units" in t else ""
        step, gpu, host = (
            ol.fmt(t.get("time_ms"), ".1f"),
            ol.gib(t.get("peak_gpu_bytes")),
            ol.gib(t.get("peak_host_bytes")),
        )
        disk = t.get("disk_tier")
        disk = f"{disk['units']} layers, {ol.gib(disk['bytes'])} GiB" if disk else ""
        return [str(r["layers"]), f"{r['parameters'] / 1e9:.2f}", step, gpu, resident, host, disk, r["limited_by"]]

    return "\n".join(ol.markdown(title, columns, [(ol.MODE_NAMES[m], r) for m, r in found.items()], cells))


def find_largest(run: ol.RunConfig) -> dict:
    """Per mode (default: gpu and overlapped), the most decoder layers that train; the table, and the JSON."""
    if run.model is not None:
        raise ol.UsageError("find_largest.py varies the preset's layer count: use --preset (and size flags)")
    if run.resident_layers is not None:
        raise ol.UsageError("find_largest.py plans each probe from --max-gpu-memory: drop --resident-layers")
    if run.grad_accum % run.ranks.world:
        n = run.ranks.world
        raise ol.UsageError(
            f"--nproc-per-node {n}: the step's {run.grad_accum} micro-batches split over the ranks: use a multiple "
            f"of {n} for --grad-accum"
        )
    config = ol.model_config(run)
    run = dataclasses.replace(run, train=True, inference=False)  # each probe trains one mode alone: lean
    ol.check_devices(with_layers(run, 1), ol.model_config(with_layers(run, 1)))
    modes = ("gpu", "overlapped") if run.mode == "all" else run.modes
    found = {mode: search(run, mode, config) for mode in modes}
    for mode, f in found.items():
        if run.nvme and (d := large_disk(run, mode, f)):
            f["large_disk"] = d
    report = {**ol.environment(), "run": dataclasses.asdict(run), "config": json.loads(config.to_json_string())}
    report["find_largest"] = found
    print(largest_table(found, run))
    for mode, f in found.items():
        if "large_disk" in f:
            print(large_disk_line(mode, f["large_disk"]))
    if run.json:
        ol.write_json(run.json, report)
    return report


def main(argv=None) -> int:
    """The command line: offload_llama.py's flags, and --nproc-per-node N to probe under torchrun with N ranks on this
    host; exit code 2 with one line for bad input."""
    parser = argparse.ArgumentParser(add_help=False)
    parser.add_argument("--nproc-per-node", type=int, default=1)
    own, rest = parser.parse_known_args(sys.argv[1:] if argv is None else argv)
    n = own.nproc_per_node
    run = ol.parse_args(["--train", *rest])
    run = dataclasses.replace(run, ranks=ol.Ranks(0, n, 0, n)) if n > 1 else run  # as each probe's rank 0 sees
    try:
        ol.check_outputs(run)
        find_largest(run)
    except ol.UsageError as e:
        print(f"find_largest.py: error: {e}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
