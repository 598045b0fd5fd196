"""Layer-wise parameter offload for LLaMA, measured.

The weights of every decoder layer live in pinned CPU memory as one flat buffer; each layer is copied
into a small ring of GPU slots just before it runs. `blocked` copies, then computes, one layer at a
time; `overlapped` lets a copy stream fill the next slot(s) while the compute stream runs the current
one. The forward pass is the unmodified Hugging Face `LlamaForCausalLM.forward`: only the decoder
layers it calls are swapped for thin wrappers that fetch their weights from the ring.

References: torchao's CPUOffloadOptimizer (pinned buffers allocated once, one event per sync point),
torchtune's activation offloading (streams named for their role), gau-nernst's offload.py (flat
buffers with parameter views into them), nanoGPT/gpt-fast (presets, derived efficiency figures).

    python offload_llama.py --mode all            # every mode, then the memory and time tables
"""

from __future__ import annotations

import argparse
import contextlib
import copy
import dataclasses
import gc
import json
import platform
import statistics
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import torch
import transformers
from torch import nn
from transformers import LlamaConfig, LlamaForCausalLM
from transformers.models.llama.modeling_llama import LlamaDecoderLayer

GiB = 2**30
MODES = ("gpu", "blocked", "overlapped", "cpu")
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
MODE_NAMES = {"gpu": "w/o offload (gpu)", "blocked": "blocked offload", "overlapped": "overlapped offload",
              "cpu": "cpu"}


def log(msg: str) -> None:
    """Progress goes to stderr: stdout carries only the tables."""
    print(msg, file=sys.stderr, flush=True)


class UsageError(Exception):
    """Bad input: main() prints it as one line on stderr and exits with code 2."""


# ----------------------------------------------------------------------------- run configuration

PRESETS = {
    # tiny: for tests; grouped-query attention (2 KV heads for 4 query heads) and an odd layer count
    "tiny": dict(hidden_size=64, intermediate_size=176, num_hidden_layers=3, num_attention_heads=4,
                 num_key_value_heads=2, vocab_size=256),
    # LLaMA-7B dimensions with 8 layers (1.88B parameters): the report's model
    "7b-8l": dict(hidden_size=4096, intermediate_size=11008, num_hidden_layers=8, num_attention_heads=32,
                  num_key_value_heads=32, vocab_size=32000),
    "llama-7b": dict(hidden_size=4096, intermediate_size=11008, num_hidden_layers=32, num_attention_heads=32,
                     num_key_value_heads=32, vocab_size=32000),
}
SIZE_FLAGS = {"hidden_size": "hidden-size", "intermediate_size": "intermediate-size", "num_hidden_layers": "layers",
              "num_attention_heads": "heads", "num_key_value_heads": "kv-heads", "vocab_size": "vocab-size"}


@dataclass(frozen=True)
class RunConfig:
    mode: str = "all"
    preset: str = "7b-8l"
    model: str | None = None            # a save_pretrained folder; overrides preset and sizes
    sizes: tuple = ()                   # (field, value) pairs that override the preset
    dtype: str = "bfloat16"             # the compute dtype; master weights stay float32
    batch_size: int = 1
    seq_len: int = 4096
    seed: int = 0
    prefetch: int = 1                   # layers copied ahead in overlapped mode (ring of prefetch + 1 slots)
    warmup: int = 2
    repeat: int = 5
    max_gpu_memory: float | None = None  # GiB
    json: str | None = None
    save_output: str | None = None
    profile: str | None = None

    @property
    def modes(self) -> tuple[str, ...]:
        return MODES if self.mode == "all" else (self.mode,)

    @property
    def torch_dtype(self) -> torch.dtype:
        return DTYPES[self.dtype]


def default_dtype() -> str:
    """bfloat16, unless the GPU cannot compute in it."""
    cuda_without_bf16 = torch.cuda.is_available() and not torch.cuda.is_bf16_supported(including_emulation=False)
    return "float16" if cuda_without_bf16 else "bfloat16"


# ----------------------------------------------------------------------------- model

def llama_config(run: RunConfig) -> LlamaConfig:
    """The model's config: from --model's folder, or the preset with size flags applied; validated."""
    if run.model is not None:
        return load_config(Path(run.model))
    sizes = {**PRESETS[run.preset], **dict(run.sizes)}
    for field, value in sizes.items():
        if value < 1:
            raise UsageError(f"--{SIZE_FLAGS[field]} must be at least 1, got {value}")
    if sizes["hidden_size"] % sizes["num_attention_heads"]:
        raise UsageError(f"hidden size {sizes['hidden_size']} is not divisible by {sizes['num_attention_heads']} "
                         "attention heads")
    if sizes["num_attention_heads"] % sizes["num_key_value_heads"]:
        raise UsageError(f"{sizes['num_attention_heads']} attention heads are not divisible by "
                         f"{sizes['num_key_value_heads']} key/value heads")
    if (sizes["hidden_size"] // sizes["num_attention_heads"]) % 2:
        raise UsageError("the head dimension (hidden size / heads) must be even for rotary embeddings")
    return LlamaConfig(**sizes, max_position_embeddings=max(4096, run.seq_len), tie_word_embeddings=False)


def load_config(path: Path) -> LlamaConfig:
    if not path.is_dir():
        raise UsageError(f"--model {path}: no such folder (give a folder written by save_pretrained)")
    config_file = path / "config.json"
    if not config_file.is_file():
        raise UsageError(f"--model {path}: no config.json, so not a save_pretrained folder")
    try:
        model_type = json.loads(config_file.read_text()).get("model_type")
    except (json.JSONDecodeError, AttributeError) as e:
        raise UsageError(f"--model {path}: config.json is not valid JSON ({e})") from None
    if model_type != "llama":
        raise UsageError(f"--model {path}: model_type is {model_type!r}, not 'llama'")
    return LlamaConfig.from_pretrained(path)


def build_model(run: RunConfig, config: LlamaConfig) -> LlamaForCausalLM:
    """The CPU model in the compute dtype: loaded from --model, or randomly initialised from --seed."""
    dtype = run.torch_dtype
    n = param_count(config)
    what = run.model or run.preset
    log(f"building {what}: {n / 1e9:.2f}B parameters, {str(dtype).removeprefix('torch.')} "
        f"({n * dtype.itemsize / GiB:.1f} GiB) on the CPU ...")
    t0 = time.perf_counter()
    if run.model is not None:
        try:
            model = LlamaForCausalLM.from_pretrained(run.model, dtype=dtype)
        except (OSError, ValueError) as e:
            raise UsageError(f"--model {run.model}: cannot load the weights ({str(e).splitlines()[0]})") from None
    else:
        torch.manual_seed(run.seed)
        model = LlamaForCausalLM._from_config(config, dtype=dtype)
    log(f"built in {time.perf_counter() - t0:.1f} s")
    return model.eval()


def param_count(config: LlamaConfig) -> int:
    with torch.device("meta"):
        return sum(p.numel() for p in LlamaForCausalLM(config).parameters())


def random_input_ids(run: RunConfig, vocab_size: int) -> torch.Tensor:
    generator = torch.Generator().manual_seed(run.seed)
    return torch.randint(vocab_size, (run.batch_size, run.seq_len), generator=generator)  # (B, T)


# ----------------------------------------------------------------------------- parameter store

ALIGN = 128  # elements: 256 B in 16-bit dtypes, as the caching allocator aligns, so cuBLAS picks the same kernels


@dataclass(frozen=True)
class FlatLayout:
    """Where each parameter of a decoder layer sits in its flat buffer (offsets in elements)."""
    names: tuple[str, ...]
    shapes: tuple[torch.Size, ...]
    offsets: tuple[int, ...]
    numel: int

    @staticmethod
    def of(layer: nn.Module) -> FlatLayout:
        names, shapes, offsets, end = [], [], [], 0
        for name, p in layer.named_parameters():
            names.append(name), shapes.append(p.shape), offsets.append(end)
            end += -(-p.numel() // ALIGN) * ALIGN
        return FlatLayout(tuple(names), tuple(shapes), tuple(offsets), end)

    def views(self, flat: torch.Tensor) -> dict[str, torch.Tensor]:
        return {name: flat[off:off + shape.numel()].view(shape)
                for name, shape, off in zip(self.names, self.shapes, self.offsets)}

    def bind(self, module: nn.Module, flat: torch.Tensor) -> nn.Module:
        """Make `module`'s parameters views into `flat`: filling `flat` then changes the weights it runs."""
        for name, view in self.views(flat).items():
            owner, _, leaf = name.rpartition(".")
            setattr(module.get_submodule(owner), leaf, nn.Parameter(view, requires_grad=False))
        return module


class ParamStore:
    """Every decoder layer's weights as one flat CPU buffer in the compute dtype, pinned when a GPU streams it.

    The CPU model's layer parameters are rebound as views into these buffers, so the host holds one copy.
    """

    @torch.no_grad()
    def __init__(self, model: LlamaForCausalLM, pin: bool):
        layers = model.model.layers
        self.layout = FlatLayout.of(layers[0])
        self.dtype = next(layers[0].parameters()).dtype
        self.flats = []
        for layer in layers:
            # allocated once: pinning costs about 0.6 s per GiB, never pay it per step
            flat = torch.zeros(self.layout.numel, dtype=self.dtype, pin_memory=pin)
            for name, view in self.layout.views(flat).items():
                view.copy_(layer.get_parameter(name))
            self.layout.bind(layer, flat)
            self.flats.append(flat)

    @property
    def num_layers(self) -> int:
        return len(self.flats)

    @property
    def layer_bytes(self) -> int:
        return self.layout.numel * self.dtype.itemsize


# ----------------------------------------------------------------------------- layer streamer

class InOrder:
    """Stands in for a CUDA stream or event on the CPU, where every op already runs in program order.

    Tests also put it in place of a real event to remove one stream wait and watch the result go wrong.
    """

    def wait_event(self, event) -> None: ...
    def wait(self, stream=None) -> None: ...
    def record(self, stream=None) -> None: ...


def on_stream(stream):
    """A `with` block that issues its work on `stream` (nothing to switch on the CPU)."""
    return torch.cuda.stream(stream) if isinstance(stream, torch.cuda.Stream) else contextlib.nullcontext()


class LayerStreamer:
    """Streams decoder layers from the pinned store into a ring of GPU slots; layer i runs in slot i % n_slots.

    depth is how many layers the copy stream runs ahead of the compute stream: 0 is blocked offload (copy a
    layer, run it, copy the next), >= 1 is overlapped. Two events per slot order the two streams:
      copied[s]  the copy into slot s has landed:        compute may read the slot
      freed[s]   compute has finished the slot's layer:  the next copy may overwrite it
    """

    def __init__(self, store: ParamStore, config: LlamaConfig, device: torch.device, depth: int):
        self.store, self.depth = store, depth
        n_slots = min(depth + 1, store.num_layers)
        self.buffers = [torch.empty(store.layout.numel, dtype=store.dtype, device=device) for _ in range(n_slots)]
        with torch.device("meta"):  # slot modules own no memory: their parameters are views into the buffers
            self.layers = [store.layout.bind(LlamaDecoderLayer(config, layer_idx=0), buf).eval()
                           for buf in self.buffers]
        cuda = device.type == "cuda"
        self.compute_stream = torch.cuda.current_stream(device) if cuda else InOrder()
        self.copy_stream = torch.cuda.Stream(device) if cuda else InOrder()
        self.copied = [torch.cuda.Event() if cuda else InOrder() for _ in range(n_slots)]
        self.freed = [torch.cuda.Event() if cuda else InOrder() for _ in range(n_slots)]

    @property
    def n_slots(self) -> int:
        return len(self.buffers)

    def prefetch(self, i: int) -> None:
        """Start copying layer i into its slot, on the copy stream."""
        s = i % self.n_slots
        with on_stream(self.copy_stream):
            self.copy_stream.wait_event(self.freed[s])  # the slot's previous layer may still be running from it
            self.buffers[s].copy_(self.store.flats[i], non_blocking=True)
            self.copied[s].record(self.copy_stream)

    def acquire(self, i: int) -> nn.Module:
        """The module that runs layer i; also starts the copies of the layers `depth` ahead."""
        first = 0 if i == 0 else i + self.depth  # layer 0 opens a pass by filling the whole ring
        for j in range(first, min(i + self.depth + 1, self.store.num_layers)):
            self.prefetch(j)
        s = i % self.n_slots
        self.compute_stream.wait_event(self.copied[s])  # layer i's weights must have landed before its kernels read them
        return self.layers[s]

    def release(self, i: int) -> None:
        """Layer i's kernels are all issued: its slot is free once they have run."""
        self.freed[i % self.n_slots].record(self.compute_stream)


class SkipLayers:
    """A strategy that runs no decoder layer: times the resident parts (embeddings, norm, head) alone."""

    def acquire(self, i: int):
        return lambda hidden_states, **kwargs: hidden_states

    def release(self, i: int) -> None: ...


class StreamedLayer(nn.Module):
    """Stands in for decoder layer `index` inside the HF forward: gets a module holding its weights, runs it."""

    def __init__(self, index: int, strategy):
        super().__init__()
        self.index, self.strategy = index, strategy

    def forward(self, hidden_states: torch.Tensor, **kwargs) -> torch.Tensor:
        out = self.strategy.acquire(self.index)(hidden_states, **kwargs)
        self.strategy.release(self.index)
        return out


def offloaded_model(model: LlamaForCausalLM, strategy, device: torch.device) -> LlamaForCausalLM:
    """A copy of `model` on `device` without its decoder layers (embeddings, norm, head, rotary stay resident);
    its layer list holds StreamedLayer wrappers, so the unmodified HF forward runs the layers from `strategy`."""
    layers = model.model.layers
    model.model.layers = nn.ModuleList()
    try:
        shell = copy.deepcopy(model).to(device)
    finally:
        model.model.layers = layers
    shell.model.layers = nn.ModuleList(StreamedLayer(i, strategy) for i in range(len(layers)))
    return shell.train(model.training)


def set_strategy(shell: LlamaForCausalLM, strategy) -> None:
    for layer in shell.model.layers:
        layer.strategy = strategy


# ----------------------------------------------------------------------------- measurement

CUBLAS_WORKSPACE = 32 * 2**20  # torch's default cuBLAS workspace on Hopper (":4096:8"), allocated once per stream

def timed(fn, device: torch.device) -> tuple[float, object]:
    """Milliseconds fn() takes on `device`, and its result."""
    if device.type != "cuda":
        t0 = time.perf_counter()
        out = fn()
        return (time.perf_counter() - t0) * 1e3, out
    # start from an idle GPU, so no stream can begin work before `start` is recorded
    torch.cuda.synchronize(device)
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    out = fn()
    end.record()  # fn's side-stream work is all waited for by the current stream, so `end` covers it
    end.synchronize()
    return start.elapsed_time(end), out


def median_ms(fn, device: torch.device, warmup: int, repeat: int) -> tuple[float, object]:
    """Median time of `repeat` runs after `warmup` untimed ones, and the last run's result."""
    for _ in range(warmup):
        fn()
    times, out = [], None
    for _ in range(repeat):
        out = None  # free the last output before the next run allocates its own
        ms, out = timed(fn, device)
        times.append(ms)
    return statistics.median(times), out


def pipeline_bound_ms(n_layers: int, copy_ms: float, compute_ms: float, resident_ms: float, depth: int) -> float:
    """The fastest a pass can be given per-layer copy and compute times (DESIGN.md).

    Blocked (depth 0) serialises each copy with its layer. Overlapped hides the shorter of the two behind the
    longer, except the first copy and the last layer's compute, which have nothing to overlap with."""
    if depth == 0:
        return resident_ms + n_layers * (copy_ms + compute_ms)
    return resident_ms + copy_ms + (n_layers - 1) * max(copy_ms, compute_ms) + compute_ms


def analytic_peak_bytes(config: LlamaConfig, dtype: torch.dtype, tokens: int, resident_layers: int,
                        layer_bytes: int) -> dict[str, int]:
    """The GPU memory a forward pass needs, term by term: layer weights on the GPU (all of them, or the slots),
    the resident parts, the largest activation footprint (a decoder layer's MLP, or the head) and workspace."""
    b, h, i, v = dtype.itemsize, config.hidden_size, config.intermediate_size, config.vocab_size
    head_dim = getattr(config, "head_dim", None) or h // config.num_attention_heads
    resident = (2 * v * h + h) * b  # embeddings, head, final norm
    # in a layer the peak is in the MLP: layer input, residual, attention sum, normed input; act(gate(x)), up(x),
    # their product (measured on the H100: exact in bfloat16 and float32)
    layer_act = tokens * b * (4 * h + 3 * i)
    # at the head, counted together though they do not all coexist: hidden state, normed hidden state,
    # float32 norm temporaries, logits
    head_act = tokens * (2 * b * h + 2 * 4 * h + b * v)
    rotary_and_ids = tokens * (2 * head_dim * b + 2 * 8)  # cos and sin, token ids and position ids (int64)
    return {"layer weights": resident_layers * layer_bytes, "resident parts": resident,
            "activations": max(layer_act, head_act) + rotary_and_ids, "workspace": CUBLAS_WORKSPACE + 8 * 512}


def trace_overlap(path: str) -> dict:
    """From a Chrome trace: total host-to-device copy time, and how much of it ran while a kernel ran on
    another stream. Proof of overlap that does not rely on timing the whole pass."""
    events = json.loads(Path(path).read_text())["traceEvents"]
    copies = [e for e in events if e.get("cat") == "gpu_memcpy" and "HtoD" in e.get("name", "")]
    kernels = [e for e in events if e.get("cat") == "kernel"]
    kernel_spans = sorted((e["ts"], e["ts"] + e["dur"], e["args"].get("stream")) for e in kernels)
    overlap_us = 0.0
    for c in copies:
        c0, c1, stream = c["ts"], c["ts"] + c["dur"], c["args"].get("stream")
        overlap_us += union_length([(max(k0, c0), min(k1, c1)) for k0, k1, s in kernel_spans
                                    if s != stream and k0 < c1 and k1 > c0])
    return {"copy_ms": sum(c["dur"] for c in copies) / 1e3, "overlap_ms": overlap_us / 1e3,
            "copy_streams": sorted({c["args"].get("stream") for c in copies}),
            "kernel_streams": sorted({k[2] for k in kernel_spans})}


def union_length(spans: list[tuple[float, float]]) -> float:
    total, end = 0.0, float("-inf")
    for a, b in sorted(spans):
        if b > end:
            total += b - max(a, end)
            end = b
    return total


# ----------------------------------------------------------------------------- modes

def logits_of(model: LlamaForCausalLM, input_ids: torch.Tensor) -> torch.Tensor:
    """One forward pass. No KV cache: a single pass needs none, and the slot modules share one layer_idx."""
    return model(input_ids, use_cache=False).logits  # (B, T, vocab)


def layer_inputs(shell: LlamaForCausalLM, input_ids: torch.Tensor) -> tuple[tuple, dict]:
    """The arguments the HF forward passes to decoder layer 0 (hidden states, rotary embeddings, mask)."""
    captured = {}
    hook = shell.model.layers[0].register_forward_pre_hook(
        lambda module, args, kwargs: captured.update(args=args, kwargs=kwargs), with_kwargs=True)
    try:
        logits_of(shell, input_ids)
    finally:
        hook.remove()
    return captured["args"], captured["kwargs"]


def measure_bound(shell, streamer: LayerStreamer, input_ids, device, run: RunConfig) -> dict:
    """Copy-only and compute-only runs of the same layers, combined into each mode's bound."""
    n = streamer.store.num_layers

    def copy_all():
        for i in range(n):
            streamer.prefetch(i)
        # `timed` records its end event on this stream: make it wait for the copies
        torch.cuda.current_stream(device).wait_stream(streamer.copy_stream)

    copy_ms = median_ms(copy_all, device, run.warmup, run.repeat)[0] / n
    args, kwargs = layer_inputs(shell, input_ids)
    compute_ms = median_ms(lambda: streamer.layers[0](*args, **kwargs), device, run.warmup, run.repeat)[0]
    set_strategy(shell, SkipLayers())
    resident_ms = median_ms(lambda: logits_of(shell, input_ids), device, run.warmup, run.repeat)[0]
    set_strategy(shell, streamer)
    return {"copy_ms_per_layer": copy_ms, "compute_ms_per_layer": compute_ms, "resident_ms": resident_ms,
            "h2d_gbps_copy_only": streamer.store.layer_bytes / copy_ms / 1e6}


def infer_resident(model, input_ids, device, run: RunConfig, config) -> tuple[dict, torch.Tensor]:
    """gpu and cpu modes: the plain HF model, resident on `device`."""
    if device.type == "cuda":
        model = copy.deepcopy(model).to(device)
    ids = input_ids.to(device)
    # the CPU takes minutes per pass at full size: one run, no warm-up
    warmup, repeat = (run.warmup, run.repeat) if device.type == "cuda" else (0, 1)
    ms, logits = median_ms(lambda: logits_of(model, ids), device, warmup, repeat)
    result = {"time_ms": ms}
    if device.type == "cuda":
        result["peak_gpu_bytes"] = torch.cuda.max_memory_allocated(device)
        result["analytic_peak_bytes"] = analytic_peak_bytes(
            config, run.torch_dtype, ids.numel(), config.num_hidden_layers, layer_bytes_of(model))
    return result, logits.cpu()


def layer_bytes_of(model) -> int:
    return sum(p.numel() * p.element_size() for p in model.model.layers[0].parameters())


def infer_offloaded(model, store: ParamStore, input_ids, device, depth: int, run: RunConfig, config,
                    profile: str | None) -> tuple[dict, torch.Tensor]:
    """blocked (depth 0) and overlapped (depth >= 1) modes: the HF forward with layers streamed in."""
    streamer = LayerStreamer(store, config, device, depth)
    shell = offloaded_model(model, streamer, device)
    ids = input_ids.to(device)
    ms, logits = median_ms(lambda: logits_of(shell, ids), device, run.warmup, run.repeat)
    result = {"time_ms": ms, "prefetch": depth, "slots": streamer.n_slots}
    if device.type == "cuda":
        result["peak_gpu_bytes"] = torch.cuda.max_memory_allocated(device)
        result["analytic_peak_bytes"] = analytic_peak_bytes(config, store.dtype, ids.numel(), streamer.n_slots,
                                                            store.layer_bytes)
        result |= measure_bound(shell, streamer, ids, device, run)
        n = store.num_layers
        result["bound_ms"] = pipeline_bound_ms(n, result["copy_ms_per_layer"], result["compute_ms_per_layer"],
                                               result["resident_ms"], depth)
        result["efficiency"] = result["bound_ms"] / ms
        result["h2d_gbps"] = n * store.layer_bytes / ms / 1e6
        if profile:
            result["trace"] = profile_forward(shell, ids, profile)
    return result, logits.cpu()


def profile_forward(shell, ids, path: str) -> dict:
    """Write a Chrome/Perfetto trace of one forward pass and say how much of its copying was hidden."""
    activities = [torch.profiler.ProfilerActivity.CPU, torch.profiler.ProfilerActivity.CUDA]
    with torch.profiler.profile(activities=activities) as prof:
        logits_of(shell, ids)
        torch.cuda.synchronize()  # the trace must hold the whole pass
    prof.export_chrome_trace(path)
    return trace_overlap(path)


def run_mode(mode: str, model, store, input_ids, run: RunConfig, config) -> tuple[dict, torch.Tensor | None]:
    """One mode's inference result; {'oom': True} when it does not fit the GPU (or the --max-gpu-memory cap)."""
    device = torch.device("cpu" if mode == "cpu" else "cuda")
    log(f"mode {mode}: inference over {input_ids.numel()} tokens ...")
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
    try:
        with torch.inference_mode():
            if mode in ("gpu", "cpu"):
                return infer_resident(model, input_ids, device, run, config)
            depth = 0 if mode == "blocked" else run.prefetch
            profile = run.profile if mode == profiled_mode(run) else None
            return infer_offloaded(model, store, input_ids, device, depth, run, config, profile)
    except torch.OutOfMemoryError:
        log(f"mode {mode}: out of GPU memory")
        return {"oom": True}, None


def profiled_mode(run: RunConfig) -> str:
    return "overlapped" if "overlapped" in run.modes else "blocked"


def free_gpu_memory() -> None:
    """Drop the last mode's GPU copies (and an OOM's leftovers) before the next mode measures its peak."""
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()


# ----------------------------------------------------------------------------- tables

def fmt(x, spec: str) -> str:
    return "" if x is None else format(x, spec)


def tables(results: dict, run: RunConfig, config, tokens: int) -> str:
    dtype = str(run.torch_dtype).removeprefix("torch.")
    what = f"{run.model or run.preset}, {dtype}, {run.batch_size}x{run.seq_len} = {tokens} tokens"
    rows = [(mode, results[mode]["inference"]) for mode in ("gpu", "blocked", "overlapped", "cpu") if mode in results]

    def label(mode, r):
        return MODE_NAMES[mode] + (f" (prefetch {r['prefetch']})" if mode == "overlapped" and "prefetch" in r else "")

    mem = [f"Table 1: peak GPU memory, inference ({what})", "",
           "| mode | peak GPU (GiB) | analytic (GiB) |", "|---|---:|---:|"]
    for mode, r in rows:
        if r.get("oom"):
            mem.append(f"| {label(mode, r)} | OOM | |")
        elif mode == "cpu":
            mem.append(f"| {label(mode, r)} | 0 (runs on the CPU) | |")
        else:
            mem.append(f"| {label(mode, r)} | {r['peak_gpu_bytes'] / GiB:.2f} | "
                       f"{sum(r['analytic_peak_bytes'].values()) / GiB:.2f} |")
    tim = [f"Table 2: time per forward pass, inference ({what})", "",
           "| mode | time (ms) | bound (ms) | efficiency | H2D (GB/s) | logits == gpu |", "|---|---:|---:|---:|---:|:---:|"]
    for mode, r in rows:
        if r.get("oom"):
            tim.append(f"| {label(mode, r)} | OOM | | | | |")
            continue
        equal = {True: "yes", False: "NO", None: ""}[r.get("equal_to_gpu")]
        tim.append(f"| {label(mode, r)} | {r['time_ms']:.1f} | {fmt(r.get('bound_ms'), '.1f')} | "
                   f"{fmt(r.get('efficiency'), '.3f')} | {fmt(r.get('h2d_gbps'), '.1f')} | {equal} |")
    notes = []
    for mode, r in rows:
        if "copy_ms_per_layer" in r:
            notes.append(f"{mode}: per layer copy {r['copy_ms_per_layer']:.2f} ms "
                         f"({r['h2d_gbps_copy_only']:.1f} GB/s alone), compute {r['compute_ms_per_layer']:.2f} ms; "
                         f"embeddings + norm + head {r['resident_ms']:.2f} ms")
        if "trace" in r:
            t = r["trace"]
            notes.append(f"{mode} trace: {t['overlap_ms']:.1f} of {t['copy_ms']:.1f} ms of copies ran under "
                         f"compute on another stream (copy streams {t['copy_streams']}, "
                         f"kernel streams {t['kernel_streams']})")
    if "cpu" in results and not results["cpu"]["inference"].get("oom"):
        notes.append("cpu: one run, no warm-up; GPU modes: median of "
                     f"{run.repeat} runs after {run.warmup} warm-up runs")
    return "\n".join(mem + [""] + tim + [""] + notes)


# ----------------------------------------------------------------------------- CLI

class Parser(argparse.ArgumentParser):
    def error(self, message):  # one line, exit 2, as for every other bad input
        print(f"offload_llama.py: error: {message} (see --help)", file=sys.stderr)
        sys.exit(2)


def parse_args(argv=None) -> RunConfig:
    p = Parser(description=__doc__.split("\n\n")[0], formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("--mode", choices=(*MODES, "all"), default="all",
                   help="gpu: resident model; cpu: on the CPU; blocked: copy each layer then run it; "
                        "overlapped: copy ahead on a second stream; all: every mode, then the tables")
    p.add_argument("--preset", choices=tuple(PRESETS), default="7b-8l")
    p.add_argument("--model", help="load a save_pretrained LLaMA folder instead of building a random model")
    for field, flag in SIZE_FLAGS.items():
        p.add_argument(f"--{flag}", type=int, dest=field, help=f"override the preset's {field}")
    p.add_argument("--dtype", choices=tuple(DTYPES), help="compute dtype (default: bfloat16 where supported)")
    p.add_argument("--batch-size", type=int, default=1)
    p.add_argument("--seq-len", type=int, default=4096)
    p.add_argument("--seed", type=int, default=0, help="seeds the random weights and the input token ids")
    p.add_argument("--prefetch", type=int, default=RunConfig.prefetch,
                   help="layers the copy stream runs ahead in overlapped mode")
    p.add_argument("--warmup", type=int, default=RunConfig.warmup)
    p.add_argument("--repeat", type=int, default=RunConfig.repeat, help="timed runs; the median is reported")
    p.add_argument("--max-gpu-memory", type=float, metavar="GIB", help="cap the GPU memory this process may use")
    p.add_argument("--json", metavar="PATH", help="write the results as JSON")
    p.add_argument("--save-output", metavar="PATH", help="torch.save the input ids and each mode's logits")
    p.add_argument("--profile", metavar="PATH", help="write a Chrome trace of one offloaded forward pass")
    a = p.parse_args(argv)
    for flag in ("batch_size", "seq_len", "repeat"):
        if getattr(a, flag) < 1:
            p.error(f"--{flag.replace('_', '-')} must be at least 1")
    if a.prefetch < 1:
        p.error("--prefetch must be at least 1 (blocked mode is prefetch 0)")
    if a.warmup < 0:
        p.error("--warmup must be at least 0")
    sizes = tuple((f, getattr(a, f)) for f in SIZE_FLAGS if getattr(a, f) is not None)
    return RunConfig(mode=a.mode, preset=a.preset, model=a.model, sizes=sizes, dtype=a.dtype or default_dtype(),
                     batch_size=a.batch_size, seq_len=a.seq_len, seed=a.seed, prefetch=a.prefetch,
                     warmup=a.warmup, repeat=a.repeat, max_gpu_memory=a.max_gpu_memory, json=a.json,
                     save_output=a.save_output, profile=a.profile)


def check_devices(run: RunConfig, config: LlamaConfig) -> None:
    """Everything about the GPU and host that can be refused before a byte is allocated."""
    dtype = run.torch_dtype
    layer_bytes = FlatLayout.of(meta_layer(config)).numel * dtype.itemsize
    if run.max_gpu_memory is not None and run.max_gpu_memory * GiB < layer_bytes:
        raise UsageError(f"--max-gpu-memory {run.max_gpu_memory} GiB is less than one decoder layer "
                         f"({layer_bytes / 2**20:.1f} MiB in {run.dtype}): no mode can run")
    gpu_modes = [m for m in run.modes if m != "cpu"]
    if gpu_modes and not torch.cuda.is_available():
        raise UsageError(f"mode {gpu_modes[0]} needs a CUDA GPU, and torch.cuda.is_available() is False: "
                         "use --mode cpu, or a machine with a GPU")
    if gpu_modes and dtype == torch.bfloat16 and not torch.cuda.is_bf16_supported(including_emulation=False):
        raise UsageError(f"{torch.cuda.get_device_name()} cannot compute in bfloat16: use --dtype float16 or float32")
    if run.profile and not {"blocked", "overlapped"} & set(run.modes):
        raise UsageError("--profile traces an offloaded pass: use --mode overlapped, blocked or all")
    needed = param_count(config) * dtype.itemsize
    available = host_memory_available()
    if available is not None and needed > available:
        raise UsageError(f"the model and its pinned store need {needed / GiB:.1f} GiB of host memory, "
                         f"only {available / GiB:.1f} GiB are available")
    if run.max_gpu_memory is not None and gpu_modes:
        total = torch.cuda.get_device_properties(0).total_memory
        torch.cuda.set_per_process_memory_fraction(min(1.0, run.max_gpu_memory * GiB / total))


def meta_layer(config: LlamaConfig) -> nn.Module:
    with torch.device("meta"):
        return LlamaDecoderLayer(config, layer_idx=0)


def host_memory_available() -> int | None:
    """MemAvailable from /proc/meminfo, in bytes (None where there is no such file)."""
    try:
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) * 1024
    except OSError:
        pass
    return None


def environment() -> dict:
    cuda = torch.cuda.is_available()
    return {"device": torch.cuda.get_device_name() if cuda else platform.processor() or "cpu",
            "gpu_memory_bytes": torch.cuda.get_device_properties(0).total_memory if cuda else None,
            "torch": torch.__version__, "transformers": transformers.__version__,
            "python": platform.python_version(), "cpu_threads": torch.get_num_threads()}


def run_all(run: RunConfig) -> dict:
    config = llama_config(run)
    check_devices(run, config)
    model = build_model(run, config)
    config = model.config
    input_ids = random_input_ids(run, config.vocab_size)
    needs_store = {"blocked", "overlapped"} & set(run.modes)
    store = ParamStore(model, pin=True) if needs_store else None
    results, logits = {}, {}
    for mode in run.modes:
        result, logits[mode] = run_mode(mode, model, store, input_ids, run, config)
        results[mode] = {"inference": result}
        free_gpu_memory()
    gpu_logits = logits.get("gpu")
    for mode in ("blocked", "overlapped"):
        if gpu_logits is not None and logits.get(mode) is not None:
            results[mode]["inference"]["equal_to_gpu"] = torch.equal(logits[mode], gpu_logits)
    report = {**environment(), "run": dataclasses.asdict(run), "tokens": input_ids.numel(),
              "parameters": param_count(config), "layer_bytes": FlatLayout.of(meta_layer(config)).numel
              * run.torch_dtype.itemsize, "config": json.loads(config.to_json_string()), "results": results}
    print(tables(results, run, config, input_ids.numel()))
    if run.json:
        Path(run.json).write_text(json.dumps(report, indent=2) + "\n")
    if run.save_output:
        torch.save({"input_ids": input_ids, "logits": {m: t for m, t in logits.items() if t is not None}},
                   run.save_output)
    return report


def main(argv=None) -> int:
    run = parse_args(argv)
    try:
        run_all(run)
    except UsageError as e:
        print(f"offload_llama.py: error: {e}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
