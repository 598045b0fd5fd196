"""Layer-wise parameter offload for LLaMA: a model run and trained on a GPU that holds a few of its layers.

Weights live in pinned host memory; each decoder layer is copied to the GPU just before it runs (blocked), or on a
CUDA stream of its own while the layer before computes (overlapped); training recomputes each unit in an autograd
Function and steps Adam on float32 masters on the host (OffloadedAdam). Install, test, run:
    pip install -r requirements.txt
    python -m pytest -q tests                          # every mode computes the same thing
    python offload_llama.py --mode overlapped --train  # LLaMA-7B-sized layers: the memory and time tables
The file by line, the assignment first; each section beyond it says what it adds, its flag and the hook it plugs into.
     71  the model and its configuration         Config, build_model
    200  gpu and cpu inference                   infer_resident, timed
    244  streams, events and pinned host memory  new_stream, host_zeros_each
    327  blocked and overlapped offload          every wait (S1-S16), ParamStore, LayerStreamer
    692  training: the autograd.Function         StreamedUnit, OffloadedTraining
    990  the offloaded Adam                      OffloadedAdam, CpuAdam, Steppers
   1371  the reference                           ResidentTraining
   1423  Table 1 and Table 2                     tables
   1500  # === Beyond the assignment ===
        the compiled Adam 1503, the GPU's Adam 1604, activation offload 1832, segment checkpointing 1897
        float16 and clipping 2069, the disk tier 2152, several GPUs 2423, a model folder 2674, the plan 2868
        measurement 3950, the tables' notes 4618, text in 4812, saving and resuming 5310, the command line 5773
        running a mode 6672, the run 6839
"""

from __future__ import annotations

import argparse
import array
import collections
import concurrent.futures
import contextlib
import copy
import ctypes
import dataclasses
import datetime
import errno
import fcntl
import functools
import gc
import hashlib
import itertools
import json
import math
import mmap
import os
import platform
import queue
import re
import shutil
import signal
import stat
import statistics
import struct
import sys
import tempfile
import threading
import time
import traceback
import weakref
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.distributed as dist
import transformers
from torch import nn
from transformers import LlamaConfig, LlamaForCausalLM
from transformers.models.llama.modeling_llama import LlamaDecoderLayer, LlamaRMSNorm, LlamaRotaryEmbedding

# ------------------------------------------------------------------------------------ the model and its configuration
# A run's configuration (Config: the model, the batch, the timing, Adam) and the random LLaMA it builds.

GiB = 2**30
MODES = ("gpu", "blocked", "overlapped", "cpu")  # the order of the tables' rows
DTYPE_NAMES = ("float32", "bfloat16", "float16")
DTYPES = {name: getattr(torch, name) for name in DTYPE_NAMES}
SIZE_FLAGS = {  # a LlamaConfig size and its flag, in the order of PRESET_SIZES
    "hidden_size": "hidden-size",
    "intermediate_size": "intermediate-size",
    "num_hidden_layers": "layers",
    "num_attention_heads": "heads",
    "num_key_value_heads": "kv-heads",
    "vocab_size": "vocab-size",
}
PRESET_SIZES = {  # hidden, intermediate, layers, heads, key/value heads, vocabulary
    "tiny": (64, 176, 3, 4, 2, 256),  # for tests: grouped-query attention (2 KV heads for 4) and an odd layer count
    "7b-8l": (4096, 11008, 8, 32, 32, 32000),  # LLaMA-7B with 8 layers (1.88B parameters): the report's model
    "llama-7b": (4096, 11008, 32, 32, 32, 32000),
}
PRESETS = {name: dict(zip(SIZE_FLAGS, sizes, strict=True)) for name, sizes in PRESET_SIZES.items()}  # field -> size
ALIGN = 128  # elements (256 B in 16 bits): each parameter starts as the caching allocator aligns, for cuBLAS's kernels
DRAW_CHUNK = 2**24  # elements: a random weight is drawn in chunks this size, each from a generator of its own
STARTED = time.perf_counter()


def log(msg: str) -> None:
    """Print a progress line on stderr (stdout carries the tables); of torchrun's ranks, rank 0 speaks for all."""
    if os.environ.get("RANK", "0") == "0":
        print(f"{time.perf_counter() - STARTED:6.1f} s  {msg}", file=sys.stderr, flush=True)


@dataclass(frozen=True)
class Config:
    """One run of the assignment: the model, the batch, the timing and Adam's settings; frozen, passed explicitly."""

    mode: str = "all"  # gpu, blocked, overlapped or cpu, several with commas, or all
    preset: str = "7b-8l"
    sizes: tuple = ()  # (field, value) pairs over the preset's sizes
    dtype: str = "bfloat16"  # what the GPU computes in; master weights and Adam state stay float32
    attention: str = "sdpa"  # eager: a backward that is bitwise reproducible (sdpa's is not)
    batch_size: int = 1
    seq_len: int = 4096
    seed: int = 0
    prefetch: int = 1  # units the copy stream runs ahead in overlapped mode (a ring of prefetch + 1 slots)
    warmup: int = 2  # untimed runs first
    repeat: int = 5  # timed runs, the median reported
    train: bool = False  # also train each mode: forward, backward, Adam
    inference: bool = True
    steps: int = 10
    grad_accum: int = 1  # micro-batches of batch_size x seq_len tokens a step
    lr: float = 1e-4
    betas: tuple = (0.9, 0.999)
    eps: float = 1e-8
    weight_decay: float = 0.0

    @property
    def modes(self) -> tuple[str, ...]:  # the modes to run, in the tables' order
        return MODES if self.mode == "all" else tuple(m for m in MODES if m in self.mode.split(","))

    @property
    def tokens(self) -> int:  # the tokens of one micro-batch
        return self.batch_size * self.seq_len

    @property
    def torch_dtype(self) -> torch.dtype:  # the compute dtype as a torch.dtype
        return DTYPES[self.dtype]

    @property
    def adam(self) -> Adam:  # Adam's settings
        return Adam(self.lr, tuple(self.betas), self.eps, self.weight_decay)


def llama_config(run: Config) -> LlamaConfig:
    """The preset's LlamaConfig with the run's sizes over it; its head untied, as training streams it as a unit."""
    sizes = {**PRESETS[run.preset], **dict(run.sizes)}
    return LlamaConfig(**sizes, max_position_embeddings=max(4096, run.seq_len), tie_word_embeddings=False)


def meta_model(config: LlamaConfig, dtype: torch.dtype, attention: str) -> LlamaForCausalLM:
    """A LLaMA of `config` on the meta device: its shapes and dtype, no memory."""
    with torch.device("meta"):
        return transformers.AutoModelForCausalLM.from_config(config, dtype=dtype, attn_implementation=attention)


def build_model(run: Config, config: LlamaConfig) -> LlamaForCausalLM:
    """A random LLaMA on the CPU in the compute dtype, drawn from the run's seed (init_random)."""
    model = meta_model(config, run.torch_dtype, run.attention)
    size = sum(p.numel() for p in model.parameters()) * run.torch_dtype.itemsize / GiB
    log(f"building a random {run.preset} on the CPU: {size:.1f} GiB of {run.dtype} weights")
    init_random(model, run.seed)
    return model.eval()


@torch.no_grad()
def init_random(model: LlamaForCausalLM, seed: int) -> None:
    """HF's LLaMA initialisation of a meta-device model: weights N(0, initializer_range), norms 1, in parallel."""
    config = model.config
    model.to_empty(device="cpu")
    weights = [p for p in model.parameters() if p.dim() > 1]
    chunks = [  # no_grad does not reach the pool threads: the tensors are detached
        (chunk, i, j) for i, p in enumerate(weights) for j, chunk in enumerate(p.detach().view(-1).split(DRAW_CHUNK))
    ]

    def draw(chunk: torch.Tensor, i: int, j: int) -> None:  # chunk j of weight i, rounded to its dtype
        chunk.copy_(drawn_chunk(seed, i, j, chunk.numel(), config.initializer_range))

    with ThreadPoolExecutor(torch.get_num_threads()) as pool:  # normal_ releases the GIL
        list(pool.map(lambda job: draw(*job), chunks))
    for p in model.parameters():
        if p.dim() == 1:
            p.fill_(1.0)  # RMSNorm weights
    if config.pad_token_id is not None:
        model.model.embed_tokens.weight[config.pad_token_id].zero_()
    model.model.rotary_emb = LlamaRotaryEmbedding(config)  # its buffers are computed, not drawn


def drawn_chunk(seed: int, weight: int, chunk: int, numel: int, std: float) -> torch.Tensor:
    """Chunk `chunk` of a random weight, from its own generator: chunks may be drawn on any thread, in any order."""
    generator = torch.Generator().manual_seed((seed << 32) + (weight << 16) + chunk)
    return torch.empty(numel, dtype=torch.float32).normal_(0.0, std, generator=generator)


def random_input_ids(run: Config, vocab_size: int, micro_batches: int = 1) -> torch.Tensor:
    """Token ids drawn from the run's seed: micro_batches x batch_size sequences of seq_len tokens."""
    generator = torch.Generator().manual_seed(run.seed)
    return torch.randint(vocab_size, (micro_batches * run.batch_size, run.seq_len), generator=generator)  # (K*B, T)


# ---------------------------------------------------------------------------------------------- gpu and cpu inference
# The plain HF model resident on the GPU (gpu mode, the reference) or the CPU (cpu mode), timed.


def logits_of(model: LlamaForCausalLM, input_ids: torch.Tensor) -> torch.Tensor:  # one forward pass, no KV cache
    return model(input_ids, use_cache=False).logits  # (B, T, vocab)


def infer_resident(model, input_ids, device, run: Config) -> tuple[dict, torch.Tensor]:
    """gpu and cpu modes: the plain model on `device`, timed (on the CPU one run), with its peak GPU memory; logits."""
    if device.type != "cuda":
        ms, logits = median_ms(lambda: logits_of(model, input_ids), device, 0, 1)
        return {"time_ms": ms}, logits.cpu()
    model = copy.deepcopy(model).to(device)
    ids = input_ids.to(device)
    ms, logits = median_ms(lambda: logits_of(model, ids), device, run.warmup, run.repeat)
    return {"time_ms": ms, "peak_gpu_bytes": torch.cuda.max_memory_allocated(device)}, logits.cpu()


def timed(fn, device: torch.device) -> tuple[float, object]:
    """Milliseconds fn() takes on `device`, and its result."""
    if device.type != "cuda":
        t0 = time.perf_counter()
        out = fn()
        return (time.perf_counter() - t0) * 1e3, out
    torch.cuda.synchronize(device)  # from an idle GPU: no stream begins work before `start` is recorded
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    out = fn()
    end.record()  # fn's side-stream work is all waited for by the current stream, so `end` covers it
    end.synchronize()
    return start.elapsed_time(end), out


def median_ms(fn, device: torch.device, warmup: int, repeat: int) -> tuple[float, object]:
    """Median time of `repeat` runs after `warmup` untimed ones, and the last run's result."""
    times, out = [], None
    for r in range(warmup + repeat):
        out = None  # the last result is freed before the next run
        ms, out = timed(fn, device)
        times += [ms] if r >= warmup else []
    return statistics.median(times), out


# ----------------------------------------------------------------------------- streams, events and pinned host memory
# CUDA's streams and events, with stand-ins on the CPU so the CPU tests run the same code; pinned host buffers.


class InOrder:  # a CUDA stream or event's stand-in on the CPU, where ops run in order; tests swap it in to drop a wait
    def wait_event(self, event) -> None: ...  # nothing to wait for: the CPU runs every op in order
    def wait(self, stream=None) -> None: ...  # nothing to wait for
    def record(self, stream=None) -> None: ...  # nothing to record
    def synchronize(self) -> None: ...  # nothing to finish
    def query(self) -> bool:  # always done
        return True


def on_stream(stream):  # A `with` block that issues its work on `stream` (nothing to switch on the CPU)
    return torch.cuda.stream(stream) if isinstance(stream, torch.cuda.Stream) else contextlib.nullcontext()


def new_stream(device: torch.device):  # A side stream on a GPU; on the CPU, a stand-in that needs no ordering
    return torch.cuda.Stream(device) if device.type == "cuda" else InOrder()


def compute_stream(device: torch.device):  # The stream kernels run on now (the compute stream); its CPU stand-in
    return torch.cuda.current_stream(device) if device.type == "cuda" else InOrder()


def new_event(device: torch.device, blocking: bool = False):  # a CUDA event; blocking: a waiting thread sleeps
    return torch.cuda.Event(blocking=blocking) if device.type == "cuda" else InOrder()


class HostBuffer(mmap.mmap):
    """Exactly `nbytes` of zeroed host memory (torch's pinned allocator rounds up); its tensors must outlive copies."""

    def __new__(cls, nbytes: int):  # anonymous, private: zero-filled, page-aligned, in huge pages where asked
        return super().__new__(cls, -1, nbytes, flags=mmap.MAP_PRIVATE)

    def __init__(self, nbytes: int):
        with contextlib.suppress(AttributeError, OSError):  # a platform or kernel without transparent huge pages
            self.madvise(mmap.MADV_HUGEPAGE)  # before the first touch, which allocates the pages
        self.address = torch.frombuffer(self, dtype=torch.uint8).data_ptr()
        self.unregister = None

    def pin(self) -> None:
        """Page-lock the memory for the copy engines, its pages touched first (registering maps them in one thread)."""
        cudart = torch.cuda.cudart()
        torch.cuda.check_error(cudart.cudaHostRegister(self.address, len(self), 0))
        self.unregister = cudart.cudaHostUnregister

    def __del__(self):  # before the memory is unmapped: the driver must let go of its pages first
        if self.unregister is not None:
            self.unregister(self.address)


TOUCH_CHUNK = 2**26  # bytes: fresh host memory is first written by the rank's threads in chunks this size


def touch_pages(spans) -> None:
    """Zero each (address, bytes) span of fresh host memory a chunk a thread: together they map its pages faster."""
    chunks = [(a + i, min(TOUCH_CHUNK, n - i)) for a, n in spans for i in range(0, n, TOUCH_CHUNK)]
    with ThreadPoolExecutor(torch.get_num_threads()) as pool:
        list(pool.map(lambda chunk: ctypes.memset(chunk[0], 0, chunk[1]), chunks))


def host_zeros(numel: int, dtype: torch.dtype, pin: bool) -> torch.Tensor:
    """A zeroed flat CPU buffer, pinned when a GPU streams it. Allocate once: pinning is slow."""
    return host_zeros_each([numel], dtype, pin)[0]


def host_zeros_but(numels, dtype: torch.dtype, pin: bool, elsewhere) -> list[torch.Tensor]:
    """host_zeros_each of `numels`, but for the indices in `elsewhere` a meta tensor of that size: no memory here."""
    host = iter(host_zeros_each([n for i, n in enumerate(numels) if i not in elsewhere], dtype, pin))
    return [torch.empty(n, dtype=dtype, device="meta") if i in elsewhere else next(host) for i, n in enumerate(numels)]


def host_zeros_each(numels, dtype: torch.dtype, pin: bool) -> list[torch.Tensor]:
    """host_zeros of each of `numels`, touched and pinned by several threads at once, which the driver serves."""
    buffers = [HostBuffer(numel * dtype.itemsize) for numel in numels]
    if pin:
        touch_pages([(b.address, len(b)) for b in buffers])
        with ThreadPoolExecutor(torch.get_num_threads()) as pool:
            list(pool.map(HostBuffer.pin, buffers))
    return [torch.frombuffer(b, dtype=dtype) for b in buffers]  # each tensor keeps its buffer alive


# ------------------------------------------------------------------------------------- blocked and overlapped offload
# Each decoder layer's weights live in one flat pinned host buffer (ParamStore); a LayerStreamer copies them on a copy
# stream into a ring of GPU slots. blocked is depth 0: one slot, each copy issued as its unit is about to run (S1 and S2
# serialise copy and compute); overlapped copies depth units ahead into depth + 1 slots while the current one computes.
# Every synchronisation (the accelerations' too), [the lines naming it]. Streams: compute (the current one),
# copy (weights in), D2H (gradients out; blocked's is compute), gather (several GPUs'); threads: main, autograd's, Adam.
# Blocked against overlapped, in training: one slot, D2H on compute, holds_updates (the Adam after S11), wait_all (S4).
# A unit's copy first calls wait_written: CpuAdam's blocks the host (S4), StreamedAdam's the copy stream (S13).
#   S1   [585 619 2555 2557 4420] copied[s], CUDA event. Recorded by prefetch on copy (several GPUs: landed_in, on
#        gather); waited on by acquire on compute. Slot s is not read before its unit landed.
#   S2   [468 580 627 4420] freed[s], CUDA event. Recorded by release on compute; waited on by prefetch on copy. Slot s
#        is not overwritten while a unit reads it.
#   S3   [603] landed, CUDA event. Recorded by wait_copies on copy and gather; waited on by compute (keep_resident) or
#        timed's end. A ring is not freed, nor a time ended, under a copy.
#   S4   [578 895 1265 1275 1316] done[u], thread event. Cleared by CpuAdam.update, set by the worker once unit u's
#        update is written; waited on by wait_written (in prefetch) and wait_all (main: blocked's step ends there);
#        polled by written (CopyWindow issues ready copies first). A host source is not copied or saved mid-update.
#   S5   [863 1249 1785 2577] ready, CUDA event. Recorded by OffloadedTraining.send on compute after the unit's
#        backward; waited on by CpuAdam.send on D2H (StreamedAdam.take on s_adam): gradients read once all are written.
#   S6   [1249 2578 2580] summed, CUDA event (several GPUs): recorded on D2H after the reduce-scatter, S5's stand-in;
#        the next reduce-scatter waits for summed_taken, the last shard's S7 or S13 (consumed): `summed` is not
#        overwritten early.
#   S7   [864 1251 1310] landed[u], blocking CUDA event. Recorded by CpuAdam.send on D2H after the copy to pinned
#        memory; waited on by the worker (synchronize; next_job queries it). The CPU does not read gradients in flight.
#   S8   [864 1341] last_landed[b]: S7's (or S13's consumed), kept by Steppers.send for gradient buffer b; waited on by
#        wait_to_write on compute before a backward's first write of buffer b: not before its gradients left.
#   S9   [1287 1294] cond, condition. Notified by CpuAdam.update and close; waited on by next_job (worker): the jobs.
#   S10  [1172] GradientPool.free, queue. Given back by the worker after a step; taken by CpuAdam.send (few buffers).
#   S11  [889 4420 6816] host syncs (main): blocked's compute stream after the backward, so its Adam overlaps no GPU
#        work; loss.item() in the training loop: the step's end. A step is not timed unfinished.
#   S12  [1716] the GPU's Adam over resident units (ResidentUnits): no event, each steps on compute before later
#        kernels.
#   S13  [578 1799 1804 1811 1822 1829] the GPU's Adam over streamed state (StreamedAdam): consumed, landed[k],
#        stepped[k], left[k], written_back[u], which u's next copy waits on, on the copy stream (wait_written).
#   S14  [578 1854 1874 1881 1885] activation offload: written, offloaded[a]. No input moved or freed early.
#   S15  [2133] clipping: taken. The norm of the norms is not taken before every unit's norm.
#   S16  [2249 2267 2304 2305] the disk tier: settled, current, free, staged. No file read mid-write, no slot reused.


class OneProcess:  # a run's processes when it is one: rank 0 of 1 holds every unit whole, nothing to gather or wait for
    rank, world, local_rank, local_world = 0, 1, 0, 1
    several = False

    def shard_numel(self, numel: int) -> int:  # all of a flat buffer's elements, on an ALIGN boundary
        return -(-numel // ALIGN) * ALIGN

    def whole_numel(self, shard: torch.Tensor) -> int:  # the whole unit is here
        return shard.numel()

    def sum(self, value: torch.Tensor) -> torch.Tensor:  # no other rank's to add
        return value

    def gathered(self, shard: torch.Tensor, everywhere: bool = True) -> torch.Tensor:  # the whole unit already
        return shard

    def each(self, value) -> list:  # this process's alone
        return [value]

    def meet(self) -> None: ...  # nobody to wait for


ONE_PROCESS = OneProcess()
STAGING = 2**24  # elements: float32 masters cross PCIe in chunks this size, cast to the compute dtype on the GPU


@dataclass(frozen=True)
class FlatLayout:
    """Where each parameter of a module sits in its flat buffer (offsets in elements, each on an ALIGN boundary)."""

    names: tuple[str, ...]
    shapes: tuple[torch.Size, ...]
    offsets: tuple[int, ...]
    numel: int

    @staticmethod
    def of(module: nn.Module) -> FlatLayout:  # the layout of `module`'s parameters
        params = dict(module.named_parameters())
        sizes = [-(-p.numel() // ALIGN) * ALIGN for p in params.values()]  # each rounded up to a multiple of ALIGN
        offsets = tuple(sum(sizes[:i]) for i in range(len(sizes)))
        return FlatLayout(tuple(params), tuple(p.shape for p in params.values()), offsets, sum(sizes))

    def views(self, flat: torch.Tensor) -> dict[str, torch.Tensor]:  # each parameter as a view into `flat`, by name
        places = zip(self.names, self.shapes, self.offsets, strict=True)
        return {name: flat[off : off + shape.numel()].view(shape) for name, shape, off in places}

    def spans(self, start: int, end: int) -> list[tuple[str, int, int, int]]:
        """(name, offset, lo, hi) of each parameter with elements [lo, hi) of the flat buffer within [start, end)."""
        places = zip(self.names, self.shapes, self.offsets, strict=True)
        bounds = [(name, o, max(o, start), min(o + shape.numel(), end)) for name, shape, o in places]
        return [(name, o, lo, hi) for name, o, lo, hi in bounds if lo < hi]

    def fill(self, flat: torch.Tensor, get, start: int = 0) -> None:
        """Fill `flat`, the flat buffer from element `start` on (a rank's shard may cut a parameter), from get(name)."""
        for name, o, lo, hi in self.spans(start, start + flat.numel()):
            flat[lo - start : hi - start].copy_(get(name).reshape(-1)[lo - o : hi - o])

    def bind(self, module: nn.Module, flat: torch.Tensor, trainable: bool = False) -> nn.Module:
        """Make `module`'s parameters views into `flat`: filling `flat` then changes the weights it runs."""
        for name, view in self.views(flat).items():
            owner, _, leaf = name.rpartition(".")
            setattr(module.get_submodule(owner), leaf, nn.Parameter(view, requires_grad=trainable))
        return module


class ParamStore:
    """Inference's weights: a flat pinned host buffer a decoder layer, the CPU model's parameters views into them."""

    @torch.no_grad()
    def __init__(self, model: LlamaForCausalLM, pin: bool):
        layers = model.model.layers
        self.layout = FlatLayout.of(layers[0])
        self.dtype = next(layers[0].parameters()).dtype
        numel, start = self.held(self.layout.numel)
        self.flats = host_zeros_each([numel] * len(layers), self.dtype, pin)
        for layer, flat in zip(layers, self.flats, strict=True):
            self.layout.fill(flat, layer.get_parameter, start=start)
            self.share(layer, flat)

    def held(self, numel: int) -> tuple[int, int]:  # a layer's elements held here, and where they start: all of them
        return numel, 0

    def share(self, layer: nn.Module, flat: torch.Tensor) -> None:  # the model's parameters: views into the store
        self.layout.bind(layer, flat)

    def streamer(self, kinds, make_module, device, depth: int) -> LayerStreamer:  # over the layers' flat buffers
        return LayerStreamer(self.flats, kinds, make_module, self.dtype, device, depth)


class ReadOnly:  # the writer of sources nothing rewrites (inference's weights; training's: Steppers): copies go at once
    def wait_written(self, u: int) -> None: ...  # nothing to wait for

    def written(self, u: int) -> bool:  # always
        return True


@dataclass
class CopyWindow:
    """One pass's copies in run order: a position enters once compute is within `depth` of it, leaves once issued; a
    copy whose source is mid-update waits while ready ones behind it go, never past the window's end (its slot: S2)."""

    units: list[int]  # the streamed unit of each position, in the order the pass runs them (a unit may run twice)
    slots: list[int]  # each position's slot: where its unit already is, else the one run from least recently (S2)
    kept: set[int]  # the positions whose unit is still in its slot: no copy
    runs: list[tuple[int, int]]  # (unit, position) of each run in order; a resident unit's: the next streamed one's
    holds: list  # after the pass, the unit each slot holds
    recent: list[int]  # after the pass, the slots from the least recently run from
    run: int = 0  # the runs before this one are done
    entered: int = 0  # positions 0 .. entered - 1 have entered the window
    waiting: list[int] = dataclasses.field(default_factory=list)  # entered, not issued: their sources were not written

    @classmethod
    def over(cls, order, resident, holds: list, recent: list[int]) -> CopyWindow:
        """The window of a pass running `order`, `resident` aside, from slots holding `holds`, `recent` ordering them:
        a slot run from least recently was last run from at least len(slots) positions back, so its copy waits on
        a release already recorded (S2)."""
        units, slots, kept, runs, holds, recent = [], [], set(), [], list(holds), list(recent)
        for u in order:
            runs.append((u, len(units)))
            if u in resident:
                continue
            s = holds.index(u) if u in holds else recent[0]
            if holds[s] == u:
                kept.add(len(units))
            holds[s] = u
            recent.remove(s)
            recent.append(s)
            units.append(u)
            slots.append(s)
        return cls(units, slots, kept, runs, holds, recent)

    def next_run(self, u: int) -> int:
        """The position of unit u's next run; a pass run again without begin (inference repeats it) starts over."""
        later = (r for r in range(self.run, len(self.runs)) if self.runs[r][0] == u)
        r = next(later, None)
        if r is None:
            if self.kept:  # its first units run from where the last pass left them, which this one has moved
                raise RuntimeError("a pass begun from the slots' units cannot run again: begin it anew")
            self.entered, self.waiting = 0, []
            r = next(r for r, (v, _) in enumerate(self.runs) if v == u)
        self.run = r + 1
        return self.runs[r][1]

    def take(self, p: int, written, need: int | None = None) -> list[int]:
        """Positions up to p enter; those waiting to issue now: the written(u) ones in order, then `need` (to run)."""
        end = min(p + 1, len(self.units))
        self.waiting += range(self.entered, end)
        self.entered = max(self.entered, end)
        issue = [q for q in self.waiting if written(self.units[q])]
        if need in self.waiting and need not in issue:
            issue.append(need)
        self.waiting = [q for q in self.waiting if q not in issue]
        return issue


class LayerStreamer:
    """Streams units from flat host buffers through a ring of GPU slots, copying ahead (copies_ahead; 0: blocked)."""

    def __init__(self, sources, kinds, make_module, dtype, device, depth: int, copy_stream=None, writer=None):
        self.sources = sources  # each unit's flat host buffer
        self.kinds, self.make_module = kinds, make_module  # each unit's kind; make_module(kind, buffer) builds one
        self.dtype, self.device = dtype, device  # of the slots
        self.depth = depth  # units the copy stream runs ahead
        self.held = 1  # units a pass runs from at once (a segment's backward, beyond: its units)
        self.running = {}  # unit -> the slot it runs from, acquired and not yet released
        self.compute_stream = compute_stream(device)
        self.copy_stream = copy_stream or new_stream(device)
        self.writer = writer or ReadOnly()  # training: a unit's update rewrites its source, which a copy must not pass
        self.keep_resident(())

    def keep_resident(self, units, load=None) -> None:
        """Run `units` from GPU buffers of their own, filled by load(u), and stream the rest through a new ring."""
        self.wait_copies(self.compute_stream)  # copies into the old ring must land before its memory is reused
        self.buffers = self.modules = self.staging = None  # the old ring is freed before load runs
        flats = {u: load(u) for u in units}
        with torch.device("meta"):  # the modules own no memory: their parameters are views into the buffers
            self.resident = {u: self.make_module(self.kinds[u], flat) for u, flat in flats.items()}
        self.streamed = [u for u in range(len(self.sources)) if u not in self.resident]
        self.ahead = copies_ahead(self.depth, self.held)  # positions the copies run ahead
        n_slots = min(self.ahead + self.held, len(self.streamed))  # the copies ahead and the units held
        numel = max((self.whole_numel(self.sources[u]) for u in self.streamed), default=0)
        slots = [torch.empty(numel, dtype=self.dtype, device=self.device) for _ in range(n_slots)]
        cast = {self.sources[u].dtype for u in self.streamed} - {self.dtype}
        self.staging = torch.empty(min(numel, STAGING), dtype=cast.pop(), device=self.device) if cast else None
        kinds = dict.fromkeys(self.kinds[u] for u in self.streamed)
        with torch.device("meta"):
            self.modules = [{kind: self.make_module(kind, buf) for kind in kinds} for buf in slots]
        # copies write through .data, which has a version counter of its own: a graph kept over a unit's weights stays
        # valid while other units pass through its slot, as its backward copies the same weights back into it first
        self.buffers = [buf.data for buf in slots]
        self.copied = [new_event(self.device) for _ in range(n_slots)]
        self.freed = [new_event(self.device) for _ in range(n_slots)]
        self.window = None
        self.begin(range(len(self.sources)))

    @property
    def n_slots(self) -> int:  # how many streamed units fit on the GPU at once
        return len(self.buffers)

    def begin(self, order, current: bool = False) -> None:
        """The next pass runs `order`; current: the units the slots hold are current (backward right after forward)."""
        last = self.window if current and self.window else None  # the slots as the last pass left them
        holds, recent = (last.holds, last.recent) if last else ([None] * self.n_slots, range(self.n_slots))
        self.window = CopyWindow.over(order, self.resident, holds, recent)

    def prefetch(self, p: int) -> None:
        """Start copying the streamed unit at position p of the pass into its slot, on the copy stream."""
        u, s = self.window.units[p], self.window.slots[p]
        if p in self.window.kept:  # still in its slot from the last run
            return
        src = self.sources[u]
        dst = self.destination(s, src)
        self.writer.wait_written(u)  # S4, S13, S14: the host, or the copy stream, waits until the source is written
        with on_stream(self.copy_stream):
            self.copy_stream.wait_event(self.freed[s])  # S2: the slot's previous unit may still be running from it
            if src.dtype == self.dtype:
                dst.copy_(src, non_blocking=True)
            else:
                self.cast_in(src, dst)
            self.copied[s].record(self.copy_stream)  # S1: compute waits for it before it reads the slot
        self.landed_in(s, src)

    def whole_numel(self, src: torch.Tensor) -> int:  # the slot elements of the unit whose source is `src`
        return src.numel()

    def destination(self, s: int, src: torch.Tensor) -> torch.Tensor:  # where in slot s the copy of `src` lands
        return self.buffers[s][: src.numel()]

    def landed_in(self, s: int, src: torch.Tensor) -> None: ...  # nothing more to bring (several GPUs: gathered)

    def side_streams(self) -> tuple:  # the streams the copies run on
        return (self.copy_stream,)

    def wait_copies(self, stream) -> None:  # `stream` waits for every copy queued so far
        for side in self.side_streams():
            landed = new_event(self.device)
            landed.record(side)
            stream.wait_event(landed)  # S3

    def cast_in(self, src: torch.Tensor, dst: torch.Tensor) -> None:
        """Copy float32 `src` into the compute-dtype slot `dst` through the staging buffer, a chunk at a time."""
        for a in range(0, src.numel(), STAGING):
            n = min(STAGING, src.numel() - a)  # in order on the copy stream: a chunk is cast before the next lands
            self.staging[:n].copy_(src[a : a + n], non_blocking=True)
            dst[a : a + n].copy_(self.staging[:n])

    def acquire(self, u: int) -> nn.Module:
        """The module that runs unit u; a streamed unit also starts the copies up to `depth` positions ahead."""
        self.at = p = self.window.next_run(u)
        if u in self.resident:  # its copies ahead go in release, once its kernels are queued and more updates written
            return self.resident[u]
        self.issue_through(p + self.ahead, need=p)
        s = self.running[u] = self.window.slots[p]
        self.compute_stream.wait_event(self.copied[s])  # S1: unit u's weights must have landed before its kernels read
        return self.modules[s][self.kinds[u]]

    def release(self, u: int) -> None:
        """Unit u's kernels are issued: its slot frees once they run; a resident unit starts the next copies."""
        if u in self.resident:
            self.issue_through(self.at + self.ahead)
        else:
            self.freed[self.running.pop(u)].record(self.compute_stream)  # S2: the slot's next copy waits for it

    def issue_through(self, p: int, need: int | None = None) -> None:  # the window's copies up to p (CopyWindow.take)
        for q in self.window.take(p, self.written, need):
            self.prefetch(q)

    def written(self, u: int) -> bool:  # whether unit u's copy may be issued now: the writer's say
        return self.writer.written(u)


def copies_ahead(depth: int, held: int) -> int:
    """Positions a streamer's copies run ahead: depth, and where a pass holds several units at once, as many more."""
    return depth + (held - 1) * (depth > 0)


def layer_streamer(store: ParamStore, config: LlamaConfig, device: torch.device, depth: int, resident=()):
    """Inference's streamer of the decoder layers, the `resident` ones copied to the GPU once (one process only)."""

    def make_module(kind, buffer):  # a decoder layer, its weights views into `buffer` (a slot's or its own)
        return store.layout.bind(LlamaDecoderLayer(config, layer_idx=0), buffer).eval()

    streamer = store.streamer(["layer"] * len(store.flats), make_module, device, depth)
    if resident:
        streamer.keep_resident(resident, lambda i: store.flats[i].to(device))
    return streamer


class StreamedLayer(nn.Module):
    """Stands in for unit `index` of `strategy` in HF's forward, telling the module in its slot which layer it is."""

    def __init__(self, index: int, strategy, layer: int | None = None):
        super().__init__()
        self.index, self.strategy, self.layer = index, strategy, layer

    def forward(self, hidden_states: torch.Tensor, **kwargs) -> torch.Tensor:  # run unit `index` from its slot
        module = self.strategy.acquire(self.index)
        if self.layer is not None:
            module.self_attn.layer_idx = self.layer
        out = module(hidden_states, **kwargs)
        self.strategy.release(self.index)
        return out


def offloaded_model(model: LlamaForCausalLM, strategy, device: torch.device) -> LlamaForCausalLM:
    """`model` on `device` with StreamedLayer stand-ins, run from `strategy`, in place of its decoder layers."""
    layers = model.model.layers
    model.model.layers = nn.ModuleList()
    try:
        shell = copy.deepcopy(model).to(device)
    finally:
        model.model.layers = layers
    shell.model.layers = nn.ModuleList(StreamedLayer(i, strategy, layer=i) for i in range(len(layers)))
    return shell.train(model.training)


def mode_depth(mode: str, prefetch: int) -> int:  # units the copy stream runs ahead: blocked 0, overlapped --prefetch
    return prefetch if mode == "overlapped" else 0


def infer_offloaded(model: LlamaForCausalLM, store: ParamStore, device, depth: int, resident=()):
    """blocked and overlapped inference: HF's forward, streaming all but the `resident` layers; it and its streamer."""
    streamer = layer_streamer(store, model.config, device, depth, resident)
    return offloaded_model(model, streamer, device), streamer


# ------------------------------------------------------------------------------------ training: the autograd.Function
# Training streams every unit (embeddings, decoder layers, norm, head) through StreamedUnit, which keeps only the unit's
# inputs, recomputes it in the backward (unless the plan has room to keep its graphs) and sends its gradients to the
# host for the offloaded Adam.


@dataclass(frozen=True)
class Unit:  # a piece of the model streamed whole in training: the embeddings, a decoder layer, the norm or the head
    name: str  # its module's name in the HF model, so master weights map back to HF parameter names
    kind: str  # embed, layer, norm or head
    layout: FlatLayout


def unit_module(kind: str, config: LlamaConfig) -> nn.Module:
    """A module of this kind, built as LlamaForCausalLM builds its own (call it under torch.device('meta'))."""
    if kind == "embed":
        return nn.Embedding(config.vocab_size, config.hidden_size, config.pad_token_id)
    if kind == "layer":
        return LlamaDecoderLayer(config, layer_idx=0)
    if kind == "norm":
        return LlamaRMSNorm(config.hidden_size, eps=config.rms_norm_eps)
    return nn.Linear(config.hidden_size, config.vocab_size, bias=False)


def model_units(config: LlamaConfig) -> list[Unit]:  # the units in forward order: embeddings, layers, norm, head
    return list(units_of(config.to_json_string()))


@functools.cache
def units_of(config_json: str) -> tuple[Unit, ...]:
    """model_units of the config in `config_json`, made once: the plan asks for them many times."""
    config = LlamaConfig.from_dict(json.loads(config_json))
    with torch.device("meta"):
        layout = {kind: FlatLayout.of(unit_module(kind, config)) for kind in ("embed", "layer", "norm", "head")}
    layers = range(config.num_hidden_layers)
    names = ["model.embed_tokens", *(f"model.layers.{i}" for i in layers), "model.norm", "lm_head"]
    kinds = ["embed", *("layer" for _ in layers), "norm", "head"]
    return tuple(Unit(name, kind, layout[kind]) for name, kind in zip(names, kinds, strict=True))


def decoder_kwargs(model: LlamaForCausalLM, shape: tuple[int, int], dtype: torch.dtype, device) -> dict:
    """What HF's forward passes its decoder layers beside the hidden states (rotary tables, mask, positions)."""
    captured = {}

    class Recorder(nn.Module):  # a decoder layer that keeps the keyword arguments HF passes it, returns its input
        def forward(self, hidden_states, **kwargs):  # record the kwargs, pass the hidden states through
            captured.update(kwargs)
            return hidden_states

    base = model.model
    kept = base.layers, base.norm, base.rotary_emb
    base.layers, base.norm, base.rotary_emb = nn.ModuleList([Recorder()]), nn.Identity(), copy.deepcopy(kept[2])
    base.rotary_emb.to(device)
    try:
        with torch.no_grad():
            zeros = torch.zeros(*shape, model.config.hidden_size, dtype=dtype, device=device)
            base(inputs_embeds=zeros, use_cache=False)
    finally:
        base.layers, base.norm, base.rotary_emb = kept
    return captured


def objective(loss: torch.Tensor, micro_batches: int, scale: float) -> torch.Tensor:
    """One micro-batch's share of the mean loss times the loss scale, built here for every mode: the same gradients."""
    return loss / micro_batches * scale


class StreamedUnit(torch.autograd.Function):
    """One unit over every micro-batch: forward streams it in, keeping only its inputs; backward (on autograd's thread)
    recomputes it and sends its gradients to be stepped. `anchor` requires grad: the embeddings get a backward too."""

    @staticmethod
    def forward(ctx, trainer: OffloadedTraining, u: int, anchor: torch.Tensor, *xs: torch.Tensor):
        """Run unit u on every micro-batch from its slot; keep the inputs, or (u in trainer.keep) the whole graphs."""
        ctx.trainer, ctx.u = trainer, u
        module = trainer.streamer.acquire(u)
        if u in trainer.keep:  # its activations fit: the backward skips the recompute
            ctx.graphs = [trainer.unit_graph(u, module, x, k) for k, x in enumerate(xs)]
            outs = tuple(out.detach() for _, out in ctx.graphs)
        else:
            trainer.inputs.save(ctx, u, xs)
            outs = tuple(trainer.run_unit(u, module, x, k) for k, x in enumerate(xs))
        trainer.streamer.release(u)
        return outs

    @staticmethod
    def backward(ctx, *grad_outs):
        """Stream unit u in, sum its gradients over the micro-batches and send them; return the inputs' gradients."""
        trainer, u = ctx.trainer, ctx.u
        xs = ctx.graphs if u in trainer.keep else trainer.inputs.load(u, ctx.saved_tensors)  # may run other units
        module = trainer.streamer.acquire(u)
        ctx.graphs = None  # each graph freed as its backward runs
        views = trainer.grad_views(u)
        grads_in = unit_backward(trainer, u, module, xs, grad_outs, views)
        trainer.send(u, views)
        trainer.streamer.release(u)
        if u not in trainer.keep:
            trainer.inputs.release(u)
        return None, None, None, *grads_in  # none for trainer, u and anchor


class OffloadedTraining:
    """blocked and overlapped training: each unit streamed in for its forward and its backward, its gradients stepped on
    the host; blocked (depth 0) overlaps nothing. Beyond set its policies: steppers, inputs, scaling, clip, function."""

    def __init__(self, store: OffloadedAdam, config, dtype, device, depth: int, loss_function, kwargs):
        self.store = store
        self.units, self.ranks = store.units, store.ranks
        self.dtype, self.device = dtype, device  # where the units compute
        self.loss_function, self.kwargs = loss_function, kwargs  # for the head and the decoder layers
        self.vocab_size, self.hidden_size = config.vocab_size, config.hidden_size
        layouts = {unit.kind: unit.layout for unit in self.units}

        def make_module(kind, buffer):  # a slot's module of this kind, its trainable weights views into the buffer
            return layouts[kind].bind(unit_module(kind, config), buffer, trainable=True).eval()

        self.blocked = depth == 0
        if self.blocked and not store.pool.dedicated:
            raise ValueError("blocked steps every unit after the backward: give each unit a gradient buffer")
        self.d2h_stream = compute_stream(device) if self.blocked else new_stream(device)  # gradients leave on it
        self.steppers = self.make_steppers(store, dtype, device, self.d2h_stream)
        streamed = (store.weights, [u.kind for u in self.units], make_module, dtype, device, depth)
        self.streamer = self.make_streamer(*streamed, writer=self.steppers)
        self.anchor = torch.empty(0, device=device, requires_grad=True)
        self.inputs, self.scaling, self.clip = KeptInputs(), Unscaled(), Unscaled()
        self.function = StreamedUnit  # each unit's autograd Function (SegmentGraphs, beyond: SegmentUnit)
        self.keep = frozenset()  # the units whose graphs the forward keeps: no recompute (the plan's, beyond)

    def make_steppers(self, *args) -> Steppers:  # of Steppers' arguments (several GPUs: the gradients summed first)
        return Steppers(*args)

    def make_streamer(self, *args, **kwargs) -> LayerStreamer:  # of LayerStreamer's (several GPUs: shards gathered)
        return LayerStreamer(*args, **kwargs)

    @property
    def grad_norms(self) -> list[float]:  # each applied step's gradient norm before clipping (none without it)
        return self.clip.grad_norms

    def run_unit(self, u: int, module: nn.Module, x: torch.Tensor, k: int) -> torch.Tensor:
        """Unit u's forward on micro-batch k: hidden states out, or the loss for the head."""
        kind = self.units[u].kind
        if kind == "layer":
            return module(x, **self.kwargs)
        if kind == "head":  # the head's output is micro-batch k's loss, so no more than one batch of logits lives
            return self.loss_function(module(x), self.labels[k], vocab_size=self.vocab_size)
        return module(x)

    def unit_graph(self, u: int, module: nn.Module, x: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Unit u's forward on micro-batch k with its graph: (the input as a leaf, the output)."""
        return with_graph(lambda x: self.run_unit(u, module, x, k), x)

    def unit_grads(self, u: int, module: nn.Module, x, k: int, grad_out: torch.Tensor):
        """Back-propagate unit u on micro-batch k, recomputed from input x or through its kept graph (an (input,
        output) pair): (gradient of its input or None, parameter gradients)."""
        params = list(module.parameters())  # those the kept graph was built over: the same slot's module
        x, out = x if isinstance(x, tuple) else self.unit_graph(u, module, x, k)
        inputs = [x, *params] if x.requires_grad else params
        grads = torch.autograd.grad(out, inputs, grad_out)
        return (grads[0], grads[1:]) if x.requires_grad else (None, grads)

    def grad_views(self, u: int) -> list[torch.Tensor]:  # where unit u's gradients accumulate on the GPU, by parameter
        return list(self.units[u].layout.views(self.steppers.grads(u)).values())

    @property
    def holds_updates(self) -> bool:  # whether units step only once all gradients are in: blocked, loss scale, clipping
        return self.blocked or self.scaling.holds_updates or self.clip.holds_updates

    def send(self, u: int, views: list[torch.Tensor]) -> None:
        """Send unit u's gradients (views: grad_views(u)) to be stepped, unscaled and their norm taken where asked."""
        self.scaling.unscale(views)
        ready = new_event(self.device)
        ready.record(self.streamer.compute_stream)  # S5: the end of the unit's backward, for its stepper to wait on
        sent = self.steppers.send(u, ready)  # the D2H copy: the worker (S7) and the buffer's next writer (S8) wait
        self.clip.add(u, views, sent, self.d2h_stream)
        self.sent.append(u)
        if not self.holds_updates:
            self.steppers.update(u, 1.0)

    def step(self, micro_batches: list[torch.Tensor]) -> torch.Tensor:
        """One optimizer step over the micro-batches; returns the mean loss. overlapped's updates may still run."""
        if len(micro_batches) > 1 and self.store.grad_dtype != torch.float32:
            raise ValueError("micro-batches accumulate their gradients in float32: give the store float32 gradients")
        settings = self.store.hyper_parameters()  # param_groups' now: an LR scheduler may have set a new lr
        if settings != self.store.update.adam:
            self.wait_updates()  # the last step's updates, which may still run, keep the old settings
            self.store.update.adam = settings
        n = len(self.units)
        self.labels, self.sent = micro_batches, []
        self.streamer.begin(range(n))
        losses = self.function.apply(self, 0, self.anchor, *micro_batches)
        for u in range(1, n):
            losses = self.function.apply(self, u, self.anchor, *losses)
        self.streamer.begin(self.inputs.backward_order(n), current=True)  # the forward's last units are in the slots
        self.inputs.backward_begins(n)
        count = len(losses) * self.ranks.world  # the step's micro-batches, over every rank
        sum(objective(loss, count, self.scaling.scale) for loss in losses).backward()
        if self.blocked:
            self.streamer.compute_stream.synchronize()  # S11: the naive step's Adam starts after the whole backward
        if self.scaling.update() and self.holds_updates:
            multiplier = self.clip.multiplier()
            for u in self.sent:
                self.steppers.update(u, multiplier)
        if self.blocked:
            self.steppers.wait_all()  # S4: the naive step ends once the host's Adam is done
        self.store.step(queued=True)  # each unit's update queued as its gradients landed: the optimizer's step
        return mean_loss(losses, self.ranks)

    def state_dict(self, grads: bool = False, on_first: bool = False) -> dict[str, torch.Tensor]:
        """The float32 masters (grads: the gradients the steppers keep) by HF name on the CPU, after every update."""
        self.wait_updates()
        return self.store.named_flats([self.steppers.state(u, grads) for u in range(len(self.units))], on_first)

    def wait_updates(self) -> None:  # block until every update is done and written back
        self.steppers.wait_all()

    def finish(self) -> None:
        """Wait for the last updates and stop the CPU Adam worker, also where an update failed (its error raised)."""
        try:
            self.wait_updates()
        finally:
            self.steppers.cpu_adam.close()


def with_graph(forward, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """forward(x) with its graph, x made a leaf that needs its gradient where it can: (the leaf, the output)."""
    with torch.enable_grad():
        x = x.detach().requires_grad_(x.is_floating_point())
        return x, forward(x)


def unit_backward(trainer: OffloadedTraining, u: int, module: nn.Module, xs, grad_outs, views) -> list:
    """Unit u's recompute and backward over the micro-batches, gradients summed into `views`; returns the inputs'."""
    grads_in, first = [], None
    for k, (x, grad_out) in enumerate(zip(xs, grad_outs, strict=True)):
        grad_in, grads = trainer.unit_grads(u, module, x, k, grad_out)
        grads_in.append(grad_in)
        first = sum_grads(trainer, u, views, (k, len(xs)), grads, first)
        grads = None  # freed before the next recompute
    return grads_in


def sum_grads(trainer: OffloadedTraining, u: int, views, k_of: tuple[int, int], grads, first):
    """Sum micro-batch k's (k_of: k and the count) parameter gradients of unit u into `views`; returns micro-batch 0's
    where they wait, to be written with micro-batch 1's: that first write waits on S8, a recompute later."""
    k, count = k_of
    if k == 0 and count > 1:
        return grads
    if k <= 1:  # the buffer's first write: micro-batch 0's gradients
        trainer.steppers.wait_to_write(u, trainer.streamer.compute_stream)
        add_grads(views, grads if k == 0 else first, write=True)
    if k >= 1:
        add_grads(views, grads)
    return None


def add_grads(views: list[torch.Tensor], grads, write: bool = False) -> None:
    """Add a micro-batch's parameter gradients into a unit's gradient views (write: copy them, the first)."""
    for view, grad in zip(views, grads, strict=True):
        (view.copy_ if write else view.add_)(grad)


def mean_loss(losses, ranks: OneProcess = ONE_PROCESS) -> torch.Tensor:  # the losses' mean, every rank's, detached
    return ranks.sum(sum(loss.detach() for loss in losses)) / (len(losses) * ranks.world)


class KeptInputs:  # the plain path's saved inputs: on the GPU until the unit's backward
    held = 1  # units whose backwards run at once, held on the GPU (SegmentGraphs, beyond: a segment's)

    def save(self, ctx, u: int, xs) -> None:  # keep unit u's inputs for its backward
        ctx.save_for_backward(*xs)

    def load(self, u: int, saved: tuple) -> tuple:  # unit u's inputs, at its backward
        return saved

    def release(self, u: int) -> None: ...  # nothing to free

    def backward_begins(self, n_units: int) -> None: ...  # nothing to bring back

    def backward_order(self, n_units: int) -> list[int]:  # the units the backward runs, in order: each once, last first
        return list(reversed(range(n_units)))


class Unscaled:  # the plain path's loss scale and clipping: none, so each unit steps as its gradients land
    scale = 1.0
    holds_updates = False
    grad_norms = ()  # none taken

    def unscale(self, grads: list[torch.Tensor]) -> None: ...  # nothing to undo

    def update(self) -> bool:  # after the backward: the step may always be applied
        return True

    def add(self, u: int, views, sent, stream) -> None: ...  # no norm to take

    def multiplier(self) -> float:  # the gradients' multiplier for this step
        return 1.0


# ------------------------------------------------------------------------------------------------- the offloaded Adam
# torch.optim.Adam with its state on the host (OffloadedAdam), the worker that steps each unit as its gradients land.
# Host bytes a CPU step moves per parameter: a run's CompiledAdamUpdate 24 (master and moments, read and written) + the
# gradients (bfloat16 at one micro-batch of bfloat16, else float32: gradient_dtype) + the compute-dtype copy: 28 or 30.


@dataclass(frozen=True)
class Adam:  # torch.optim.Adam's hyper-parameters, with its meaning (L2 weight decay added to the gradient)
    lr: float = 1e-4
    betas: tuple[float, float] = (0.9, 0.999)
    eps: float = 1e-8
    weight_decay: float = 0.0

    def optimizer(self, params: list[torch.Tensor]) -> torch.optim.Adam:  # torch's over `params`, fused: far faster
        return torch.optim.Adam(params, self.lr, self.betas, self.eps, self.weight_decay, fused=True)


def torch_adam_step(adam: Adam, master, grads, exp_avg, exp_avg_sq, step: torch.Tensor) -> None:
    """Step `master` by `grads` (float32 both) with torch.optim.Adam's fused kernel on its device, state in place."""
    param = nn.Parameter(master)  # shares the master's memory
    param.grad = grads
    optimizer = adam.optimizer([param])
    optimizer.state[param] = {"step": step, "exp_avg": exp_avg, "exp_avg_sq": exp_avg_sq}  # steps it
    optimizer.step()


class AdamUpdate:
    """One unit's Adam step on the CPU: torch.optim.Adam's fused kernel, then a cast into the copy the GPU streams."""

    def __init__(self, adam: Adam, grad_dtype: torch.dtype, copy_dtype: torch.dtype | None, scaled: bool = False):
        self.adam = adam
        self.copy_dtype = copy_dtype
        self.scaled = scaled  # the gradients are multiplied first (clipping)
        self.grad_dtype = torch.float32  # the fused kernel's; `grad_dtype`: what a fused update would take

    @property
    def bytes_per_param(self) -> int:
        """Host bytes a step moves per parameter: master and moments read and written (24), float32 gradients (4), the
        master again and the copy (4 + 2 in bfloat16): 34; 42 with clipping, which scales the gradients (8). A run steps
        with CompiledAdamUpdate (beyond the line): 28 in its default, bfloat16 gradients of one micro-batch and copy."""
        copy = self.copy_dtype.itemsize + 4 if self.copy_dtype else 0
        rescale = 8 if self.scaled else 0
        return 24 + self.grad_dtype.itemsize + copy + rescale

    @torch.no_grad()
    def __call__(self, master, grads, exp_avg, exp_avg_sq, copy, step: torch.Tensor, multiplier: float = 1.0) -> None:
        """Step `master` by `grads` times `multiplier`; `step`: the unit's count, a tensor as torch keeps it."""
        if multiplier != 1.0:
            grads.mul_(multiplier)  # float32 here
        torch_adam_step(self.adam, master, grads, exp_avg, exp_avg_sq, step)
        if copy is not None:
            copy.copy_(master)


class OffloadedAdam(torch.optim.Optimizer):
    """torch.optim.Adam with each unit's float32 master, gradients and moments in flat host buffers; step_unit(u) steps
    one unit and rewrites the copy the GPU streams. Policies `moments` (HostMoments), `update` (AdamUpdate)."""

    def __init__(
        self,
        units: list[Unit],
        adam: Adam,
        pin: bool,
        grad_buffers=None,
        grad_dtype=torch.float32,
        copy_dtype=None,
        scaled_grads: bool = False,
        moments=None,
        ranks: OneProcess = ONE_PROCESS,
        update=AdamUpdate,
        on_device=None,
    ):
        self.units = units
        self.pin = pin  # whether the host buffers are pinned
        self.ranks = ranks  # each unit's state here is this rank's shard of it
        self.on_device = on_device or {}  # unit -> the device its master lives on alone (beyond: masters_to_device)
        numels = [self.ranks.shard_numel(u.layout.numel) for u in units]
        self.masters = host_zeros_but(numels, torch.float32, pin, self.on_device)
        self.copies = host_zeros_but(numels, copy_dtype, pin, self.on_device) if copy_dtype else None
        self.adam_moments = (moments or HostMoments)(numels)
        self.update = update(adam, grad_dtype, copy_dtype, scaled_grads)  # after the pinning, which a compile overlaps
        self.grad_dtype = self.update.grad_dtype  # what the update takes: float32 but where it compiled
        self.setup_s = {}  # seconds of set-up by part
        self.steps = [torch.zeros(()) for _ in units]
        self.unstarted = set(range(len(units)))  # units whose moments are not zeroed for their first step yet
        self.pool = GradientPool(numels, grad_buffers or len(units), pin, self.grad_dtype)
        self.grads = list(self.pool.buffers) if self.pool.dedicated else [None] * len(units)
        super().__init__(self.masters, dataclasses.asdict(adam))
        for master, step in zip(self.masters, self.steps, strict=True):
            self.state[master]["step"] = step  # the moments: moments_of(u)

    @property
    def weights(self) -> list[torch.Tensor]:  # what the GPU streams: the compute-dtype copies, else the float32 masters
        return self.copies or self.masters

    @property
    def moments(self) -> list:  # each unit's moments in host memory, None where the disk tier keeps them
        return self.adam_moments.buffers

    def take_grads(self, u: int) -> torch.Tensor:  # a pinned buffer for unit u's gradients; waits for a free one
        self.grads[u] = self.pool.take(u)[: self.masters[u].numel()]
        return self.grads[u]

    def hyper_parameters(self) -> Adam:  # Adam's settings in param_groups now (an LR scheduler's, or the user's)
        group = self.param_groups[0]
        return Adam(group["lr"], tuple(group["betas"]), group["eps"], group["weight_decay"])

    @torch.no_grad()
    def step(self, closure=None, queued: bool = False) -> None:
        """Every unit on its host gradients, as torch.optim.Adam.step steps all; `queued`: the trainer already did."""
        if queued:  # the training step's end, where torch's loop calls step(): an LR scheduler counts it
            return
        self.update.adam = self.hyper_parameters()
        for u in range(len(self.units)):
            self.step_unit(u)

    def state_dict(self, *_) -> dict:
        """Refused, as load_state_dict is: torch's would hold the step counts without the moments (host or disk)."""
        raise NotImplementedError("OffloadedAdam's state: save it with --checkpoint DIR, load it with --resume DIR")

    load_state_dict = state_dict

    def step_unit(self, u: int, multiplier: float = 1.0) -> None:
        """Unit u's Adam step (master, moments, copy) on its gradients times `multiplier`."""
        if u in self.unstarted:
            self.zero_moments([u])
        copy = self.copies[u] if self.copies else None
        try:
            moments = self.adam_moments.stage(u)
            self.update(self.masters[u], self.grads[u], *moments, copy, self.steps[u], multiplier)
        finally:  # a read or update that fails still frees the buffers: the backward waiting for one sees the error
            self.adam_moments.staged(u)
            if not self.pool.dedicated:
                self.pool.give(self.grads[u])
                self.grads[u] = None

    def moments_of(self, u: int) -> tuple[torch.Tensor, torch.Tensor]:  # unit u's moments after its updates
        return self.adam_moments.read(u)

    def close(self) -> None:  # free what the moments hold beside host memory (the disk tier's files)
        self.adam_moments.close()

    def zero_moments(self, units) -> None:  # zero the moments of `units` not started since load, as torch's Adam would
        starting = self.unstarted.intersection(units)
        self.adam_moments.zero(starting)
        self.unstarted -= starting

    @torch.no_grad()
    def load(self, model: LlamaForCausalLM | None) -> None:
        """Start from `model`'s weights (None: the masters as drawn) with fresh Adam state, as torch.optim.Adam does."""
        for u, (unit, master) in enumerate(zip(self.units, self.masters, strict=True)):
            if model is not None:  # this rank's shard starts at rank x its size in the unit's flat buffer
                unit.layout.fill(master, model.get_submodule(unit.name).get_parameter, self.ranks.rank * master.numel())
            if self.copies and u not in self.on_device:
                self.copies[u].copy_(master)
            self.steps[u].zero_()
        self.unstarted = set(range(len(self.units)))
        self.adam_moments.restart()

    def named_flats(self, flats: list[torch.Tensor] | None = None, on_first: bool = False) -> dict[str, torch.Tensor]:
        """The masters (or other flats: gradients) as float32 CPU tensors by HF name, gathered (on_first: to rank 0)."""
        fulls = (self.ranks.gathered(flat.cpu(), everywhere=not on_first) for flat in flats or self.masters)
        units = ((u.name, u.layout.views(full)) for u, full in zip(self.units, fulls, strict=True) if full is not None)
        return {
            f"{unit}.{name}": view.to("cpu", torch.float32, copy=True) for unit, v in units for name, view in v.items()
        }


class GradientPool:  # the pinned buffers gradients land in: one a unit (`dedicated`), or `count` shared, waited for
    def __init__(self, numels: list[int], count: int, pin: bool, dtype: torch.dtype):
        self.dedicated = count >= len(numels)
        sizes = numels if self.dedicated else [max(numels)] * count
        self.buffers = host_zeros_each(sizes, dtype, pin)
        self.free = queue.SimpleQueue()
        for buffer in self.buffers:
            self.free.put(buffer)
        self.waited_s = 0.0

    def take(self, u: int) -> torch.Tensor:  # unit u's own buffer, or the next shared one that is free
        if self.dedicated:
            return self.buffers[u]
        start = time.perf_counter()
        buffer = self.free.get()  # S10
        self.waited_s += time.perf_counter() - start
        return buffer

    def give(self, grads: torch.Tensor) -> None:  # a shared buffer (or a view at its start) is free again
        self.free.put(next(b for b in self.buffers if b.data_ptr() == grads.data_ptr()))


class HostMoments:  # the plain path's Adam moments: two float32 host buffers a unit, zeroed before its first step
    disk = None  # no disk tier

    def __init__(self, numels: list[int], elsewhere=frozenset()):
        self.buffers = [  # None for the units whose moments are kept `elsewhere` (the disk tier)
            None if u in elsewhere else (host_zeros(n, torch.float32, False), host_zeros(n, torch.float32, False))
            for u, n in enumerate(numels)
        ]
        self.pinned = set()  # units whose moments are pinned (pin_moments)

    def stage(self, u: int) -> tuple[torch.Tensor, torch.Tensor]:  # unit u's moments for its step
        return self.buffers[u]

    def staged(self, u: int) -> None: ...  # its step is done: nothing to write back

    def ready(self, u: int) -> bool:  # always: they are in memory
        return True

    read = stage  # unit u's moments after its updates: in place

    def zero(self, units) -> None:  # zero the moments of `units` for their first step (a first touch maps the pages)
        touch_pages([(m.data_ptr(), m.nbytes) for u in units for m in self.buffers[u]])

    def fill(self, u: int, fill) -> None:  # unit u's moments from a checkpoint: fill(exp_avg, exp_avg_sq) writes them
        fill(*self.buffers[u])

    def restart(self) -> None: ...  # a new mode's load: nothing staged

    def flush(self) -> None: ...  # nothing to write back

    def close(self) -> None: ...  # nothing to free


class HostState:  # a stepper of streamed units (CpuAdam, StreamedAdam): gradients in Steppers' buffer, state on host
    holds_grads = False  # the units' gradients accumulate in the gradient buffer of Steppers
    shares_buffer = True  # and so wait for the last gradients sent to leave it

    def __init__(self, store: OffloadedAdam):
        self.store = store

    def state(self, u: int, grads: bool = False) -> torch.Tensor:  # unit u's float32 master (or gradients), host's
        return self.store.grads[u] if grads else self.store.masters[u]

    def adam_state(self, u: int) -> tuple[torch.Tensor, ...]:  # unit u's float32 master, moments and step count
        return self.store.masters[u], *self.store.moments_of(u), self.store.steps[u]


class CpuAdam(HostState):
    """The plain path's stepper: gradients leave on D2H for pinned memory; a worker steps landed units, lowest first."""

    def __init__(self, store: OffloadedAdam, device: torch.device, d2h_stream):
        super().__init__(store)
        self.step = store.step_unit  # step(u, multiplier): unit u's update, run in the worker
        self.d2h_stream = d2h_stream  # the gradients leave on it
        self.landed = [new_event(device, blocking=True) for _ in store.units]
        self.done = [threading.Event() for _ in store.units]
        for event in self.done:
            event.set()
        self.pending = []  # (unit, landed event, multiplier), in the order submitted; None asks the worker to stop
        self.error = None
        self.busy_s = 0.0  # time spent in updates
        self.cond = threading.Condition()
        self.thread = threading.Thread(target=self.work, name="cpu-adam", daemon=True)
        self.thread.start()

    def send(self, u: int, grads: torch.Tensor, ready):
        """Copy the gradients to the host once `ready`; returns the event after which their memory may be reused."""
        host = self.store.take_grads(u)
        with on_stream(self.d2h_stream):
            self.d2h_stream.wait_event(ready)  # S5 (S6): the unit's backward must have written all its gradients
            host.copy_(grads, non_blocking=True)
            self.landed[u].record(self.d2h_stream)  # S7
        return self.landed[u]

    def update(self, u: int, multiplier: float) -> None:
        """Queue unit u's step, its gradients times `multiplier`; the worker runs it once its gradients land."""
        if not self.thread.is_alive():  # else the next wait for the update would never end
            raise RuntimeError("the CPU Adam's worker has stopped (the trainer finished): build a new trainer")
        self.done[u].clear()
        with self.cond:  # the multiplier travels with the job: a later step's must never reach these gradients
            self.pending.append((u, self.landed[u], multiplier))
            self.cond.notify()

    def wait_written(self, u: int) -> None:
        """Block until unit u's last update has written its master and copy; re-raise an error of the worker."""
        self.done[u].wait()  # S4
        if self.error:
            raise self.error

    def written(self, u: int) -> bool:  # whether unit u's last update is done (an error counts: wait_written raises it)
        return self.done[u].is_set()

    def wait_all(self) -> None:
        """Block until every queued update is done (then re-raise an error of the worker) and written back."""
        for done in self.done:
            done.wait()  # S4
        if self.error:
            raise self.error
        self.store.adam_moments.flush()

    def close(self) -> None:
        """Finish every update, then stop the worker, also after its error, which it re-raises; once."""
        if not self.thread.is_alive():
            return
        with self.cond:
            self.pending.append(None)  # last in the queue: the worker steps every queued unit first
            self.cond.notify()
        self.thread.join()  # S9: the worker took the stop, after every queued job
        self.wait_all()

    def next_job(self):
        """The next (unit, landed, multiplier) to step, sleeping until one is queued; None once close() asks to stop."""
        with self.cond:
            while not self.pending:
                self.cond.wait()  # S9
            if self.pending[0] is None:
                return None
            # the lowest of the units whose gradients landed and whose moments are in memory; else the oldest job
            ready = self.store.adam_moments.ready
            landed = [job for job in self.pending if job is not None and job[1].query() and ready(job[0])]
            job = min(landed, key=lambda job: job[0]) if landed else self.pending[0]
            self.pending.remove(job)
            return job

    def work(self) -> None:
        """The worker thread: step each unit as its job comes, and mark it done."""
        torch.set_flush_denormal(True)  # Adam's v goes denormal as the loss falls, slow on x86; sqrt(v) << eps anyway
        while (job := self.next_job()) is not None:
            u, landed, multiplier = job
            try:
                landed.synchronize()  # S7: the gradients must be in pinned memory before the CPU reads them
                start = time.perf_counter()
                self.step(u, multiplier)
                self.busy_s += time.perf_counter() - start
            except Exception as e:  # hand it to the main thread, which waits on `done`
                self.error = e
            self.done[u].set()  # S4


class Steppers:
    """Each unit's stepper (CpuAdam, or the GPU's Adam) and the GPU buffers gradients sum in; the streamer's writer. A
    gradient: written (after S8), ready (S5), copied out, landed (S7), stepped, done (S4); then the unit's next copy."""

    def __init__(self, store: OffloadedAdam, dtype: torch.dtype, device: torch.device, d2h_stream):
        self.store, self.dtype, self.device = store, dtype, device
        numel = max(map(store.ranks.whole_numel, store.masters))  # one buffer (SegmentGraphs: one a unit held)
        self.buffers = [torch.zeros(numel, dtype=store.grad_dtype, device=device)]  # zeroed: the padding is stepped
        self.last_landed = [InOrder()]  # the events after which each buffer may be overwritten: its last sent left
        self.cpu_adam = CpuAdam(store, device, d2h_stream)
        self.of = [self.cpu_adam] * len(store.units)  # unit -> its stepper

    def grads(self, u: int) -> torch.Tensor:
        """The GPU memory unit u's gradients accumulate in: the start of its gradient buffer, or a resident unit's."""
        stepper = self.of[u]
        if stepper.holds_grads:
            return stepper.grads(u)
        return self.buffers[u % len(self.buffers)][: self.store.ranks.whole_numel(self.store.masters[u])]

    def wait_to_write(self, u: int, stream) -> None:
        """Before unit u's backward writes its shared buffer, `stream` waits for the last gradients sent to leave it."""
        if self.of[u].shares_buffer:
            stream.wait_event(self.last_landed[u % len(self.buffers)])  # S8

    def send(self, u: int, ready) -> torch.Tensor:
        """Send unit u's gradients to its stepper once `ready` (its backward's end); returns what was sent."""
        grads, ready = self.to_send(u, ready)
        landed = self.of[u].send(u, grads, ready)
        if landed is not None:  # None: they stay on the GPU (a resident unit), and the last ones sent hold the buffer
            self.last_landed[u % len(self.buffers)] = landed
        return grads

    def to_send(self, u: int, ready) -> tuple:  # its gradients, once `ready` (several GPUs: summed first)
        return self.grads(u), ready

    def update(self, u: int, multiplier: float) -> None:  # unit u's Adam step: queued, or a resident unit's now
        self.of[u].update(u, multiplier)

    def wait_written(self, u: int) -> None:  # hold the streamer's next copy of unit u until its update is written
        self.of[u].wait_written(u)

    def written(self, u: int) -> bool:  # whether unit u's copy may be issued now, without waiting on the host
        return self.of[u].written(u)

    def state(self, u: int, grads: bool = False) -> torch.Tensor:  # unit u's float32 master (or gradients)
        return self.of[u].state(u, grads)

    def wait_all(self) -> None:  # block until every update is done and written back
        for stepper in dict.fromkeys(self.of):
            stepper.wait_all()


# ------------------------------------------------------------- the reference: the resident model and torch.optim.Adam
# gpu and cpu modes train the plain model with torch.optim.Adam: what every offloaded mode is compared with.


class ResidentTraining:
    """gpu and cpu modes: the plain model, torch.optim.Adam on float32 masters; recompute: HF's layer checkpointing."""

    def __init__(self, model, device, adam: Adam, clip=None, scaling=None, recompute: bool = False):
        self.model = copy.deepcopy(model).to(device)
        self.clip = clip  # --clip-grad-norm: torch.nn.utils.clip_grad_norm_ over every master's gradients
        self.grad_norms = []  # each applied step's, before clipping
        self.names = [name for name, _ in self.model.named_parameters()]
        self.params = [p.requires_grad_() for p in self.model.parameters()]  # the inference store froze the layers
        self.masters = [p.detach().float().clone() for p in self.params]
        self.optimizer = adam.optimizer(self.masters)
        self.scaling = scaling or Unscaled()  # float16's loss scale, beyond the assignment
        self.units = model_units(model.config)
        self.ranks = ONE_PROCESS
        if recompute:
            enable = getattr(self.model, "activation_checkpointing_enable", None)  # transformers 5.23's name
            (enable or self.model.gradient_checkpointing_enable)({"use_reentrant": False})
            for layer in self.model.model.layers:  # HF recomputes a layer in training mode only; its modules stay in
                layer.training = True  # eval mode, so nothing else changes

    def step(self, micro_batches: list[torch.Tensor]) -> torch.Tensor:
        """One step: each micro-batch's backward, gradients summed in float32, Adam on the masters; the mean loss."""
        losses = []
        for k, ids in enumerate(micro_batches):
            loss = self.model(ids, labels=ids, use_cache=False).loss
            objective(loss, len(micro_batches), self.scaling.scale).backward()
            for master, p in zip(self.masters, self.params, strict=True):
                master.grad = p.grad.float() if k == 0 else master.grad.add_(p.grad)
                p.grad = None
            losses.append(loss.detach())
        self.scaling.unscale([m.grad for m in self.masters])
        if self.scaling.update():
            if self.clip is not None:
                self.grad_norms.append(torch.nn.utils.clip_grad_norm_(self.masters, self.clip).item())
            self.optimizer.step()
            with torch.no_grad():
                for p, master in zip(self.params, self.masters, strict=True):
                    p.copy_(master)
        return mean_loss(losses)

    def finish(self) -> None: ...  # nothing runs in the background

    def wait_updates(self) -> None: ...  # each step is done when step() returns

    def state_dict(self, tensors: list[torch.Tensor]) -> dict[str, torch.Tensor]:  # CPU copies of `tensors` by HF name
        return {name: t.detach().to("cpu", copy=True) for name, t in zip(self.names, tensors, strict=True)}


# ------------------------------------------------------------------------------------------------ Table 1 and Table 2
# The memory and time tables, a row a mode.


def fmt(x, spec: str) -> str:  # format(x, spec), or an empty cell for None
    return "" if x is None else format(x, spec)


def gib(x) -> str:  # bytes as GiB with two decimals, or an empty cell
    return fmt(None if x is None else x / GiB, ".2f")


def cell(field: str, spec: str = "", of=lambda value: value):
    """A column's cell: a result's `field` in the format `spec` (of(value) first), yes or NO for a bool."""

    def text(r: dict) -> str:  # the cell of result `r`
        value = r.get(field)
        return (
            ("yes" if value else "NO") if isinstance(value, bool) else fmt(None if value is None else of(value), spec)
        )

    return text


PEAK_GPU = ("peak GPU (GiB)", lambda r: gib(r.get("peak_gpu_bytes")) or "0 (runs on the CPU)")  # the tables' columns
PEAK_HOST = ("peak host RSS (GiB)", lambda r: gib(r.get("peak_host_bytes")))
TIME, STEP = ("time (ms)", cell("time_ms", ".1f")), ("step (ms)", cell("time_ms", ".1f"))
LOGITS = ("logits == gpu:", cell("equal_to_gpu"))
CHECKS = [("loss first -> last:", lambda r: f"{r['losses'][0]:.4f} -> {r['losses'][-1]:.4f}")]
CHECKS += [("grads == gpu:", cell("grads_equal_to_gpu")), ("step-1 masters ~ gpu:", cell("masters_close_to_gpu"))]

TABLES = {  # part: its tables as (title, columns), a column (header, cell of a mode's result); "x:" is centred
    "inference": [
        ("Table 1: peak GPU memory, inference", [PEAK_GPU]),
        ("Table 2: time per forward pass, inference", [TIME, LOGITS]),
    ],
    "training": [
        ("Table 1 (training): peak memory per step", [PEAK_GPU, PEAK_HOST]),
        ("Table 2 (training): time per step", [STEP, *CHECKS]),
    ],
}
MODE_NAMES = {  # a row's label: the modes, and gpu mode trained with the offloaded modes' recomputation
    "gpu": "w/o offload (gpu)",
    "gpu_recomputed": "w/o offload, layers recomputed (gpu)",
    "blocked": "blocked offload",
    "overlapped": "overlapped offload",
    "cpu": "cpu",
}


def markdown(title: str, columns: list[tuple[str, str]], rows: list[tuple[str, dict]], cells) -> list[str]:
    """A markdown table of columns (header, alignment), `cells(label, r)` a row's cells, OOM where it did not fit."""
    header = "| mode | " + " | ".join(h for h, _ in columns) + " |"
    lines = [title, "", header, "|---|" + "|".join(align for _, align in columns) + "|"]
    for label, r in rows:
        row = ["OOM"] + [""] * (len(columns) - 1) if r.get("oom") else cells(label, r)
        lines.append(f"| {label} | " + " | ".join(row) + " |")
    return lines + [""]


def tables(results: dict, run: Config, layout: dict = TABLES, model: str | None = None) -> str:
    """Table 1 (memory) and Table 2 (time) of inference, then of training, a row a mode (results[mode][part])."""
    what = {
        "inference": f"{model or run.preset}, {run.dtype}, {run.batch_size}x{run.seq_len} = {run.tokens} tokens",
        "training": f"{run.dtype}, {run.grad_accum}x{run.batch_size}x{run.seq_len} tokens per step, Adam",
    }
    labels = dict(MODE_NAMES, overlapped=f"{MODE_NAMES['overlapped']} (prefetch {run.prefetch})")
    lines = []
    for part in [part for part, wanted in (("inference", run.inference), ("training", run.train)) if wanted]:
        rows = [(labels[mode], results[mode][part]) for mode in MODE_NAMES if part in results.get(mode, {})]
        for title, columns in layout[part]:
            aligned = [(h.removesuffix(":"), ":---:" if h.endswith(":") else "---:") for h, _ in columns]
            cells = functools.partial(lambda columns, label, r: [cell(r) for _, cell in columns], columns)
            lines += markdown(f"{title} ({what[part]})", aligned, rows, cells)
    return "\n".join(lines)


# === Beyond the assignment ===


# -------------------------------------------------------------------------------------------------- the compiled Adam
# Adds: the CPU Adam's update as one pass over host memory, fused by torch.compile (adam_update), compiled early.
# Turned on: by default, where it compiles (AdamUpdate otherwise). Plugs into: OffloadedAdam's `update`.


ADAM_SPARE_CORES = 1  # cores the CPU Adam leaves to the main thread, which drives the GPU meanwhile
EARLY_COMPILES = {}  # compiled_adam_update's arguments -> its call started in the background by start_adam_compile


@contextlib.contextmanager
def without_isa_probes():
    """Report AVX-512 bf16 and VNNI absent while the update compiles: the update uses neither, and probing is slow."""
    probes = ("_is_avx512_bf16_supported", "_is_vnni_supported")  # torch.cpu's private probes (torch 2.11 to 2.13)
    saved = {name: getattr(torch.cpu, name) for name in probes if hasattr(torch.cpu, name)}
    try:
        vars(torch.cpu).update(dict.fromkeys(saved, lambda: False))
        yield
    finally:
        vars(torch.cpu).update(saved)


def adam_update(master, grads, exp_avg, exp_avg_sq, copy, scalars, scaled: bool = False) -> None:
    """torch.optim.Adam's step of one unit, for torch.compile to fuse into one pass over memory (`copy`: rounded)."""
    grads = grads.float() * scalars[7] if scaled else grads.float()
    grads = grads + master * scalars[6]
    exp_avg_new = exp_avg + (grads - exp_avg) * scalars[0]  # exp_avg.lerp_(grads, 1 - beta1)
    exp_avg_sq_new = exp_avg_sq * scalars[1] + scalars[2] * grads * grads
    master_new = master + scalars[5] * exp_avg_new / (exp_avg_sq_new.sqrt() / scalars[3] + scalars[4])
    exp_avg.copy_(exp_avg_new)
    exp_avg_sq.copy_(exp_avg_sq_new)
    master.copy_(master_new)
    if copy is not None:
        copy.copy_(master_new)  # rounded to nearest even, as the GPU casts


def adam_scalars(adam: Adam, step: int, multiplier: float = 1.0) -> torch.Tensor:  # adam_update's, as torch rounds
    beta1, beta2 = adam.betas
    step_size = -adam.lr / (1 - beta1**step)
    values = [1 - beta1, beta2, 1 - beta2, math.sqrt(1 - beta2**step), adam.eps, step_size, adam.weight_decay]
    return torch.tensor([*values, multiplier], dtype=torch.float32)


@functools.cache
def compiled_adam_update(grad_dtype: torch.dtype, copy_dtype: torch.dtype | None, scaled: bool = False):
    """adam_update built by inductor's C++ backend and run once, so no timed step compiles it; None if it cannot be."""
    n = 2**24  # inductor builds a serial loop for a size that looks small, and reuses it for any size
    # cpp_wrapper: no GIL; cpp.threads: a static OpenMP loop runs at its slowest thread's pace; vec_isa_ok: no ISA probe
    threads = max(1, torch.get_num_threads() - ADAM_SPARE_CORES)
    options = {"cpp_wrapper": True, "cpp.threads": threads, "cpp.vec_isa_ok": True, "compile_threads": 1}
    t0 = time.perf_counter()
    try:
        update = functools.partial(adam_update, scaled=scaled)
        compiled = torch.compile(update, dynamic=True, fullgraph=True, options=options)
        master, grads = torch.zeros(n), torch.zeros(n, dtype=grad_dtype)
        copy = None if copy_dtype is None else torch.zeros(n, dtype=copy_dtype)
        with torch.no_grad(), without_isa_probes():
            compiled(master, grads, torch.zeros(n), torch.zeros(n), copy, adam_scalars(Adam(), 1))
    except Exception as e:  # inductor's errors have no common class; the fallback is exact too
        reason = f"{type(e).__name__}: {str(e)[:200]}"
        log(f"CPU Adam: no fused update ({reason}); using torch.optim.Adam(fused=True) and a cast, float32 gradients")
        return None
    log(f"CPU Adam: fused update compiled in {time.perf_counter() - t0:.1f} s")
    return compiled


def start_adam_compile(grad_dtype: torch.dtype, copy_dtype: torch.dtype | None, scaled: bool) -> None:
    """Compile the update on a thread while the host state pins; after the model's build, which sets the dtype."""
    key = (grad_dtype, copy_dtype, scaled)
    if key not in EARLY_COMPILES:
        pool = ThreadPoolExecutor(1, thread_name_prefix="adam-compile")
        EARLY_COMPILES[key] = pool.submit(compiled_adam_update, *key)
        pool.shutdown(wait=False)  # the thread ends with its one job


class CompiledAdamUpdate(AdamUpdate):
    """AdamUpdate in one pass over memory (adam_update compiled), gradients in their dtype; else AdamUpdate's."""

    def __init__(self, adam: Adam, grad_dtype: torch.dtype, copy_dtype: torch.dtype | None, scaled: bool = False):
        super().__init__(adam, grad_dtype, copy_dtype, scaled)
        early = EARLY_COMPILES.get((grad_dtype, copy_dtype, scaled))
        self.compiled = early.result() if early else compiled_adam_update(grad_dtype, copy_dtype, scaled)
        if self.compiled:
            self.grad_dtype = grad_dtype

    @property
    def bytes_per_param(self) -> int:
        """Host bytes a step moves per parameter: master and moments read and written (24), the gradients, the copy:
        28 in a run's default (bfloat16 gradients of one micro-batch, a bfloat16 copy), 30 in float32's sums."""
        if self.compiled is None:
            return super().bytes_per_param
        return 24 + self.grad_dtype.itemsize + (self.copy_dtype.itemsize if self.copy_dtype else 0)

    @torch.no_grad()
    def __call__(self, master, grads, exp_avg, exp_avg_sq, copy, step: torch.Tensor, multiplier: float = 1.0) -> None:
        """AdamUpdate's step in one pass; `multiplier` is heeded where the update was built `scaled` (clipping)."""
        if self.compiled is None:
            return super().__call__(master, grads, exp_avg, exp_avg_sq, copy, step, multiplier)
        step += 1
        self.compiled(master, grads, exp_avg, exp_avg_sq, copy, adam_scalars(self.adam, int(step.item()), multiplier))


# ----------------------------------------------------------------------------------------------------- the GPU's Adam
# Adds: units resident and stepped on the GPU (ResidentUnits), and streamed ones stepped there over state streamed from
# the host (StreamedAdam); the masters of units resident in every mode on the GPU alone (masters_to_device). Turned on:
# overlapped under --max-gpu-memory, --resident-layers, --gpu-adam-share (the plan's choice). Plugs into:
# Steppers.assign, LayerStreamer.keep_resident, OffloadedAdam.on_device.


GPU_ADAM_SHARE = 0.3  # of the streamed parameters, the default share of the GPU's Adam over streamed state
GPU_ADAM_CHUNK = 2**23  # parameters: the state the GPU's Adam streams crosses PCIe in chunks this size


def pin_moments(moments: HostMoments, u: int, pin: bool) -> None:  # unit u's moments into pinned memory, once
    if u not in moments.pinned:
        moments.buffers[u] = tuple(host_zeros(m.numel(), torch.float32, pin).copy_(m) for m in moments.buffers[u])
        moments.pinned.add(u)


def place_on_gpu(trainer: OffloadedTraining, resident=(), gpu_adam=(), own_grads: bool = True) -> None:
    """Keep `resident` units on the GPU (ResidentUnits); step `gpu_adam` ones over streamed state (StreamedAdam)."""
    held = "float16 or clipping steps once every gradient is in"
    if trainer.holds_updates and gpu_adam:
        raise ValueError(f"{held}: the streamed units stay on the CPU Adam")
    if trainer.holds_updates and resident and not own_grads:
        raise ValueError(f"{held}: resident units need their own gradients")
    if set(resident) & set(gpu_adam):
        raise ValueError("resident units are stepped on the GPU already: give the GPU's Adam streamed units only")
    if resident and trainer.ranks.several:
        raise ValueError("several ranks keep only their shards: every unit streams, none is resident")
    steppers, streamer, store = trainer.steppers, trainer.streamer, trainer.store
    held = len(steppers.buffers)  # units whose gradients sum at once
    steppers.buffers = None  # freed before the resident units' state is allocated
    numels = [store.ranks.whole_numel(m) for m in store.masters]
    streamed = max((n for u, n in enumerate(numels) if u not in resident), default=0)
    sharing = 0 if own_grads else max((numels[u] for u in resident), default=0)
    words = max(-(-streamed * store.grad_dtype.itemsize // 4), sharing)
    shared = [torch.zeros(words, dtype=torch.float32, device=trainer.device) for _ in range(held)]  # padding stepped
    buffers = [part.view(store.grad_dtype)[:streamed] for part in shared]  # the streamed units', resident ones share
    on_gpu = ResidentUnits(store, trainer.dtype, trainer.device, None if own_grads else shared)
    streamer.keep_resident(resident, on_gpu.load)
    streamed = StreamedAdam(store, gpu_adam, trainer.device, streamer.copy_stream, own_grads)
    chosen = {**dict.fromkeys(resident, on_gpu), **dict.fromkeys(gpu_adam, streamed)}
    steppers.buffers, steppers.of = buffers, [chosen.get(u, steppers.cpu_adam) for u in range(len(steppers.of))]


def masters_to_device(store: OffloadedAdam) -> None:
    """The masters of the units resident in every mode (store.on_device) onto their device, zeroed, for load or
    draw_masters to fill: a mode's start. The host holds a meta tensor in their place, and no copy."""
    for u, device in store.on_device.items():
        replace_master(store, u, torch.zeros(store.masters[u].numel(), device=device))


def masters_off_device(store: OffloadedAdam) -> None:  # a mode's end: their device memory given back for the next
    for u in store.on_device:
        replace_master(store, u, torch.empty(store.masters[u].numel(), device="meta"))


def replace_master(store: OffloadedAdam, u: int, master: torch.Tensor) -> None:  # unit u's, in param_groups too
    store.state[master] = store.state.pop(store.masters[u])
    store.param_groups[0]["params"][u] = store.masters[u] = master


class ResidentUnit:
    """One unit resident on the GPU: weights, float32 master and Adam moments; `grads` may be memory the units share."""

    def __init__(self, store: OffloadedAdam, u: int, dtype: torch.dtype, grads: torch.Tensor):
        on_device = u in store.on_device  # its master lives there: the store's own, aliased
        self.master = store.masters[u] if on_device else store.masters[u].to(grads.device, copy=True)
        self.weights = self.master if dtype == torch.float32 else self.master.to(dtype)  # what the GPU computes with
        resumed = bool(store.steps[u])  # else the store's moments are not written yet: they start at zero
        self.moments = tuple(
            m.to(grads.device, copy=True) if resumed else torch.zeros_like(self.master) for m in store.moments_of(u)
        )
        self.steps = store.steps[u].to(grads.device, copy=True)  # float32 beside the master, as the fused kernel has it
        self.update = store.update  # its `adam`: the settings of the step, as the store's param_groups set them
        self.grads = grads  # float32, alive from the unit's backward to its step

    @torch.no_grad()
    def step(self, multiplier: float = 1.0) -> None:  # Adam on the master, gradients times `multiplier`; then weights
        if multiplier != 1.0:
            self.grads.mul_(multiplier)
        torch_adam_step(self.update.adam, self.master, self.grads, *self.moments, self.steps)
        if self.weights is not self.master:
            self.weights.copy_(self.master)


class ResidentUnits:
    """Units resident on the GPU, each stepped after its backward on the compute stream, before the next reuses
    `shared`."""

    holds_grads = True  # the units' gradients are in memory of this stepper's (`shared`: of the gradient buffer's)

    def __init__(self, store: OffloadedAdam, dtype: torch.dtype, device: torch.device, shared: list | None):
        self.store, self.dtype, self.device = store, dtype, device
        self.shared = shared  # float32 gradient buffers, unit u's the one at u % len, or None: each its own
        self.shares_buffer = shared is not None  # then its backward waits for the last gradients sent to leave it
        self.units = {}  # unit -> its ResidentUnit

    def load(self, u: int) -> torch.Tensor:  # unit u's state onto the GPU; returns its compute-dtype weights
        n = self.store.masters[u].numel()
        if self.shares_buffer:
            grads = self.shared[u % len(self.shared)][:n]
        else:
            grads = torch.zeros(n, dtype=torch.float32, device=self.device)
        self.units[u] = ResidentUnit(self.store, u, self.dtype, grads)
        return self.units[u].weights

    def grads(self, u: int) -> torch.Tensor:  # unit u's float32 gradients on the GPU
        return self.units[u].grads

    def send(self, u: int, grads: torch.Tensor, ready) -> None: ...  # nothing leaves the GPU

    def update(self, u: int, multiplier: float) -> None:  # unit u's Adam step, now, on the compute stream
        self.units[u].step(multiplier)  # S12: stream order puts it before every later kernel

    def wait_written(self, u: int) -> None: ...  # never streamed

    def written(self, u: int) -> bool:  # never streamed
        return True

    def state(self, u: int, grads: bool = False) -> torch.Tensor:  # unit u's float32 master (or gradients) on the GPU
        return self.units[u].grads if grads else self.units[u].master

    def adam_state(self, u: int) -> tuple[torch.Tensor, ...]:  # unit u's float32 master, moments and step count
        unit = self.units[u]
        return unit.master, *unit.moments, unit.steps

    def wait_all(self) -> None: ...  # its steps run on the compute stream, which every read of the state waits for


class StreamedAdam(HostState):
    """The GPU's fused Adam for streamed units whose state stays on the host, crossing PCIe a chunk at a time in two
    slots: s_in brings chunk k in (after left[k]), s_adam steps it (after landed[k]), s_out sends it back (S13)."""

    def __init__(self, store: OffloadedAdam, units, device, copy_stream, keep_first_grads: bool = False):
        if keep_first_grads and units and not store.pool.dedicated:
            raise ValueError("the first step's gradients stay on the host: give each unit a gradient buffer")
        super().__init__(store)
        self.units, self.device = tuple(units), device
        self.copy_stream = copy_stream  # the weights' copies: a unit's next one waits for its state to be written
        self.keep_first_grads = keep_first_grads  # the first step's gradients go to the host, to compare them
        for u in self.units:
            pin_moments(store.adam_moments, u, store.pin)  # for the copy engines, a unit at a time
        numel = max((store.masters[u].numel() for u in self.units), default=0)
        self.buffer = torch.empty(numel, dtype=store.grad_dtype, device=device)  # the unit's gradients, taken
        self.slots = [self.staging_slot(min(numel, GPU_ADAM_CHUNK)) for _ in range(2)]
        self.s_in, self.s_adam, self.s_out = (new_stream(device) for _ in range(3))
        self.landed, self.stepped, self.left = ([new_event(device) for _ in range(2)] for _ in range(3))
        self.written_back = {u: new_event(device, blocking=True) for u in self.units}

    def staging_slot(self, chunk: int) -> tuple:  # a chunk's float32 master and moments, and its copy where kept
        copies = self.store.copies
        copy = torch.empty(chunk, dtype=copies[0].dtype, device=self.device) if copies else None
        return (*(torch.empty(chunk, device=self.device) for _ in range(3)), copy)

    def chunks(self, u: int):  # (slot, start, length) of unit u's chunks, in order, taking the two slots in turn
        n, chunk = self.store.masters[u].numel(), self.slots[0][0].numel()
        return [(i % 2, lo, min(chunk, n - lo)) for i, lo in enumerate(range(0, n, chunk))]

    def host_state(self, u: int, lo: int, n: int) -> tuple:  # unit u's master, moments and copy (or None) from lo, n
        copy = self.store.copies[u][lo : lo + n] if self.store.copies else None
        return self.store.masters[u][lo : lo + n], *(m[lo : lo + n] for m in self.store.moments[u]), copy

    def copy_in(self, u: int, k: int, lo: int, n: int, fresh: bool = False) -> None:
        """Unit u's chunk into slot k, on the current stream: master, and moments unless `fresh` (zeroed instead)."""
        master, exp_avg, exp_avg_sq, _ = self.host_state(u, lo, n)
        p, m, v, _ = self.slots[k]
        p[:n].copy_(master, non_blocking=True)
        for dst, src in ((m, exp_avg), (v, exp_avg_sq)):
            if fresh:
                dst[:n].zero_()  # a unit's first step starts its moments at zero, as torch.optim.Adam does
            else:
                dst[:n].copy_(src, non_blocking=True)

    def send(self, u: int, grads: torch.Tensor, ready):  # take unit u's gradients; the first step's to the host too
        first = self.keep_first_grads and not self.store.steps[u]
        return self.take(u, grads, ready, self.store.take_grads(u) if first else None)

    def take(self, u: int, grads: torch.Tensor, ready, host: torch.Tensor | None = None):
        """Copy unit u's gradients, once `ready`, into the buffer (and `host`); the event after which they may go."""
        n, consumed = grads.numel(), new_event(self.device)
        with on_stream(self.s_adam):
            self.s_adam.wait_event(ready)  # S5: the unit's backward must have written all its gradients
            self.buffer[:n].copy_(grads)
            consumed.record(self.s_adam)
            if host is not None:  # before the next unit's gradients overwrite the buffer, in order on this stream
                host.copy_(self.buffer[:n], non_blocking=True)
        return consumed

    def update(self, u: int, multiplier: float) -> None:
        """Queue unit u's Adam step chunk by chunk (multiplier 1: clipping and float16 keep streamed units on CPU)."""
        steps = self.store.steps[u]
        fresh, done = not steps, float(steps)  # steps done: the fused kernel counts this one in
        steps += 1  # this count lives on the host: only the thread that runs the backward issues this unit's steps
        for k, lo, n in self.chunks(u):
            with on_stream(self.s_in):
                self.s_in.wait_event(self.left[k])  # S13: the slot's chunk before must be back on the host
                self.copy_in(u, k, lo, n, fresh)
                self.landed[k].record(self.s_in)
            p, m, v, copy = (t[:n] if t is not None else None for t in self.slots[k])
            with on_stream(self.s_adam):  # after take: the unit's gradients are in the buffer
                self.s_adam.wait_event(self.landed[k])  # S13: the chunk's state must have landed
                step = torch.full((), done, device=p.device)
                torch_adam_step(self.store.update.adam, p, self.buffer[lo : lo + n].float(), m, v, step)
                if copy is not None:
                    copy.copy_(p)  # rounded to nearest even, as the CPU Adam writes the copy
                self.stepped[k].record(self.s_adam)
            with on_stream(self.s_out):
                self.s_out.wait_event(self.stepped[k])  # S13: the chunk must be stepped before it leaves
                self.copy_out(u, k, lo, n)
                self.left[k].record(self.s_out)
        self.written_back[u].record(self.s_out)

    def copy_out(self, u: int, k: int, lo: int, n: int) -> None:  # slot k's chunk into u's host state, this stream
        for dst, src in zip(self.host_state(u, lo, n), self.slots[k], strict=True):
            if dst is not None:
                dst.copy_(src[:n], non_blocking=True)

    def wait_written(self, u: int) -> None:  # the next forward's copy of unit u waits on the copy stream, not the host
        self.copy_stream.wait_event(self.written_back[u])  # S13: its state must be back on the host

    def written(self, u: int) -> bool:  # the copy stream waits for it: the copy may be issued now
        return True

    def wait_all(self) -> None:  # block until every queued step has written its state back to the host
        for event in self.written_back.values():
            event.synchronize()  # S13


# ------------------------------------------------------------------------------------------------- activation offload
# Adds: the saved inputs wait in pinned host memory between a unit's forward and its backward.
# Turned on: --offload-activations, or the plan where they do not fit the cap. Plugs into: OffloadedTraining.inputs.


class ActivationOffload(KeptInputs):
    """--offload-activations: each unit's inputs wait in pinned host memory from its forward to its backward: out on
    the D2H stream, back on the weights' copy stream `depth` units ahead. Host input a is unit a + 1's."""

    def __init__(self, trainer: OffloadedTraining, micro_batches: int, shape: tuple[int, int]):
        device, dtype, ring = trainer.device, trainer.dtype, trainer.streamer
        self.micro_batches, self.device = micro_batches, device
        self.shape = (*shape, trainer.hidden_size)  # one micro-batch's inputs
        self.d2h_stream = trainer.d2h_stream  # the gradients' stream: the inputs leave on it too
        count = micro_batches * math.prod(self.shape)
        self.host = host_zeros_each([count] * (len(trainer.units) - 1), dtype, pin=device.type == "cuda")
        self.offloaded = [new_event(device) for _ in self.host]
        self.leaving = collections.deque()  # (landed event, GPU inputs) of the copies that may still read them
        kinds, split = ["inputs"] * len(self.host), lambda _, flat: self.split(flat)
        self.streamer = LayerStreamer(self.host, kinds, split, dtype, device, ring.depth, ring.copy_stream, self)

    def wait_written(self, a: int) -> None:  # host input a comes back only once it has reached the host
        self.streamer.copy_stream.wait_event(self.offloaded[a])  # S14

    def written(self, a: int) -> bool:  # the copy stream waits for it: the copy may be issued now
        return True

    def split(self, flat: torch.Tensor) -> tuple[torch.Tensor, ...]:  # one (B, T, hidden) view per micro-batch
        return flat[: self.micro_batches * math.prod(self.shape)].view(self.micro_batches, *self.shape).unbind()

    def save(self, ctx, u: int, xs) -> None:
        """Copy unit u's inputs to the host on the D2H stream before its kernels are issued; unit 0's stay in ctx."""
        if u == 0:
            ctx.save_for_backward(*xs)
        else:
            self.send(u, xs)

    def send(self, u: int, xs: tuple[torch.Tensor, ...]) -> None:
        """Unit u's inputs out to host input u - 1 on the D2H stream, once the unit before has written them."""
        written, stream = new_event(self.device), self.d2h_stream
        written.record(self.streamer.compute_stream)
        with on_stream(stream):
            stream.wait_event(written)  # S14: the unit before must have written them
            for host, x in zip(self.split(self.host[u - 1]), xs, strict=True):
                host.copy_(x, non_blocking=True)
            self.offloaded[u - 1].record(stream)
        self.leaving.append((self.offloaded[u - 1], xs))
        while self.leaving and (len(self.leaving) > 2 or self.leaving[0][0].query()):
            # the copy reads them: the caching allocator must not hand their memory out before it has landed
            self.leaving.popleft()[0].synchronize()  # S14

    def backward_begins(self, n_units: int) -> None:  # let go of the inputs still leaving; start the backward's ring
        for landed, _ in self.leaving:
            self.streamer.compute_stream.wait_event(landed)  # S14: the allocator hands their memory out on this stream
        self.leaving.clear()
        self.streamer.begin(reversed(range(n_units - 1)))

    def load(self, u: int, saved: tuple) -> tuple:  # unit u's inputs at its backward: back from the host, or the ids
        return saved if u == 0 else self.streamer.acquire(u - 1)

    def release(self, u: int) -> None:  # unit u's backward is issued: its inputs' slot may take the next unit's
        if u > 0:
            self.streamer.release(u - 1)


# ---------------------------------------------------------------------------------------------- segment checkpointing
# Adds: only the first unit of each segment of --segment units keeps its inputs (SegmentStarts). The backward remakes
# the others' by running the segment's forwards again (SegmentInputs: the saved inputs take the starts' and a segment's
# memory, each unit but a segment's last runs forward three times), or runs the segment a micro-batch at a time
# through its units with their graphs (SegmentGraphs: each unit runs forward twice, as without segments; a
# micro-batch's graphs of the segment, a gradient buffer and up to two slots a unit). Turned on: --segment, or the
# plan where every unit keeping its inputs does not fit or is slower; the plan weighs both ways. Plugs into:
# OffloadedTraining.inputs and .function, LayerStreamer.held, Steppers.buffers.


class SegmentStarts(KeptInputs):
    """Keeps the inputs of each segment's first unit alone (units 0, N, 2N ...), on the GPU until its backward."""

    def __init__(self, trainer: OffloadedTraining, length: int):
        if trainer.keep:  # a kept graph is over its forward's slot, which the backward in segments may not reuse
            raise ValueError("segments recompute every unit: keep no graphs with them")
        self.trainer, self.length = trainer, length
        self.inputs = {}  # unit -> its inputs on the GPU until its backward: a start's from the forward, or remade

    def segment(self, u: int) -> range:  # the units of unit u's segment
        first = u - u % self.length
        return range(first, min(first + self.length, len(self.trainer.units)))

    def save(self, ctx, u: int, xs) -> None:  # a segment's first unit keeps its inputs, without their graph
        if u == 0:  # a step begins: none are left from one that ended early
            self.inputs.clear()
        if u == self.segment(u)[0]:
            self.inputs[u] = tuple(x.detach() for x in xs)


class SegmentInputs(SegmentStarts):
    """Remakes the other units' inputs in the backward: at each segment's last unit its units but the last run forward
    again from its first's inputs (streamed as in the forward), then every unit's backward runs, last first."""

    def load(self, u: int, saved: tuple) -> tuple:  # unit u's inputs at its backward; the segment's last remakes all
        if u not in self.inputs:
            self.remake(self.segment(u)[0], u)
        return self.inputs[u]

    def remake(self, first: int, last: int) -> None:
        """Run units first .. last - 1 forward again from the first's inputs: the inputs of first + 1 .. last."""
        trainer, xs = self.trainer, self.inputs[first]
        with torch.no_grad():
            for v in range(first, last):
                module = trainer.streamer.acquire(v)
                xs = tuple(trainer.run_unit(v, module, x, k) for k, x in enumerate(xs))
                trainer.streamer.release(v)
                self.inputs[v + 1] = xs

    def release(self, u: int) -> None:  # unit u's backward is issued: its inputs are freed once it has run
        del self.inputs[u]

    def backward_order(self, n_units: int) -> list[int]:  # the units the backward runs, in order
        return segment_order(n_units, self.length)


class SegmentGraphs(SegmentStarts):
    """Runs each segment's backward at its last unit (SegmentUnit), a micro-batch at a time from its first's inputs
    through its units with their graphs; the streamer holds the segment's units and Steppers a gradient buffer each."""

    def __init__(self, trainer: OffloadedTraining, length: int):
        if trainer.streamer.resident:
            raise ValueError("give segments before keeping units resident: the ring is made anew")
        super().__init__(trainer, length)
        self.held = held = min(length, len(trainer.units))  # units a segment, at most all
        trainer.function = SegmentUnit
        trainer.streamer.held = held
        trainer.streamer.keep_resident(())  # the ring anew: as many more slots, the copies as far ahead
        steppers = trainer.steppers
        numel, dtype = steppers.buffers[0].numel(), steppers.buffers[0].dtype
        steppers.buffers = None  # the old one freed first
        steppers.buffers = [torch.zeros(numel, dtype=dtype, device=trainer.device) for _ in range(held)]
        steppers.last_landed = [InOrder()] * held

    def take(self, first: int) -> tuple:  # the inputs of the segment that starts at unit `first`, kept no longer
        return self.inputs.pop(first)

    def backward_order(self, n_units: int) -> list[int]:  # the units the backward runs, in order
        return segment_order(n_units, self.length, remade=False)


class SegmentUnit(StreamedUnit):
    """Streams a unit as StreamedUnit does, but a segment's last unit runs the whole segment's backward
    (segment_backward) and the units before it pass their first's input gradients on (None after the embeddings)."""

    @staticmethod
    def forward(ctx, trainer: OffloadedTraining, u: int, anchor: torch.Tensor, *xs: torch.Tensor):
        """Run StreamedUnit's forward, its backward allowed gradients of None (passed on from the embeddings)."""
        ctx.set_materialize_grads(False)
        return StreamedUnit.forward(ctx, trainer, u, anchor, *xs)

    @staticmethod
    def backward(ctx, *grad_outs):
        """Run the segment's backward at its last unit; the others pass the gradients of its first's inputs on."""
        trainer, u = ctx.trainer, ctx.u
        units = trainer.inputs.segment(u)
        if u == units[-1]:
            grad_outs = segment_backward(trainer, units, trainer.inputs.take(units[0]), grad_outs)
        return None, None, None, *grad_outs  # none for trainer, u and anchor


def segment_backward(trainer: OffloadedTraining, units: range, xs, grad_outs) -> list:
    """Run a segment's backward, its units all in their slots, micro-batch by micro-batch: forward through them with
    the graph from the first's inputs, then back, each unit's gradients summed in its buffer; then send each, last
    first. Returns the first's input gradients."""
    streamer = trainer.streamer
    modules = [streamer.acquire(v) for v in units]  # every copy issued at once: the next segment's come in meanwhile
    views = [trainer.grad_views(v) for v in units]
    grads_in, firsts = [], [None] * len(units)
    for k, (x, grad_out) in enumerate(zip(xs, grad_outs, strict=True)):
        grad_in, grads = segment_grads(trainer, units, modules, (x, k), grad_out)
        grads_in.append(grad_in)
        for i, v in enumerate(units):
            firsts[i] = sum_grads(trainer, v, views[i], (k, len(xs)), grads[i], firsts[i])
        grads = None  # freed before the next micro-batch's
    for v, unit_views in reversed(list(zip(units, views, strict=True))):
        trainer.send(v, unit_views)
        streamer.release(v)
    return grads_in


def segment_grads(trainer: OffloadedTraining, units: range, modules, x_k: tuple, grad_out):
    """Run micro-batch k (x_k: its input x to the segment, and k) forward through the segment's units with its graph,
    then back from grad_out: (x's gradient or None, each unit's parameter gradients)."""
    x, k = x_k

    def forward(x: torch.Tensor) -> torch.Tensor:  # the segment's units in turn: the last one's output
        for v, module in zip(units, modules, strict=True):
            x = trainer.run_unit(v, module, x, k)
        return x

    x, out = with_graph(forward, x)
    params = [list(module.parameters()) for module in modules]
    inputs = ([x] if x.requires_grad else []) + [p for unit_params in params for p in unit_params]
    grads = list(torch.autograd.grad(out, inputs, grad_out))
    grad_in = grads.pop(0) if x.requires_grad else None
    ends = list(itertools.accumulate(len(unit_params) for unit_params in params))
    return grad_in, [grads[a:b] for a, b in zip([0, *ends[:-1]], ends, strict=True)]


def ring_slots(depth: int, held: int, streamed: int) -> int:  # a streamer's slots, as LayerStreamer makes them
    return min(copies_ahead(depth, held) + held, streamed)


def segment_order(n_units: int, length: int, remade: bool = True) -> list[int]:
    """The units a backward in segments of `length` runs, in order: the segments from the last, each (remade) its
    units but the last forward again, then each unit's backward, last first; or (not remade) its units first to last,
    held at once. Length 1: each unit's backward alone, last first."""
    order = []
    for first in reversed(range(0, n_units, length)):
        last = min(first + length, n_units) - 1
        order += [*range(first, last), *reversed(range(first, last + 1))] if remade else [*range(first, last + 1)]
    return order


def remade_units(order: list[int]) -> list[int]:  # the units a backward running `order` runs forward again
    return sorted(u for u, runs in collections.Counter(order).items() if runs > 1)


def remade_before(order: list[int], u: int) -> list[int]:  # the units run forward again before unit u's backward
    backward = len(order) - 1 - order[::-1].index(u)  # its last run
    return [v for v in remade_units(order) if order.index(v) < backward]


def step_copies(backward: list[int], resident, n_slots: int) -> list[int]:
    """The units a training step copies in, in order: the forward's, then the backward's running `backward`, but those
    still in their slots (CopyWindow's kept)."""
    forward = CopyWindow.over(range(len(set(backward))), resident, [None] * n_slots, range(n_slots))
    after = CopyWindow.over(backward, resident, forward.holds, forward.recent)
    return [u for window in (forward, after) for p, u in enumerate(window.units) if p not in window.kept]


# ----------------------------------------------------------------------------------------------- float16 and clipping
# Adds: float16's dynamic loss scale (LossScale) and --clip-grad-norm (GradClip); units step once every gradient
# is in. Turned on: --dtype float16, --clip-grad-norm X. Plugs into: the trainers' `scaling` and `clip`.


class LossScale:
    """float16's dynamic loss scale, as torch.amp.GradScaler's: a step whose gradients overflow is skipped."""

    holds_updates = True

    def __init__(self, device: torch.device, ranks: OneProcess = ONE_PROCESS):
        self.scale, self.good_steps = 2.0**16, 0  # good steps in a row, since the scale last changed
        self.device, self.ranks = device, ranks  # every rank skips a step that overflows on one
        self.found_inf = torch.zeros(1, device=device)

    def unscale(self, grads: list[torch.Tensor]) -> None:  # divide by the scale, noting inf or NaN, with no sync
        inv_scale = torch.full((1,), 1 / self.scale, device=self.device)
        torch._amp_foreach_non_finite_check_and_unscale_(grads, self.found_inf, inv_scale)  # private (torch 2.11-13)

    def restore(self, scale: float, good_steps: int) -> None:  # the scale and its good steps, from a checkpoint
        self.scale, self.good_steps = scale, good_steps

    def update(self) -> bool:  # after the backward pass: whether the step may be applied (a sync)
        overflow = bool(self.ranks.sum(self.found_inf).item())
        self.found_inf.zero_()
        self.good_steps = 0 if overflow else self.good_steps + 1
        if overflow or self.good_steps == 2000:  # an overflow halves the scale, 2000 good steps in a row double it
            self.scale, self.good_steps = self.scale * (0.5 if overflow else 2), 0
        return not overflow


def loss_scaling(dtype: torch.dtype, device: torch.device, ranks: OneProcess = ONE_PROCESS):  # LossScale for float16
    return LossScale(device, ranks) if dtype == torch.float16 else Unscaled()


class GradClip:
    """--clip-grad-norm: gradients times min(1, max_norm / (norm + 1e-6)) as clip_grad_norm_; units step once all in."""

    holds_updates = True

    def __init__(self, store: OffloadedAdam, max_norm: float, device: torch.device):
        if not store.pool.dedicated:
            raise ValueError("clipping steps only once every unit's gradients are in: give each unit a gradient buffer")
        if not store.update.scaled:
            raise ValueError("the CPU Adam must multiply the gradients: build the store with scaled_grads")
        self.max_norm, self.units = max_norm, store.units
        self.ranks = store.ranks  # with several, each takes the norm of its shards, and the squares are summed
        self.norms = {}  # unit -> its parameters' gradient norms, float32 on the GPU
        self.grad_norms = []  # each applied step's, before clipping
        self.taken = new_event(device)  # recorded after each unit's norms, on the stream that took them

    def add(self, u: int, views: list[torch.Tensor], sent: torch.Tensor, stream) -> None:
        """Queue the float32 norms of unit u's gradients `views` (several ranks: of this rank's summed shard `sent`)."""
        several = self.ranks.several
        grads = pieces(self.units[u].layout, sent, self.ranks.rank * sent.numel()) if several else views
        with on_stream(stream if several else None):
            if grads and grads[0].dtype == torch.float32:
                self.norms[u] = torch._foreach_norm(grads, 2.0)  # clip_grad_norm_'s own (private: torch 2.11 to 2.13)
            else:  # 16-bit gradients, summed in float32 without a float32 copy of the unit (none: a shard of padding)
                self.norms[u] = [torch.linalg.vector_norm(g, 2.0, dtype=torch.float32) for g in grads]
            self.taken.record()

    def multiplier(self) -> float:
        """This step's coefficient, once the backward is done (a sync): the norm of the norms, in parameter order."""
        self.taken.wait()  # S15: the current stream waits for the last norm, taken on the D2H stream with several ranks
        norms, self.norms = [norm for u in sorted(self.norms) for norm in self.norms[u]], {}
        total = torch.linalg.vector_norm(torch.stack(norms), 2.0)
        if self.ranks.several:
            total = self.ranks.sum(total.square()).sqrt()
        coefficient = torch.clamp(self.max_norm / (total + 1e-6), max=1.0)
        norm, multiplier = torch.stack([total, coefficient]).tolist()  # one sync for both
        self.grad_norms.append(norm)
        return multiplier


def scale_and_clip(trainer: OffloadedTraining, max_norm: float | None) -> None:  # LossScale, and GradClip if asked
    trainer.scaling = loss_scaling(trainer.dtype, trainer.device, trainer.ranks)
    if trainer.scaling.holds_updates and not trainer.store.pool.dedicated:
        raise ValueError("float16 steps only once every unit's gradients are in: give each unit a gradient buffer")
    if max_norm is not None:
        trainer.clip = GradClip(trainer.store, max_norm, trainer.device)


# ------------------------------------------------------------------------------------------------------ the disk tier
# Adds: the Adam moments of some decoder layers on a local disk, read ahead of their steps, written back after.
# Turned on: --nvme DIR (the plan picks the layers). Plugs into: OffloadedAdam's `moments` (moments_for).


DISK_CALL = 2**28  # bytes one read or write call moves at most (Linux moves under 2 GiB per call)
DISK_SLOTS = 2  # the disk tier's staging buffers: one unit stepped while the disk reads the next or writes one back
DISK_BLOCK = 4096  # bytes: direct I/O moves whole blocks between block-aligned memory and file offsets


class DiskFiles:
    """The disk tier's unnamed files (O_TMPFILE), a unit's two moments each, reserved up front, direct I/O if taken."""

    def __init__(self, folder: str, numels: dict[int, int], probe: mmap.mmap):  # probe: aligned, as large as any file
        self.folder, self.numels = folder, numels
        self.half = {u: moment_bytes(n) for u, n in numels.items()}  # one moment's bytes in the file and a slot
        self.fds = {}
        try:
            for u in sorted(numels, reverse=True):
                self.fds[u] = unnamed_file(folder, 2 * self.half[u])
            self.direct = all(direct_io(fd, probe) for fd in self.fds.values())
            self.rates = self.measure(probe)
        except OSError as e:
            self.close()
            raise self.failed(e) from None

    def moments(self, buffer: mmap.mmap, u: int) -> tuple[torch.Tensor, torch.Tensor]:  # unit u's, as in its file
        flat = torch.frombuffer(buffer, dtype=torch.float32)  # keeps the buffer alive
        h, n = self.half[u] // 4, self.numels[u]
        return flat[:n], flat[h : h + n]

    def transfer(self, call, u: int, buffer: mmap.mmap) -> None:  # os.preadv/os.pwritev of u's file, DISK_CALL a call
        view, nbytes, done = memoryview(buffer), 2 * self.half[u], 0
        try:
            while done < nbytes:
                moved = call(self.fds[u], [view[done : min(nbytes, done + DISK_CALL)]], done)
                if moved == 0:
                    raise OSError(errno.EIO, "a file of the disk tier ended early")
                done += moved
        except OSError as e:
            raise self.failed(e) from None

    def measure(self, buffer: mmap.mmap) -> dict:  # the disk's write and read GB/s, by the tier's I/O, on one file
        u = max(self.fds)  # the backward's first
        fd = self.fds[u]
        torch.frombuffer(buffer, dtype=torch.uint8).zero_()  # its pages mapped now, not in the timed write
        start = time.perf_counter()
        self.transfer(os.pwritev, u, buffer)
        os.fsync(fd)
        written = time.perf_counter()
        if not self.direct:
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        self.transfer(os.preadv, u, buffer)
        nbytes, read = 2 * self.half[u], time.perf_counter()
        return {"write_gbps": nbytes / (written - start) / 1e9, "read_gbps": nbytes / (read - written) / 1e9}

    def failed(self, e: OSError) -> OSError:  # `e` with the tier's folder as its file name, for the run's last line
        if e.filename and e.filename.endswith("(the --nvme disk tier)"):
            return e
        return OSError(e.errno, e.strerror or str(e), f"{self.folder} (the --nvme disk tier)")

    def close(self) -> None:  # close every file (the kernel frees an unnamed file with its last descriptor)
        for fd in self.fds.values():
            os.close(fd)
        self.fds = {}


class DiskTier:
    """--nvme: some units' Adam moments in files on a local disk, staged for each step by reader and writer threads."""

    def __init__(self, folder: str, numels: dict[int, int], slots: int | None = None):
        self.units = tuple(sorted(numels, reverse=True))  # the order the backward sends their gradients in
        slot_bytes = 2 * moment_bytes(max(numels.values()))  # no GPU copy reads the slots: they need no pinning
        self.ring = [HostBuffer(slot_bytes) for _ in range(slots or DISK_SLOTS)]
        self.files = DiskFiles(folder, numels, self.ring[0])
        self.settled = {u: threading.Event() for u in self.units}  # u's file has its last step's: the reader may read
        self.current = {u: threading.Event() for u in self.units}  # u's file has its latest: a checkpoint may read it
        self.fresh = set()  # units whose moments start at zero at their next step
        self.in_slot = {}  # unit -> the slot it is being stepped in
        self.error = None  # the reader's or the writer's, raised by the next stage, read or flush
        self.waited_s = 0.0  # the CPU Adam's wait for reads in this mode
        self.writer, self.reader = ThreadPoolExecutor(1, thread_name_prefix="disk-writer"), None
        self.lock = threading.Lock()  # stop() sets `stopping` and the reader clears a settled event, never both at once
        self.reset()

    def reset(self) -> None:  # nothing staged, every slot free, the reader not started (the next stage starts it)
        self.free = queue.SimpleQueue()
        for k in range(len(self.ring)):
            self.free.put(k)
        self.staged = {u: queue.SimpleQueue() for u in self.units}  # a slot index, or the read's error
        for event in [*self.settled.values(), *self.current.values()]:
            event.set()

    def stage(self, u: int) -> tuple[torch.Tensor, torch.Tensor]:  # u's moments for its step, read (zeros if fresh)
        self.raise_error()
        self.start()
        start = time.perf_counter()
        k = self.staged[u].get()  # S16
        self.waited_s += time.perf_counter() - start
        if isinstance(k, BaseException):
            raise k
        self.current[u].clear()  # the step changes them: the file is behind until the write-back lands
        self.in_slot[u] = k
        moments = self.files.moments(self.ring[k], u)
        if u in self.fresh:
            for moment in moments:
                moment.zero_()
            self.fresh.discard(u)
        return moments

    def write_back(self, u: int) -> None:  # queue the write of unit u's stepped moments, if staged; then its slot frees
        if u in self.in_slot:
            self.writer.submit(self.write, u, self.in_slot.pop(u))

    def read(self, u: int) -> tuple[torch.Tensor, torch.Tensor]:  # u's moments as its file holds them, in new memory
        self.current[u].wait()  # S16: the last write-back has landed
        self.raise_error()
        buffer = HostBuffer(2 * self.files.half[u])  # block-aligned, as direct I/O needs
        if u not in self.fresh:
            self.transfer(os.preadv, u, buffer)
        return self.files.moments(buffer, u)

    def load(self, u: int, fill) -> None:  # unit u's moments on the disk from fill(exp_avg, exp_avg_sq), reader stopped
        self.stop()
        fill(*self.files.moments(self.ring[0], u))
        self.transfer(os.pwritev, u, self.ring[0])
        self.fresh.discard(u)

    def flush(self) -> None:  # block until every write-back has landed; re-raise an error of the disk
        self.writer.submit(lambda: None).result()  # one writer thread: what was queued before has run
        self.raise_error()

    def start(self) -> None:  # start the reader thread (read_ahead), unless it runs
        if self.reader is None:
            self.stopping = False
            self.reader = threading.Thread(target=self.read_ahead, name="disk-reader", daemon=True)
            self.reader.start()

    def stop(self) -> None:  # stop the reader once the write-backs land, dropping what it staged; no step may run
        self.writer.submit(lambda: None).result()  # every write-back has landed or failed
        if self.reader is not None:
            with self.lock:
                self.stopping = True
                for event in self.settled.values():
                    event.set()  # wakes the reader where it waits to read a unit again
            self.free.put(None)  # wakes it where it waits for a slot
            self.reader.join()
            self.reader = None
        self.reset()

    def read_ahead(self) -> None:  # the reader: each unit, once settled, into a free slot, in the backward's order
        for u in itertools.cycle(self.units):
            self.settled[u].wait()  # S16
            k = None if self.stopping else self.free.get()  # S16
            with self.lock:  # else stop() could set the event between the check and the clear, and the wait hang
                if self.stopping or k is None:
                    return
                self.settled[u].clear()
            try:
                self.transfer(os.preadv, u, self.ring[k])
            except BaseException as e:  # every step that waits for a read from now on raises it
                self.fail(e)
                return
            self.staged[u].put(k)

    def close(self) -> None:  # stop both threads and close the files, which frees their room; once
        if not self.files.fds:
            return
        try:
            self.stop()
        finally:
            self.writer.shutdown()
            self.files.close()

    def write(self, u: int, k: int) -> None:  # the writer thread's job: u's moments from slot k to its file; k frees
        try:
            if self.error is None:
                self.transfer(os.pwritev, u, self.ring[k])
        except BaseException as e:  # raised by the next stage, read or flush
            self.error = e
        finally:
            self.current[u].set()  # or the error: read() raises it
            self.settled[u].set()
            self.free.put(k)

    def transfer(self, call, u: int, buffer: mmap.mmap) -> None:  # unit u's file read into or written from `buffer`
        self.files.transfer(call, u, buffer)

    def raise_error(self) -> None:  # re-raise the reader's or the writer's error, if any
        if self.error is not None:
            raise self.error

    def fail(self, e: BaseException) -> None:  # the reader's error: raised by every later wait for a read, and flush
        self.error = e
        for staged in self.staged.values():
            staged.put(e)


class DiskMoments(HostMoments):
    """HostMoments with the disk tier's units' moments on its disk, read for each step and written back after it."""

    def __init__(self, numels: list[int], disk: DiskTier):
        self.disk, self.on_disk = disk, frozenset(disk.units)  # the units whose moments the disk tier keeps
        super().__init__(numels, self.on_disk)

    def stage(self, u: int) -> tuple[torch.Tensor, torch.Tensor]:  # unit u's moments for its step: from disk, or host
        return self.disk.stage(u) if u in self.on_disk else super().stage(u)

    def staged(self, u: int) -> None:  # unit u's step is done: a disk unit's moments are written back
        self.disk.write_back(u)  # a host unit's are in no slot: nothing to write

    def ready(self, u: int) -> bool:  # whether unit u's step can run without waiting for the disk; starts its reader
        if u not in self.on_disk:
            return True
        self.disk.start()
        return not self.disk.staged[u].empty()

    def read(self, u: int) -> tuple[torch.Tensor, torch.Tensor]:  # unit u's moments after its updates, wherever
        return self.disk.read(u) if u in self.on_disk else super().read(u)

    def zero(self, units) -> None:  # zero the moments of `units` for their first step (a disk unit's in its slot)
        self.disk.fresh |= set(units) & self.on_disk
        super().zero(set(units) - self.on_disk)

    def fill(self, u: int, fill) -> None:  # unit u's moments from a checkpoint, into its file or host memory
        (self.disk.load if u in self.on_disk else super().fill)(u, fill)

    def restart(self) -> None:  # a new mode's load: one before may have ended mid-step, so the reader starts over
        self.disk.stop()
        self.disk.waited_s = 0.0

    def flush(self) -> None:  # block until the disk tier's write-backs have landed; re-raise its error
        self.disk.flush()

    def close(self) -> None:  # free the disk tier's files
        self.disk.close()


def moments_for(disk: DiskTier | None):  # offloadedAdam's `moments`: HostMoments, or with a disk tier DiskMoments on it
    return functools.partial(DiskMoments, disk=disk) if disk else HostMoments


def unnamed_file(folder: str, nbytes: int) -> int:  # a new file's descriptor: `nbytes` reserved, no name points to it
    try:
        fd = os.open(folder, os.O_TMPFILE | os.O_RDWR, 0o600)
    except OSError as e:  # a file system without O_TMPFILE: a named file, unnamed at once
        if e.errno not in (errno.EOPNOTSUPP, errno.EISDIR, errno.EINVAL):
            raise
        fd, path = tempfile.mkstemp(dir=folder, prefix=".offload_llama-")
        os.unlink(path)
    try:
        os.posix_fallocate(fd, 0, nbytes)
    except BaseException:
        os.close(fd)
        raise
    return fd


def direct_io(fd: int, buffer: mmap.mmap) -> bool:  # direct I/O on for `fd` where it is taken (one block written tells)
    flags = fcntl.fcntl(fd, fcntl.F_GETFL)
    try:
        fcntl.fcntl(fd, fcntl.F_SETFL, flags | os.O_DIRECT)
        os.pwritev(fd, [memoryview(buffer)[:DISK_BLOCK]], 0)
        return True
    except OSError as e:
        if e.errno != errno.EINVAL:
            raise
        fcntl.fcntl(fd, fcntl.F_SETFL, flags)
        return False


# ------------------------------------------------------------------------------------------------------- several GPUs
# Adds: data-parallel ranks, each holding 1/N of every unit's host state, gathered over NVLink, gradients reduce-
# scattered. Turned on: torchrun. Plugs into: OneProcess (Ranks), ParamStore.streamer, OffloadedTraining's makers.


STEP_GROUP = {}  # "group": the steps' process group, with the plan's rank timeout (join_steps)
SETUP_TIMEOUT = 1800  # seconds: the ranks meet before the steps, once each has built its model and state
# the collectives on one tensor: torch 2.13 names them so, and warns at the older names, which 2.11 and 2.12 have only
all_gather = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
reduce_scatter = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor


@dataclass(frozen=True)
class Ranks(OneProcess):
    """torchrun's data-parallel processes, one a GPU, each with 1/world of the host state, calling collectives alike."""

    rank: int = 0
    world: int = 1
    local_rank: int = 0  # the GPU of this host it drives
    local_world: int = 1  # the ranks on this host, which share its cores and memory

    @classmethod
    def from_environment(cls) -> Ranks:  # the ranks torchrun describes in the environment, else one process
        env = os.environ
        if "WORLD_SIZE" not in env:
            return cls()
        world, local_world = int(env["WORLD_SIZE"]), int(env.get("LOCAL_WORLD_SIZE", env["WORLD_SIZE"]))
        return cls(int(env.get("RANK", 0)), world, int(env.get("LOCAL_RANK", 0)), local_world)

    @property
    def several(self) -> bool:  # whether other ranks take part
        return self.world > 1

    def shard_numel(self, numel: int) -> int:  # each rank's share of a flat buffer of `numel`, ALIGNed (the last pad)
        return -(-numel // (self.world * ALIGN)) * ALIGN

    def whole_numel(self, shard: torch.Tensor) -> int:  # the elements of the flat buffer whose shard here is `shard`
        return shard.numel() * self.world

    def shard(self, full: torch.Tensor) -> torch.Tensor:  # this rank's shard of `full`, a flat buffer of world shards
        n = full.numel() // self.world
        return full[self.rank * n : (self.rank + 1) * n]

    def share(self, micro_batches: list) -> list:  # this rank's micro-batches of a step's: rank, rank + world,
        return micro_batches[self.rank :: self.world]

    def gather(self, full: torch.Tensor) -> None:  # each rank's shard of `full` into every rank's, on this stream
        if self.several:
            all_gather(full, self.shard(full), group=self.group)

    def sum_shard(self, shard: torch.Tensor, full: torch.Tensor) -> None:  # the ranks' `full` summed, this one's shard
        if self.several:
            reduce_scatter(shard, full, group=self.group)
        else:
            shard.copy_(full)

    def sum(self, value: torch.Tensor) -> torch.Tensor:  # `value` summed over the ranks, in place
        if self.several:
            dist.all_reduce(value, group=self.group)
        return value

    def gathered(self, shard: torch.Tensor, everywhere: bool = True) -> torch.Tensor | None:
        """Every rank's `shard` of a flat host buffer, gathered on every rank (not `everywhere`: on rank 0)."""
        if not self.several:
            return shard
        if everywhere:
            full = torch.empty(self.whole_numel(shard), dtype=shard.dtype)
            all_gather(full, shard.contiguous())
            return full
        shards = [torch.empty_like(shard) for _ in range(self.world)] if self.rank == 0 else None
        dist.gather(shard.contiguous(), shards, dst=0)
        return torch.cat(shards) if self.rank == 0 else None

    def meet(self) -> None:  # wait until every rank is here, as long as setting up may take
        if self.several:
            dist.barrier()

    def in_turn(self, make):  # make() on each host's first rank, then on its others, which read what it cached
        if self.local_rank == 0:
            made = make()
        self.meet()
        return made if self.local_rank == 0 else make()

    def each(self, value) -> list:  # every rank's `value` (a small picklable one), in rank order
        if not self.several:
            return [value]
        values = [None] * self.world
        dist.all_gather_object(values, value)
        return values

    @property
    def group(self):  # the group the steps' collectives run in: a stalled rank ends the others after the rank timeout
        return STEP_GROUP.get("group")


class ShardedParamStore(ParamStore):
    """ParamStore over several ranks: each holds its shard of every layer; the GPUs gather the rest."""

    def __init__(self, model: LlamaForCausalLM, pin: bool, ranks: Ranks):
        self.ranks = ranks
        super().__init__(model, pin)

    def held(self, numel: int) -> tuple[int, int]:  # this rank's shard of a layer's `numel` elements, and its start
        shard = self.ranks.shard_numel(numel)
        return shard, self.ranks.rank * shard

    def share(self, layer: nn.Module, flat: torch.Tensor) -> None: ...  # a shard: the model keeps its parameters

    def streamer(self, kinds, make_module, device, depth: int) -> LayerStreamer:  # a ShardedStreamer of the shards
        return ShardedStreamer(self.ranks, self.flats, kinds, make_module, self.dtype, device, depth)


def param_store_of(ranks: Ranks, model: LlamaForCausalLM, pin: bool) -> ParamStore:  # sharded with several ranks
    return ShardedParamStore(model, pin, ranks) if ranks.several else ParamStore(model, pin)


class ShardedStreamer(LayerStreamer):
    """LayerStreamer over ranks: this rank's shard crosses PCIe, an all-gather fills the rest; copies issue in order."""

    def __init__(self, ranks: Ranks, sources, kinds, make_module, dtype, device, depth: int, writer=None):
        self.ranks = ranks
        self.gather_stream = new_stream(device)  # one unit's all-gather runs while the next unit's shard crosses PCIe
        super().__init__(sources, kinds, make_module, dtype, device, depth, writer=writer)

    def whole_numel(self, src: torch.Tensor) -> int:  # the slot elements of the unit whose shard is `src`
        return self.ranks.whole_numel(src)

    def destination(self, s: int, src: torch.Tensor) -> torch.Tensor:  # this rank's shard of the unit's place in slot s
        return self.ranks.shard(self.buffers[s][: self.whole_numel(src)])

    def landed_in(self, s: int, src: torch.Tensor) -> None:  # the other ranks' shards into slot s, on the gather stream
        with on_stream(self.gather_stream):
            self.gather_stream.wait_event(self.copied[s])  # S1: this rank's shard has landed
            self.ranks.gather(self.buffers[s][: self.whole_numel(src)])
            self.copied[s].record(self.gather_stream)  # S1: compute waits for the whole unit before it reads the slot

    def side_streams(self) -> tuple:  # the streams the copies and the all-gathers run on
        return (self.copy_stream, self.gather_stream)

    def written(self, u: int) -> bool:  # every copy is issued in order: prefetch's wait_written holds the host
        return True


class ShardedSteppers(Steppers):
    """Steppers over several ranks: each unit's gradients reduce-scattered, this rank's shard (`summed`) stepped."""

    def __init__(self, store: OffloadedAdam, dtype: torch.dtype, device: torch.device, d2h_stream):
        super().__init__(store, dtype, device, d2h_stream)
        self.summed = torch.empty(max(m.numel() for m in store.masters), dtype=store.grad_dtype, device=device)
        self.summed_taken = InOrder()  # the event after which `summed` may be overwritten: the last shard left it

    def to_send(self, u: int, ready) -> tuple[torch.Tensor, object]:  # u's gradients summed, this shard into `summed`
        shard, summed, stream = self.summed_shard(u), new_event(self.device), self.cpu_adam.d2h_stream
        with on_stream(stream):
            stream.wait_event(ready)  # S5: the unit's backward must have written all its gradients
            stream.wait_event(self.summed_taken)  # S6: the last unit's shard copied out (the GPU Adam's: elsewhere)
            self.store.ranks.sum_shard(shard, self.grads(u))
            summed.record(stream)  # S6
        return shard, summed

    def send(self, u: int, ready) -> torch.Tensor:  # Steppers.send; keeps the event after which its shard left `summed`
        sent = super().send(u, ready)
        self.summed_taken = self.last_landed[u % len(self.buffers)]
        return sent

    def summed_shard(self, u: int) -> torch.Tensor:  # where this rank's shard of unit u's summed gradients lands
        return self.summed[: self.store.masters[u].numel()]


class ShardedTraining(OffloadedTraining):
    """OffloadedTraining of one of several ranks: gradients summed over the ranks, weights gathered from the shards."""

    def make_steppers(self, *args) -> Steppers:  # the gradients summed over the ranks first
        return ShardedSteppers(*args)

    def make_streamer(self, *args, **kwargs) -> LayerStreamer:  # A ShardedStreamer of LayerStreamer's arguments
        return ShardedStreamer(self.ranks, *args, **kwargs)


def pieces(layout: FlatLayout, shard: torch.Tensor, start: int) -> list[torch.Tensor]:  # the parameters' pieces in it
    return [shard[lo - start : hi - start] for _, _, lo, hi in layout.spans(start, start + shard.numel())]


def check_same(ranks: Ranks, value, what: str) -> None:  # every rank holds the same `value`, or each ends naming it
    each = ranks.each(value)
    if any(other != each[0] for other in each):
        differ = "; ".join(f"rank {r}: {v}" for r, v in enumerate(each))
        raise UsageError(f"the ranks differ in {what} ({differ}): they must plan alike; say so in an issue")


def start_ranks(ranks: Ranks) -> None:  # join the other ranks (torchrun's rendezvous) in the default group
    if ranks.several:
        dist.init_process_group(backend(), timeout=datetime.timedelta(seconds=SETUP_TIMEOUT))


def backend() -> str:  # the process groups' backends: NCCL between the GPUs, gloo between CPU tensors
    return "cpu:gloo,cuda:nccl" if torch.cuda.is_available() else "gloo"


def join_steps(ranks: Ranks, timeout: float, threads: int) -> None:  # the steps' group (`timeout` s), `threads` cores
    if not ranks.several:
        return
    STEP_GROUP["group"] = dist.new_group(backend=backend(), timeout=datetime.timedelta(seconds=timeout))
    STEP_GROUP["timeout"] = timeout
    torch.set_num_threads(threads)
    log(
        f"{ranks.world} ranks, {ranks.local_world} on this host, each on {threads} of its {host_cores()} cores, "
        f"waiting {timeout:g} s at most for the others in a step or a pass"
    )


def rank_peaks(ranks: Ranks, result: dict, params: int) -> dict:  # `result`, every rank's peaks (GPUs' max, host sum)
    if ranks.several:
        keys = ("peak_gpu_bytes", "peak_host_bytes")
        each = ranks.each({key: result.get(key) for key in keys})
        gpu, host = ([rank[key] or 0 for rank in each] for key in keys)
        result |= {"ranks": each, "peak_gpu_bytes": max(gpu), "peak_host_bytes": sum(host)}
    if result.get("peak_host_bytes"):
        result["host_bytes_per_parameter"] = result["peak_host_bytes"] / params
    return result


def host_peaks(ranks: Ranks, host: dict) -> dict:  # the host's budget and peak resident set, every rank's summed
    return {key: sum(rank[key] or 0 for rank in ranks.each(host)) for key in host} if ranks.several else host


def lost_ranks(ranks: Ranks, error: BaseException) -> str | None:  # a rank's last line if another one ended, else None
    lost = isinstance(error, dist.DistError) or (isinstance(error, RuntimeError) and "gloo/" in str(error))
    if not ranks.several or not lost:
        return None
    why = str(error).strip().splitlines()[0].split("] ", 1)[-1]  # without gloo's source place
    timeout = STEP_GROUP.get("timeout", RANK_TIMEOUT)
    return (
        f"rank {ranks.rank} of {ranks.world} stops: another rank ended, or stalled past the timeout ({timeout:g} s "
        f"in a step, {SETUP_TIMEOUT} s setting up), in a collective (torchrun's summary names it): {why}"
    )


def own_error(ranks: Ranks, error: BaseException) -> str:  # a rank's last line for its own error, with its place here
    frames = [f for f in traceback.extract_tb(error.__traceback__) if f.filename == __file__] or [None]
    place = f" (offload_llama.py:{frames[-1].lineno}, in {frames[-1].name})" if frames[-1] else ""
    what = str(error).strip().splitlines()[0] if str(error).strip() else ""
    return f"rank {ranks.rank} of {ranks.world} stops: {type(error).__name__}: {what}{place}"


def stop_ranks() -> None:  # leave the other ranks, once every collective is done
    if dist.is_available() and dist.is_initialized():
        STEP_GROUP.clear()
        dist.destroy_process_group()


# ----------------------------------------------------------------------- a model from a folder, or drawn unit by unit
# Adds: --model DIR (a save_pretrained folder, its weights checked before they load), and a lean run's random
# model drawn straight into the masters. Turned on: --model, --no-inference. Plugs into: load_model, for build_model.


def model_config(run: RunConfig) -> LlamaConfig:
    """The model's config: --model's, or the preset's with the size flags over it; refused where no LLaMA has them."""
    if run.model is not None:
        path = Path(run.model)
        model_type(path)  # a LLaMA's save_pretrained folder
        try:
            with transformers_quiet():  # its warnings on a config it cannot check: the refusal below is the one line
                config = LlamaConfig.from_pretrained(path)
            with torch.device("meta"):
                LlamaRotaryEmbedding(config)  # its rope settings, which the config takes unchecked
                LlamaDecoderLayer(config, layer_idx=0)  # its activation's name, and the like
        except Exception as e:  # transformers' own validation, whose error classes vary between versions
            reason = f"{type(e).__name__}: {str(e.__cause__ or e).splitlines()[0]}"
            raise UsageError(f"--model {path}: transformers rejects its config.json ({reason})") from None
        check_sizes({field: getattr(config, field) for field in SIZE_FLAGS}, f"--model {run.model}: config.json's ")
        return config
    check_sizes({**PRESETS[run.preset], **dict(run.sizes)})
    return llama_config(run)


def load_model(run: RunConfig, config: LlamaConfig) -> LlamaForCausalLM:
    """The CPU model in its dtype: --model's, a meta one drawn into the masters (draws_units), or a random one."""
    if draws_units(run):
        log(f"{run.preset}: {count_text(param_count(config))} {run.dtype} parameters, drawn straight into the masters")
        model = meta_model(config, run.torch_dtype, run.attention)
        model.model.rotary_emb = LlamaRotaryEmbedding(config)  # computed, not drawn
        return model.eval()
    if run.model is None:
        t0 = time.perf_counter()
        model = build_model(run, config)
        log(f"built in {time.perf_counter() - t0:.1f} s")
        return model
    log(f"loading {run.model} on the CPU: {count_text(param_count(config))} {run.dtype} parameters")
    transformers.utils.logging.disable_progress_bar()  # stderr carries this script's progress lines alone
    try:
        with transformers_quiet():  # its report of missing weights: the refusal below says it in one line
            model, info = LlamaForCausalLM.from_pretrained(
                run.model, dtype=run.torch_dtype, attn_implementation=run.attention, output_loading_info=True
            )
    except Exception as e:  # what check_weights cannot see; transformers' error classes vary between versions
        raise UsageError(f"--model {run.model}: cannot load the weights ({first_line(e)})") from None
    missing = sorted([*info.get("missing_keys", ()), *(key for key, *_ in info.get("mismatched_keys", ()))])
    if missing:  # from_pretrained draws those at random and goes on: not the model the folder names
        what = f"{len(missing)} of the model's weights, such as {missing[0]}"
        raise UsageError(f"--model {run.model}: its weights lack {what}: save the model again")
    check_no_extra_weights(Path(run.model), model.config, set(info.get("unexpected_keys", ())))  # pytorch_model.bin's
    damaged = next((name for name, p in model.named_parameters() if not torch.isfinite(p).all()), None)
    if damaged:  # it would run, every logit NaN, or train and diverge at once
        raise UsageError(f"--model {run.model}: {damaged} holds NaN or infinite values: save the model again")
    return model.eval()


@contextlib.contextmanager
def transformers_quiet():  # transformers' warnings held back for the block (its errors still show)
    verbosity = transformers.utils.logging.get_verbosity()
    transformers.utils.logging.set_verbosity_error()
    try:
        yield
    finally:
        transformers.utils.logging.set_verbosity(verbosity)


SAFETENSORS_ITEMSIZE = dict(F64=8, F32=4, F16=2, BF16=2, I64=8, I32=4, I16=2, I8=1, U8=1, BOOL=1, F8_E4M3=1, F8_E5M2=1)


def check_weights(folder: Path, config: LlamaConfig) -> None:
    """--model's weight files are there and whole, safetensors ones with each weight of its config in its shape."""
    for single in ("model.safetensors", "pytorch_model.bin"):  # safetensors first; sharded (an index) first
        index = folder / f"{single}.index.json"
        if index.is_file() or (folder / single).is_file():
            break
    else:
        raise UsageError(f"--model {folder}: no weights in it (model.safetensors or pytorch_model.bin): save it again")
    found, pickled = {}, single == "pytorch_model.bin"
    for name in indexed_files(index) if index.is_file() else [single]:
        if not (folder / name).is_file():
            raise UsageError(f"--model {folder}: {name} is missing: save the model again")
        if not pickled:
            found |= safetensors_shapes(folder, name)
            continue
        with open(folder / name, "rb") as f:
            if (head := f.read(4)) != b"PK\x03\x04" and head[:1] != b"\x80":  # a zip, as torch.save writes; or a pickle
                raise UsageError(f"--model {folder}: {name} is damaged, not a torch file: save the model again")
    if pickled:  # from_pretrained checks the shapes, build_model the rest
        return
    with torch.device("meta"):
        model = LlamaForCausalLM(config)
    for name, p in model.named_parameters():
        if found.get(name) != tuple(p.shape):
            saved = "missing" if name not in found else f"of shape {list(found[name])}"
            raise UsageError(f"--model {folder}: {name} is {saved}, the config needs {list(p.shape)}: save it again")
    check_no_extra_weights(folder, config, set(found) - set(model.state_dict()))


def check_no_extra_weights(folder: Path, config: LlamaConfig, extra: set[str]) -> None:
    """Refuse, naming one, weights the config has no place for (from_pretrained drops layers past its count)."""
    extra = sorted(name for name in extra if not name.endswith("rotary_emb.inv_freq"))  # older saves' tables
    if extra:
        held = [int(m[1]) for name in extra if (m := re.match(r"model\.layers\.(\d+)\.", name))]
        n = config.num_hidden_layers
        layers = f" (num_hidden_layers is {n}, the weights hold {max(held) + 1} layers)" if held else ""
        what = f"{len(extra)} weight(s) the config has no place for, such as {extra[0]}{layers}"
        raise UsageError(f"--model {folder}: its weights hold {what}: fix config.json, or save the model again")


def indexed_files(index: Path) -> list[str]:  # the files a sharded model's index names, by name; else it is damaged
    try:
        files = sorted(set(parse_json(index.read_text())["weight_map"].values()))
        if not all(isinstance(name, str) and name == Path(name).name for name in files):
            raise ValueError("its weight_map names files outside the folder, or not by name")
    except (OSError, ValueError, KeyError, TypeError, AttributeError) as e:
        raise UsageError(f"--model {index.parent}: {index.name} is damaged ({first_line(e)}): save it again") from None
    return files


def safetensors_shapes(folder: Path, name: str) -> dict[str, tuple]:
    """The tensors' shapes in one of --model's safetensors files; refused with one line where it is not one whole."""
    path, shapes = folder / name, {}
    size = path.stat().st_size
    try:
        with open(path, "rb") as f:
            head = f.read(8)
            length = struct.unpack("<Q", head)[0] if len(head) == 8 else size
            header = parse_json(f.read(length)) if length <= size - 8 else None
        for key, entry in header.items():  # not a table (or cut short, None): AttributeError
            if key != "__metadata__":
                shape, (start, stop) = tuple(entry["shape"]), entry["data_offsets"]
                nbytes = math.prod(shape) * SAFETENSORS_ITEMSIZE[entry["dtype"]]
                if not (stop - start == nbytes and start >= 0 and 8 + length + stop <= size):
                    raise ValueError("a tensor's bytes out of place")
                shapes[key] = shape
    except OSError as e:
        raise UsageError(f"--model {folder}: {name} cannot be read ({e.strerror})") from None
    except (AttributeError, KeyError, TypeError, ValueError):  # not JSON or UTF-8, or a tensor's entry not whole
        what = f"{name} is damaged or cut short ({size:,} bytes)"
        raise UsageError(f"--model {folder}: {what}: save the model again") from None
    return shapes


def draws_units(run: RunConfig) -> bool:  # the random model drawn into the masters: one offloaded mode trains alone
    return run.lean and run.model is None and not run.fwd_bwd_reference


def draw_masters(store, model: LlamaForCausalLM, seed: int) -> None:
    """init_random's weights for the meta `model`, in its dtype, drawn by chunks into `store`'s masters (shards)."""
    config, dtype = model.config, next(model.parameters()).dtype
    index = {name: i for i, name in enumerate(n for n, p in model.named_parameters() if p.dim() > 1)}

    def draw(master, start, span, chunk, i, j) -> None:  # chunk j of weight i (elements [a, b)) into `span`'s part
        (a, b), (lo, hi) = chunk, span
        values = drawn_chunk(seed, i, j, b - a, config.initializer_range)
        values.copy_(values.to(dtype))  # nothing to round in float32
        master[max(a, lo) - start : min(b, hi) - start].copy_(values[max(a, lo) - a : min(b, hi) - a])

    spans, jobs = [], []  # spans: (HF name, master, shard start, offset, lo, hi, numel) in this rank's shards
    for unit, master in zip(store.units, store.masters, strict=True):
        start, numels = store.ranks.rank * master.numel(), dict(zip(unit.layout.names, unit.layout.shapes, strict=True))
        for name, o, lo, hi in unit.layout.spans(start, start + master.numel()):
            spans.append((f"{unit.name}.{name}", master, start, o, lo, hi, numels[name].numel()))
    for name, master, start, o, lo, hi, numel in spans:
        if name not in index:  # a norm's weight
            master[lo - start : hi - start].fill_(1.0)
            continue
        for j in range((lo - o) // DRAW_CHUNK, (hi - 1 - o) // DRAW_CHUNK + 1):  # the chunks with elements in [lo, hi)
            chunk = (o + j * DRAW_CHUNK, o + min(numel, (j + 1) * DRAW_CHUNK))
            jobs.append((master, start, (lo, hi), chunk, index[name], j))
    with ThreadPoolExecutor(torch.get_num_threads()) as pool:  # normal_ releases the GIL; a rank's share of the cores
        list(pool.map(lambda job: draw(*job), jobs))
    for name, master, start, o, lo, hi, _ in spans:
        if name == "model.embed_tokens.weight" and config.pad_token_id is not None:
            row = o + config.pad_token_id * config.hidden_size
            x, y = max(row, lo), min(row + config.hidden_size, hi)  # the pad row's part in this shard
            if x < y:
                master[x - start : y - start].zero_()


def param_count(config: LlamaConfig) -> int:  # the model's parameter count from its config, by arithmetic
    return parameter_count(config.to_dict())


def meta_layer(config: LlamaConfig) -> nn.Module:  # one decoder layer on the meta device: its shapes, no memory
    with torch.device("meta"):
        return LlamaDecoderLayer(config, layer_idx=0)


def layer_bytes(config: LlamaConfig, dtype: torch.dtype) -> int:  # one decoder layer's weights, flat, in `dtype`
    return FlatLayout.of(meta_layer(config)).numel * dtype.itemsize


# ----------------------------------------------------------------------------------------------------------- the plan
# Adds: every placement decision (Plan's fields), made before a byte is allocated from the facts the ranks agree on.
# Turned on: every run (--plan prints it and exits). Plugs into: the stores, streamers and steppers are built from it.


DEFAULT_RATES = {  # measured on the project's H200 (calls/results/2026-12-04); --rate NAME=VALUE overrides one
    "h2d_gbps": 55.0,  # pinned host memory to the GPU
    "d2h_gbps": 55.0,  # the GPU to pinned host memory
    "adam_gbps": 110.0,  # the CPU Adam's bytes through host memory, alone
    "host_gbps": 130.0,  # host memory under the CPU Adam and the copies together
    "gpu_tflops": 520.0,  # a step's matrix work in 16 bits (float32 runs at an eighth of it)
    "disk_gbps": 2.3,  # the --nvme disk, reading and writing
}
PROCESS_BYTES = 8 * GiB // 5  # a GPU run's own resident set beside its parts: torch, CUDA, the compiled Adam
HOST_MARGIN = 2 * GiB  # of the host budget, left out of the disk layers', the copy's and the buffers' decisions
HOST_SLACK = 4  # percent of host memory never planned for: the kernel's and each allocator's own, beside the parts
RANK_TIMEOUT = 60  # seconds: the least a rank waits for the others in a step's collective (--rank-timeout)
TIMEOUT_STEPS = 5  # the default timeout is this many times the plan's longest step part, at least RANK_TIMEOUT
SEGMENTS = (2, 3, 4, 6, 8, 12, 16)  # the segment lengths the plan weighs where every unit's inputs do not fit
PLAN_MARGIN = GiB // 2  # of a --max-gpu-memory budget, left out of a placement: the caching allocator's fragmentation
CUBLAS_WORKSPACE = 32 * 2**20  # torch's default cuBLAS workspace on Hopper, allocated once per stream
ADAM_SCRATCH = 2**25  # parameters: the bound times the CPU Adam on at most this many (their state kept aside, 512 MiB)
ADAM_FIT = 16  # and again on 1/16 of them: the two times give its fixed cost a call, which a step pays a unit
FAST_FLOPS = {"cpu": 1e11, "cuda": 2e15}  # FLOP/s: a run that takes under a minute at these is not worth a rate


@dataclass(frozen=True)
class Facts:
    """The machine a plan is made for: measured here or described by flags (measured_facts), agreed by the ranks."""

    gpu_bytes: int | None  # one GPU's memory; None: no GPU
    host_bytes: int | None  # what the run may take: MemAvailable, at most --max-host-memory; None: unknown
    disk_bytes: int | None  # free bytes in --nvme's folder; None without --nvme
    process_bytes: int  # one process's own resident set beside the model and its state: torch, CUDA's libraries
    cores: int  # the host's
    world: int = 1  # ranks
    local_world: int = 1  # ranks on one host: they share its memory and cores
    rates: tuple = tuple(DEFAULT_RATES.items())

    @property
    def ranks(self) -> Ranks:  # the ranks as sizes see them: every rank's shard is the same size
        return Ranks(0, self.world, 0, self.local_world)

    @property
    def host_share(self) -> int | None:  # the host memory one rank may plan for: its share, less HOST_SLACK
        return None if self.host_bytes is None else self.host_bytes * (100 - HOST_SLACK) // 100 // self.local_world


def measured_facts(run: RunConfig) -> Facts:
    """This machine's facts, but for those --gpu-memory, --host-memory, --gpus and --rate describe."""
    gpu = torch.cuda.is_available() and any(m != "cpu" for m in run.modes)
    described = run.gpu_memory is not None or run.host_memory is not None or run.gpus is not None
    host = host_memory_available() if run.host_memory is None else int(run.host_memory * GiB)
    if run.max_host_memory is not None:
        host = int(min(host or math.inf, run.max_host_memory * GiB))
    gpu_bytes = int(run.gpu_memory * GiB) if run.gpu_memory else gpu_total_bytes() if gpu else None
    disk = shutil.disk_usage(run.nvme).free if run.nvme else None
    process = PROCESS_BYTES if described else max(PROCESS_BYTES, process_rss()) if gpu else process_rss()
    world, local_world = run.gpus or run.ranks.world, run.gpus or run.ranks.local_world
    rates = tuple((DEFAULT_RATES | dict(run.rates)).items())
    return Facts(gpu_bytes, host, disk, process, host_cores(), world, local_world, rates)


def gpu_total_bytes() -> int:  # the memory of this process's GPU (under torchrun, its rank's)
    return torch.cuda.get_device_properties(torch.cuda.current_device()).total_memory


def host_cores() -> int:  # the cores this process may run on
    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1


def agreed_facts(ranks: Ranks, facts: Facts) -> Facts:
    """The facts every rank plans from: the least memory, disk and cores, the largest process, the slowest rates."""
    each = ranks.each(facts)
    fields = ("gpu_bytes", "host_bytes", "disk_bytes", "cores")  # each the least a rank knows; None where none knows it
    least = {k: min([getattr(f, k) for f in each if getattr(f, k) is not None], default=None) for k in fields}
    rates = tuple((name, min(dict(f.rates)[name] for f in each)) for name, _ in facts.rates)
    return dataclasses.replace(facts, **least, process_bytes=max(f.process_bytes for f in each), rates=rates)


@dataclass(frozen=True)
class ModePlan:
    """An offloaded mode's plan: prefetch depth, inference's and training's placements and GPU peaks, the bound."""

    depth: int
    inference_resident: tuple[int, ...]  # decoder layers
    inference_gpu: dict  # part -> bytes
    resident: tuple[int, ...]  # training's resident units
    gpu_adam: tuple[int, ...]  # the units the GPU's Adam steps over streamed state
    training_gpu: dict  # part -> bytes
    training_fits: bool
    bound_ms: dict  # part -> predicted ms
    keep: tuple[int, ...] = ()  # the units whose graphs training keeps: not recomputed
    step_ms: float = 0.0  # the predicted step
    runner_up: dict = dataclasses.field(default_factory=dict)  # the next placement the search weighed, described

    @property
    def training_peak(self) -> int:  # the predicted peak GPU memory of a training step
        return sum(self.training_gpu.values())


@dataclass(frozen=True)
class Plan:
    """The run's plan (make_plan): every decision, and what each costs."""

    facts: Facts
    offload_activations: bool
    disk_layers: int  # decoder layers whose Adam moments live on the --nvme disk (disk_units: which)
    copy_dtype: str | None  # the masters' copy the GPU streams; None: the float32 masters, cast on the GPU
    grad_buffers: int  # pinned gradient buffers: one per unit, or fewer shared ones
    threads: int  # the CPU threads of each rank
    rank_timeout: float  # seconds a rank waits in a step's collective
    host: dict  # part -> bytes of one rank's peak host memory
    disk: int  # bytes on the --nvme disk, every rank of the host's
    modes: dict  # mode -> ModePlan, for the offloaded modes
    segment: int = 1  # units a segment: only each segment's first keeps its inputs; 1: every unit
    disk_units: tuple[int, ...] = ()  # the units whose Adam moments the disk tier keeps (disk_units)
    remake_segments: bool = False  # segments remake their inputs by their forwards run again (SegmentInputs)

    @property
    def host_peak(self) -> int:  # the predicted peak host memory of one rank
        return sum(self.host.values())

    @property
    def torch_copy_dtype(self) -> torch.dtype | None:  # the copy's dtype as a torch.dtype
        return DTYPES[self.copy_dtype] if self.copy_dtype else None

    def as_dict(self) -> dict:  # the plan for --json and the checkpoint
        return dataclasses.asdict(self)

    def described(self, mode: str, units: list[Unit]) -> dict:  # the mode's training placement, as a runner-up is
        placed = self.modes[mode]
        names = {f: unit_names(units, getattr(placed, f)) for f in ("keep", "resident", "gpu_adam")}
        chosen = {"segment": self.segment, "remake_segments": self.remake_segments, "disk_layers": self.disk_layers}
        return names | {"step_ms": placed.step_ms, "peak_bytes": placed.training_peak} | chosen


def make_plan(run: RunConfig, config: LlamaConfig, facts: Facts) -> Plan:
    """The plan of `run` on the machine of `facts`, from these alone; DiskShort where the disk lacks room for it.
    Where every unit keeping its inputs does not fit, or leaves the inputs or moments on the host or the disk, the
    fastest that fits of it and each segment length, with the host's margin or without."""
    given = run.segment == 1 or run.offload_activations  # --offload-activations keeps every unit's inputs, on host
    if given or not offloaded_training(run):
        return segment_plan(dataclasses.replace(run, segment=run.segment or 1), config, facts)
    tried, shorts = [], []
    for length, remake, margin in plan_candidates(run):
        try:  # without the host's margin, fewer layers' moments cross the disk
            plan = segment_plan(dataclasses.replace(run, segment=length, remake_segments=remake), config, facts, margin)
        except DiskShort as error:  # the disk lacks room for this one's moments (segments may need fewer)
            shorts.append(error)
            continue
        if (length, margin) == (1, HOST_MARGIN) and plan_fits(plan) and not plan.offload_activations and not plan.disk:
            return plan  # every unit keeps its inputs on the GPU, its moments on the host, the margin: nothing to weigh
        tried.append(plan)
    if not tried:
        raise min(shorts, key=lambda error: error.short)  # the plan that comes nearest: what to free for it
    # the fastest that fits; where none fits, every unit keeping its inputs (check_plan says what is short)
    best, *others = sorted(tried, key=lambda p: (not plan_fits(p), plan_step_ms(p) if plan_fits(p) else p.segment))
    chosen = (best.segment, best.remake_segments, best.disk_layers)
    others = [p for p in others if (p.segment, p.remake_segments, p.disk_layers) != chosen]  # margins alike
    if not others:
        return best
    units, other = model_units(config), others[0]
    modes = {m: dataclasses.replace(placed, runner_up=other.described(m, units)) for m, placed in best.modes.items()}
    return dataclasses.replace(best, modes=modes)


def plan_candidates(run: RunConfig) -> list[tuple[int, bool, int]]:
    """The (segment length, remade, host margin) plans make_plan weighs: --segment's in both ways (or remade), else
    every unit keeping its inputs first, then each of SEGMENTS either way, each with the host's margin and without."""
    ways = (True,) if run.remake_segments else (False, True)  # --remake-segments: remade
    if run.segment:
        return [(run.segment, remake, HOST_MARGIN) for remake in ways]
    segments = itertools.product(SEGMENTS, ways, (HOST_MARGIN, 0))
    return [(1, False, HOST_MARGIN), (1, False, 0), *segments]


def plan_fits(plan: Plan) -> bool:  # whether the host holds the plan and each mode's training fits its GPU budget
    host = plan.facts.host_share
    return (host is None or plan.host_peak <= host) and all(placed.training_fits for placed in plan.modes.values())


def plan_step_ms(plan: Plan) -> float:  # the plan's slowest predicted training step of its modes
    return max((placed.step_ms for placed in plan.modes.values()), default=0.0)


def segment_plan(run: RunConfig, config: LlamaConfig, facts: Facts, margin: int = HOST_MARGIN) -> Plan:
    """The plan with run.segment's segments: activation offload, the disk's layers and the host's room for what the
    placements leave on the host (planned again once they keep units resident, whose state then leaves it; where that
    has not settled in 3 rounds, check_plan finds the host short), the disk's layers the fewest that leave `margin` of
    the host spare (else none)."""
    given = dataclasses.replace(run, offload_activations=activation_offload_planned(run, config, facts))
    resident = set()
    if given.nvme and given.nvme_layers is None and offloaded_training(given):  # from what the GPU holds, no disk:
        probe = dataclasses.replace(given, nvme_layers=0)  # the disk's layers, planned first, would bar it the last
        room = host_room_planned(probe, config, facts)
        resident = resident_everywhere(probe, mode_plans(probe, config, facts, *room))
    for _ in range(3):  # the units resident settle in a round or two: fewer disk layers free no GPU memory
        layers = disk_layers_planned(given, config, facts, resident, tuple(dict.fromkeys((margin, 0))))
        run = dataclasses.replace(given, nvme_layers=layers)
        copy, buffers = host_room_planned(run, config, facts, resident)
        modes = mode_plans(run, config, facts, copy, buffers)
        if resident_everywhere(run, modes) == resident:
            break
        resident = resident_everywhere(run, modes)
    longest = max((ms for plan in modes.values() for ms in plan.bound_ms.values()), default=0.0)
    timeout = run.rank_timeout or max(RANK_TIMEOUT, math.ceil(TIMEOUT_STEPS * longest / 1e3))
    threads = max(1, facts.cores // facts.local_world)
    host = host_parts(run, config, facts, copy, buffers, resident_everywhere(run, modes))
    disk = run.nvme_layers * disk_unit_bytes(config, facts.ranks) * facts.local_world
    if facts.host_share is None or sum(host.values()) <= facts.host_share:  # else check_plan refuses it for the host
        check_disk_room(run, disk, facts)  # once the resident units, whose moments stay on the GPU, have settled
    name = copy and str(copy).removeprefix("torch.")
    decided = (run.offload_activations, run.nvme_layers, name, buffers, threads, timeout, host, disk, modes)
    held = set().union(*(placed.resident for placed in modes.values()))  # no mode's resident unit goes to the disk
    remake = run.remake_segments and run.segment_units > 1
    return Plan(facts, *decided, run.segment_units, disk_units(config, run.nvme_layers, held), remake)


def mode_plans(run: RunConfig, config: LlamaConfig, facts: Facts, copy, buffers: int) -> dict:
    """Each offloaded mode's placements (inference's, the search's for training) and predicted bound."""
    modes = {}
    for m in (mode for mode in run.modes if mode in ("blocked", "overlapped")):
        inference = inference_placement(run, config, facts, m) if run.inference else ((), {})
        tried = searched_placement(run, config, facts, m, copy, buffers) if run.train else []
        best = tried[0] if tried else Placement((), (), (), {}, True, {}, 0.0)
        training = best.resident, best.gpu_adam, best.gpu, best.fits, best.bound_ms, best.keep, best.step_ms
        chosen = {"segment": run.segment, "remake_segments": run.remake_segments, "disk_layers": run.nvme_layers}
        runner_up = tried[1].described(model_units(config)) | chosen if len(tried) > 1 else {}
        modes[m] = ModePlan(mode_depth(m, run.prefetch), *inference, *training, runner_up)
    return modes


def resident_everywhere(run: RunConfig, modes: dict) -> set[int]:
    """The units every offloaded training that fits keeps resident (one that does not is reported OOM, untrained)."""
    fitting = [set(plan.resident) for plan in modes.values() if plan.training_fits]
    return set.intersection(*fitting) if run.train and fitting else set()


def say_plan(run: RunConfig, config: LlamaConfig, plan: Plan) -> None:
    """Say on stderr what the plan decided that the command line did not ask for."""
    shards = shard_numels(config, plan.facts.ranks)
    if plan.offload_activations and not run.offload_activations:
        saved = size_text((config.num_hidden_layers + 2) * unit_inputs_bytes(run, config, plan.facts))
        cap = f"{run.max_gpu_memory:g} GiB cap"
        log(f"activation offload on: the saved inputs ({saved}) do not fit the {cap} with the rest")
    if plan.segment > 1 and not run.segment:
        saved = size_text((config.num_hidden_layers + 2) * unit_inputs_bytes(run, config, plan.facts))
        how = segments_text(plan.segment, plan.remake_segments).partition(", ")[2]
        why = f"every unit keeping its inputs ({saved}) did not fit or was slower"
        log(f"segments of {plan.segment} units on, {how}: {why}")
    if offloaded_training(run) and run.torch_dtype != torch.float32 and plan.copy_dtype is None:
        copy, instead = size_text(run.torch_dtype.itemsize * sum(shards)), "the GPU streams the float32 masters"
        log(f"no room on the host for the {run.dtype} copy of the masters ({copy}): {instead} and casts them")
    if offloaded_training(run) and plan.grad_buffers < len(shards):
        buffer = size_text(gradient_dtype(run).itemsize * max(shards))
        log(f"gradients: {plan.grad_buffers} pinned buffers of {buffer} for {len(shards)} units, all the host holds")


def plan_refusal(run: RunConfig, config: LlamaConfig, facts: Facts) -> str | None:  # why host or disk can't, or None
    try:
        check_host(run, config, make_plan(run, config, facts))
    except UsageError as e:
        return str(e)


def offloaded_training(run: RunConfig) -> bool:  # whether it trains an offloaded mode (the host holds its state)
    return run.train and offloaded(run.modes)


def compared_modes(run: RunConfig) -> set[str]:  # modes trained from gpu mode's start, each keeping first gradients
    if "gpu" not in run.modes or not offloaded(run.modes) or run.resume:  # a resumed mode starts from its checkpoint
        return set()
    return {"gpu", *({"blocked", "overlapped"} & set(run.modes))}


def owns_grads(run: RunConfig) -> bool:  # whether each unit keeps its gradients: compared, or its updates held
    return bool(compared_modes(run)) or run.holds_updates


def gpu_limit_text(run: RunConfig, plan: Plan) -> str:  # what a training placement must fit, in words
    gpu = plan.facts.gpu_bytes
    capped = run.max_gpu_memory is not None and (gpu is None or run.max_gpu_memory * GiB < gpu)
    whole = f"the --max-gpu-memory cap of {run.max_gpu_memory:g} GiB" if capped else f"the GPU's {gib(gpu or 0)} GiB"
    return f"{whole} less the plan's {gib(PLAN_MARGIN)} GiB for the allocator's fragmentation"


def gpu_budget(run: RunConfig, facts: Facts) -> int | None:  # a placement's bytes: the cap less PLAN_MARGIN, or None
    if run.max_gpu_memory is None:
        return None  # overlapped then streams every unit: the tables compare full offload with gpu mode
    return int(min(run.max_gpu_memory * GiB, facts.gpu_bytes or math.inf)) - PLAN_MARGIN


def host_spare(run, config, facts: Facts, copy, buffers: int, margin: int = HOST_MARGIN, resident=()) -> int | None:
    """One rank's host memory left with `copy`, `buffers` gradient buffers and the units `resident` (their state on the
    GPU alone), less `margin`; None: not known."""
    if facts.host_share is None:
        return None
    return facts.host_share - sum(host_parts(run, config, facts, copy, buffers, resident).values()) - margin


def activation_offload_planned(run: RunConfig, config: LlamaConfig, facts: Facts) -> bool:
    """--offload-activations, or on where only then does each offloaded mode's streamed training fit the budget."""
    budget = gpu_budget(run, facts)
    if run.offload_activations or not offloaded_training(run) or budget is None or run.segment_units > 1:
        return run.offload_activations  # segments keep what inputs they keep on the GPU
    offloaded = dataclasses.replace(run, offload_activations=True)
    modes = [m for m in run.modes if m in ("blocked", "overlapped")]
    peaks = [[streamed_peak(r, config, facts, m, run.torch_dtype) for r in (run, offloaded)] for m in modes]
    return all(on_gpu > budget >= offloaded_peak for on_gpu, offloaded_peak in peaks)


def streamed_peak(run: RunConfig, config: LlamaConfig, facts: Facts, mode: str, copy) -> int:
    """Training's peak GPU bytes in `mode` with every unit streamed, recomputed and stepped by the CPU Adam."""
    parts = training_parts(run, config, facts, mode_depth(mode, run.prefetch), owns_grads(run), (), (), copy)
    return sum((parts | unplaced_bytes(run, config, facts)).values())


def disk_layers_planned(run, config: LlamaConfig, facts: Facts, resident=(), margins=(HOST_MARGIN, 0)) -> int:
    """The decoder layers whose Adam moments live on --nvme: --nvme-layers, or the fewest the host needs them
    with the units `resident` (their state on the GPU alone), leaving the first of `margins` it can spare."""
    if not (run.nvme and offloaded_training(run)):
        return 0
    most = config.num_hidden_layers - (run.resident_layers or 0)  # the first layers' moments stay on the GPU
    if run.nvme_layers is not None and run.nvme_layers > most:
        raise UsageError(f"--nvme-layers {run.nvme_layers}: the model has {most} decoder layers the CPU Adam steps")
    counts = [run.nvme_layers] if run.nvme_layers is not None else range(most + 1)

    def fits(d: int, margin: int) -> bool:  # the host holds the plan with d layers' moments on the disk, `margin` spare
        buffers = least_grad_buffers(run, config)
        spare = host_spare(dataclasses.replace(run, nvme_layers=d), config, facts, None, buffers, margin, resident)
        return (spare or 0) >= 0

    # with the fewest gradient buffers and no copy: PCIe bytes cost less than the disk's
    layers = next((d for margin in margins for d in counts if fits(d, margin)), None)
    return counts[-1] if layers is None else layers  # None: the host is short even so, check_plan says by how much


def check_disk_room(run: RunConfig, needed: int, facts: Facts) -> None:
    """Refuse a plan whose run.nvme_layers' Adam moments, `needed` bytes on the disk, the disk has no room for."""
    free = facts.disk_bytes
    if free is not None and needed > free:
        short = f"{size_text(needed)} of Adam moments, {size_text(needed - free)} more than is free there"
        message = f"--nvme {run.nvme}: {run.nvme_layers} layers' {short}; free some space or give another disk"
        raise DiskShort(message, needed - free)


def host_room_planned(run: RunConfig, config: LlamaConfig, facts: Facts, resident=()) -> tuple:
    """Offloaded training's masters' copy dtype (None: float32 masters, cast on the GPU) and gradient buffers, the
    units `resident` holding their state on the GPU alone."""
    units, least = len(model_units(config)), least_grad_buffers(run, config)
    if not offloaded_training(run):
        return None, units
    shards, itemsize = shard_numels(config, facts.ranks), gradient_dtype(run).itemsize
    copy = None if run.torch_dtype == torch.float32 else run.torch_dtype  # in float32 the masters are the weights
    spare = host_spare(run, config, facts, copy, least, resident=resident)
    if copy and spare is not None and spare < 0:  # no room for the copy
        copy = None
        spare = host_spare(run, config, facts, copy, least, resident=resident)
    if least == units or spare is None or spare >= itemsize * (sum(shards) - 2 * max(shards)):
        return copy, units
    return copy, 2 + max(0, spare) // (itemsize * max(shards))


def least_grad_buffers(run: RunConfig, config: LlamaConfig) -> int:
    """The fewest pinned gradient buffers offloaded training can step with: one a unit where each unit's gradients
    wait for all (blocked, compared, float16's loss scale, clipping), else 2 (one fills, one steps)."""
    return len(model_units(config)) if owns_grads(run) or "blocked" in run.modes else 2


def shard_numels(config: LlamaConfig, ranks: Ranks) -> list[int]:  # each unit's elements in a rank's shard, padded
    return [ranks.shard_numel(unit.layout.numel) for unit in model_units(config)]


def disk_units(config: LlamaConfig, layers: int, resident=()) -> tuple[int, ...]:
    """The disk tier's units: `layers` decoder layers past the `resident` ones, spread evenly from the last, so that
    the backward meets their steps, which wait on the disk, at even intervals and not all at its start."""
    n = config.num_hidden_layers
    first = max((u for u in resident if 1 <= u <= n), default=0)  # units 1 .. first: the resident decoder layers
    return tuple(sorted(n - i for i in spread(n - first, layers)))  # unit n - i is decoder layer n - 1 - i


def spread(n: int, k: int) -> tuple[int, ...]:  # k of range(n) evenly from 0: each copy under a resident's compute
    return tuple(i for i in range(n) if -(-(i + 1) * k // n) > -(-i * k // n))


def inference_placement(run: RunConfig, config: LlamaConfig, facts: Facts, mode: str) -> tuple[tuple, dict]:
    """Inference's resident decoder layers (overlapped: as many as fit, spread) and the forward's GPU bytes by part."""
    layers, depth, tokens = config.num_hidden_layers, mode_depth(mode, run.prefetch), run.tokens

    def parts(k: int) -> dict[str, int]:  # the forward's GPU memory with k layers resident
        return analytic_peak_bytes(config, run.torch_dtype, tokens, k + min(depth + 1, layers - k))

    count, budget = run.resident_layers, gpu_budget(run, facts)
    if mode != "overlapped" or facts.world > 1 or (count is None and budget is None):  # a rank streams every layer
        count = 0
    elif count is None:
        count = max((k for k in range(layers + 1) if sum(parts(k).values()) <= budget), default=0)
    return spread(layers, count), parts(count)


def gpu_adam_units(units: list[Unit], resident, share: float, on_disk=()) -> tuple[int, ...]:
    """The streamed units, none `on_disk`, the GPU's Adam steps: up to `share` of their parameters, the head last."""
    numels = {u: unit.layout.numel for u, unit in enumerate(units) if u not in resident}
    chosen, budget = [], share * sum(numels.values())
    for u in (u for u in numels if units[u].kind != "norm" and u not in on_disk):  # in forward order
        if numels[u] > budget:
            break
        chosen.append(u)
        budget -= numels[u]
    return tuple(chosen)


@dataclass(frozen=True)
class Placement:
    """A training placement the plan weighs: which units keep their graphs, are resident, are stepped by the GPU's
    Adam; its GPU bytes by part, whether they fit, its predicted bound (ms by part) and step, whether the host fits."""

    keep: tuple[int, ...]
    resident: tuple[int, ...]
    gpu_adam: tuple[int, ...]
    gpu: dict
    fits: bool
    bound_ms: dict
    step_ms: float
    host_fits: bool = True  # the host holds the rest: fewer units resident leave it more to hold

    def described(self, units: list[Unit]) -> dict:  # for --plan and the JSON
        names = {f: unit_names(units, getattr(self, f)) for f in ("keep", "resident", "gpu_adam")}
        return names | {"step_ms": self.step_ms, "peak_bytes": sum(self.gpu.values())}


def searched_placement(run: RunConfig, config: LlamaConfig, facts: Facts, mode: str, copy, buffers) -> list:
    """Training's placements for `mode`, those that fit the GPU and the host first, then the fastest predicted step,
    of equal steps the least GPU memory: every unit recomputed, or the most (or half as many) keeping their graphs that
    fit, each with the units it then keeps resident (training_placement)."""
    depth, blocked = mode_depth(mode, run.prefetch), mode == "blocked"
    tried = []
    for keep in graph_options(run, config, facts, mode, copy):
        resident, gpu_adam, parts, fits = training_placement(run, config, facts, mode, copy, keep)
        bound = predicted_bound(run, config, facts, depth, resident, gpu_adam, copy, keep)
        serial = sum(bound[p] for p in ("gpu_compute_ms", "h2d_ms", "d2h_ms"))  # blocked: in turn, then the Adam
        serial += max(bound["cpu_adam_ms"], bound.get("disk_ms", 0.0))  # as its moments are read
        step = serial if blocked else max(bound.values())
        host = host_spare(run, config, facts, copy, buffers, 0, resident)  # as check_plan counts it
        tried.append(Placement(keep, resident, gpu_adam, parts, fits, bound, step, host is None or host >= 0))
    return sorted(
        tried, key=lambda p: (not (p.fits and p.host_fits), not p.fits, round(p.step_ms, 1), sum(p.gpu.values()))
    )


def graph_options(run: RunConfig, config: LlamaConfig, facts: Facts, mode: str, copy) -> list[tuple[int, ...]]:
    """The sets of units keeping their graphs the search weighs: none, and where the GPU has room, the most that fit
    and half as many; the decoder layers from the last, then the head (the embeddings and the norm recompute free)."""
    limit = (
        gpu_budget(run, facts) if run.max_gpu_memory is not None else facts.gpu_bytes and facts.gpu_bytes - PLAN_MARGIN
    )
    if not limit or run.offload_activations or run.segment_units > 1:  # segments recompute every unit
        return [()]
    units = model_units(config)
    order = [u for u in reversed(range(len(units))) if units[u].kind == "layer"] + [len(units) - 1]

    def fits(k: int) -> bool:  # the first k of `order` keep their graphs, every unit streamed, the GPU's Adam its share
        parts = training_placement(run, config, facts, mode, copy, order[:k], residents=False)[2]
        return sum(parts.values()) <= limit

    most = next((k for k in reversed(range(1, len(order) + 1)) if fits(k)), 0)
    return list(dict.fromkeys([(), tuple(sorted(order[:most])), tuple(sorted(order[: most // 2]))]))


def training_placement(run: RunConfig, config: LlamaConfig, facts: Facts, mode: str, copy, keep=(), residents=True):
    """Training's (resident units, GPU Adam units, GPU bytes by part, whether they fit) where the units in `keep` keep
    their graphs; only overlapped keeps units resident, and only where `residents` allows any."""
    depth, units = mode_depth(mode, run.prefetch), model_units(config)
    layers, besides = run.nvme_layers or 0, unplaced_bytes(run, config, facts, keep)
    last = range(config.num_hidden_layers + 1 - layers, config.num_hidden_layers + 1)  # residents leave this many

    def placement(resident: list[int], share: float) -> tuple[tuple, tuple, dict]:  # the GPU's Adam takes `share`
        gpu_adam = gpu_adam_units(units, resident, share, disk_units(config, layers, resident))
        parts = training_parts(run, config, facts, depth, owns_grads(run), resident, gpu_adam, copy)
        return tuple(resident), gpu_adam, parts | besides

    budget, resident, share = gpu_budget(run, facts), [], run.gpu_adam if mode == "overlapped" else 0.0
    keeps = residents and mode == "overlapped" and facts.world == 1  # a rank's units are its shards: none resident
    uncapped = keeps and budget is None and run.resident_layers is None and run.gpu_adam_share is None
    hidden = uncapped and facts.gpu_bytes and copies_hidden(run, config, facts, copy, keep)  # it keeps units (below)
    bound = compute_bound(run, config, facts, ((), ()), copy, keep)
    if share and run.gpu_adam_share is None and not hidden and bound:
        share = 0.0  # the compute bounds the step with every unit on the CPU Adam: the GPU's Adam would add to it
    if keeps and run.resident_layers is not None:
        resident = list(range(1, 1 + run.resident_layers))  # unit 0 is the embeddings
    elif keeps and budget is not None:
        resident = boundary_units([u for u in range(len(units)) if u not in last], placement, budget, share)
    elif hidden:
        limit, candidates = facts.gpu_bytes - PLAN_MARGIN, [u for u in range(len(units)) if u not in last]
        fitting = boundary_units(candidates, placement, limit)
        # at least the GPU's Adam's share: the host's traffic slows a compute-bound step more than the rates say
        least = len(boundary_units(placement([], share)[1], placement, limit))

        def step(resident: list[int]) -> float:  # predicted, every streamed unit on the CPU Adam
            return round(max(predicted_bound(run, config, facts, depth, resident, (), copy, keep).values()), 1)

        resident, share = min((fitting[:k] for k in range(least, len(fitting) + 1)), key=step), 0.0  # fewest fastest
    chosen = placement(resident, share)
    if budget is not None and sum(chosen[2].values()) > budget:
        chosen = placement(resident, 0.0)  # every streamed unit on the CPU Adam: no staging on the GPU
    limit = budget if budget is not None else facts.gpu_bytes or math.inf
    return (*chosen, sum(chosen[2].values()) <= limit)


def compute_bound(run: RunConfig, config: LlamaConfig, facts: Facts, placed: tuple, copy, keep=()) -> bool:
    """Whether the GPU's compute bounds an overlapped training step with `placed` (resident, GPU Adam units)."""
    parts = predicted_bound(run, config, facts, run.prefetch, *placed, copy, keep)
    return parts["gpu_compute_ms"] >= max(parts.values())


def copies_hidden(run: RunConfig, config: LlamaConfig, facts: Facts, copy, keep=()) -> bool:
    """Whether the GPU's compute outlasts both copies together of an overlapped step streaming every unit to the CPU
    Adam: the weights in and the gradients out, which share the host's memory with the Adam."""
    parts = predicted_bound(run, config, facts, run.prefetch, (), (), copy, keep)
    return parts["gpu_compute_ms"] >= parts["h2d_ms"] + parts["d2h_ms"]


def boundary_units(candidates, placement, limit: float, share: float = 0.0) -> list[int]:
    """The longest run of `candidates` from unit 0 whose placement fits `limit` (a cap, or the GPU with no cap)."""
    resident = []
    for u in candidates:
        if u != len(resident) or sum(placement([*resident, u], share)[2].values()) > limit:
            break
        resident.append(u)
    return resident


def training_parts(run, config, facts: Facts, depth: int, own_grads: bool, resident, gpu_adam, copy) -> dict:
    """A training placement's GPU bytes by part: slots, gradient buffers, GPU Adam staging, resident units' state."""
    b, shards, grad = run.torch_dtype.itemsize, shard_numels(config, facts.ranks), gradient_dtype(run)
    numels = [shard * facts.world for shard in shards]  # each unit whole on the GPU, its shards gathered
    on_gpu = [numels[u] for u in resident]
    streamed = [n for u, n in enumerate(numels) if u not in resident]
    largest, held = max(streamed, default=0), min(run.held_units, len(numels))  # a gradient buffer a unit held
    grads = largest * grad.itemsize
    casts = copy is None and run.torch_dtype != torch.float32  # the staging buffer of LayerStreamer.cast_in
    # StreamedAdam's: its largest unit's gradients, two staging slots, a chunk of gradients made float32
    adam = max((shards[u] for u in gpu_adam), default=0)
    chunk, copied = min(adam, GPU_ADAM_CHUNK), copy.itemsize if copy else 0
    return {
        "slots": ring_slots(depth, held, len(streamed)) * largest * b + casts * min(largest, STAGING) * 4,
        "gradient buffer": held * (grads if own_grads else max(grads, 4 * max(on_gpu, default=0))),
        "GPU Adam staging": adam * grad.itemsize + 2 * chunk * (12 + copied) + 4 * chunk * (grad != torch.float32),
        "resident weights": sum(on_gpu) * (0 if run.torch_dtype == torch.float32 else b),
        "resident masters and moments": 12 * sum(on_gpu),
        "resident gradients": 4 * sum(on_gpu) if own_grads else 0,
        "summed gradients": max(shards) * grad.itemsize if facts.world > 1 else 0,  # ShardedSteppers
    }


def unplaced_bytes(run: RunConfig, config: LlamaConfig, facts: Facts, keep=()) -> dict[str, int]:
    """Training's peak GPU bytes beside the units' weights and state, where it peaks: saved inputs, the graphs of the
    units in `keep` (not recomputed), a unit's working set, the rest."""
    kinds, inputs = [unit.kind for unit in model_units(config)], unit_inputs_bytes(run, config, facts)
    # a backward's bytes the meta trace misses: the layers' cuBLAS workspace (the backward's thread allocates it), eager
    # attention's float32 gradient of the softmax, CUDA's sorted embedding backward (float32 sums of a token's rows)
    eager = 4 * run.batch_size * config.num_attention_heads * run.seq_len**2 * (run.attention == "eager")
    extra = {"layer": CUBLAS_WORKSPACE + eager, "embed": 9 * run.tokens * config.hidden_size // 2 * (run.tokens > 3072)}
    working, graphs = {}, [0] * len(kinds)  # each unit's most GPU bytes beyond its weights and inputs; its graphs'
    traced = trace_key(run, config)
    for u, kind in enumerate(kinds):
        key = traced, kind, micro_batches_per_rank(run, facts), u in keep
        forward, backward, graphs[u] = traced_passes(*key)
        working[u] = forward, backward + extra.get(kind, 0)
    if run.held_units > 1:  # a segment's backward at its last unit: the others' graphs and gradients of a micro-batch
        for u, extra in segment_bytes(run, config, facts, kinds).items():
            working[u] = working[u][0], working[u][1] + extra
    # saved inputs as unit u runs (held_inputs) and the graphs before it; offloaded, the two still leaving in the
    # forward, none in the backward
    saved = {(u, b): held_inputs(u, run, b) * inputs for u in range(len(kinds)) for b in (0, 1)}
    if run.offload_activations:
        saved = {(u, b): 0 if b else min(u, 2) * inputs for u, b in saved}
    u, backward = max(saved, key=lambda ub: saved[ub] + sum(graphs[: ub[0]]) + working[ub[0]][ub[1]])
    # the rest: cuBLAS's workspace, HF's decoder kwargs, the token ids, activation offload's ring of slots
    passed = sum(t.nbytes for t in tensors_in(traced_decoder_kwargs(traced)))
    ids = micro_batches_per_rank(run, facts) * run.tokens * 8
    slots = min(run.prefetch + 1, config.num_hidden_layers + 1) if run.offload_activations else 0
    other = CUBLAS_WORKSPACE + passed + ids + slots * inputs
    held = {"saved inputs": saved[u, backward], "kept graphs": sum(graphs[:u])}
    return held | {"working set": working[u][backward], "other": other}


def held_inputs(u: int, run: RunConfig, backward: bool) -> int:
    """How many units' inputs (hidden states; unit 0's ids aside) wait on the GPU as unit u runs: the segments' first
    units' up to u's, and in a backward that remakes them those of u's segment up to u's own (all from its first's)."""
    segment = run.segment_units
    first = u - u % segment
    if not backward or not run.remake_segments:
        return u // segment
    return max(first // segment - 1, 0) + u - max(first, 1) + 1


def segment_bytes(run: RunConfig, config: LlamaConfig, facts: Facts, kinds: list[str]) -> dict[int, int]:
    """The bytes each segment's backward holds beyond its last unit's own working set, by that unit: the other units'
    graphs of a micro-batch and their micro-batch 0 gradients, which wait for micro-batch 1's (those take the place
    of the graphs autograd frees as it makes them)."""
    traced, length = trace_key(run, config), run.segment_units
    grads = (micro_batches_per_rank(run, facts) > 1) * run.torch_dtype.itemsize  # bytes a parameter
    numels = {unit.kind: unit.layout.numel for unit in model_units(config)}
    extra = {}
    for first in range(0, len(kinds), length):
        last = min(first + length, len(kinds)) - 1
        others = kinds[first:last]
        graphs = sum(traced_passes(traced, kind, 1, True)[2] for kind in others)
        extra[last] = graphs + grads * sum(numels[kind] for kind in others)
    return extra


def micro_batches_per_rank(run: RunConfig, facts: Facts) -> int:  # a step's most micro-batches on a rank (rank 0's)
    return -(-run.grad_accum // facts.world)


def unit_inputs_bytes(run: RunConfig, config: LlamaConfig, facts: Facts | None = None) -> int:  # a unit's saved inputs
    micro_batches = run.grad_accum if facts is None else micro_batches_per_rank(run, facts)
    return micro_batches * run.tokens * config.hidden_size * run.torch_dtype.itemsize


def tensors_in(tree) -> list[torch.Tensor]:  # the tensors in nested tuples, lists and dicts (an op's arguments, kwargs)
    if isinstance(tree, torch.Tensor):
        return [tree]
    values = tree.values() if isinstance(tree, dict) else tree if isinstance(tree, (tuple, list)) else ()
    return [t for value in values for t in tensors_in(value)]


class MetaMemory(torch.utils._python_dispatch.TorchDispatchMode):  # no public name in torch 2.11 to 2.13
    """While on, counts the bytes of the storages ops make on the meta device, as the caching allocator rounds them."""

    def __init__(self):
        super().__init__()
        self.live, self.peak, self.counted = 0, 0, set()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # run the op; count new storages until freed
        out = func(*args, **(kwargs or {}))
        inputs = {t.untyped_storage()._cdata for t in tensors_in((args, kwargs))}
        for storage in (t.untyped_storage() for t in tensors_in(out)):
            key, nbytes = storage._cdata, -(-storage.nbytes() // 512) * 512  # its C pointer: a meta data_ptr is 0
            if key in inputs or key in self.counted:
                continue
            self.counted.add(key)
            self.live += nbytes
            self.peak = max(self.peak, self.live)
            weakref.finalize(storage, self.free, key, nbytes)
        return out

    def free(self, key: int, nbytes: int) -> None:  # a counted storage was freed
        self.live -= nbytes
        self.counted.discard(key)


def trace_key(run: RunConfig, config: LlamaConfig, layers: int = 1) -> tuple:  # what a trace depends on
    config = copy.deepcopy(config)
    config.num_hidden_layers = layers
    return config.to_json_string(), run.attention, run.dtype, run.batch_size, run.seq_len


@functools.cache
def traced_passes(key: tuple, kind: str, micro_batches: int, keeps_graphs: bool = False) -> tuple[int, int, int]:
    """A unit's peak bytes beyond weights and inputs: its forward over `micro_batches`, then its recompute and
    backward (keeps_graphs: its backward through the forward's graphs); and the bytes the graphs hold in between."""
    config_json, attention, dtype_name, batch_size, seq_len = key
    config, dtype, shape = LlamaConfig.from_dict(json.loads(config_json)), DTYPES[dtype_name], (batch_size, seq_len)
    model = meta_model(config, dtype, attention)
    with torch.device("meta"):
        module = unit_module(kind, model.config).to(dtype).requires_grad_()
    kwargs = traced_decoder_kwargs(key)
    ids = [torch.zeros(shape, dtype=torch.long, device="meta") for _ in range(micro_batches)]
    xs = ids if kind == "embed" else [torch.zeros(*shape, config.hidden_size, dtype=dtype, device="meta")] * len(ids)

    def run_unit(x: torch.Tensor, k: int) -> torch.Tensor:  # as OffloadedTraining.run_unit, on micro-batch k
        if kind == "head":  # its logits freed as the loss makes them float32
            return model.loss_function(module(x), ids[k], vocab_size=config.vocab_size)
        return module(x, **kwargs) if kind == "layer" else module(x)

    def graph(x: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor]:  # as OffloadedTraining.unit_graph
        return with_graph(lambda x: run_unit(x, k), x)

    with sdpa_as_on_cuda(), MetaMemory() as memory:
        with torch.no_grad():
            graphs = [graph(x, k) for k, x in enumerate(xs)] if keeps_graphs else None
            outs = [out.detach() for _, out in graphs] if keeps_graphs else [run_unit(x, k) for k, x in enumerate(xs)]
        forward, held = memory.peak, memory.live - sum(out.untyped_storage().nbytes() for out in outs)
        memory.peak = memory.live  # the backward's peak, from here
        grads_in, first = [], []
        for k, (x, out) in enumerate(zip(xs, outs, strict=True)):
            x, y = graphs[k] if keeps_graphs else graph(x, k)
            if keeps_graphs:
                graphs[k] = None  # its saved tensors freed by its backward, as the step's are
            inputs = [x, *module.parameters()] if x.requires_grad else list(module.parameters())
            grads = torch.autograd.grad(y, inputs, out)
            grads_in.append(grads[0] if x.requires_grad else None)  # kept, as the backward's are until it returns
            # each micro-batch's parameter gradients are freed before the next's, but the first's wait for the second's
            first[:] = [grads] if k == 0 and micro_batches > 1 else []
            del grads, y
    return forward, memory.peak, held


@functools.cache
def traced_model_step(key: tuple) -> int:
    """The resident model's peak bytes in a micro-batch's forward and backward beyond weights, activations, grads."""
    config_json, attention, dtype_name, batch_size, seq_len = key
    config, dtype, shape = LlamaConfig.from_dict(json.loads(config_json)), DTYPES[dtype_name], (batch_size, seq_len)
    model = meta_model(config, dtype, attention)
    kwargs, base = traced_decoder_kwargs(key), model.model
    ids = torch.zeros(shape, dtype=torch.long, device="meta")
    with sdpa_as_on_cuda(), MetaMemory() as memory:
        hidden = base.embed_tokens(ids)
        for layer in base.layers:
            hidden = layer(hidden, **kwargs)
        model.loss_function(model.lm_head(base.norm(hidden)), ids, vocab_size=config.vocab_size).backward()
    return memory.peak


@functools.cache
def traced_decoder_kwargs(key: tuple) -> dict:
    """What HF passes each decoder layer, on the meta device: made on the CPU for 3 x 5 tokens, grown to the run's."""
    config_json, attention, dtype_name, batch_size, seq_len = key
    small, dtype = LlamaConfig.from_dict(json.loads(config_json)), DTYPES[dtype_name]
    small.vocab_size, small.num_hidden_layers = 1, 0
    model = LlamaForCausalLM._from_config(small, dtype=dtype, attn_implementation=attention)
    model.config.num_hidden_layers = 1
    kwargs = decoder_kwargs(model, (3, 5), dtype, torch.device("cpu"))

    def grown(value):  # each tensor in `value` on the meta device, its batch of 3 and its 5 tokens the run's
        if isinstance(value, (tuple, list)):
            return type(value)(grown(v) for v in value)
        if not isinstance(value, torch.Tensor):
            return value
        shape = [batch_size if (i == 0 and n == 3) else seq_len if n == 5 else n for i, n in enumerate(value.shape)]
        return torch.empty(shape, dtype=value.dtype, device="meta")

    return {key: grown(value) for key, value in kwargs.items()}


@contextlib.contextmanager
def sdpa_as_on_cuda():
    """While on, sdpa on meta tensors runs CUDA's maskless kernel (not the meta device's math one), as its memory."""
    plain, aten = nn.functional.scaled_dot_product_attention, torch.ops.aten

    def sdpa(q, k, v, attn_mask=None, dropout_p=0.0, is_causal=False, scale=None, enable_gqa=False):  # on meta tensors
        grouped = enable_gqa and k.shape[1] != q.shape[1]  # the memory-efficient kernel takes no grouped heads
        if attn_mask is not None or q.device.type != "meta" or (grouped and q.dtype == torch.float32):
            return plain(q, k, v, attn_mask, dropout_p, is_causal, scale=scale, enable_gqa=enable_gqa)
        if q.dtype == torch.float32:  # the memory-efficient kernel; flash attention in 16 bits
            grad, efficient = torch.is_grad_enabled() and q.requires_grad, aten._scaled_dot_product_efficient_attention
            return efficient(q, k, v, None, grad, dropout_p, is_causal, scale=scale)[0]
        return aten._scaled_dot_product_flash_attention(q, k, v, dropout_p, is_causal, False, scale=scale)[0]

    nn.functional.scaled_dot_product_attention = sdpa
    try:
        yield
    finally:
        nn.functional.scaled_dot_product_attention = plain


def host_parts(run: RunConfig, config: LlamaConfig, facts: Facts, copy, buffers: int, resident=()) -> dict[str, int]:
    """One rank's peak host memory by part: the process, the model, offloaded training's state, the rest."""
    b, params, shards = run.torch_dtype.itemsize, param_count(config), shard_numels(config, facts.ranks)
    parts = {"process": facts.process_bytes, "model": 0 if draws_units(run) else b * params}
    if facts.world > 1 and run.inference and offloaded(run.modes):  # a rank's shards of the layers, beside the model
        parts["inference shards"] = b * config.num_hidden_layers * layer_numel(config, facts.ranks)
    if offloaded_training(run):
        on_disk = disk_units(config, run.nvme_layers or 0, resident)
        # the moments' pages of the units on the disk, or resident and never touched (a resume fills them here first)
        untouched = sum(shards[u] for u in {*on_disk, *(() if run.resume else resident)})
        here = sum(shards) - sum(shards[u] for u in resident)  # the resident units' masters live on the GPU alone
        grads = gradient_dtype(run).itemsize * (sum(shards) if buffers >= len(shards) else buffers * max(shards))
        parts |= {
            "float32 masters": 4 * here,
            "Adam moments": 8 * (sum(shards) - untouched),
            "disk tier's buffers": DISK_SLOTS * disk_unit_bytes(config, facts.ranks) if on_disk else 0,
            "masters' copy": copy.itemsize * here if copy else 0,
            "gradient buffers": grads,
            "bound's scratch Adam": 16 * min(max(shards[1:-1] or shards), ADAM_SCRATCH) * bool(facts.gpu_bytes),
        }
        if run.save_pretrained and resident:  # on the host to be saved, together
            parts["resident masters saved"] = 4 * sum(shards[u] for u in resident)
    if run.train and (compared := compared_modes(run)):  # their first gradients and last masters, float32
        parts["compared states"] = 8 * params * len(compared)
    if run.train and "cpu" in run.modes:
        # a copy of the model, its float32 masters, their gradients and moments; a step's activations and gradients
        step = traced_model_step(trace_key(run, config, config.num_hidden_layers))
        parts["cpu mode's training"] = params * (b + 16) + step
    tokens = run.batch_size * run.seq_len  # the passes': ids, logits, the pinned saved inputs, cpu mode's activations
    ids = (1 + run.grad_accum) * tokens * 8  # int64: inference's batch and training's micro-batches
    logits = len(run.modes) * tokens * config.vocab_size * b if run.inference else 0
    saved = (config.num_hidden_layers + 2) * unit_inputs_bytes(run, config, facts)
    pool = saved if run.offload_activations and offloaded_training(run) else 0
    cpu = max(activation_bytes(config, run.torch_dtype, tokens), attention_bytes(run, config, whole_backward=run.train))
    return parts | {"passes": ids + logits + pool + (cpu if "cpu" in run.modes else 0)}


def predicted_bound(run, config, facts: Facts, depth: int, resident, gpu_adam, copy, keep=()) -> dict[str, float]:
    """What a training step cannot beat, by the rates: ms by part (GPU compute, copies, CPU Adam, host, disk); the
    units in `keep` are not recomputed. One part is a prediction, not a bound: cpu_adam_tail, the CPU Adam and then
    the GPU's work from the lowest CPU-stepped unit to the next gradients, as if that unit's update were its last."""
    rate, shards = dict(facts.rates), shard_numels(config, facts.ranks)
    streamed = [u for u in range(len(shards)) if u not in resident]
    order = segment_order(len(shards), run.segment_units, run.remake_segments)
    on_gpu, on_cpu = sum(shards[u] for u in gpu_adam), sum(shards[u] for u in streamed if u not in gpu_adam)
    grad, copied = gradient_dtype(run).itemsize, copy.itemsize if copy else 0
    slots = ring_slots(depth, run.held_units, len(streamed))
    weights = (copied or 4) * sum(shards[u] for u in step_copies(order, resident, slots))
    h2d, d2h = weights + 12 * on_gpu, grad * on_cpu + (12 + copied) * on_gpu
    adam = on_cpu * (24 + grad + copied)  # masters and moments read and written, gradients read, the copy written
    disk = 2 * (run.nvme_layers or 0) * disk_unit_bytes(config, facts.ranks)  # read, and written back
    kinds = [unit.kind for unit in model_units(config)]
    each = {kind: unit_flops(run, config, kind) for kind in set(kinds)}  # a micro-batch's forward of a unit of the kind
    recomputed = pass_flops(run, config) - sum(each[kinds[u]] for u in keep)
    recomputed += sum(each[kinds[u]] for u in remade_units(order))  # SegmentInputs' second forwards
    flops = (3 * pass_flops(run, config) + recomputed) * micro_batches_per_rank(run, facts)  # the backward twice
    tflops = rate["gpu_tflops"] / (8 if run.torch_dtype == torch.float32 else 1)
    moved = {"h2d": (h2d, "h2d_gbps"), "d2h": (d2h, "d2h_gbps"), "cpu_adam": (adam, "adam_gbps")}  # bytes, their rate
    moved["host_memory"] = facts.local_world * (adam + h2d + d2h + disk), "host_gbps"  # every rank's
    if disk:
        moved["disk"] = facts.local_world * disk, "disk_gbps"  # every rank's, on the host's one disk
    parts = {"gpu_compute_ms": flops / tflops / 1e9} | {f"{k}_ms": n / rate[r] / 1e6 for k, (n, r) in moved.items()}
    cpu_units = [u for u in streamed if u not in gpu_adam]
    if depth and cpu_units and not run.holds_updates:  # were the lowest unit's update the Adam's last (as it is
        # where the Adam keeps pace with the backward), the next forward waits for it and the Adam for the gradients
        # after it; the measured bound's adam_chain_ms takes the least chain of any unit updated last
        forward = {kind: flops * micro_batches_per_rank(run, facts) for kind, flops in each.items()}
        first, last = min(cpu_units), max(cpu_units)
        chain = sum(forward[kinds[u]] for u in range(first, len(kinds)))
        since = last - last % run.held_units  # the backwards run with the last's, recompute and all
        chain += sum((2 + (u not in keep)) * forward[kinds[u]] for u in range(since, len(kinds)))
        chain += sum(forward[kinds[v]] for v in remade_before(order, last))  # and SegmentInputs' remade forwards
        copies = (copied or 4) * shards[first] / rate["h2d_gbps"] + grad * shards[last] / rate["d2h_gbps"]
        parts["cpu_adam_tail_ms"] = parts["cpu_adam_ms"] + chain / tflops / 1e9 + copies / 1e6
    return parts


def check_plan(run: RunConfig, config: LlamaConfig, plan: Plan) -> None:
    """Refuse before allocating what the plan says won't fit: a GPU mode's least memory, the host's, a rank's peak."""
    run = dataclasses.replace(run, offload_activations=plan.offload_activations, nvme_layers=plan.disk_layers)
    run = dataclasses.replace(run, segment=plan.segment, remake_segments=plan.remake_segments)
    run = dataclasses.replace(run, grad_accum=micro_batches_per_rank(run, plan.facts))
    known = plan.facts.gpu_bytes is not None  # else there is no GPU to check against
    needs = {mode: gpu_bytes_needed(run, config, mode) for mode in run.modes if mode != "cpu" and known}
    if needs:
        cap = int(min(run.max_gpu_memory * GiB, plan.facts.gpu_bytes)) if run.max_gpu_memory else plan.facts.gpu_bytes
        least = min(needs, key=needs.get)
        if needs[least] > cap:
            what = f"the --max-gpu-memory cap of {run.max_gpu_memory:g} GiB" if run.max_gpu_memory else "the GPU has"
            tokens = f"GPU memory for {run.grad_accum} x {run.batch_size} x {run.seq_len} tokens"
            more = f"more than {what} ({size_text(cap)}): use fewer or shorter sequences"
            raise UsageError(f"mode {least} needs at least {size_text(needs[least])} of {tokens}, {more}")
    budget = gpu_budget(run, plan.facts) or plan.facts.gpu_bytes
    for mode, placed in plan.modes.items():  # past the cap, one rank's OOM would leave the others waiting
        more = f"of GPU memory a rank, more than the {size_text(budget or 0)} it leaves"  # None: all fit
        if run.ranks.several and run.train and not placed.training_fits:
            advice = "use --offload-activations, or fewer or shorter sequences"
            raise UsageError(f"mode {mode}: the plan needs {size_text(placed.training_peak)} {more}: {advice}")
        passes = sum(placed.inference_gpu.values())
        if run.ranks.several and run.inference and budget and passes > budget:
            advice = "use fewer or shorter sequences, or --no-inference"
            raise UsageError(f"mode {mode}: a pass needs {size_text(passes)} {more}: {advice}")
    check_host(run, config, plan)


def check_host(run: RunConfig, config: LlamaConfig, plan: Plan) -> None:
    """The host holds the plan's peak (with several ranks on it, each rank's share of it)."""
    available = plan.facts.host_share
    if available is None or plan.host_peak <= available:
        return
    passes = plan.host["passes"]
    sequences = "use fewer or shorter sequences (--batch-size, --seq-len, --grad-accum)"
    smaller = "use a smaller model" if run.model else f"use {SMALLER_LAYERS}"
    advice = sequences if passes > plan.host_peak - passes else smaller
    if run.nvme is None and advice != sequences and offloaded_training(run):
        advice += ", or give --nvme DIR on a local disk for the Adam state"
    if run.max_host_memory is not None:
        advice += ", or a larger --max-host-memory"
    unfit = [m for m, placed in plan.modes.items() if run.train and placed.resident and not placed.training_fits]
    if unfit:  # its resident units' state is then the host's: the GPU is what is short
        gpu = f"mode {unfit[0]} does not fit the GPU with its {len(plan.modes[unfit[0]].resident)} resident units, so"
        advice = f"{gpu} the host holds their state: fewer --resident-layers or more --max-gpu-memory; else {advice}"
    parts = parts_text(plan.host, plan.host_peak / 20, size_text)
    short = f"{HOST_SLACK}% stays free for the kernel and the allocators; {size_text(plan.host_peak - available)} short"
    host = size_text(plan.facts.host_bytes // plan.facts.local_world)  # this rank's share
    needs = f"the run needs {size_text(plan.host_peak)} of host memory, only {host} are available"
    raise UsageError(f"{needs}, {size_text(available)} to plan for ({short}; the largest parts: {parts}): {advice}")


def runner_up_text(r: dict) -> str:  # a plan's runner-up (Plan.described), in words
    text = f"{r['step_ms']:.0f} ms, peak GPU {gib(r['peak_bytes'])} GiB; resident {r['resident']}"
    text += f"; GPU Adam {r['gpu_adam']}; keeping their graphs {r['keep']}; "
    text += f"segments {segments_text(r['segment'] or 1, r['remake_segments'])}; "
    return text + f"moments of {r['disk_layers']} layers on the disk"


def segments_text(length: int, remake: bool) -> str:  # a plan's segments, in words
    if length == 1:
        return "1"
    return f"{length}, " + ("their inputs remade by their forwards run again" if remake else "a micro-batch at a time")


def plan_table(plan: Plan, run: RunConfig, config: LlamaConfig) -> str:
    """The plan as one table: the machine it is made for, each decision, and what it predicts."""
    facts, units = plan.facts, model_units(config)
    gpu = f"{gib(facts.gpu_bytes)} GiB" if facts.gpu_bytes else "no GPU"
    gpu += " (--gpu-memory's)" if run.gpu_memory else ""
    host = f"{gib(facts.host_bytes)} GiB" if facts.host_bytes else "unknown"
    rows = [("machine", f"{facts.world} rank(s), {facts.local_world} a host; a GPU: {gpu}; host memory: {host}")]
    if offloaded_training(run):  # the offloaded training state's decisions
        rows += [
            ("activation offload", "on" if plan.offload_activations else "off"),
            (
                "segments: units a segment, only its first keeping its inputs",
                segments_text(plan.segment, plan.remake_segments),
            ),
            ("Adam moments on the disk", f"{plan.disk_layers} decoder layers ({size_text(plan.disk)})"),
            ("the masters' copy the GPU streams", plan.copy_dtype or "none: the float32 masters, cast on the GPU"),
            ("pinned gradient buffers", f"{plan.grad_buffers} for {len(units)} units"),
        ]
    rows.append(("threads a rank; rank timeout", f"{plan.threads}; {plan.rank_timeout:g} s"))
    rows.append(("predicted peak host, a rank", f"{gib(plan.host_peak)} GiB: {parts_text(plan.host)}"))
    for mode, placed in plan.modes.items():
        if run.inference:
            layers = ", ".join(map(str, placed.inference_resident)) or "none"
            peak = sum(placed.inference_gpu.values())
            rows.append((f"{mode} inference", f"resident decoder layers: {layers}; predicted peak GPU {gib(peak)} GiB"))
        if run.train:
            ms, fits = placed.bound_ms, "" if placed.training_fits else f" (does not fit {gpu_limit_text(run, plan)})"
            by = max(ms, key=ms.get)
            bound = ", ".join(f"{part.removesuffix('_ms').replace('_', ' ')} {t:.0f}" for part, t in ms.items())
            chosen = (placed.resident, placed.gpu_adam, placed.keep)
            names = "; ".join(unit_names(units, units_of) for units_of in chosen)
            peak = f"{gib(placed.training_peak)} GiB{fits}: {parts_text(placed.training_gpu)}"
            rows.append((f"{mode} training: resident; GPU Adam; keeping their graphs", names))
            rows.append((f"{mode} training: peak GPU", peak))
            step = f"{placed.step_ms:.0f} ms, bound by {by.removesuffix('_ms')}: {bound}"
            rows.append((f"{mode} training: predicted step", step))
            if placed.runner_up:
                rows.append((f"{mode} training: runner-up", runner_up_text(placed.runner_up)))
    lines = ["plan (--plan; predictions from the rates " + ", ".join(f"{k} {v:g}" for k, v in facts.rates) + ")", ""]
    return "\n".join([*lines, "| | |", "|---|---|", *(f"| {what} | {value} |" for what, value in rows)]) + "\n"


def parts_text(parts: dict, least: float = 2**20, text=gib) -> str:  # a peak's parts, largest first, none under least
    shown = sorted(((n, part) for part, n in parts.items() if n >= least), reverse=True)
    return ", ".join(f"{part} {text(n)}" for n, part in shown)


def unit_names(units: list[Unit], chosen) -> str:  # units by name, each run of layers joined: model.layers.0-13
    chosen = sorted(chosen)
    layers = [u - 1 for u in chosen if units[u].kind == "layer"]
    runs = [[n for _, n in run] for _, run in itertools.groupby(enumerate(layers), lambda i_n: i_n[1] - i_n[0])]
    names = [units[u].name for u in chosen if units[u].kind == "embed"]
    names += [f"model.layers.{run[0]}" + (f"-{run[-1]}" if len(run) > 1 else "") for run in runs]
    return ", ".join(names + [units[u].name for u in chosen if units[u].kind in ("norm", "head")]) or "none"


def params_with_layers(config: LlamaConfig, layers: int) -> int:  # the model's parameters with `layers` layers
    per_layer = sum(p.numel() for p in meta_layer(config).parameters())
    return param_count(config) + (layers - config.num_hidden_layers) * per_layer


def layer_numel(config: LlamaConfig, ranks: OneProcess = ONE_PROCESS) -> int:  # a decoder layer's padded shard
    return ranks.shard_numel(model_units(config)[1].layout.numel)


def disk_unit_bytes(config: LlamaConfig, ranks: OneProcess = ONE_PROCESS) -> int:  # a layer's moments on the disk
    return 2 * moment_bytes(layer_numel(config, ranks))


def moment_bytes(numel: int) -> int:  # an Adam moment of `numel` float32s on the disk, in whole direct-I/O blocks
    return -(-4 * numel // DISK_BLOCK) * DISK_BLOCK


def gradient_dtype(run: RunConfig) -> torch.dtype:  # gradients' dtype off the GPU: bfloat16's at one micro-batch
    return torch.bfloat16 if run.torch_dtype == torch.bfloat16 and run.grad_accum == 1 else torch.float32


def attention_bytes(run: RunConfig, config: LlamaConfig, whole_backward: bool) -> int:  # eager attention's scores
    scores = run.batch_size * config.num_attention_heads * run.seq_len**2 * run.torch_dtype.itemsize
    return scores * (config.num_hidden_layers + 1 if whole_backward else 2) * (run.attention == "eager")


def gpu_bytes_needed(run: RunConfig, config: LlamaConfig, mode: str) -> int:
    """A lower bound on a mode's GPU memory, known before allocating: weights or slots, state, inputs, activations."""
    dtype, b, layers = run.torch_dtype, run.torch_dtype.itemsize, config.num_hidden_layers
    act = activation_bytes(config, dtype, run.batch_size * run.seq_len, at_least=True)
    act = max(act, attention_bytes(run, config, whole_backward=run.train and mode == "gpu"))
    if mode == "gpu":
        return param_count(config) * (2 * b + 16 if run.train else b) + act
    depth = mode_depth(mode, run.prefetch)
    inference = min(depth + 1, layers) * layer_bytes(config, dtype) + resident_bytes(config, dtype) + act
    if not run.train:
        return inference
    unit_numel = max(layer_bytes(config, dtype) // b, config.vocab_size * config.hidden_size)  # a layer or the head
    # the units' saved inputs: all, or with activation offload the ring of slots and two still being copied out
    most = max(held_inputs(u, run, True) for u in range(layers + 3))  # all but the ids, in one segment
    saved_units = min(depth + 1, layers + 2) + 2 if run.offload_activations else most
    held, grads = min(run.held_units, layers + 3), gradient_dtype(run).itemsize  # the slots and the gradients
    weights = ring_slots(depth, held, layers + 3) * unit_numel * b + grads * unit_numel * held
    return max(inference, weights + saved_units * unit_inputs_bytes(run, config) + act)


def pass_flops(run: RunConfig, config: LlamaConfig) -> float:  # a forward's matrix FLOPs over a micro-batch
    attention = 4 * config.num_hidden_layers * run.batch_size * run.seq_len**2 * config.hidden_size
    return 2 * param_count(config) * run.tokens + attention


def unit_flops(run: RunConfig, config: LlamaConfig, kind: str) -> float:  # a unit's share of pass_flops
    if kind == "layer":
        attention = 4 * run.batch_size * run.seq_len**2 * config.hidden_size
        return 2 * sum(p.numel() for p in meta_layer(config).parameters()) * run.tokens + attention
    return 2 * config.vocab_size * config.hidden_size * run.tokens if kind == "head" else 0.0


def matmul_rate(device: torch.device, dtype: torch.dtype) -> float:
    """The FLOP/s of square matmuls in `dtype` on `device`, over a tenth of a second or so: a rough rate."""
    n = 2048 if device.type == "cuda" else 256
    a = torch.ones(n, n, dtype=dtype, device=device)
    a @ a  # the first call picks its kernel
    count, t0 = 0, time.perf_counter()
    while time.perf_counter() - t0 < 0.1:
        for _ in range(8 if device.type == "cuda" else 1):
            a @ a
            count += 1
        if device.type == "cuda":
            torch.cuda.synchronize(device)
    return 2 * n**3 * count / (time.perf_counter() - t0)


def warn_if_long(run: RunConfig, config: LlamaConfig) -> None:
    """Say on stderr how long the run computes at least (passes, steps), where over a minute at a matmul's rate."""
    flops = {"cpu": 0.0, "cuda": 0.0}
    for mode in run.modes:
        device = "cpu" if mode == "cpu" else "cuda"
        passes = 1 if mode == "cpu" else run.warmup + run.repeat  # and a step is 4 forwards' worth a micro-batch
        flops[device] += pass_flops(run, config) * (passes * run.inference + 4 * run.steps * run.grad_accum * run.train)
    slow = {device: f for device, f in flops.items() if f > 60 * FAST_FLOPS[device]}  # the rate is measured for these
    seconds = sum(f / matmul_rate(torch.device(device), run.torch_dtype) for device, f in slow.items())
    if seconds > 60:
        log(f"note: this run computes for {duration_text(seconds)} at least, at the rate a matmul reaches here")


def duration_text(seconds: float) -> str:  # a duration in words: 45 s, 12 min, 3.2 h, 18 days
    for unit, name in ((86400, "days"), (3600, "h"), (60, "min")):
        if seconds >= 2 * unit or (unit < 86400 and seconds >= unit):
            return f"{seconds / unit:.1f} {name}" if seconds < 10 * unit else f"{seconds / unit:.0f} {name}"
    return f"{seconds:.0f} s"


def place_units(trainer: OffloadedTraining, run: RunConfig, mode: str, plan: Plan) -> dict:
    """Install the plan's placement of the units; log it and describe it for the JSON."""
    placed = plan.modes[mode]
    place_on_gpu(trainer, placed.resident, placed.gpu_adam, owns_grads(run))
    if placed.keep and isinstance(trainer.inputs, SegmentStarts):
        raise ValueError("segments recompute every unit: the plan keeps no graphs with them")
    trainer.keep = frozenset(placed.keep)
    torch.cuda.reset_peak_memory_stats(trainer.device)  # the step's peak
    resident = [trainer.units[u].name for u in placed.resident]
    gpu_adam = [trainer.units[u].name for u in placed.gpu_adam]
    kept = [trainer.units[u].name for u in placed.keep]
    parts = ", ".join(f"{part} {gib(n)}" for part, n in placed.training_gpu.items())
    adam = f"stepped by the GPU's Adam over streamed state: {', '.join(gpu_adam) or 'none'}"
    graphs = f"keeping their graphs (not recomputed): {unit_names(trainer.units, placed.keep)}"
    peak = f"predicted peak {gib(placed.training_peak)} GiB: {parts}"
    log(f"mode {mode}: units resident on the GPU: {', '.join(resident) or 'none'}; {adam}; {graphs}; {peak}")
    described = {"units": len(trainer.units), "resident_units": resident, "gpu_adam_units": gpu_adam}
    described |= {"kept_graph_units": kept, "predicted_step_ms": placed.step_ms, "runner_up": placed.runner_up}
    remade = remade_units(trainer.inputs.backward_order(len(trainer.units)))  # SegmentInputs: run forward again
    described["remade_units"] = [trainer.units[u].name for u in remade]
    return described | {"predicted_peak_bytes": placed.training_peak, "predicted_parts": placed.training_gpu}


def planned_oom(mode: str, plan: Plan, device: torch.device) -> bool:  # the plan says training won't fit: OOM, logged
    placed = plan.modes.get(mode)
    if placed is None or device.type != "cuda" or placed.training_fits:
        return False
    log(f"mode {mode}: out of GPU memory: the plan needs {gib(placed.training_peak)} GiB, more than the cap leaves")
    return True


# -------------------------------------------------------------------------------------------------------- measurement
# Adds: the bounds (each part of a pass or step timed alone), efficiency, the traces, the comparisons with gpu
# mode. Turned on: every GPU run; --profile PATH. Plugs into: timed and the tables' results.


BOUND_SLACK = 1.02  # a bound this much above its step is a failed measurement: a part ran slower timed alone
SETTLE_S = 1.5  # seconds the bound times its GPU compute parts after: a loaded GPU's power cap slows its clocks
RESET_HOST_PEAKS = [0]  # the process's peak resident set at each reset_peak_memory, which restarts the kernel's count
RESIDENT_SCRATCH = 2**24  # elements: the bound times the resident units' Adam over scratch state this size
PROFILED = (torch.profiler.ProfilerActivity.CPU, torch.profiler.ProfilerActivity.CUDA)  # what --profile traces
# a GPU's dense 16-bit tensor-core peak, by a part of its name (H100 80GB HBM3: the SXM card), from NVIDIA's data sheets
DENSE_PEAK_FLOPS = {"H100 80GB HBM3": 989e12, "H100 PCIe": 756e12, "H100 NVL": 835e12, "H200": 989e12, "A100": 312e12}


def bound_parts_of(trainer, micro_batches, device: torch.device):  # offloaded GPU training's bound parts maker
    if isinstance(trainer, OffloadedTraining) and device.type == "cuda":
        return lambda: train_bound_parts(trainer, micro_batches, device)
    return None


def time_round(fns: dict, parts: dict[str, list[float]], ranks: Ranks) -> None:
    """Time each of `fns` (name -> (device, fn)) once, alone, into `parts`, the GPU compute parts first."""
    check_same(ranks, list(fns), "the bound's parts")
    compute = {name: part for name, part in fns.items() if isinstance(part[1], Compute)}
    end = time.perf_counter() + SETTLE_S  # they run untimed, in turn, till then: a loaded GPU's clocks settle lower
    while compute and time.perf_counter() < end:
        for device, fn in compute.values():
            fn()
            if device.type == "cuda":
                torch.cuda.synchronize(device)  # one part at a time queued, so the loop ends near SETTLE_S
    try:
        for name, (device, fn) in (compute | fns).items():  # the compute parts first
            ranks.meet()  # every rank starts each part together: as in a step, they share the host's memory
            parts[name].append(timed(fn, device)[0])
    finally:  # the parts timed on the training's own state put it back
        for fn in [fn for _, fn in fns.values() if isinstance(fn, AdamInPlace)]:
            fn.restore()


class Compute(functools.partial):
    """A part of the training bound that is GPU compute, which time_round times first, at settled clocks."""


class StepClock:
    """The training steps' times, CPU Adam busy times and memory peaks, but the bound's rounds and each next step."""

    def __init__(self, trainer, device: torch.device, done: int = 0, steps: int = 0, tokens: int = 0, seen: int = 0):
        self.trainer, self.device = trainer, device
        self.done, self.seen = done, seen  # steps and tokens trained before this run (a resumed run counts on)
        self.steps, self.tokens = steps, tokens  # this run's steps, and each step's tokens: for the progress
        self.adam = trainer.steppers.cpu_adam if isinstance(trainer, OffloadedTraining) else None
        self.times, self.busy = [], []  # each step's time, and the CPU Adam's busy time in it (ms)
        self.untimed = set()  # the steps right after a round
        self.paused_s = 0.0  # time spent in rounds and checkpoints between the steps
        self.peaks = {"peak_host_bytes": None}  # and on the GPU peak_gpu_bytes
        self.resume()

    def resume(self, after_round: bool = False) -> None:  # time the next step from now; after a round, new peaks
        if after_round:
            reset_peak_memory(self.device)
            self.paused_s += time.perf_counter() - self.paused_at
        self.start, self.busy_s = time.perf_counter(), self.adam and self.adam.busy_s

    def pause(self, i: int) -> None:  # a round before step i: every update done first, so each part runs alone
        self.paused_at = time.perf_counter()
        if self.adam:
            self.trainer.wait_updates()
        self.note_peaks()
        self.untimed.add(i)

    def note_peaks(self) -> None:  # count the GPU and host memory peaks since the last reset (no host's without /proc)
        gpu = torch.cuda.max_memory_allocated(self.device) if self.device.type == "cuda" else None
        for key, peak in (("peak_host_bytes", peak_host_rss()), ("peak_gpu_bytes", gpu)):
            if peak is not None:
                self.peaks[key] = max(self.peaks.get(key) or 0, peak)

    def lap(self, i: int, loss: float) -> None:  # step i has run: its time, the CPU Adam's busy time; a progress line
        now = time.perf_counter()
        self.times.append((now - self.start) * 1e3)
        self.start = now
        line = f"  step {self.done + i + 1}: loss {loss:.4f}, {self.times[-1]:.0f} ms"
        if self.adam:
            self.busy.append((self.adam.busy_s - self.busy_s) * 1e3)
            self.busy_s = self.adam.busy_s
            line += f", CPU Adam busy {self.busy[-1]:.0f} ms"
        rate = self.tokens / statistics.median(self.times[-10:]) * 1e3
        left = duration_text((self.steps - i - 1) * self.tokens / rate)
        log(f"{line}; {self.seen + (i + 1) * self.tokens:,} tokens seen, {rate:,.0f} tokens/s, {left} left")

    def result(self, warmup: int) -> dict:  # the median step after the warm-up, the steps timed, the peaks
        self.note_peaks()
        timed = [i for i in range(warmup, len(self.times)) if i not in self.untimed] or list(range(len(self.times)))
        result = {"time_ms": statistics.median(self.times[i] for i in timed), "step_ms": self.times}
        busy = {"cpu_adam_busy_ms": self.busy} if self.adam else {}
        return result | {"timed_steps": timed} | self.peaks | busy


def bound_rounds(run: RunConfig) -> list[int]:
    """Before which steps a round of the bound's parts runs: after the warm-up, then after up to run.repeat blocks."""
    after_warmup = run.steps - run.warmup
    blocks = max(0, min(run.repeat, after_warmup // 2))  # of 2 steps or more
    if blocks == 0:  # all after the last step (run.steps)
        return [run.steps] * (1 + run.repeat)
    return [run.warmup] + [run.warmup + after_warmup * (b + 1) // blocks for b in range(blocks)]


def free_gpu_memory() -> None:  # drop the last mode's GPU copies (an OOM's leftovers too) before the next's peak
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()


def interleaved_ms(fns: dict, warmup: int, repeat: int) -> tuple[dict[str, list[float]], object]:
    """Time each of `fns` (name -> (device, fn)) in rounds, one run each: the times, and the last one's last result."""
    times, out = {name: [] for name in fns}, None
    for r in range(warmup + repeat):
        for name, (device, fn) in fns.items():
            out = None
            ms, out = timed(fn, device)
            if r >= warmup:
                times[name].append(ms)
    return times, out


def reset_peak_memory(device: torch.device) -> None:  # start new GPU and host peaks (the process's peak is kept)
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
    RESET_HOST_PEAKS.append(peak_host_rss() or 0)
    with contextlib.suppress(OSError):
        Path("/proc/self/clear_refs").write_text("5")  # resets the peak resident set size (Linux)


def process_host_peak() -> int | None:  # the peak resident set since the process began: --max-host-memory's measure
    now = peak_host_rss()
    return None if now is None else max(now, *RESET_HOST_PEAKS)


def peak_host_rss() -> int | None:  # the process's peak resident set since the last reset, pinned memory included
    return proc_kib("/proc/self/status", "VmHWM")


def process_rss() -> int:  # the process's resident set now (0 where /proc cannot say): interpreter, torch, transformers
    return proc_kib("/proc/self/status", "VmRSS") or 0


def pipeline_bound_ms(streamed: list[bool], copy_ms: float, compute_ms: float, resident_ms: float, depth: int):
    """The fastest a pass can be, from per-layer copy and compute times (`streamed`: the layers copied in)."""
    n = len(streamed)
    if depth == 0:  # blocked: each copy before its layer
        return resident_ms + sum(streamed) * copy_ms + n * compute_ms
    # overlapped: all the compute, or the copies up to a streamed layer i and the compute from it on
    ends = [c * copy_ms + (n - i) * compute_ms for i, c in enumerate(itertools.accumulate(streamed)) if streamed[i]]
    return resident_ms + max([n * compute_ms, *ends])


def inference_parts(shell, streamer: LayerStreamer, input_ids) -> dict:
    """What bounds an offloaded pass, as functions to time alone: the streamed layers' copies, the compute, the rest."""
    device = input_ids.device
    hidden = shell.model.embed_tokens(input_ids)  # what the pass gives decoder layer 0, with decoder_kwargs
    kwargs = decoder_kwargs(shell, tuple(input_ids.shape), streamer.dtype, device)
    layer = streamer.modules[0]["layer"] if streamer.modules else streamer.resident[0]  # any layer: same time

    def copy_all():  # every streamed layer into its slot, nothing computed
        for p in range(len(streamer.window.units)):
            streamer.prefetch(p)
        streamer.wait_copies(torch.cuda.current_stream(device))  # `timed` records its end event on this stream

    def compute_all():  # one layer's compute once for every layer of the model, back to back
        for _ in streamer.sources:
            layer(hidden, **kwargs)

    def resident_only():  # the pass without its decoder layers: embeddings, norm and head
        layers = shell.model.layers
        shell.model.layers = nn.ModuleList()
        try:
            logits_of(shell, input_ids)
        finally:
            shell.model.layers = layers

    return {"copy": (device, copy_all), "compute": (device, compute_all), "resident": (device, resident_only)}


def inference_bound(streamer: LayerStreamer, best: dict[str, float], measured_ms: float) -> dict:
    """The parts' best times combined into the mode's bound, and the pass against it: efficiency, H2D bandwidth."""
    n, nbytes = len(streamer.streamed), streamer.sources[0].nbytes  # streamed layers, and one layer's bytes
    copy_ms, compute_ms = best["copy"] / n if n else 0.0, best["compute"] / len(streamer.sources)
    streamed = [u not in streamer.resident for u in range(len(streamer.sources))]
    bound_ms = pipeline_bound_ms(streamed, copy_ms, compute_ms, best["resident"], streamer.depth)
    parts = {"copy_ms_per_layer": copy_ms, "compute_ms_per_layer": compute_ms, "resident_ms": best["resident"]}
    parts["h2d_gbps_copy_only"] = nbytes / copy_ms / 1e6 if n else None
    parts |= {"bound_ms": bound_ms, "efficiency": bound_ms / measured_ms}
    return parts | {"h2d_gbps": n * nbytes / measured_ms / 1e6}


def gpu_memory(config: LlamaConfig, dtype: torch.dtype, tokens: int, layers_on_gpu: int) -> dict:
    """The peak GPU memory of the pass just run, next to the analytic figure for it."""
    analytic = analytic_peak_bytes(config, dtype, tokens, layers_on_gpu)
    return {"peak_gpu_bytes": torch.cuda.max_memory_allocated(), "analytic_peak_bytes": analytic}


def analytic_peak_bytes(config: LlamaConfig, dtype: torch.dtype, tokens: int, layers_on_gpu: int) -> dict[str, int]:
    """The GPU memory a forward pass needs by term: layer weights on the GPU, resident parts, activations, workspace."""
    weights, resident = layers_on_gpu * layer_bytes(config, dtype), resident_bytes(config, dtype)
    activations, workspace = activation_bytes(config, dtype, tokens), CUBLAS_WORKSPACE + 8 * 512
    return {"layer weights": weights, "resident parts": resident, "activations": activations, "workspace": workspace}


def resident_bytes(config: LlamaConfig, dtype: torch.dtype) -> int:  # on the GPU but slots: embeddings, head, norm
    return (2 * config.vocab_size * config.hidden_size + config.hidden_size) * dtype.itemsize


def activation_bytes(config: LlamaConfig, dtype: torch.dtype, tokens: int, at_least: bool = False) -> int:
    """A forward pass's largest activations; at_least: what it cannot do without (the MLP's peak, or the logits)."""
    b, h, i, v = dtype.itemsize, config.hidden_size, config.intermediate_size, config.vocab_size
    head_dim = getattr(config, "head_dim", None) or h // config.num_attention_heads
    layer_act = tokens * b * (4 * h + 3 * i)  # in the MLP: x, residual, attention sum, normed; act(gate), up, product
    head_act = tokens * (2 * b * h + 2 * 4 * h + b * v)  # hidden, normed, float32 norm temps, logits (not all coexist)
    if at_least:
        return max(layer_act, tokens * b * v)
    rotary_and_ids = tokens * (2 * head_dim * b + 2 * 8)  # cos and sin, token ids and position ids (int64)
    return max(layer_act, head_act) + rotary_and_ids


def training_figures(trainer, result: dict) -> dict:
    """An offloaded mode's gradient pool; on the GPU also its bound, from the parts' best times, and efficiency."""
    if not isinstance(trainer, OffloadedTraining):
        return {}
    pool = trainer.store.pool
    figures = {"gradient_pool": {"buffers": len(pool.buffers), "per_unit": pool.dedicated}}
    figures["gradient_pool"]["waited_ms"] = pool.waited_s * 1e3
    if disk := trainer.store.adam_moments.disk:
        tier = {"units": len(disk.units), "bytes": disk_step_bytes(disk), "direct_io": disk.files.direct}
        figures["disk_tier"] = tier | disk.files.rates | {"waited_ms": disk.waited_s * 1e3}
    if "bound_parts_ms" in result:
        busy = result.get("cpu_adam_busy_ms", [])
        timed = [busy[i] for i in result.get("timed_steps", ()) if i < len(busy)]
        in_step = statistics.median(timed) if timed else None
        figures |= train_bound(trainer, {name: min(ms) for name, ms in result["bound_parts_ms"].items()}, in_step)
        figures |= efficiency_of(figures["bound_ms"], result["time_ms"])
    return figures


def efficiency_of(bound_ms: float, step_ms: float) -> dict:
    """The bound against the step: its efficiency; or, where the bound's parts timed alone took longer than the whole
    step (by more than BOUND_SLACK), a failed measurement, reported as such, with no efficiency."""
    if bound_ms > BOUND_SLACK * step_ms:
        return {"efficiency": None, "bound_failed": True}
    return {"efficiency": bound_ms / step_ms}


def step_rates(run: RunConfig, config: LlamaConfig, mode: str, result: dict) -> dict:
    """A GPU mode's model TFLOPS a GPU, executed TFLOPS and their share of DENSE_PEAK_FLOPS in 16 bits."""
    if mode == "cpu" or not result.get("time_ms"):
        return {}
    seconds = result["time_ms"] / 1e3
    tokens = result["tokens_per_step"] // run.ranks.world  # a GPU's
    # executed, in each pass: 2 FLOPs a token for each matmul parameter, and causal attention's; the backward is two
    # passes, and every unit but those keeping their graphs (the gpu mode: all) runs its forward again, and in
    # SegmentInputs the segments' units but their last once more, for the next unit's inputs
    head = config.vocab_size * config.hidden_size
    layers = config.num_hidden_layers
    matmul_params = param_count(config) - (0 if config.tie_word_embeddings else head)
    layer = 2 * (matmul_params - head) // layers * tokens + 2 * tokens * run.seq_len * config.hidden_size
    flops = {"layer": layer, "head": 2 * head * tokens}  # a unit's forward, by kind (the embeddings and norm: none)
    forward = {unit.name: flops[unit.kind] for unit in model_units(config) if unit.kind in flops}
    kept = set(forward) if mode == "gpu" else set(result.get("kept_graph_units", ()))
    recomputed = sum(n for name, n in forward.items() if name not in kept)
    recomputed += sum(forward.get(name, 0) for name in result.get("remade_units", ()))
    rates = {"model_tflops": 6 * param_count(config) * tokens / seconds / 1e12}
    rates["executed_tflops"] = (3 * sum(forward.values()) + recomputed) / seconds / 1e12
    peak = dense_peak_flops()
    if peak and run.torch_dtype != torch.float32:
        rates["executed_share_of_peak"] = rates["executed_tflops"] * 1e12 / peak
    return rates


def dense_peak_flops() -> float | None:  # the GPU's dense 16-bit peak FLOP/s, where DENSE_PEAK_FLOPS knows its name
    name = torch.cuda.get_device_name()
    return next((flops for part, flops in DENSE_PEAK_FLOPS.items() if part in name), None)


def forward_backward_reference(model: LlamaForCausalLM, input_ids: torch.Tensor, run: RunConfig) -> dict:
    """What offloaded training is held to: plain forward and backward, the model resident on the GPU, no optimizer."""
    log(f"forward/backward reference: {run.grad_accum} micro-batches, the model resident on the GPU ...")
    device = torch.device("cuda")
    reset_peak_memory(device)
    ms, _ = median_ms(resident_forward_backward(model, input_ids, run), device, max(1, run.warmup), run.repeat)
    result = {"time_ms": ms, "sequences_per_s": input_ids.shape[0] / ms * 1e3}
    result["peak_gpu_bytes"] = torch.cuda.max_memory_allocated()
    free_gpu_memory()  # the model's GPU copy is gone with the function timed
    return result


def resident_forward_backward(model: LlamaForCausalLM, input_ids: torch.Tensor, run: RunConfig):
    """A function to time: one step's forward and backward of a GPU copy of `model` over the micro-batches."""
    device = torch.device("cuda")
    with torch.device("meta"):
        gpu = LlamaForCausalLM._from_config(model.config, dtype=run.torch_dtype, attn_implementation=run.attention)
    gpu.load_state_dict({k: v.to(device) for k, v in model.state_dict().items()}, assign=True)
    gpu.model.rotary_emb = LlamaRotaryEmbedding(model.config).to(device)  # computed, not in the state dict
    params = [p.requires_grad_() for p in gpu.parameters()]
    micro_batches = [ids.to(device) for ids in input_ids.chunk(run.grad_accum)]

    def forward_backward():  # one step's; its gradients are dropped at the start of the next
        for p in params:
            p.grad = None
        for ids in micro_batches:
            objective(gpu(ids, labels=ids, use_cache=False).loss, len(micro_batches), 1.0).backward()

    return forward_backward


def train_bound_parts(trainer: OffloadedTraining, micro_batches, device) -> dict:
    """The bound's parts as functions to time alone (name -> (device, fn)), made anew each round (train_bound's)."""
    fns, (on_cpu, _) = {}, cpu_and_gpu_adam_units(trainer)
    forwards = not trainer.blocked and (trainer.holds_updates or bool(on_cpu))  # train_bound's held bound or chain
    forwards = forwards or bool(remade_units(trainer.inputs.backward_order(len(trainer.units))))  # segments' too
    for name, (u, _) in compute_groups(trainer).items():  # one unit of each kind, recomputed or keeping its graphs
        forward, backward = unit_passes(trainer, u, micro_batches, device)
        fns[name] = (device, Compute(lambda forward=forward, backward=backward: backward(forward())))
        if forwards:
            fns[f"{name}_forward"] = (device, Compute(forward))
    if trainer.streamer.streamed:
        fns |= {"h2d": (device, lambda: copy_in(trainer)), "d2h": (device, lambda: copy_out(trainer))}
    resident = next((s.units for s in trainer.steppers.of if isinstance(s, ResidentUnits)), {})  # stepped on the GPU
    if resident:
        numels = [trainer.store.masters[u].numel() for u in resident]
        fns["resident_adam"] = (device, Compute(lambda: resident_adam(trainer, numels, device)))
    if on_cpu:  # the CPU Adam steps something: timed in one call, as a step's, on its largest unit's own state, put
        # back after the round (a call over a share of each unit would run slower a parameter than a step's)
        big, numel = max(on_cpu, key=on_cpu.get), adam_timed_numel(on_cpu)
        adam = AdamInPlace(trainer.store, {big: numel})
        cpu = torch.device("cpu")
        fns |= {"adam": (cpu, adam), "adam_small": (cpu, functools.partial(adam, ADAM_FIT))}
        fns["host"] = (cpu, lambda: adam_and_copies(trainer, big, adam, numel))
    if trainer.store.adam_moments.disk:
        fns["disk"] = (torch.device("cpu"), lambda: disk_cycle(trainer.store.adam_moments.disk))
    return fns


def compute_groups(trainer: OffloadedTraining) -> dict[str, tuple[int, int]]:
    """The units the bound times alike, by name ("layer", or "layer kept" for those keeping their graphs): (the first
    such unit, how many)."""
    groups = {}
    for u in range(len(trainer.units)):
        name = compute_group(trainer, u)
        first, count = groups.get(name, (u, 0))
        groups[name] = first, count + 1
    return groups


def compute_group(trainer: OffloadedTraining, u: int) -> str:  # unit u's name in compute_groups
    kind = trainer.units[u].kind
    return f"{kind} kept" if u in trainer.keep else kind


def resident_adam(trainer: OffloadedTraining, numels: list[int], device) -> None:
    """The resident units' Adam steps, as ResidentUnit.step makes them, over small scratch state on the GPU."""
    scratch = min(max(numels), RESIDENT_SCRATCH)
    master, grads, exp_avg, exp_avg_sq = (torch.zeros(scratch, device=device) for _ in range(4))
    weights = torch.empty(scratch, dtype=trainer.streamer.dtype, device=device)
    steps = torch.zeros((), device=device)
    for numel in numels:
        for lo in range(0, numel, scratch):
            n = min(scratch, numel - lo)
            torch_adam_step(trainer.store.update.adam, master[:n], grads[:n], exp_avg[:n], exp_avg_sq[:n], steps)
            weights[:n].copy_(master[:n])


def copy_in(trainer: OffloadedTraining) -> None:
    """Every H2D copy of a step: the forward's, the backward's but the slots', then the GPU's Adam's units' state."""
    streamer, n, gpu_adam = trainer.streamer, len(trainer.units), streamed_adam(trainer)
    for order, current in ((range(n), False), (trainer.inputs.backward_order(n), True)):
        streamer.begin(order, current)
        for p in range(len(streamer.window.units)):
            streamer.prefetch(p)
    with on_stream(streamer.copy_stream):
        for u in gpu_adam.units if gpu_adam else ():
            for k, lo, count in gpu_adam.chunks(u):
                gpu_adam.copy_in(u, k, lo, count)
    streamer.wait_copies(torch.cuda.current_stream())  # `timed` records its end event on this stream


def copy_out(trainer: OffloadedTraining) -> None:
    """Every D2H copy of a step into the pool's buffers (the state unchanged): CPU Adam gradients, GPU Adam state."""
    store, gpu_adam, steppers = trainer.store, streamed_adam(trainer), trainer.steppers
    if store.ranks.several:  # each unit's reduce-scatter first, on that stream, as ShardedSteppers queues it
        with on_stream(trainer.d2h_stream):
            for u in trainer.streamer.streamed:
                store.ranks.sum_shard(steppers.summed_shard(u), steppers.grads(u))
    pool = [buffer.view(torch.uint8) for buffer in store.pool.buffers]
    grads = trainer.steppers.buffers[0].view(torch.uint8)
    on_cpu, _ = cpu_and_gpu_adam_units(trainer)
    for u, numel in on_cpu.items():
        queue_copies(numel * store.grad_dtype.itemsize, grads, pool[u % len(pool)], trainer.d2h_stream)
    source = gpu_adam.buffer.view(torch.uint8) if gpu_adam else grads
    queue_copies(step_copy_bytes(trainer)[2], source, pool[0], trainer.d2h_stream)
    torch.cuda.current_stream().wait_stream(trainer.d2h_stream)  # `timed` records its end event on this stream


def adam_and_copies(trainer: OffloadedTraining, big: int, adam, numel: int) -> None:
    """The host traffic of `numel` CPU Adam parameters at once: their share of the copies, as Adam steps them."""
    on_cpu, _ = cpu_and_gpu_adam_units(trainer)
    h2d, d2h, _ = (count * numel // sum(on_cpu.values()) for count in step_copy_bytes(trainer))
    store, streamer = trainer.store, trainer.streamer
    buffer = store.pool.buffers[big % len(store.pool.buffers)].view(torch.uint8)
    queue_copies(h2d, store.masters[big].view(torch.uint8), streamer.buffers[0].view(torch.uint8), streamer.copy_stream)
    queue_copies(d2h, trainer.steppers.buffers[0].view(torch.uint8), buffer, trainer.d2h_stream)
    adam()
    torch.cuda.synchronize()  # the copies count in the time, which the CPU clock takes


def cpu_and_gpu_adam_units(trainer: OffloadedTraining) -> tuple[dict[int, int], dict[int, int]]:
    """The streamed units the CPU Adam steps, and those the GPU's Adam steps over streamed state: unit -> size."""
    gpu = getattr(streamed_adam(trainer), "units", ())  # none without a StreamedAdam
    numels = {u: trainer.store.masters[u].numel() for u in trainer.streamer.streamed}
    return {u: n for u, n in numels.items() if u not in gpu}, {u: n for u, n in numels.items() if u in gpu}


def streamed_adam(trainer: OffloadedTraining) -> StreamedAdam | None:  # its GPU Adam over streamed state, if any
    return next((s for s in trainer.steppers.of if isinstance(s, StreamedAdam)), None)


def step_copy_bytes(trainer: OffloadedTraining) -> tuple[int, int, int]:
    """A step's (H2D, D2H, the GPU Adam's part of D2H) bytes: weights and GPU Adam state in, gradients and state out."""
    store, streamer = trainer.store, trainer.streamer
    on_cpu, on_gpu = cpu_and_gpu_adam_units(trainer)
    copied = step_copies(trainer.inputs.backward_order(len(trainer.units)), streamer.resident, streamer.n_slots)
    state_in = 12 * sum(on_gpu.values())
    state_out = state_in + sum(on_gpu.values()) * (store.copies[0].itemsize if store.copies else 0)
    h2d = sum(store.weights[u].nbytes for u in copied) + state_in
    return h2d, sum(on_cpu.values()) * store.grad_dtype.itemsize + state_out, state_out


def queue_copies(nbytes: int, src: torch.Tensor, dst: torch.Tensor, stream) -> None:
    """Queue copies of `nbytes` in all from `src` into `dst` (byte views, each copy from their starts) on `stream`."""
    step = min(src.numel(), dst.numel())
    with on_stream(stream):
        for a in range(0, nbytes, step):
            dst[: min(step, nbytes - a)].copy_(src[: min(step, nbytes - a)], non_blocking=True)


def train_bound(trainer: OffloadedTraining, best: dict[str, float], in_step_adam_ms: float | None = None) -> dict:
    """What a training step cannot beat (ms by part), from train_bound_parts' best times scaled to the whole step; the
    CPU Adam's timed alone is a failed measurement where the steps' own (their median busy time) took less."""
    store = trainer.store
    on_cpu, on_gpu = cpu_and_gpu_adam_units(trainer)
    groups = compute_groups(trainer)
    parts = {"gpu_compute_ms": sum(count * best[name] for name, (_, count) in groups.items())}
    remade = remade_units(trainer.inputs.backward_order(len(trainer.units)))  # run forward again: SegmentInputs
    parts["gpu_compute_ms"] += sum(best[f"{compute_group(trainer, u)}_forward"] for u in remade)
    disk_bytes, figures = 0, {}
    if "resident_adam" in best:  # on the compute stream, between the passes
        parts["gpu_compute_ms"] += best["resident_adam"]
        figures["resident_adam_ms"] = best["resident_adam"]
    if store.adam_moments.disk:
        disk_bytes = disk_step_bytes(store.adam_moments.disk)  # read, and as many written
        parts["disk_ms"] = best["disk"]
        figures |= {"disk_bytes": disk_bytes, "disk_gbps": 2 * disk_bytes / best["disk"] / 1e6}
    if trainer.streamer.streamed:
        h2d_bytes, d2h_bytes, _ = step_copy_bytes(trainer)
        host_bytes = sum(on_cpu.values()) * store.update.bytes_per_param + h2d_bytes + d2h_bytes + 2 * disk_bytes
        parts |= {"h2d_ms": best["h2d"], "d2h_ms": best["d2h"]}
        figures |= {"h2d_bytes": h2d_bytes, "d2h_bytes": d2h_bytes, "host_bytes": host_bytes}
        figures["host_bytes_per_param"] = host_bytes / sum(m.numel() for m in store.masters)
        figures |= {"adam_bytes_per_param": store.update.bytes_per_param, "gpu_adam_params": sum(on_gpu.values())}
    if on_cpu:
        adam, figures["adam_calls_ms"], figures["cpu_adam_alone_ms"] = cpu_adam_parts(on_cpu, best, in_step_adam_ms)
        parts |= adam
        figures["host_gbps"] = host_bytes / parts["host_memory_ms"] / 1e6
    if trainer.blocked:  # nothing overlaps (S1, S2, S11): the GPU's parts in turn, then the Adam, its moments read
        parts["serial_ms"] = sum(parts.get(part, 0.0) for part in ("gpu_compute_ms", "h2d_ms", "d2h_ms"))
        parts["serial_ms"] += max(parts.get("cpu_adam_ms", 0.0), parts.get("disk_ms", 0.0))
    elif trainer.holds_updates:  # each waits for the whole backward, then the longer of the next forward and the Adam
        forward = sum(count * best[f"{name}_forward"] for name, (_, count) in groups.items())
        figures |= {"gpu_forward_ms": forward, "unheld_bound_ms": max(parts.values())}
        parts["held_updates_ms"] = parts["gpu_compute_ms"] - forward + max(forward, parts.get("cpu_adam_ms", 0.0))
    elif on_cpu:  # the CPU Adam idles through the chain (adam_chain_ms), so a step takes at least the two in turn
        figures["adam_chain_ms"] = adam_chain_ms(trainer, on_cpu, best, figures)
        parts["cpu_adam_chain_ms"] = parts["cpu_adam_ms"] + figures["adam_chain_ms"]
    bound = {"bound_ms": max(parts.values()), "bound_by": max(parts, key=parts.get).removesuffix("_ms")}
    return parts | bound | figures


def adam_chain_ms(trainer: OffloadedTraining, on_cpu: dict[int, int], best: dict[str, float], figures: dict) -> float:
    """The least GPU work a step between the CPU Adam's last update and its next, whichever unit it updates last: that
    unit's copy in (S4) and the forward from it through the head, then the backward down to the first unit the Adam
    steps, whose gradients leave (S5, S7) before it can start again."""
    last, n, store = max(on_cpu), len(trainer.units), trainer.store
    forward = [best[f"{compute_group(trainer, u)}_forward"] for u in range(n)]
    h2d = {u: store.weights[u].nbytes / figures["h2d_bytes"] * best["h2d"] for u in on_cpu}
    since = last - last % trainer.inputs.held  # the backward of the units whose backwards run with the last's
    backward = sum(best[compute_group(trainer, u)] - forward[u] for u in range(since, n))
    backward += sum(forward[v] for v in remade_before(trainer.inputs.backward_order(n), last))  # segments' remakes
    d2h = on_cpu[last] * store.grad_dtype.itemsize / figures["d2h_bytes"] * best["d2h"]
    return min(h2d[u] + sum(forward[u:]) for u in on_cpu) + backward + d2h


def disk_cycle(disk: DiskTier) -> None:
    """A step's disk traffic alone: each unit's moments read into a slot, in the backward's order, and written back."""
    disk.stop()  # the reader: the next step, untimed, reads it all again
    writes = collections.deque()
    try:
        for i, u in enumerate(disk.units):
            k = i % len(disk.ring)
            if len(writes) == len(disk.ring):
                writes.popleft().result()  # slot k's write-back has landed: it may be filled again
            disk.transfer(os.preadv, u, disk.ring[k])
            writes.append(disk.writer.submit(disk.transfer, os.pwritev, u, disk.ring[k]))
    finally:
        concurrent.futures.wait(writes)  # a read failed: no write still reads a slot the next step fills
    for write in writes:
        write.result()


def disk_step_bytes(disk: DiskTier) -> int:  # the bytes a step reads (and writes back): the moments, in whole blocks
    return sum(2 * half for half in disk.files.half.values())


def unit_passes(trainer: OffloadedTraining, u: int, micro_batches, device):
    """Unit u's forward() and backward(outs) over every micro-batch, as a step runs them from whatever its slot has:
    recomputed in the backward, or through the forward's graphs where u keeps them."""
    streamer = trainer.streamer
    streamer.begin([u])
    module = streamer.acquire(u)
    hidden = torch.randn(*micro_batches[0].shape, trainer.hidden_size, dtype=streamer.dtype, device=device)
    xs = micro_batches if trainer.units[u].kind == "embed" else [hidden] * len(micro_batches)
    trainer.labels = micro_batches
    views = trainer.grad_views(u)
    keeps_graphs = u in trainer.keep

    def forward() -> list:  # unit u's outputs, or where it keeps them its (input, output) graphs
        if keeps_graphs:
            return [trainer.unit_graph(u, module, x, k) for k, x in enumerate(xs)]
        with torch.no_grad():
            return [trainer.run_unit(u, module, x, k) for k, x in enumerate(xs)]

    def backward(outs: list) -> list:  # the outputs stand in for their gradients
        grad_outs = [out.detach() for _, out in outs] if keeps_graphs else outs
        return unit_backward(trainer, u, module, outs if keeps_graphs else xs, grad_outs, views)

    return forward, backward


def cpu_adam_parts(on_cpu: dict[int, int], best: dict[str, float], in_step_ms: float | None) -> tuple:
    """The bound's CPU Adam and host memory parts (their timed call scaled to every parameter it steps, its fixed cost
    counted a call a unit; the steps' own Adam time where the one timed alone took longer), the fixed costs, and the
    time alone where it failed (else None)."""
    scale = sum(on_cpu.values()) / adam_timed_numel(on_cpu)  # the parts timed this many of its parameters
    call = adam_call_ms(best["adam"], best["adam_small"])  # a step makes a call a unit: not scaled up
    adam, host = (len(on_cpu) * call + (best[name] - call) * scale for name in ("adam", "host"))
    failed = in_step_ms is not None and in_step_ms < adam
    parts = {"cpu_adam_ms": in_step_ms if failed else adam, "host_memory_ms": host}
    return parts, len(on_cpu) * call, adam if failed else None


def adam_call_ms(whole_ms: float, small_ms: float) -> float:
    """The CPU Adam's fixed cost a call (it wakes its threads): where the line through its timed call's time and the
    time over the call's first 1/ADAM_FIT meets no parameters."""
    return min(max(0.0, (ADAM_FIT * small_ms - whole_ms) / (ADAM_FIT - 1)), small_ms)


def adam_timed_numel(on_cpu: dict[int, int]) -> int:  # what the bound times the CPU Adam on: its largest unit, capped
    return min(max(on_cpu.values()), ADAM_SCRATCH)


class AdamInPlace:
    """A function to time: the store's Adam on each unit u's first `shares[u]` parameters, in place, on a worker; or
    on the first 1/divisor of each share."""

    def __init__(self, store: OffloadedAdam, shares: dict[int, int]):
        self.update, self.args = store.update, []
        for u, n in ((u, n) for u, n in shares.items() if n):
            grads = store.pool.buffers[u if store.pool.dedicated else 0][:n]  # the last step's: they are read only
            moments = store.moments[u] or [host_zeros(n, torch.float32, False).zero_() for _ in "ab"]  # disk's: scratch
            copy = store.copies[u][:n] if store.copies else None
            self.args.append((store.masters[u][:n], grads, *(m[:n] for m in moments), copy, store.steps[u]))
        self.written = [t for args in self.args for i, t in enumerate(args) if i != 1 and t is not None]
        self.before = [t.clone() for t in self.written]
        self.worker = ThreadPoolExecutor(1, initializer=torch.set_flush_denormal, initargs=(True,))
        self()  # untimed: a new thread's first parallel loop starts its OpenMP threads, which the bound scales up

    def __call__(self, divisor: int = 1) -> None:  # one update of every share (or its first 1/divisor), on the worker
        args = [[t[: t.numel() // divisor] if t is not None and t.dim() else t for t in a] for a in self.args]
        self.worker.submit(lambda: [self.update(*a) for a in args]).result()

    def restore(self) -> None:  # the masters, moments, copies and steps as before the first update, bit for bit
        self.worker.shutdown()
        for tensor, before in zip(self.written, self.before, strict=True):
            tensor.copy_(before)


def profile_pass(fn, path: str) -> dict:  # --profile: one more pass traced into `path`; how much copying was hidden
    with torch.profiler.profile(activities=PROFILED) as prof:
        fn()
        torch.cuda.synchronize()  # the trace must hold the whole pass
    write_atomically(path, prof.export_chrome_trace)
    return trace_overlap(path)


def profile_step(trainer, micro_batches, path: str) -> dict:
    """Write a Chrome trace of one training step, its CPU updates included; say how much copying was hidden."""
    all_threads = None  # by default only the profiler's and autograd's threads are recorded, not the CPU Adam worker's
    with contextlib.suppress(AttributeError, TypeError):  # private, with no public form: torch 2.11 to 2.13 have it
        all_threads = torch._C._profiler._ExperimentalConfig(profile_all_threads=True)
    with torch.profiler.profile(activities=PROFILED, experimental_config=all_threads) as prof:
        loss = trainer.step(micro_batches).item()
        trainer.wait_updates()  # the worker goes on: a caller may step again
        torch.cuda.synchronize()  # the trace must hold the whole step
    write_atomically(path, prof.export_chrome_trace)
    return {"loss": loss, "path": path, "h2d": trace_overlap(path, "HtoD"), "d2h": trace_overlap(path, "DtoH")}


def trace_overlap(path: str, direction: str = "HtoD") -> dict:
    """From a Chrome trace: the copy time in `direction` (HtoD or DtoH), how much of it ran under other streams, and
    how much could have (hideable: before the other streams' last kernel ended)."""
    events = json.loads(Path(path).read_text())["traceEvents"]
    copies = [e for e in events if e.get("cat") == "gpu_memcpy" and direction in e.get("name", "")]
    spans = sorted((e["ts"], e["ts"] + e["dur"], e["args"].get("stream")) for e in events if e.get("cat") == "kernel")
    last = {}  # each stream's end of its kernels
    for _, k1, s in spans:
        last[s] = max(last.get(s, k1), k1)
    overlap_us = hideable_us = 0.0
    for c in copies:
        c0, c1, stream = c["ts"], c["ts"] + c["dur"], c["args"].get("stream")
        others_end = max((end for s, end in last.items() if s != stream), default=c0)
        hideable_us += max(0.0, min(c1, others_end) - c0)
        under = [(max(k0, c0), min(k1, c1)) for k0, k1, s in spans if s != stream and k0 < c1 and k1 > c0]
        covered, end = 0.0, float("-inf")  # the length of their union: overlaps counted once
        for a, b in sorted(under):
            if b > end:
                covered += b - max(a, end)
                end = b
        overlap_us += covered
    result = {"copy_ms": sum(c["dur"] for c in copies) / 1e3, "overlap_ms": overlap_us / 1e3}
    result["hideable_ms"] = hideable_us / 1e3
    result["copy_streams"] = sorted({c["args"].get("stream") for c in copies})
    return result | {"kernel_streams": sorted({k[2] for k in spans})}


def first_step_state(trainer) -> tuple[dict, dict]:  # (float32 gradients, masters) after a step: HF names, CPU
    if isinstance(trainer, ResidentTraining):
        return trainer.state_dict([m.grad for m in trainer.masters]), trainer.state_dict(trainer.masters)
    trainer.wait_updates()  # gradients have landed once their updates are done
    return trainer.state_dict(grads=True), trainer.state_dict()


def compare_training(result: dict, reference: dict, run: RunConfig) -> None:
    """Judge the first step's gradients (bitwise, unclipped) and masters (to float32 rounding) under eager attention."""
    grads, masters = result["grads"]
    ref_grads, ref_masters = reference["grads"]
    result["masters_step1_max_abs_diff"] = max_abs_diff(masters, ref_masters)
    result["masters_tolerance"] = masters_tolerance(max(m.abs().max().item() for m in ref_masters.values()), 1)
    result["masters_max_abs_diff"] = max_abs_diff(result["masters"], reference["masters"])  # 16-bit flips grow big
    if run.attention == "eager" and run.clip_grad_norm is None:  # sdpa's backward differs even from itself
        result["grads_equal_to_gpu"] = all(torch.equal(g, ref_grads[name]) for name, g in grads.items())
    if run.attention == "eager":
        result["masters_close_to_gpu"] = result["masters_step1_max_abs_diff"] <= result["masters_tolerance"]


def max_abs_diff(a: dict, b: dict) -> float:  # the largest absolute difference of two state dicts with the same names
    return max((t - b[name]).abs().max().item() for name, t in a.items())


def masters_tolerance(largest: float, steps: int) -> float:  # how far float32 rounding may move masters in `steps`
    return 4 * steps * torch.finfo(torch.float32).eps * largest


# -------------------------------------------------------------------------------------------------- the tables' notes
# Adds: the instruments' columns (REPORT_TABLES) and the notes under the tables. On: every run. Plugs into: tables.


ANALYTIC = ("analytic (GiB)", cell("analytic_peak_bytes", ".2f", lambda p: sum(p.values()) / GiB))  # the instruments'
H2D = ("H2D (GB/s)", cell("h2d_gbps", ".1f"))
BOUND, EFFICIENCY = ("bound (ms)", cell("bound_ms", ".1f")), ("efficiency", cell("efficiency", ".3f"))  # both parts'
TRAINING_MEMORY = [
    PEAK_GPU,
    ("predicted (GiB)", lambda r: gib(r.get("predicted_peak_bytes"))),
    ("units resident", lambda r: f"{len(r['resident_units'])} of {r['units']}" if "units" in r else ""),
    PEAK_HOST,
    ("host (B / param)", cell("host_bytes_per_parameter", ".1f")),
    ("on the disk (GiB)", lambda r: gib(r["disk_tier"]["bytes"]) if "disk_tier" in r else ""),
    ("set-up (s)", cell("setup_s", ".1f", lambda p: sum(p.values()))),
]
TRAINING_TIME = [
    STEP,
    BOUND,
    ("bound by:", cell("bound_by")),
    EFFICIENCY,
    ("model TFLOPS", cell("model_tflops", ".0f")),
    ("executed TFLOPS", cell("executed_tflops", ".0f")),
    ("of peak", cell("executed_share_of_peak", ".0%")),
    ("host traffic (B / param)", cell("host_bytes_per_param", ".1f")),
    *CHECKS,
]
REPORT_TABLES = {  # the tables a run prints: the assignment's columns (TABLES) and the instruments' beside them
    "inference": [
        ("Table 1: peak GPU memory, inference", [PEAK_GPU, ANALYTIC]),
        ("Table 2: time per forward pass, inference", [TIME, BOUND, EFFICIENCY, H2D, LOGITS]),
    ],
    "training": [
        ("Table 1 (training): peak memory per step", TRAINING_MEMORY),
        ("Table 2 (training): time per step", TRAINING_TIME),
    ],
}


def report_tables(results: dict, run: RunConfig, reference: dict | None = None, host: dict | None = None) -> str:
    """The tables a run prints (REPORT_TABLES), their notes, and the process's peak RSS against its host memory."""
    lines = [tables(results, run, REPORT_TABLES, run.model), *notes(results, run, reference)]
    peak, budget = (host or {}).get("peak_host_bytes_process"), (host or {}).get("host_budget_bytes")
    if peak is not None and budget is not None:
        cap = f"the --max-host-memory cap of {run.max_host_memory:g} GiB" if run.max_host_memory else "MemAvailable"
        within = f"{'within' if peak <= budget else 'OVER'} {cap} ({gib(budget)} GiB at the start)"
        lines.append(f"host: the process's peak resident set {gib(peak)} GiB, {within}")
    return "\n".join(lines)


def notes(results: dict, run: RunConfig, reference: dict | None = None):
    """The lines under the tables: each mode's notes, how the times were taken, the reference and speeds against it."""
    for mode, rs in results.items():
        yield from inference_notes(mode, rs.get("inference", {}))
        yield from training_notes(mode, rs.get("training", {}), run)
        yield from text_notes(mode, rs.get("training", {}), run)
    if "cpu" in results and not results["cpu"].get("inference", {"oom": True}).get("oom"):
        yield f"cpu: one run, no warm-up; GPU modes: median of {run.repeat} runs after {run.warmup} warm-ups"
    if run.train and run.attention != "eager" and "gpu" in results:
        yield "training: grads and masters judged against gpu mode with --attention eager only (sdpa: atomics)"
    if run.train and run.clip_grad_norm is not None:
        clipped = "training: gradients clipped (clip_grad_norm_ in gpu and cpu modes; offloaded units step once every"
        yield f"{clipped} unit's gradients are in); grads not judged against gpu mode's"
    if reference:
        ref = f"forward/backward reference (resident model, no optimizer, no cap): {reference['time_ms']:.1f} ms per"
        ref += f" step, {reference['sequences_per_s']:.2f} sequences/s, peak GPU {gib(reference['peak_gpu_bytes'])} GiB"
        yield ref
        for mode, rs in results.items():
            if "time_ms" in rs.get("training", {}):
                seqs = run.grad_accum * run.batch_size / rs["training"]["time_ms"] * 1e3
                ratio = seqs / reference["sequences_per_s"]
                yield f"{mode} training: {seqs:.2f} sequences/s, {ratio:.2f}x the reference's"
    if run.train:  # StepClock.result: over every step where the warm-up leaves none
        timed = f"after the first {run.warmup} of {run.steps} steps"
        if run.warmup >= run.steps:
            timed = f"over every step (--warmup {run.warmup} leaves none of {run.steps} after it)"
        skips = "offloaded GPU modes skip the step after each round of their bound's parts (it waits for no update)"
        yield f"training: median step time, start to next start, {timed}; {skips}"
    if any("model_tflops" in rs.get("training", {}) for rs in results.values()):  # what step_rates counts
        name, peak = torch.cuda.get_device_name(), dense_peak_flops()
        line = "training: model TFLOPS a GPU count 6 x parameters x tokens; executed TFLOPS the step's forward, the"
        line += " offloaded modes' recompute and the backward (twice a forward), causal attention's half of the scores"
        yield line + (f"; of peak: of the {name}'s dense 16-bit peak, {peak / 1e12:.0f} TFLOPS" if peak else "")


def inference_notes(mode: str, r: dict):  # a mode's inference notes: its resident layers, per-layer times, trace
    if r.get("resident_layers"):
        layers = ", ".join(map(str, r["resident_layers"]))
        yield f"{mode}: decoder layers {layers} resident on the GPU, the others streamed"
    if "compute_ms_per_layer" in r:
        copy = ""
        if r["h2d_gbps_copy_only"]:
            copy = f"copy {r['copy_ms_per_layer']:.2f} ms ({r['h2d_gbps_copy_only']:.1f} GB/s alone), "
        times = f"compute {r['compute_ms_per_layer']:.2f} ms; embeddings + norm + head {r['resident_ms']:.2f} ms"
        yield f"{mode}: per layer {copy}{times}"
    if "trace" in r:
        t = r["trace"]
        streams = f"(copy streams {t['copy_streams']}, kernel streams {t['kernel_streams']})"
        yield f"{mode} trace: {t['overlap_ms']:.1f} of {t['copy_ms']:.1f} ms of copies under compute {streams}"


def training_notes(mode: str, t: dict, run: RunConfig):
    """A mode's training notes: placement and peak, the bound's parts, the trace, the gradient pool, the masters."""
    if "predicted_peak_bytes" in t:
        resident, gpu_adam = t["resident_units"], t.get("gpu_adam_units", [])
        units = f"{len(resident)} of {t['units']} units resident ({', '.join(resident) or 'none'})"
        adam = f"{len(gpu_adam)} stepped by the GPU's Adam ({', '.join(gpu_adam) or 'none'})"
        parts = ", ".join(f"{part} {gib(n)}" for part, n in t["predicted_parts"].items())
        peak = f"peak GPU {gib(t['peak_gpu_bytes'])} GiB against {gib(t['predicted_peak_bytes'])} predicted: {parts}"
        yield f"{mode} training: {units}, {adam}; {peak}"
    if "gpu_compute_ms" in t:
        yield bound_note(mode, t)
    if "setup_s" in t:
        parts = ", ".join(f"{part.replace('_', ' ')} {s:.1f}" for part, s in t["setup_s"].items())
        yield f"{mode} training: set-up {sum(t['setup_s'].values()):.1f} s before the first step: {parts}"
    if "ranks" in t:
        each = ", ".join(f"{gib(r['peak_gpu_bytes'])} and {gib(r['peak_host_bytes'])}" for r in t["ranks"])
        host = f"host {gib(t['peak_host_bytes'])} GiB in all, {t['host_bytes_per_parameter']:.1f} bytes a parameter"
        yield f"{mode} training: {len(t['ranks'])} ranks, peak GPU and host GiB of each: {each}; {host}"
    if "trace" in t:
        h2d, d2h = (f"{c['overlap_ms']:.1f} of {c['copy_ms']:.1f} ms" for c in (t["trace"]["h2d"], t["trace"]["d2h"]))
        yield f"{mode} training trace: {h2d} of H2D copies and {d2h} of D2H copies ran under compute"
    if not (g := t.get("gradient_pool", {"per_unit": True}))["per_unit"]:
        waited = f"the backward waited {g['waited_ms']:.0f} ms in all for the CPU Adam to free one"
        yield f"{mode} training: {g['buffers']} shared gradient buffers; {waited}"
    if "disk_tier" in t:
        d = t["disk_tier"]
        io = "direct I/O" if d["direct_io"] else "buffered I/O"
        moments = f"the Adam moments of {d['units']} units ({gib(d['bytes'])} GiB) on the disk, {io}"
        yield f"{mode} training: {moments}; the CPU Adam waited {d['waited_ms']:.0f} ms in all for its reads"
    if t.get("grad_norms"):
        norms = f"{t['grad_norms'][0]:.3g} -> {t['grad_norms'][-1]:.3g}"
        yield f"{mode} training: gradient norm {norms} before clipping to {run.clip_grad_norm:g}"
    if "masters_max_abs_diff" in t:
        step1 = f"{t['masters_step1_max_abs_diff']:.3g} after step 1 (rounding allows {t['masters_tolerance']:.3g})"
        last = f"{t['masters_max_abs_diff']:.3g} after step {run.steps}"
        yield f"{mode} training: masters differ from gpu mode's by at most {step1} and {last}"


def text_notes(mode: str, t: dict, run: RunConfig):  # a mode's held-out losses, an evaluation's cost, its samples
    if t.get("evaluations"):
        first, last = t["evaluations"][0], t["evaluations"][-1]
        losses = f"{first['loss']:.4f} -> {last['loss']:.4f} (perplexity {first['perplexity']:.1f} -> "
        losses += f"{last['perplexity']:.1f}) after {last['tokens']:,} tokens"
        cost = f"{statistics.median(e['ms'] for e in t['evaluations']):.0f} ms an evaluation"
        step = f", {t['time_ms']:.0f} ms a step" if "time_ms" in t else ""
        yield f"{mode} training: held-out loss {losses}; {cost}{step}"
    for when, texts in t.get("samples", {}).items():
        for prompt, text in zip(run.sample, texts, strict=True):
            yield f"{mode} sample {when} training: {prompt!r} -> {text!r}"


def bound_note(mode: str, t: dict) -> str:  # a mode's training bound, each part alone, in the order of the parts
    rounds = len(next(iter(t["bound_parts_ms"].values())))
    adam = f", the resident units' Adam {t['resident_adam_ms']:.1f}" if "resident_adam_ms" in t else ""
    note = f"{mode} training bound, each part alone (best of {rounds} rounds): GPU compute {t['gpu_compute_ms']:.1f} ms"
    recompute = "recompute, " if len(t.get("kept_graph_units", ())) < t.get("units", 0) else ""
    note += f" (forward, {recompute}backward{adam}; after {SETTLE_S:g} s of load)"
    if "h2d_ms" in t:
        h2d, d2h = t["h2d_bytes"] / t["h2d_ms"] / 1e6, t["d2h_bytes"] / t["d2h_ms"] / 1e6
        note += f", H2D {t['h2d_ms']:.1f} ms ({h2d:.1f} GB/s), D2H {t['d2h_ms']:.1f} ms ({d2h:.1f} GB/s)"
    if "host_memory_ms" in t:
        calls = f"{t['adam_calls_ms']:.1f} of it a call's fixed cost, a unit"
        if t.get("cpu_adam_alone_ms") is None:
            note += f", CPU Adam {t['cpu_adam_ms']:.1f} ms ({calls})"
        else:  # the steps' own took less
            alone = t["cpu_adam_alone_ms"]
            note += f", CPU Adam {t['cpu_adam_ms']:.1f} ms as the steps ran it (timed alone {alone:.1f} ms, {calls}: "
            note += "a failed measurement)"
        note += f", host memory {t['host_memory_ms']:.1f} ms "
        note += f"({t['host_bytes'] / 1e9:.1f} GB, {t['host_bytes_per_param']:.1f} bytes per parameter, "
        note += f"{t['adam_bytes_per_param']} per CPU-stepped one for the Adam, at {t['host_gbps']:.0f} GB/s with the "
        note += "Adam and the copies running together)"
    if "disk_ms" in t:
        note += f", disk {t['disk_ms']:.1f} ms ({t['disk_bytes'] / 1e9:.1f} GB read and written back, "
        note += f"{t['disk_gbps']:.2f} GB/s together)"
    if "held_updates_ms" in t:
        why = "clipping" if t.get("grad_norms") else "float16's loss scale"
        note += f", updates held for the whole backward ({why}) {t['held_updates_ms']:.1f} ms (backward "
        note += f"{t['gpu_compute_ms'] - t['gpu_forward_ms']:.1f} ms, then the longer of the forward "
        note += f"{t['gpu_forward_ms']:.1f} ms and the CPU Adam; {t['unheld_bound_ms']:.1f} ms were they not held)"
    if "cpu_adam_chain_ms" in t:
        note += ", the CPU Adam and then the least the GPU runs between its last update and the next gradients it "
        note += "steps (a unit's copy in and the forward from it, the backward down to the first unit it steps and "
        note += "its gradients' copy out) "
        note += f"{t['cpu_adam_chain_ms']:.1f} ms (of them {t['adam_chain_ms']:.1f})"
    if "serial_ms" in t:
        note += f", every part in turn (blocked: nothing overlaps) {t['serial_ms']:.1f} ms"
    if t.get("bound_failed"):
        note += f"; a failed measurement: the {t['bound_by'].replace('_', ' ')} part timed alone took longer than the "
        note += "whole step, so it bounds nothing here (no efficiency)"
    return note


# ------------------------------------------------------------------------------------------------------------ text in
# Adds: --data tokenized once into a memory-mapped token cache, packed into --seq-len blocks shuffled by --seed, a share
# held out; --train-tokenizer; --sample. Turned on: --data, --sample. Plugs into: step_batches, forward_model.


END_OF_TEXT = "<|endoftext|>"  # a trained tokenizer's one special token: joins documents
LEFT_RUNNING = []  # threads of waited() still in native code: the interpreter's teardown would abort on them
CAUGHT = []  # the signals signals_raised's handler raised in this run
TOKEN_CACHE_FORMAT = 1  # part of the cache's key: a new format never reads an old file
TOKEN_MAGIC = b"OLTOKS"  # a token cache file's header: this, the ids' itemsize (2 or 4) and their count
TOKEN_HEADER = "<6sHQ"
TOKEN_START = 16  # bytes: the header's size, where the ids start
TOKENIZE_BATCH = 256  # documents the tokenizer's threads encode at once
HELD_OUT_SEED = 0  # draws the held-out blocks: the same for every --seed, so none is ever trained on


def data_files(run: RunConfig) -> list[Path]:
    """--data's files: the file itself, or the folder's files that match --data-glob at any depth, in sorted order."""
    path = Path(run.data)
    if not path.exists():
        raise UsageError(f"--data {path}: no such file or folder")
    patterns = [pattern.strip() for pattern in run.data_glob.split(",") if pattern.strip()]
    matched = {path} if path.is_file() else {f for p in patterns for f in path.rglob(p)}
    files = sorted(f for f in matched if f.is_file())
    others = sorted(f for f in matched if not f.is_file() and not f.is_dir())  # a FIFO, a device, a broken link
    if others:
        log(f"note: --data: {len(others)} match(es) of --data-glob left out, not files to read, such as {others[0]}")
    if not files:
        raise UsageError(f"--data {path}: no file in it matches --data-glob {run.data_glob}")
    if not any(f.stat().st_size for f in files):
        raise UsageError(f"--data {path}: empty, no text to train on")
    return files


def file_documents(path: Path, text: str, field: str) -> list[str]:
    """The documents of one file: its whole text, or, for JSONL, each line's text under `field`."""
    if path.suffix != ".jsonl":
        return [text]
    documents = []
    # lines end at \n alone (JSON strings may hold U+2028 and the like), and a BOM may start the file
    for number, line in enumerate(text.removeprefix("\ufeff").split("\n"), 1):
        if not line.strip():
            continue
        try:
            record = parse_json(line, finite_numbers=False)  # only its text is read
        except ValueError as e:
            raise UsageError(f"--data: {path} line {number} is not JSON ({getattr(e, 'msg', e)})") from None
        if not isinstance(record, dict) or not isinstance(record.get(field), str):
            raise UsageError(f"--data: {path} line {number} has no text under {field!r}: see --text-field")
        try:
            documents.append(record[field].encode("utf-8").decode("utf-8"))
        except UnicodeEncodeError:  # JSON's \\ud800 escapes make lone surrogates, which no tokenizer encodes
            raise UsageError(f"--data: {path} line {number} holds a lone surrogate (an escape like \\ud800)") from None
    return documents


def corpus_documents(run: RunConfig, files: list[Path], skipped: list[Path] | None = None):
    """Each document of the corpus, file by file, checked as it is read; the files skipped go to `skipped`."""
    for path in files:
        try:
            text = path.read_bytes().decode("utf-8")
        except OSError as e:
            raise UsageError(f"--data: {path} cannot be read ({e.strerror}): give files you can read") from None
        except UnicodeDecodeError as e:
            if not run.skip_undecodable:
                fix = "fix it, or pass --skip-undecodable"
                raise UsageError(f"--data: {path} is not UTF-8 (byte {e.start}): {fix}") from None
            if skipped is not None:
                skipped.append(path)
            continue
        yield from file_documents(path, text, run.text_field)


def saved_tokenizer(folder, flag: str, fix: str):
    """The tokenizer saved in `folder`, refused in one line naming `flag` and `fix` where it does not load."""
    try:
        return transformers.AutoTokenizer.from_pretrained(folder)
    except Exception as e:  # a damaged or missing file: the errors of tokenizers, json and sentencepiece vary
        raise UsageError(f"{flag} {folder}: its tokenizer does not load ({first_line(e)}): {fix}") from None


def tokenizer_text(tokenizer) -> str:  # a fast tokenizer's definition: equal for two that map text to the same ids
    return tokenizer.backend_tokenizer.to_str()


def load_tokenizer(run: RunConfig):  # --tokenizer's tokenizer, else --model's where its folder has one, else None
    folder = run.tokenizer or run.model
    if not has_tokenizer(folder):
        if run.tokenizer:
            raise UsageError(f"--tokenizer {run.tokenizer}: no tokenizer.json, tokenizer.model or vocab.json there")
        return None
    tokenizer = saved_tokenizer(folder, "--tokenizer" if run.tokenizer else "--model", "save it again")
    if tokenizer.eos_token_id is None:
        raise UsageError(f"the tokenizer in {folder} has no end-of-text token to join documents with")
    return tokenizer


def check_cache_entry(path: Path, kind: str, what: str) -> None:
    """Refuse what is at `path` in --data-cache unless it is `kind` or nothing: no write of the run's leaves it."""
    if path_kind(path) not in (None, kind):
        held = f"{path.name} is {path_kind(path)}, where the run caches {what}"
        raise UsageError(f"--data-cache {path.parent}: {held}: move it, or give another --data-cache")


def train_tokenizer(run: RunConfig, files: list[Path], folder: Path):
    """A byte-level BPE of --train-tokenizer tokens trained on the corpus, cached in `folder` (redone if damaged)."""
    check_cache_entry(folder, "a folder", "a tokenizer's folder")
    if folder.exists():
        try:
            return transformers.AutoTokenizer.from_pretrained(folder)
        except Exception as e:  # a cache entry damaged (a full disk, an edit): rebuilt, never a traceback
            other = foreign_entry(folder, lambda p: path_kind(p) == "a file" and re.fullmatch(TOKENIZER_FILE, p.name))
            if other:
                held = f"{folder.name} does not load as a tokenizer and holds {other}"
                fix = "which training it again would remove: move it, or give another --data-cache"
                raise UsageError(f"--data-cache {folder.parent}: {held}, {fix}") from None
            log(f"note: the cached tokenizer {folder} does not load ({first_line(e)}): trained again")
            remove_path(folder)
    t0 = time.perf_counter()
    megabytes = sum(f.stat().st_size for f in files) / 1e6
    log(f"tokenizer: training a byte-level BPE of {run.train_tokenizer} tokens on {megabytes:.1f} MB of text ...")
    # through transformers' own API: GPT-2's tokenizer, empty, trained anew with END_OF_TEXT its one special token
    empty = transformers.GPT2Tokenizer(vocab={}, merges=[], unk_token=END_OF_TEXT, bos_token=END_OF_TEXT)
    documents = corpus_documents(run, files)
    train = functools.partial(empty.train_new_from_iterator, documents, run.train_tokenizer, show_progress=False)
    tokenizer = waited(train, "tokenizer: still training")
    with folder_aside(folder) as tmp, named_errors(folder, writer=True):  # renamed whole: never a part of one
        tokenizer.save_pretrained(tmp)
        os.rename(tmp, folder)
    log(f"tokenizer: a byte-level BPE of {len(tokenizer)} tokens trained in {time.perf_counter() - t0:.1f} s")
    return tokenizer


def waited(work, what: str, every: float = 10.0):
    """work() in its own thread, logging `what` every `every` s: this wait takes the signals a native call holds."""
    outcome = {}

    def run() -> None:  # work()'s value or its error, for the waiting thread
        try:
            outcome["value"] = work()
        except BaseException as e:
            outcome["error"] = e

    thread, t0 = threading.Thread(target=run, daemon=True), time.perf_counter()
    thread.start()
    LEFT_RUNNING.append(thread)  # until it returns: should the wait end early, the process ends without it
    said = 0
    while thread.is_alive():
        thread.join(0.5)
        if CAUGHT:  # a signal whose raise fell in a callback, which prints and drops it: raised again here
            raise KeyboardInterrupt if CAUGHT[-1] == signal.SIGINT else Terminated(CAUGHT[-1])
        if time.perf_counter() - t0 >= (said + 1) * every and thread.is_alive():
            said += 1
            log(f"{what} ({time.perf_counter() - t0:.0f} s)")
    LEFT_RUNNING.remove(thread)
    if "error" in outcome:
        raise outcome["error"]
    return outcome["value"]


@contextlib.contextmanager
def folder_aside(folder: Path):  # a new folder beside `folder` to write it in, removed unless renamed
    folder.parent.mkdir(parents=True, exist_ok=True)
    tmp = None
    try:
        with signals_held():
            tmp = Path(tempfile.mkdtemp(dir=folder.parent, prefix=f".{folder.name}.", suffix=".tmp"))
        os.chmod(tmp, 0o777 & ~current_umask())  # mkdtemp makes it 0700
        yield tmp
    finally:
        if tmp is not None:
            shutil.rmtree(tmp, ignore_errors=True)


@contextlib.contextmanager
def named_errors(path, writer: bool = False, aside: str | None = None):
    """A failed write as an OSError naming `path` (where it names none, or `aside`); writer: any error of the block."""
    try:
        yield
    except OSError as e:
        if e.filename is not None and e.filename != aside:
            raise
        raise OSError(e.errno, e.strerror, str(path)) from e
    except Exception as e:
        if not writer or isinstance(e, UsageError):
            raise
        raise OSError(errno.EIO, f"could not be written ({first_line(e)}): is its disk full?", str(path)) from e


def current_umask() -> int:  # the process's umask (reading it means setting it: set back at once)
    umask = os.umask(0)
    os.umask(umask)
    return umask


def corpus_key(run: RunConfig, files: list[Path], tokenizer_text: str) -> str:
    """The token cache's key: each file's path, size and modification time, how it is read, and the tokenizer's text."""
    stats = [(str(f.resolve()), f.stat().st_size, f.stat().st_mtime_ns) for f in files]
    reading = [run.text_field, run.skip_undecodable, TOKEN_CACHE_FORMAT]
    tokenizer = hashlib.sha256(tokenizer_text.encode()).hexdigest()
    return hashlib.sha256(json.dumps([stats, reading, tokenizer]).encode()).hexdigest()[:24]


def token_cache(run: RunConfig, files: list[Path], tokenizer) -> torch.Tensor:
    """The corpus's ids, memory-mapped from the token cache: written once (aside, renamed), rebuilt if not whole."""
    path = data_cache_folder(run) / f"tokens-{corpus_key(run, files, tokenizer_text(tokenizer))}.bin"
    check_cache_entry(path, "a file", "token ids in a file")
    ids = mapped_tokens(path)
    if ids is not None and largest_id(ids) < len(tokenizer):
        log(f"data: {ids.numel():,} tokens of {len(files)} file(s), from the token cache {path}")
        return ids
    if path_kind(path) is not None:
        log(f"note: the token cache {path} is not whole: tokenized again")
        remove_path(path)
    with folder_aside(path) as tmp, open(tmp / path.name, "wb") as f, named_errors(path):
        write_tokens(run, files, tokenizer, f)
        f.flush()
        os.fsync(f.fileno())
        os.chmod(f.name, 0o666 & ~current_umask())
        os.replace(f.name, path)
    return mapped_tokens(path)


def largest_id(ids: torch.Tensor) -> int:  # a chunk at a time: unsigned 16-bit tensors have no max of their own
    return max(int(chunk.to(torch.int64).max()) for chunk in ids.split(2**24))


def remove_path(path: Path) -> None:  # a folder with what it holds, else the file, link or other entry itself
    if path.is_dir() and not path.is_symlink():
        shutil.rmtree(path)
    else:
        path.unlink(missing_ok=True)


def write_tokens(run: RunConfig, files: list[Path], tokenizer, f) -> None:
    """Tokenize the documents into `f` after its header, in the tokenizer's threads, each ended by end-of-text."""
    itemsize = 2 if len(tokenizer) <= 2**16 else 4
    f.write(struct.pack(TOKEN_HEADER, TOKEN_MAGIC, itemsize, 0))  # the count is written once every token is in
    count, skipped, t0, shown = 0, [], time.perf_counter(), time.perf_counter()
    read = texts = 0  # documents, and of them those with a token of their own (not the end of text alone)
    documents = corpus_documents(run, files, skipped)
    while batch := list(itertools.islice(documents, TOKENIZE_BATCH)):
        encode = functools.partial(tokenizer.backend_tokenizer.encode_batch, batch, add_special_tokens=False)
        for encoding in waited(encode, f"data: tokenizing, {count:,} tokens so far"):
            ids = array.array("H" if itemsize == 2 else "I", encoding.ids)
            ids.append(tokenizer.eos_token_id)
            f.write(ids.tobytes())
            count, read, texts = count + len(ids), read + 1, texts + (len(ids) > 1)
        if time.perf_counter() - shown > 5:
            shown = time.perf_counter()
            log(f"data: tokenizing, {count:,} tokens so far")
    if skipped and len(skipped) == len(files):
        raise UsageError(f"--data: all {len(skipped)} file(s) were skipped as not UTF-8: no text to train on")
    if not texts:  # end-of-text tokens alone: nothing to learn
        held = f"its {read:,} document(s) are all empty" if read else "its JSONL lines are all blank"
        raise UsageError(f"--data {run.data} holds no text to train on: {held}, end-of-text tokens alone")
    f.seek(0)
    f.write(struct.pack(TOKEN_HEADER, TOKEN_MAGIC, itemsize, count))
    note = f", {len(skipped)} file(s) skipped as not UTF-8" if skipped else ""
    log(f"data: {count:,} tokens of {len(files)} file(s) tokenized in {time.perf_counter() - t0:.1f} s{note}")


def mapped_tokens(path: Path) -> torch.Tensor | None:
    """The ids of a token cache file, memory-mapped; None where it is missing or not whole."""
    try:
        with open(path, "rb") as f:
            magic, itemsize, count = struct.unpack(TOKEN_HEADER, f.read(struct.calcsize(TOKEN_HEADER)))
            size = os.fstat(f.fileno()).st_size
            if magic != TOKEN_MAGIC or itemsize not in (2, 4) or size != TOKEN_START + count * itemsize or not count:
                return None
            mapped = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_COPY)  # pages stay shared until written, never are
    except (OSError, struct.error):  # missing, a folder, unreadable: rebuilt (or its write says why not)
        return None
    dtype = torch.uint16 if itemsize == 2 else torch.uint32
    return torch.frombuffer(mapped, dtype=dtype, offset=TOKEN_START, count=count)


class Blocks:
    """The corpus's ids in blocks of seq_len tokens: a share held out (the same every run), the rest shuffled."""

    def __init__(self, ids: torch.Tensor, seq_len: int, eval_fraction: float, seed: int):
        self.ids, self.seq_len, self.seed = ids, seq_len, seed
        count = ids.numel() // seq_len
        if count < 2:
            needs = f"--seq-len {seq_len} needs {2 * seq_len:,}, a block to train on and one held out"
            raise UsageError(f"--data has {ids.numel():,} tokens: {needs}")
        held = min(count - 1, max(1, round(eval_fraction * count)))
        order = torch.randperm(count, generator=torch.Generator().manual_seed(HELD_OUT_SEED))
        self.held_out, self.training = order[:held].sort().values, order[held:].sort().values
        self.orders = {}  # epoch -> its order of the training blocks

    def step_blocks(self, step: int, count: int) -> list[int]:
        """The `count` blocks of step `step` (from 0): the next ones of the epochs' orders, one epoch after another."""
        n, blocks = len(self.training), []
        for epoch, i in (divmod(p, n) for p in range(step * count, (step + 1) * count)):
            if epoch not in self.orders:  # the training blocks in this epoch's order (the last epoch's alone kept)
                generator = torch.Generator().manual_seed(self.seed * 1_000_003 + epoch)
                self.orders = {epoch: self.training[torch.randperm(n, generator=generator)]}
            blocks.append(int(self.orders[epoch][i]))
        return blocks

    def gather(self, blocks) -> torch.Tensor:  # the blocks' token ids, (len(blocks), seq_len) int64
        return torch.stack([self.ids[b * self.seq_len : (b + 1) * self.seq_len].long() for b in blocks])


def step_batches(blocks: Blocks, run: RunConfig, device: torch.device):
    """step(i): step i's micro-batches on `device`, grad_accum of batch_size blocks each (this rank's share of them)."""
    count = run.batch_size * run.grad_accum

    def step(i: int) -> list[torch.Tensor]:  # step i's; on a GPU copied from pinned memory, the host going on
        ids = blocks.gather(blocks.step_blocks(i, count))
        if device.type == "cuda":  # the caching host allocator hands the block out again once its copy has landed
            ids = ids.pin_memory()
        return [micro.to(device, non_blocking=True) for micro in run.ranks.share(ids.chunk(run.grad_accum))]

    return step


def first_batch(blocks: Blocks, run: RunConfig) -> torch.Tensor:  # what sizes the plans and --save-output keeps
    return blocks.gather(blocks.step_blocks(0, run.batch_size * run.grad_accum))


def with_epochs(run: RunConfig, blocks: Blocks | None) -> RunConfig:  # --epochs as a step count; log the blocks' plan
    if blocks is None:
        return run
    per_step, training, held_out = run.batch_size * run.grad_accum, len(blocks.training), len(blocks.held_out)
    if run.epochs is not None:
        run = dataclasses.replace(run, steps=max(1, math.ceil(run.epochs * training / per_step)))
    epochs = f"{run.steps} steps of {per_step} block(s) make {run.steps * per_step / training:.2f} epoch(s)"
    log(f"data: {training:,} blocks of {run.seq_len} tokens to train on, {held_out:,} held out; {epochs}")
    evaluations = 2 + (run.steps // run.eval_every if run.eval_every else 0)  # before, every N steps, after
    steps = evaluations * held_out / (3 * per_step)  # a step: forward, recompute, backward
    if steps > max(10, run.steps):
        held = f"{evaluations} held-out losses over {held_out:,} blocks"
        log(f"note: the {held} take about as long as {steps:.0f} steps (--eval-fraction, --eval-every)")
    return run


@dataclass
class Text:  # what a run on text has: the blocks of --data (None with --sample alone) and the tokenizer
    blocks: Blocks | None
    tokenizer: object


def prepare_text(run: RunConfig, config: LlamaConfig) -> Text | None:
    """--data's blocks and tokenizer, or with --sample alone --tokenizer's or --model's, else None; checks --sample."""
    if run.data:
        text = Text(*prepare_data(run, config.vocab_size))
    elif run.sample:
        tokenizer = load_tokenizer(run)
        if tokenizer is None:
            raise UsageError("--sample needs a tokenizer: give --tokenizer DIR, or --data with --train-tokenizer V")
        check_vocab(run, tokenizer, config.vocab_size)
        text = Text(None, tokenizer)
    else:
        return None
    for prompt in run.sample:  # each prompt and its --sample-tokens fit the model's positions
        tokens = len(text.tokenizer(prompt).input_ids) + run.sample_tokens
        if tokens > config.max_position_embeddings:
            positions = config.max_position_embeddings
            shown = repr(prompt) if len(prompt) <= 60 else f"{prompt[:40]!r}... ({len(prompt)} characters)"
            raise UsageError(f"--sample {shown} and --sample-tokens make {tokens} tokens: the model has {positions}")
    return text


def check_vocab(run: RunConfig, tokenizer, vocab_size: int) -> None:
    """Refuse a tokenizer with ids past the model's embeddings, in one line saying what would fit."""
    if len(tokenizer) > vocab_size:
        size = f"the tokenizer's {len(tokenizer):,} ids exceed the model's vocab_size {vocab_size:,}"
        other = "" if run.model else f", or --vocab-size {len(tokenizer)}"
        raise UsageError(f"{size}: give a tokenizer of at most {vocab_size:,} ids{other}")


def agreed_text(run: RunConfig, config: LlamaConfig) -> Text | None:
    """prepare_text on each host's first rank, then on its others (which read its cache); every rank's text the same."""
    text = run.ranks.in_turn(lambda: prepare_text(run, config))
    if run.ranks.several:
        check_same(run.ranks, text_fingerprint(text), "their text: each host's tokenizer and token ids")
    return text


def text_fingerprint(text: Text | None) -> str | None:
    """A hash of the tokenizer, the token count and 65,536 token ids spread over the corpus (a page of cache each)."""
    if text is None:
        return None
    digest = hashlib.sha256(tokenizer_text(text.tokenizer).encode())
    if text.blocks is not None:
        ids = text.blocks.ids
        digest.update(f"{ids.numel()}".encode() + ids[:: max(1, ids.numel() >> 16)].numpy().tobytes())
    return digest.hexdigest()[:24]


def prepare_data(run: RunConfig, vocab_size: int) -> tuple[Blocks, object]:
    """--data read, tokenized (or read from the token cache) and packed: (the blocks, the tokenizer)."""
    files = data_files(run)
    resumed = None  # the tokenizer the --resume checkpoint trained with: a run that goes on keeps its ids
    if resumes_with_tokenizer(run):  # an unreadable record too: read_checkpoint says what is wrong with it
        resumed = saved_tokenizer(mode_folder(run.resume, run, run.modes[0]), "--resume", "it is damaged")
    if run.train_tokenizer:  # asked to train one: not --model's
        if run.train_tokenizer > vocab_size:
            larger = f"is larger than the model's vocab_size {vocab_size}"
            raise UsageError(f"--train-tokenizer {run.train_tokenizer} {larger}")
        key = corpus_key(run, files, f"byte-level BPE of {run.train_tokenizer}")
        tokenizer = train_tokenizer(run, files, data_cache_folder(run) / f"tokenizer-{key}")
    else:
        tokenizer = load_tokenizer(run) if run.tokenizer or resumed is None else resumed  # before --model's
        if tokenizer is None:
            raise UsageError("no tokenizer: give --tokenizer DIR, or --train-tokenizer V to train one on the data")
    if resumed is not None and tokenizer_text(tokenizer) != tokenizer_text(resumed):
        other = f"--resume {run.resume} trained with another tokenizer than this run's, so its token ids mean"
        raise UsageError(f"{other} other text: leave out --tokenizer and --train-tokenizer to go on with its own")
    if not tokenizer.is_fast:
        raise UsageError("the tokenizer has no fast (tokenizers) form, which tokenizing in threads needs")
    check_vocab(run, tokenizer, vocab_size)
    return Blocks(token_cache(run, files, tokenizer), run.seq_len, run.eval_fraction, run.seed), tokenizer


def forward_model(trainer, config: LlamaConfig, device: torch.device) -> nn.Module:
    """What runs forward passes of the training state: gpu and cpu modes' model, else a shell of StreamedLayers."""
    if isinstance(trainer, ResidentTraining):
        return trainer.model
    streamer, n = trainer.streamer, config.num_hidden_layers
    with torch.device("meta"):  # HF's forward and generate (KV cache and all) run the units' state as it streams
        shell = LlamaForCausalLM(config)
    shell.model.embed_tokens = StreamedLayer(0, streamer)
    shell.model.layers = nn.ModuleList(StreamedLayer(1 + i, streamer, layer=i) for i in range(n))
    shell.model.norm = StreamedLayer(n + 1, streamer)
    shell.lm_head = StreamedLayer(n + 2, streamer)
    shell.model.rotary_emb = LlamaRotaryEmbedding(config).to(device)  # computed, not trained
    # HF reads the model's device and dtype from its first parameter: an empty one says where the units compute
    shell.anchor = nn.Parameter(torch.empty(0, dtype=streamer.dtype, device=device), requires_grad=False)
    streamer.begin(range(n + 3))
    return shell.eval()


class Evaluation:
    """The held-out loss of --data and the --sample continuations, through the training state, timed apart."""

    def __init__(self, trainer, run: RunConfig, config, device, text: Text | None, start: int):
        self.model = lambda: forward_model(trainer, config, device)  # a new pass over the units each time
        self.run_config, self.device, self.text, self.start = run, device, text, start
        self.tokens_per_step = run.batch_size * run.grad_accum * run.seq_len
        self.evaluations, self.samples = [], {}
        if text and run.sample:
            self.samples["before"] = self.sampled("before training")
        if text and text.blocks:
            self.run(0)

    def due(self, done: int, last: int) -> bool:  # whether the held-out loss is due after `done` of `last` steps
        every = self.run_config.eval_every
        now = done == last or bool(every) and (self.start + done) % every == 0
        return bool(self.text and self.text.blocks) and now

    @torch.no_grad()
    def run(self, done: int) -> None:  # measure the mean held-out loss after `done` steps, batch_size blocks at a time
        t0 = shown = time.perf_counter()
        model, blocks, batch, total = self.model(), self.text.blocks, self.run_config.batch_size, 0.0
        for i, part in enumerate(blocks.held_out.split(batch)):
            ids = blocks.gather(part.tolist()).to(self.device)
            total += model(ids, labels=ids, use_cache=False).loss.item() * len(part)
            if time.perf_counter() - shown > 10:  # a long evaluation says how far it is
                shown = time.perf_counter()
                held = len(blocks.held_out)
                log(f"  held-out loss: {min((i + 1) * batch, held):,} of {held:,} blocks")
        loss = total / len(blocks.held_out)
        ms = (time.perf_counter() - t0) * 1e3
        step = self.start + done
        if not math.isfinite(loss):
            raise Diverged(f"the held-out loss after step {step} is {loss}: {DIVERGED if step else UNTRAINED}")
        record = {"step": step, "tokens": step * self.tokens_per_step, "loss": loss, "perplexity": math.exp(loss)}
        self.evaluations.append(record | {"ms": ms})
        log(f"  held-out loss after step {step}: {loss:.4f}, perplexity {math.exp(loss):.2f} ({ms:.0f} ms)")

    def after(self) -> None:  # the samples after the last step
        if self.text and self.run_config.sample:
            self.samples["after"] = self.sampled("after training")

    @torch.no_grad()
    def sampled(self, when: str) -> list[str]:
        """Each --sample prompt's continuation by HF's generate, greedy or at --temperature, logged."""
        run, tokenizer = self.run_config, self.text.tokenizer
        log(f"  sampling {len(run.sample)} prompt(s) {when}, {run.sample_tokens} tokens each ...")
        model, texts = self.model(), []
        drawn = {"do_sample": True, "temperature": run.temperature, "top_k": run.top_k} if run.temperature else {}
        kwargs = {"max_new_tokens": run.sample_tokens, "pad_token_id": tokenizer.eos_token_id, "do_sample": False}
        kwargs["synced_gpus"] = run.ranks.several  # each pass gathers the units: a rank whose text ended passes on
        for prompt in run.sample:
            ids = tokenizer(prompt, return_tensors="pt").input_ids.to(self.device)
            torch.manual_seed(run.seed)
            out = model.generate(ids, attention_mask=torch.ones_like(ids), **(kwargs | drawn))
            texts.append(tokenizer.decode(out[0, ids.shape[1] :]))
            log(f"  sample {when}: {prompt!r} -> {texts[-1]!r}")
        return texts

    def figures(self) -> dict:  # for the JSON: each held-out evaluation and the samples
        return {"evaluations": self.evaluations, "samples": self.samples} if self.text else {}


# ------------------------------------------------------------------------------------------------ saving and resuming
# Adds: --save-pretrained, --checkpoint and --resume, every file written aside and renamed. Turned on: those flags.
# Plugs into: the trainers' state (OffloadedAdam, the steppers).


CHECKPOINT_FILE = "checkpoint.json"  # names the unit files of the last whole checkpoint in its folder
CHECKPOINT_FORMAT = 1
CHECKPOINT_RECORD = {"steps": int, "files": list, "loss_scale": (int, float), "good_steps": int}  # and their types
RECORD_COUNTS = {"ranks": (1, 2**20 + 1), "tokens": (0, 2**63), "grad_accum": (1, 2**63)}  # each one's [least, end)
RECORD_COUNTS |= {"batch_size": (1, 2**63), "seq_len": (1, 2**63)}  # least: its value where an older record lacks it
BATCH_KEYS = ("grad_accum", "batch_size", "seq_len", "seed", "eval_fraction")  # seed, eval_fraction: held-out blocks
SAVE_SHARD = "2GB"  # save_pretrained's shard size: a safetensors writer may hold a whole shard's bytes in memory
PLAN_FLAGS = ("max_gpu_memory", "max_host_memory", "prefetch", "resident_layers", "gpu_adam_share")
PLAN_FLAGS += ("offload_activations", "segment", "remake_segments", "nvme", "nvme_layers", "rank_timeout")
SIGNALS = (signal.SIGINT, signal.SIGTERM, signal.SIGHUP)  # what ends a run early, every output whole or absent
STATE_KEYS = ("master", "exp_avg", "exp_avg_sq")  # a unit's float32 state in a checkpoint, beside its step


def save_pretrained(trainer, config: LlamaConfig, folder: Path, tokenizer=None) -> None:
    """The float32 masters (and the tokenizer) as a Hugging Face folder, replaced whole; with several ranks rank 0's."""
    t0 = time.perf_counter()
    check_finite_masters(trainer)
    reset_peak_memory(torch.device("cpu"))
    if tokenizer is not None:  # its ids in the configs (a trained one's end of text is 0, not the preset's 2)
        config, eos = copy.deepcopy(config), tokenizer.eos_token_id
        for field in ("bos_token_id", "eos_token_id", "pad_token_id"):
            setattr(config, field, eos if getattr(tokenizer, field) is None else getattr(tokenizer, field))
    aside = folder_aside(folder) if trainer.ranks.rank == 0 else contextlib.nullcontext()
    with aside as tmp, named_errors(folder, writer=not trainer.ranks.several):  # the collectives' errors stay theirs
        save_weights(trainer, config, tmp)
        if trainer.ranks.rank == 0:
            if tokenizer is not None:
                tokenizer.save_pretrained(tmp)
            for path in filter(Path.is_file, tmp.iterdir()):  # the umask's modes: safetensors writes its shards 0600
                path.chmod(0o666 & ~current_umask())
            old = tmp.with_name(tmp.name + ".old")  # the older folder moved aside, then removed
            with signals_held():
                if folder.exists():
                    os.rename(folder, old)
                os.rename(tmp, folder)
                shutil.rmtree(old, ignore_errors=True)
                sync_folder(folder.parent)
    trainer.ranks.meet()  # the folder is whole before any rank goes on
    seconds, peak = time.perf_counter() - t0, size_text(peak_host_rss())
    log(f"trained float32 weights saved to {folder} in {seconds:.1f} s, host peak {peak} meanwhile")


def save_weights(trainer, config: LlamaConfig, folder: Path | None) -> None:
    """The masters as HF weights: a meta-device model over them, or (several ranks, a collective) a file a unit."""
    ranks, n, weight_map, total = trainer.ranks, len(trainer.units), {}, 0
    if not ranks.several:
        with torch.device("meta"):
            model = LlamaForCausalLM(config)
        for name, master in named_masters(trainer):
            owner, _, leaf = name.rpartition(".")
            setattr(model.get_submodule(owner), leaf, nn.Parameter(master, requires_grad=False))
        transformers.utils.logging.disable_progress_bar()  # stderr carries this script's progress lines alone
        model.save_pretrained(folder, max_shard_size=SAVE_SHARD)
        return
    for u, unit in enumerate(trainer.units):  # gathered one at a time, written by rank 0
        full = ranks.gathered(trainer.steppers.state(u).cpu())
        tensors = {f"{unit.name}.{name}": view for name, view in unit.layout.views(full).items()}
        name = f"model-{u + 1:05d}-of-{n:05d}.safetensors"
        weight_map |= dict.fromkeys(tensors, name)
        total += sum(t.nbytes for t in tensors.values())
        if ranks.rank == 0:
            write_safetensors(folder / name, tensors)
    if ranks.rank == 0:
        config.save_pretrained(folder)
        transformers.GenerationConfig.from_model_config(config).save_pretrained(folder)
        index = {"metadata": {"total_size": total}, "weight_map": weight_map}
        (folder / "model.safetensors.index.json").write_text(json.dumps(index, indent=2) + "\n")


def write_safetensors(path: Path, tensors: dict[str, torch.Tensor]) -> None:
    """Float32 `tensors` as safetensors: the header's length (8 bytes), a JSON header, then the tensors' bytes."""
    header, start = {"__metadata__": {"format": "pt"}}, 0
    for name, t in tensors.items():
        header[name] = {"dtype": "F32", "shape": list(t.shape), "data_offsets": [start, start + t.nbytes]}
        start += t.nbytes
    text = json.dumps(header, separators=(",", ":")).encode()
    text += b" " * (-len(text) % 8)  # the tensors' bytes start 8-byte aligned
    with open(path, "wb") as f:
        f.write(struct.pack("<Q", len(text)) + text)
        for t in tensors.values():
            f.write(t.contiguous().numpy())  # its bytes, without a copy: a view of the gathered unit


def checkpoint_manifest(run: RunConfig, config: LlamaConfig, mode: str, plan: Plan | None = None) -> dict:
    """What a checkpoint records besides its files: what a resume must match, how it trained, the plan."""
    adam = json.loads(json.dumps(dataclasses.asdict(run.adam)))  # as read back: betas a list
    sizes = {field: getattr(config, field) for field in SIZE_FLAGS}
    batch = {key: getattr(run, key) for key in (*BATCH_KEYS, "data")}  # data None: random ids
    ranks = {"ranks": run.ranks.world} if run.ranks.several else {}  # each rank's files hold its shards
    record = {"format": CHECKPOINT_FORMAT, "mode": mode, "sizes": sizes, "dtype": run.dtype, "adam": adam}
    if plan is None:
        return record | batch | ranks
    # what the plan is made from: the machine's facts (memory to a tenth of a GiB) and the flags that steer it
    memory = (("gpu", plan.facts.gpu_bytes), ("host", plan.facts.host_bytes), ("disk", plan.facts.disk_bytes))
    inputs = {f"{field}_gib": None if b is None else round(b / GiB, 1) for field, b in memory}
    inputs |= {"cores": plan.facts.cores, "ranks": plan.facts.world, "ranks_a_host": plan.facts.local_world}
    inputs |= {flag: getattr(run, flag) for flag in PLAN_FLAGS}
    return record | batch | ranks | {"plan_inputs": inputs, "plan": plan.as_dict()}


def say_plan_changes(saved: dict, manifest: dict) -> None:
    """Log the plan inputs that differ from the checkpoint's: the state resumes the same, the placement may not."""
    before, now = saved.get("plan_inputs") or {}, manifest.get("plan_inputs") or {}

    def differs(a, b) -> bool:  # memory (GiB, as the kernel has it available) by 5% or more; the rest at all
        return abs(b - a) >= 0.05 * max(abs(a), abs(b)) if isinstance(a, float) and isinstance(b, float) else a != b

    changed = [f"{key} {before.get(key)} -> {value}" for key, value in now.items() if differs(before.get(key), value)]
    if before and changed:
        log(f"resuming under other plan inputs than the checkpoint's: {'; '.join(changed)}")


class Checkpoints:
    """--checkpoint's writer for one mode: every `every` steps (counted across resumes) and after the last."""

    def __init__(self, trainer, run: RunConfig, mode: str, manifest: dict, tokenizer=None):
        # write(done): the checkpoint after `done` steps of this run; run(done) as the steps' tasks call it
        folder = mode_folder(run.checkpoint, run, mode)
        self.write = self.run = functools.partial(write_checkpoint, trainer, folder, manifest, tokenizer=tokenizer)
        self.start, self.every = manifest.get("resumed_from", 0), run.checkpoint_every

    def due(self, done: int, last: int) -> bool:  # after `done` of `last` steps (the last one's: once trained)
        return bool(self.every) and done < last and (self.start + done) % self.every == 0


def trained_outputs(trainer, run: RunConfig, config: LlamaConfig, mode: str, compared: bool, tokenizer=None) -> dict:
    """After the last step: --save-pretrained's folder, gradient norms, the masters on the host to compare or save."""
    result = {"grad_norms": list(trainer.grad_norms)} if run.clip_grad_norm is not None else {}
    if run.save_pretrained:
        save_pretrained(trainer, config, mode_folder(run.save_pretrained, run, mode), tokenizer)
    if compared or run.save_output:  # several ranks: on rank 0 alone (which writes --save-output), a unit at a time
        resident = isinstance(trainer, ResidentTraining)
        result["masters"] = trainer.state_dict(trainer.masters) if resident else trainer.state_dict(on_first=True)
    return result


def check_finite_masters(trainer) -> None:  # raise Diverged unless every master is finite on every rank (a collective)
    if isinstance(trainer, ResidentTraining):
        mine = [name for name, master in named_masters(trainer) if not torch.isfinite(master).all()]
    else:  # this rank's flat masters (its shards), by unit
        mine = [unit.name for u, unit in enumerate(trainer.units) if not trainer.steppers.state(u).isfinite().all()]
    bad = sorted({name for names in trainer.ranks.each(mine) for name in names})
    if bad:
        more = f" and {len(bad) - 1} more" if len(bad) > 1 else ""
        raise Diverged(f"after the last step {bad[0]}{more} is not finite: {DIVERGED}; nothing saved")


def write_checkpoint(trainer, folder: Path, manifest: dict, done: int, tokenizer=None) -> None:
    """The state after `done` steps: unit files, tokenizer, then CHECKPOINT_FILE naming them, each written aside."""
    t0, steps, made = time.perf_counter(), manifest.get("resumed_from", 0) + done, not folder.exists()
    trainer.wait_updates()
    folder.mkdir(parents=True, exist_ok=True)
    ranks, n = trainer.ranks, len(trainer.units)
    files = checkpoint_files(n, steps, ranks)
    try:
        for u, name in enumerate(files[ranks.rank * n : (ranks.rank + 1) * n]):  # this rank's
            state = unit_state(trainer, u)
            if not all(ranks.each(finite_state(state))):  # every rank's shard, so that all stop here
                what = f"{trainer.units[u].name}'s state is not finite: {DIVERGED}"
                raise Diverged(f"after step {steps} {what}; the checkpoint before stays")
            write_atomically(str(folder / name), functools.partial(save_synced, state))
        tokenizer_files = save_checkpoint_tokenizer(tokenizer, folder) if tokenizer and ranks.rank == 0 else []
        ranks.meet()  # every rank's files are on the disk before the record names them
        if ranks.rank == 0:  # the manifest, the loss scale, the steps and tokens trained on, the files of the state
            scale = {"loss_scale": trainer.scaling.scale, "good_steps": getattr(trainer.scaling, "good_steps", 0)}
            tokens = manifest.get("tokens_before", 0) + done * step_tokens(manifest)
            named = {"steps": steps, "tokens": tokens, "files": files, "tokenizer": tokenizer_files}
            record = json.dumps(manifest | scale | named, indent=2)
            with signals_held():  # the record and the folder agree once this returns
                write_atomically(str(folder / CHECKPOINT_FILE), functools.partial(save_synced, record))
                sync_folder(folder)  # the renames too, before the files they replace go
                remove_unnamed(folder)
        ranks.meet()  # the stale files are gone before a rank writes the next checkpoint's
    except BaseException:  # a write stopped part-way removes what it wrote (a process killed outright: the next write)
        with signals_held():
            remove_unnamed(folder)
            if made and ranks.rank == 0:  # the first write: no empty folder left behind (another rank's files stay)
                with contextlib.suppress(OSError):
                    folder.rmdir()
        raise
    log(f"checkpoint after step {steps} written to {folder} in {time.perf_counter() - t0:.1f} s")


def remove_unnamed(folder: Path) -> None:  # remove what checkpoint writes left that CHECKPOINT_FILE does not name
    try:
        record = parse_json((folder / CHECKPOINT_FILE).read_text())
        named = {*record["files"], *record.get("tokenizer", [])}
    except (OSError, ValueError, KeyError, TypeError, AttributeError):  # no whole record: nothing of a write is
        named = set()
    for path in folder.iterdir():
        if path.name not in named and written_by_checkpoint(path):  # no file of the user's
            remove_path(path)


def save_checkpoint_tokenizer(tokenizer, folder: Path) -> list[str]:
    """The tokenizer's files into a checkpoint's folder, each written aside and renamed; returns their names."""
    with folder_aside(folder / ".tokenizer") as tmp:
        tokenizer.save_pretrained(tmp)
        names = sorted(p.name for p in tmp.iterdir())
        for name in names:
            os.replace(tmp / name, folder / name)
        return names


@contextlib.contextmanager
def signals_held():
    """SIGNALS put off during the block (renames not to split), then raised; in the main thread, which handles them."""
    caught, main = [], threading.current_thread() is threading.main_thread()
    before = {sig: signal.signal(sig, lambda signum, frame: caught.append(signum)) for sig in SIGNALS if main}
    try:
        yield
    finally:
        for sig, handler in before.items():
            signal.signal(sig, handler)
        if caught:
            signal.raise_signal(caught[0])


def checkpoint_files(units: int, steps: int, ranks: Ranks) -> list[str]:  # one a unit (and rank) after `steps` steps
    if not ranks.several:
        return [f"unit{u:03d}.step{steps}.pt" for u in range(units)]
    return [f"unit{u:03d}.rank{r}of{ranks.world}.step{steps}.pt" for r in range(ranks.world) for u in range(units)]


def save_synced(obj, path: str) -> None:  # `obj` (text or torch.save's) to `path`, on the disk before its rename
    with open(path, "w" if isinstance(obj, str) else "wb") as f:
        if isinstance(obj, str):
            f.write(obj + "\n")
        else:
            torch_save(obj, f, path)
        f.flush()
        os.fsync(f.fileno())


def torch_save(obj, f, path: str) -> None:  # torch.save(obj, f), signals put off; a full disk an OSError naming `path`
    try:
        with signals_held():
            torch.save(obj, f)
    except RuntimeError as e:  # the zip writer's error for a full disk
        reason = f"torch.save could not write it ({str(e).splitlines()[0]}): is its disk full?"
        raise OSError(errno.EIO, reason, path) from None


def sync_folder(folder: Path) -> None:  # flush a folder's entries (the files renamed into it) to the disk
    fd = os.open(folder, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def read_checkpoint(folder: Path, manifest: dict, units: list[Unit] | None = None) -> dict:
    """A checkpoint's record, refused where damaged or of another model, dtype or Adam (`units`: its unit files too)."""
    path, at = folder / CHECKPOINT_FILE, f"--resume {folder}"
    if not path.is_file():
        raise UsageError(f"{at}: no {CHECKPOINT_FILE} there: {checkpoint_hint(folder)}")
    try:
        saved = parse_json(path.read_text())
    except OSError as e:
        raise UsageError(f"{at}: {CHECKPOINT_FILE} cannot be read ({e.strerror})") from None
    except ValueError as e:  # UnicodeDecodeError too
        raise UsageError(f"{at}: {CHECKPOINT_FILE} is not valid JSON ({first_line(e)})") from None
    fault = next((message for bad, message in record_faults(folder, saved, manifest) if bad), None)
    if fault:
        raise UsageError(f"{at}: {fault}")
    for i, name in enumerate(saved["files"] if units is not None else []):  # each loads and holds its unit's state
        unit, ranks = units[i % len(units)], Ranks(world=saved.get("ranks", 1))  # the ranks that wrote it
        try:
            state = torch.load(folder / name, mmap=True, weights_only=True)
        except Exception as e:  # torch's errors for a file cut short or not its format vary between versions
            raise UsageError(f"{at}: {name} does not load ({first_line(e)}): resume another checkpoint") from None
        if not unit_state_fits(state, unit.layout, ranks) or state.get("unit", unit.name) != unit.name:
            raise UsageError(f"{at}: {name} does not hold unit {unit.name}'s state: it is damaged")
    return saved


def record_faults(folder: Path, saved, manifest: dict):
    """(fault, message) of each check of a checkpoint's record in turn, each made once those before it passed."""
    record, damaged = CHECKPOINT_FILE, ": the file is damaged"
    yield not isinstance(saved, dict), f"{record} holds no record: it is damaged"
    fmt = saved.get("format")
    yield fmt != CHECKPOINT_FORMAT, f"checkpoint format {fmt}, this script reads {CHECKPOINT_FORMAT}"
    for key, what in (("sizes", "model"), ("dtype", "dtype"), ("adam", "Adam setting")):
        yield saved.get(key) != manifest[key], f"a checkpoint of another {what}: {saved.get(key)}, not {manifest[key]}"
    for key, kind in CHECKPOINT_RECORD.items():
        value = saved.get(key)
        yield not isinstance(value, kind) or isinstance(value, bool), f"{record}'s {key} is {value!r}{damaged}"
    steps, files = saved["steps"], saved["files"]
    counts = not 0 <= steps < 2**53 or not 0 <= saved["good_steps"] < 2**53
    yield counts, f"{record}'s step counts are out of range{damaged}"
    outside = not all(isinstance(f, str) and f == Path(f).name for f in files)
    yield outside, f"{record} names files outside its folder{damaged}"
    for key, (least, end) in RECORD_COUNTS.items():
        value = saved.get(key, least)
        wrong = not isinstance(value, int) or isinstance(value, bool) or not least <= value < end
        yield wrong, f"{record}'s {key} is {value!r}{damaged}"
    for key in ("plan", "plan_inputs"):
        yield not isinstance(saved.get(key, {}), dict), f"{record}'s {key} is not a table{damaged}"
    units = manifest["sizes"]["num_hidden_layers"] + 3
    expected = checkpoint_files(units, steps, Ranks(world=saved.get("ranks", 1)))
    yield len(files) != len(expected), f"{record} names {len(files)} files, not {len(expected)}: it is damaged"
    for f, e in zip(files, expected, strict=True):  # each unit's own file, as written after that step: none swapped
        yield f != e, f"{record} names {f} where a checkpoint after step {steps} has {e}: it is damaged"
    missing = [name for name in files if not (folder / name).is_file()]
    yield bool(missing), f"{len(missing)} of the files {record} names are missing"


def unit_state_fits(state, layout: FlatLayout, ranks: Ranks) -> bool:
    """Whether `state` is unit_state's dict for `layout`: a float step, float32 master and moments of its shapes."""
    if not isinstance(state, dict) or not isinstance(state.get("step"), float) or not 0 <= state["step"] < 2**53:
        return False
    shapes = dict(zip(layout.names, layout.shapes, strict=True))
    for key in STATE_KEYS:
        tensors = state.get(key)
        if ranks.several:
            tensors, shapes = {"shard": tensors}, {"shard": torch.Size([ranks.shard_numel(layout.numel)])}
        if not isinstance(tensors, dict) or tensors.keys() != shapes.keys():
            return False
        for name, t in tensors.items():
            if not isinstance(t, torch.Tensor) or t.dtype != torch.float32 or t.shape != shapes[name]:
                return False
    return True


def checkpoint_hint(folder: Path) -> str:  # what to give --resume instead: a mode's subfolder, or the folder above
    if folder.name in MODES and (folder.parent / CHECKPOINT_FILE).is_file():
        return f"{folder.parent} holds one mode's; several modes resume each from DIR/<mode>: give --mode as it trained"
    inside = sorted(sub.parent.name for sub in folder.glob(f"*/{CHECKPOINT_FILE}") if sub.parent.name in MODES)
    if inside:
        return f"it holds the checkpoints of modes {', '.join(inside)}: give one of their folders, or --mode as trained"
    return "give a folder written by --checkpoint"


def unit_state(trainer, u: int) -> dict:
    """Unit u's state for a checkpoint: name, step, float32 master and moments by name (several ranks: flat shards)."""
    if isinstance(trainer, ResidentTraining):
        state = {"unit": trainer.units[u].name, "step": 0.0, "master": {}, "exp_avg": {}, "exp_avg_sq": {}}
        for name, master, _ in unit_params(trainer, u):
            adam = trainer.optimizer.state.get(master)  # none before the first step that was applied
            state["master"][name] = master.cpu()
            for key in ("exp_avg", "exp_avg_sq"):
                state[key][name] = adam[key].cpu() if adam else torch.zeros_like(master, device="cpu")
            state["step"] = adam["step"].item() if adam else 0.0
        return state
    *flats, step = trainer.steppers.of[u].adam_state(u)
    kept = [flat.cpu() if trainer.ranks.several else trainer.units[u].layout.views(flat.cpu()) for flat in flats]
    return {"unit": trainer.units[u].name, "step": step.item()} | dict(zip(STATE_KEYS, kept, strict=True))


def unit_params(trainer: ResidentTraining, u: int):  # unit u's (name in it, float32 master, weight) in gpu or cpu mode
    prefix = trainer.units[u].name + "."
    for name, master, param in zip(trainer.names, trainer.masters, trainer.params, strict=True):
        if name.startswith(prefix):
            yield name.removeprefix(prefix), master, param


@torch.no_grad()
def load_unit(trainer, u: int, state: dict) -> None:
    """Set unit u's training state from a checkpoint's before placement (offloaded: this rank's shards, on the host)."""
    if isinstance(trainer, ResidentTraining):
        for name, master, param in unit_params(trainer, u):
            master.copy_(state["master"][name])
            param.copy_(master)
            if state["step"]:  # as torch.optim.Adam(fused=True) keeps it: tensors on the master's device
                moments = {key: state[key][name].to(master.device, copy=True) for key in ("exp_avg", "exp_avg_sq")}
                trainer.optimizer.state[master] = {"step": torch.tensor(state["step"], device=master.device), **moments}
        return
    store = trainer.store
    layout, start = store.units[u].layout, store.ranks.rank * store.masters[u].numel()

    def fill(keys: tuple[str, ...], *flats) -> None:  # the state's `keys` into this rank's part of the buffers `flats`
        for key, flat in zip(keys, flats, strict=True):
            if isinstance(state[key], torch.Tensor):  # the shard this rank wrote, padding and all
                flat.copy_(state[key])
            else:
                layout.fill(flat, state[key].__getitem__, start=start)  # by name, from any number of ranks

    fill(("master",), store.masters[u])
    store.adam_moments.fill(u, functools.partial(fill, ("exp_avg", "exp_avg_sq")))
    if store.copies and u not in store.on_device:
        store.copies[u].copy_(store.masters[u])
    store.steps[u].fill_(state["step"])
    store.unstarted.discard(u)


def named_masters(trainer):  # each parameter's float32 master by HF name on the CPU (one process: a rank has shards)
    if isinstance(trainer, ResidentTraining):
        yield from ((name, master.detach().cpu()) for name, master in zip(trainer.names, trainer.masters, strict=True))
        return
    for u, unit in enumerate(trainer.units):
        flat = trainer.steppers.state(u).cpu()  # a resident unit's is copied from the GPU
        for name, shape, offset in zip(unit.layout.names, unit.layout.shapes, unit.layout.offsets, strict=True):
            # its own storage over the same memory: save_pretrained clones tensors that share one (the whole model)
            view = torch.frombuffer(flat.numpy(), dtype=flat.dtype, count=shape.numel(), offset=offset * flat.itemsize)
            yield f"{unit.name}.{name}", view.view(shape)


def resume(trainer, folder: Path, manifest: dict) -> int:
    """Load a checkpoint into `trainer`, before placement; returns the steps it had done."""
    t0, saved = time.perf_counter(), read_checkpoint(folder, manifest)
    say_plan_changes(saved, manifest)
    for u, unit in enumerate(trainer.units):
        state = checkpoint_unit(folder, saved, u, unit.layout, trainer.ranks)
        load_unit(trainer, u, state)
        if not finite_state(state):  # read again from the page cache the load filled
            what = f"unit {unit.name}'s state is not finite (NaN or infinity)"
            raise UsageError(f"--resume {folder}: {what}: resume an earlier checkpoint")
    if saved.get("ranks", 1) != trainer.ranks.world:
        log(f"the checkpoint of {saved.get('ranks', 1)} rank(s) resharded over {trainer.ranks.world}")
    if isinstance(trainer.scaling, LossScale):
        trainer.scaling.restore(saved["loss_scale"], saved["good_steps"])
    log(f"resumed from {folder} after step {saved['steps']} in {time.perf_counter() - t0:.1f} s")
    # the tokens trained on: as the record counts them, or (an older record) its steps at its batch's (else this run's)
    manifest["tokens_before"] = saved["tokens"] if "tokens" in saved else saved["steps"] * step_tokens(manifest | saved)
    changed = [key for key in BATCH_KEYS if key in saved and saved[key] != manifest[key]]  # older records lack some
    if changed:
        log(f"note: another {', '.join(changed)} than the checkpoint's, so other batches (and held-out blocks)")
    if isinstance(saved.get("data"), str) and manifest["data"] is None:
        without = "without --data, this run trains on random ids"
        log(f"note: the checkpoint trained on text (--data {saved['data']}); {without}")
    return saved["steps"]


def step_tokens(record: dict) -> int:  # the tokens of a step of the run a checkpoint manifest describes
    return record["grad_accum"] * record["batch_size"] * record["seq_len"]


def finite_state(state: dict) -> bool:  # whether a unit's checkpointed state holds finite values alone
    held = [state[key] for key in STATE_KEYS]
    held = [h.shards if isinstance(h, Resharded) else h.values() if isinstance(h, dict) else [h] for h in held]
    return all(torch.isfinite(t).all() for tensors in held for t in tensors)


def checkpoint_unit(folder: Path, saved: dict, u: int, layout: FlatLayout, ranks: Ranks) -> dict:
    """Unit u's state in a checkpoint, mmapped: this rank's file (as many ranks wrote), else by name (Resharded)."""
    world, units = saved.get("ranks", 1), len(saved["files"]) // saved.get("ranks", 1)
    writers = [ranks.rank] if world == ranks.world else range(world)  # its own file: it goes on bit for bit
    states = [torch.load(folder / saved["files"][r * units + u], mmap=True, weights_only=True) for r in writers]
    if len(states) == 1:
        return states[0]
    return {"step": states[0]["step"]} | {key: Resharded([s[key] for s in states], layout) for key in STATE_KEYS}


class Resharded:
    """A unit's flat state written by several ranks as equal shards (in rank order), read by parameter name."""

    def __init__(self, shards: list[torch.Tensor], layout: FlatLayout):
        self.shards, self.size = shards, shards[0].numel()
        self.places = dict(zip(layout.names, zip(layout.offsets, layout.shapes, strict=True), strict=True))

    def __getitem__(self, name: str) -> torch.Tensor:  # the parameter `name`, whole, in its shape
        start, shape = self.places[name]
        end, size = start + shape.numel(), self.size
        ranks = range(start // size, -(-end // size))  # those whose shards it spans
        parts = [self.shards[r][max(start, r * size) - r * size : min(end, (r + 1) * size) - r * size] for r in ranks]
        return torch.cat(parts).view(shape)


# ------------------------------------------------------------------------------------ the command line and its checks
# Adds: the flags (RunConfig), and every check that refuses bad input with one line before the model is built.
# Turned on: the command line (main).


@dataclass(frozen=True)
class RunConfig(Config):
    """A run from the command line (parse_args) or a test: the assignment's Config and every flag beyond it."""

    model: str | None = None  # a save_pretrained folder; overrides preset and sizes
    # placement
    max_gpu_memory: float | None = None  # GiB; overlapped keeps on the GPU what this budget holds
    resident_layers: int | None = None  # overlapped: this many decoder layers resident instead of the budget's plan
    gpu_adam_share: float | None = None  # overlapped training: of the streamed parameters, the GPU Adam's share
    offload_activations: bool = False  # the units' saved inputs wait in pinned host memory, not on the GPU
    segment: int | None = None  # units a segment: only its first keeps its inputs, the rest recomputed (the plan's)
    remake_segments: bool = False  # segments remake their inputs by their forwards run again (else the plan's way)
    max_host_memory: float | None = None  # GiB; the host memory the run plans for, at most (default: MemAvailable)
    nvme: str | None = None  # a folder on a local disk: the disk tier keeps Adam moments there
    nvme_layers: int | None = None  # decoder layers whose Adam moments live on the disk (planned: disk_units)
    rank_timeout: float | None = None  # seconds a rank waits in a step's collective (default: the plan's)
    # the plan alone (--plan), for this machine or one described
    plan: bool = False  # print the plan and exit, allocating nothing
    gpu_memory: float | None = None  # GiB: a GPU's memory, instead of this machine's
    host_memory: float | None = None  # GiB: the host memory available, instead of this machine's
    gpus: int | None = None  # ranks, one per GPU, all on one host, instead of torchrun's
    rates: tuple = ()  # (name, value) pairs that override DEFAULT_RATES
    json: str | None = None  # outputs: the results as JSON
    save_output: str | None = None  # torch.save'd input ids, logits and trained masters
    profile: str | None = None  # a Chrome trace of one offloaded forward pass and step
    save_pretrained: str | None = None  # a folder: the trained float32 weights, for from_pretrained
    checkpoint: str | None = None  # a folder: the whole training state, every checkpoint_every steps and at the end
    checkpoint_every: int | None = None
    resume: str | None = None  # a --checkpoint folder to go on from
    # training
    fwd_bwd_reference: bool = False  # also time plain forward and backward of the resident model, uncapped
    clip_grad_norm: float | None = None  # the gradients' largest float32 norm, as torch.nn.utils.clip_grad_norm_
    # text to train on (--data); without it every step trains on one fixed batch of random ids
    data: str | None = None  # a text or JSONL file, or a folder of them
    data_glob: str = "*.txt,*.jsonl,*.py"  # a folder's files to read, at any depth
    text_field: str = "text"  # a JSONL record's text
    skip_undecodable: bool = False  # skip files that are not UTF-8, instead of refusing them
    tokenizer: str | None = None  # a folder with a tokenizer (default: --model's)
    train_tokenizer: int | None = None  # a byte-level BPE of this many tokens, trained on the data
    data_cache: str | None = None  # where token caches and trained tokenizers are kept
    eval_fraction: float = 0.01  # of the blocks, held out
    eval_every: int | None = None  # steps between held-out losses (also before the first step and after the last)
    epochs: float | None = None  # passes over the training blocks, instead of --steps
    sample: tuple = ()  # prompts continued before training and after
    sample_tokens: int = 32
    temperature: float = 0.0  # 0: greedy
    top_k: int | None = None
    ranks: Ranks = Ranks()  # the processes torchrun started, one per GPU (without torchrun, this one: rank 0 of 1)

    @property
    def lean(self) -> bool:  # one offloaded mode trains alone: once its masters are loaded, decoder layers are freed
        return self.train and not self.inference and self.modes in (("blocked",), ("overlapped",))

    @property
    def profile_mode(self) -> str:  # the mode --profile traces: overlapped, or blocked when overlapped is not run
        return "overlapped" if "overlapped" in self.modes else "blocked"

    @property
    def holds_updates(self) -> bool:  # units step once all gradients are in: float16's loss scale or clipping sees them
        return self.dtype == "float16" or self.clip_grad_norm is not None

    @property
    def segment_units(self) -> int:  # units a segment: --segment, or the plan's; 1 where neither says
        return self.segment or 1

    @property
    def held_units(self) -> int:  # units whose backwards run at once, held on the GPU: a segment's in SegmentGraphs
        return 1 if self.remake_segments else self.segment_units

    @property
    def gpu_adam(self) -> float:  # the GPU Adam's share: --gpu-adam-share, or 0 if updates wait, or GPU_ADAM_SHARE
        if self.gpu_adam_share is not None:
            return self.gpu_adam_share
        return 0.0 if self.holds_updates else GPU_ADAM_SHARE


MAX_SEED = 2**32 - 1  # --seed's largest: seeds derived from it (seed << 32, seed * 1_000_003) stay within 64 bits
DIVERGED = "training diverged (try a lower --lr)"
UNTRAINED = "the model computes so before any update (its weights or config, not --lr)"  # where DIVERGED is not it
FIRST_CONTACT = "python offload_llama.py --preset tiny --mode cpu --train --steps 5 --seq-len 256"  # no GPU needed
EXAMPLES = f"""examples:
  {FIRST_CONTACT}
      a tiny model on the CPU, inference then 5 training steps: seconds, no GPU
  python offload_llama.py --mode overlapped --train
      LLaMA-7B-sized layers (7b-8l) streamed through the GPU: the memory and time tables
  python offload_llama.py --preset llama-7b --mode overlapped --train --no-inference --grad-accum 16 \\
      --batch-size 4 --seq-len 1024 --max-gpu-memory 11
      LLaMA-7B, 64 x 1024 tokens a step, under an 11 GiB GPU cap"""


class UsageError(Exception): ...  # bad input: main() prints it as one line on stderr and exits with code 2


class DiskShort(UsageError):
    """The --nvme disk lacks room for a plan's Adam moments: `short` bytes more would be needed."""

    def __init__(self, message: str, short: int):
        super().__init__(message)
        self.short = short


class Diverged(Exception): ...  # logits or a loss not finite: main() prints one line, exits 1, writes nothing more


def default_dtype() -> str:  # bfloat16, unless the GPU cannot compute in it
    cuda_without_bf16 = torch.cuda.is_available() and not torch.cuda.is_bf16_supported(including_emulation=False)
    return "float16" if cuda_without_bf16 else "bfloat16"


def print_error(message: str) -> None:  # a refusal on stderr, control characters escaped, in one write (ranks share it)
    escaped = "".join(c if c.isprintable() or c == "\t" else ascii(c)[1:-1] for c in message)  # a path's \n, ESC
    sys.stderr.write(f"offload_llama.py: error: {escaped}\n")
    sys.stderr.flush()


class Parser(argparse.ArgumentParser):
    """argparse with bad arguments as one line and exit code 2, like all bad input; no prefixes of flags."""

    def __init__(self):
        description = __doc__.split("\n\n")[0]
        super().__init__(description=description, formatter_class=HelpFormatter, epilog=EXAMPLES, allow_abbrev=False)

    def error(self, message):  # one line, exit 2
        print_error(f"{message} (see --help)")
        sys.exit(2)


class HelpFormatter(argparse.ArgumentDefaultsHelpFormatter, argparse.RawDescriptionHelpFormatter):
    """--help with every flag's default (a switch's: off; a flag of none says its own), the examples as written."""

    def _get_help_string(self, action):  # the flag's help and its default
        if isinstance(action.default, bool):
            return f"{action.help} (default: off)"
        if action.default is None or action.default == argparse.SUPPRESS:
            return action.help
        return super()._get_help_string(action)


def parameter_count(sizes: dict) -> int:
    """A LLaMA's parameter count from its sizes (LlamaConfig field -> value), by arithmetic: no torch, no model."""
    h, i, layers, vocab = (sizes[f] for f in ("hidden_size", "intermediate_size", "num_hidden_layers", "vocab_size"))
    heads, kv_heads = sizes["num_attention_heads"], sizes["num_key_value_heads"]
    head_dim = sizes.get("head_dim") or h // heads
    q, kv = heads * head_dim, kv_heads * head_dim  # the queries' width, the keys' and values' each
    attention = 2 * h * q + 2 * h * kv + (q + 2 * kv + h) * bool(sizes.get("attention_bias"))
    mlp = 3 * h * i + (2 * i + h) * bool(sizes.get("mlp_bias"))
    embeddings = vocab * h * (1 if sizes.get("tie_word_embeddings") else 2)  # and the head
    return embeddings + layers * (attention + mlp + 2 * h) + h  # two norms a layer, the final norm


def count_text(n: float) -> str:  # a count in words: 1.88B, 53.2M, 171K, 900
    for scale, suffix in ((1e9, "B"), (1e6, "M"), (1e3, "K")):
        if n >= scale:
            return f"{n / scale:.3g}{suffix}" if n < 100 * scale else f"{n / scale:.0f}{suffix}"
    return f"{n:.0f}"


def size_text(nbytes: float) -> str:  # bytes in words, from GiB down: 3.5 GiB, 120.0 MiB, 4.0 KiB, 1 byte
    for unit, suffix in ((GiB, "GiB"), (2**20, "MiB"), (2**10, "KiB")):
        if abs(nbytes) >= unit:
            return f"{nbytes / unit:.1f} {suffix}"
    return "1 byte" if nbytes == 1 else f"{nbytes:.0f} bytes"


def add_run_flags(p: argparse.ArgumentParser) -> None:
    """The model, the batch, the timing, what stays on the GPU, and the outputs."""
    modes = "gpu: resident; cpu; blocked: copy each layer, then run it; overlapped: copy ahead; all; or a list: gpu,cpu"
    p.add_argument("--mode", default="all", help=modes)
    presets = [  # each preset's layers, hidden size and parameters
        f"{name}: {s['num_hidden_layers']} layers, hidden {s['hidden_size']}, vocabulary {s['vocab_size']}, "
        f"{count_text(parameter_count(s))} parameters"
        for name, s in PRESETS.items()
    ]
    presets = "a random model's sizes; " + "; ".join(presets) + f" (default: {RunConfig.preset})"
    p.add_argument("--preset", choices=tuple(PRESETS), help=presets)
    model = "load a save_pretrained LLaMA folder instead of building a random model (default: none, the preset)"
    p.add_argument("--model", metavar="DIR", help=model)
    for field, flag in SIZE_FLAGS.items():
        size = f"override the preset's {field} (default: the preset's)"
        p.add_argument(f"--{flag}", type=int, dest=field, metavar="N", help=size)
    dtype = "compute dtype; masters and Adam state stay float32 (default: bfloat16, float16 on a GPU without it)"
    p.add_argument("--dtype", choices=DTYPE_NAMES, help=dtype)
    attention = "sdpa: flash, backward not bitwise reproducible; eager: reproducible, memory quadratic in --seq-len"
    p.add_argument("--attention", choices=("sdpa", "eager"), default=RunConfig.attention, help=attention)
    p.add_argument("--batch-size", type=int, default=RunConfig.batch_size, help="sequences per micro-batch")
    p.add_argument("--seq-len", type=int, default=RunConfig.seq_len, help="tokens per sequence")
    p.add_argument("--seed", type=int, default=RunConfig.seed, help="seeds the random weights and the input token ids")
    p.add_argument("--prefetch", type=int, default=RunConfig.prefetch, help="units copied ahead in overlapped mode")
    p.add_argument("--warmup", type=int, default=RunConfig.warmup, help="untimed runs (steps) first")
    p.add_argument("--repeat", type=int, default=RunConfig.repeat, help="timed runs; the median is reported")
    cap = "GPU memory cap; overlapped keeps on the GPU the layers (and their Adam state) it holds and streams the rest"
    p.add_argument("--max-gpu-memory", type=float, metavar="GIB", help=f"{cap} (default: no cap)")
    host = "the host memory the run keeps under; --nvme takes the rest (default: what the kernel has available)"
    p.add_argument("--max-host-memory", type=float, metavar="GIB", help=host)
    resident = "overlapped: N decoder layers resident (inference: spread; training: the first N), not the cap's plan"
    p.add_argument("--resident-layers", type=int, metavar="N", help=f"{resident} (default: the cap's plan)")
    p.add_argument("--json", metavar="PATH", help="write the results as JSON (default: none)")
    saved = "torch.save the input ids, logits and trained masters (default: none)"
    p.add_argument("--save-output", metavar="PATH", help=saved)
    trace = "write a Chrome trace of one offloaded forward pass and step (default: none)"
    p.add_argument("--profile", metavar="PATH", help=trace)


def add_training_flags(p: argparse.ArgumentParser) -> None:
    """Training and its accelerations."""
    t = p.add_argument_group("training (--train)")
    t.add_argument("--train", action="store_true", help="after inference, train each mode: forward, backward, Adam")
    t.add_argument("--steps", type=int, default=RunConfig.steps, help="training steps on one fixed batch")
    accum = "micro-batches of batch-size x seq-len per optimizer step, accumulated in float32"
    t.add_argument("--grad-accum", type=int, default=RunConfig.grad_accum, metavar="K", help=accum)
    lean = "train only; one offloaded mode alone then holds the model in its masters only (a random one drawn by unit)"
    t.add_argument("--no-inference", dest="inference", action="store_false", help=lean)
    reference = "first time plain forward and backward of the model resident on the GPU (no optimizer, no cap)"
    t.add_argument("--fwd-bwd-reference", action="store_true", help=reference)
    acts = "keep the units' saved inputs in pinned host memory (turned on by itself when they would not fit the cap)"
    t.add_argument("--offload-activations", action="store_true", help=acts)
    segment = "offloaded: keep the inputs of every Nth unit only, the backward running each segment of N units from "
    segment += (
        "them a micro-batch at a time, or remade (default: the plan's: 1, or where every unit keeping its inputs "
    )
    segment += "does not fit or is slower, the fastest that fits)"
    t.add_argument("--segment", type=int, metavar="N", help=segment)
    remake = "offloaded: segments remake their units' inputs by running their forwards again: less GPU memory than a "
    remake += "micro-batch at a time with their graphs, more compute; else the plan weighs both ways"
    t.add_argument("--remake-segments", action="store_true", help=remake)
    t.add_argument("--lr", type=float, default=RunConfig.lr, help="Adam's learning rate")
    betas = "Adam's moment decays"
    t.add_argument("--betas", type=float, nargs=2, default=RunConfig.betas, metavar=("BETA1", "BETA2"), help=betas)
    t.add_argument("--eps", type=float, default=RunConfig.eps, help="Adam's denominator term")
    t.add_argument("--weight-decay", type=float, default=RunConfig.weight_decay, help="L2 penalty, as in torch's Adam")
    clip = "scale the gradients to this float32 norm at most, as clip_grad_norm_ (units step once every one is in)"
    t.add_argument("--clip-grad-norm", type=float, metavar="X", help=f"{clip} (default: no clipping)")
    share = "overlapped: the share (0 to 1) of streamed parameters the GPU's Adam steps over float32 state streamed "
    share += f"in (embeddings, first layers, head), the CPU Adam the rest (default: {GPU_ADAM_SHARE} where the plan "
    share += "predicts the host bounds the step, else 0; 0 in float16 or with --clip-grad-norm; given, no units "
    share += "resident without a cap)"
    t.add_argument("--gpu-adam-share", type=float, metavar="F", help=share)
    nvme = "offloaded: a folder on a local disk for the Adam moments of the layers the host cannot hold (freed at exit;"
    t.add_argument("--nvme", metavar="DIR", help=f"{nvme} default: none, the host holds them)")
    layers = "with --nvme: N decoder layers' Adam moments on the disk, spread (default: the host plan's count)"
    t.add_argument("--nvme-layers", type=int, metavar="N", help=layers)


def add_data_flags(p: argparse.ArgumentParser) -> None:
    """Text to train on, and its tokenizer."""
    d = p.add_argument_group("text to train on (--train --data; without it, one fixed batch of random ids)")
    data = "a UTF-8 text file, a JSONL file, or a folder of them: tokenized once, packed into --seq-len blocks"
    d.add_argument("--data", metavar="PATH", help=f"{data} (default: none)")
    d.add_argument("--data-glob", default=RunConfig.data_glob, metavar="GLOBS", help="a folder's files to read")
    d.add_argument("--text-field", default=RunConfig.text_field, metavar="KEY", help="a JSONL record's text")
    skip = "skip the files that are not UTF-8 (and say how many) instead of refusing them"
    d.add_argument("--skip-undecodable", action="store_true", help=skip)
    d.add_argument("--tokenizer", metavar="DIR", help="a folder with the tokenizer (default: --model's)")
    train = "no tokenizer at hand: train a byte-level BPE of V tokens on the data (V at most the model's vocab_size)"
    d.add_argument("--train-tokenizer", type=int, metavar="V", help=train)
    cache = "the folder for token caches and trained tokenizers (default: $XDG_CACHE_HOME or ~/.cache/offload_llama)"
    d.add_argument("--data-cache", metavar="DIR", help=cache)
    held = "the share of the blocks held out, never trained on (at least one block)"
    d.add_argument("--eval-fraction", type=float, default=RunConfig.eval_fraction, metavar="F", help=held)
    d.add_argument("--epochs", type=float, metavar="N", help="passes over the training blocks, instead of --steps")
    every = "the held-out loss every N steps (also before the first and after the last; default: only those two)"
    d.add_argument("--eval-every", type=int, metavar="N", help=every)
    sample = "continue PROMPT before training and after (repeat the flag for more prompts)"
    d.add_argument("--sample", action="append", default=[], metavar="PROMPT", help=sample)
    adds = "tokens a sample adds"
    d.add_argument("--sample-tokens", type=int, default=RunConfig.sample_tokens, metavar="N", help=adds)
    d.add_argument("--temperature", type=float, default=RunConfig.temperature, help="samples drawn at it; 0: greedy")
    d.add_argument("--top-k", type=int, metavar="K", help="samples drawn from the K likeliest tokens (default: all)")


def add_saving_flags(p: argparse.ArgumentParser) -> None:
    """What training leaves behind, and where it goes on from."""
    s = p.add_argument_group("saving and resuming (--train)")
    weights = "after training, the float32 weights as a HF model folder (default: none)"
    s.add_argument("--save-pretrained", metavar="DIR", help=weights)
    s.add_argument("--checkpoint", metavar="DIR", help="the whole training state, after the last step (default: none)")
    every = "also after every N steps, counted from the first (default: the last step only)"
    s.add_argument("--checkpoint-every", type=int, metavar="N", help=every)
    resume = "go on from a --checkpoint folder for --steps more steps (default: none)"
    s.add_argument("--resume", metavar="DIR", help=resume)


def add_plan_flags(p: argparse.ArgumentParser) -> None:
    """The plan: printed alone, for this machine or one described; the ranks' timeout."""
    g = p.add_argument_group("the plan (--plan: where every byte goes, predicted, before anything is allocated)")
    plan = "print the plan and its predictions and exit, allocating nothing"
    g.add_argument("--plan", action="store_true", help=plan)
    g.add_argument("--gpu-memory", type=float, metavar="GIB", help="plan for GPUs of this memory (default: this one's)")
    host = "plan for a host with this much memory available (default: this one's MemAvailable)"
    g.add_argument("--host-memory", type=float, metavar="GIB", help=host)
    g.add_argument("--gpus", type=int, metavar="N", help="plan for N ranks on one host (default: torchrun's, or 1)")
    rates = f"override a rate of the plan's predictions; NAME one of {', '.join(DEFAULT_RATES)} (default: an H200's)"
    g.add_argument(
        "--rate", dest="rates", type=rate_flag, action="append", default=[], metavar="NAME=VALUE", help=rates
    )
    timeout = "seconds a rank waits for the others in a step's collective (default: 5x the plan's longest step part, "
    g.add_argument("--rank-timeout", type=float, metavar="S", help=timeout + "60 at least)")


def rate_flag(text: str) -> tuple[str, float]:
    """--rate's NAME=VALUE, checked: a known rate, a number from 0.001 to a million (GB/s or TFLOP/s)."""
    name, _, value = text.partition("=")
    try:
        number = float(value)
    except ValueError:
        number = math.nan
    if name not in DEFAULT_RATES or not 1e-3 <= number <= 1e6:
        rates = ", ".join(DEFAULT_RATES)
        raise argparse.ArgumentTypeError(f"{text!r}: give NAME=VALUE, NAME one of {rates}, VALUE from 0.001 to 1e6")
    return name, number


def positive(value: float) -> bool:  # whether `value` is a finite number above 0
    return math.isfinite(value) and value > 0


ADAM_RANGES = "Adam needs --lr > 0, --eps > 0, --weight-decay >= 0 and betas in [0, 1), all finite"
RANGES = (  # (argparse dests, whether a value given is in range, the refusal), checked in this order
    (("batch_size", "seq_len", "repeat", "steps", "grad_accum"), lambda v: v >= 1, "{flag} must be at least 1"),
    (("prefetch",), lambda v: v >= 1, "{flag} must be at least 1 (blocked mode is prefetch 0)"),
    (("segment",), lambda v: v >= 1, "{flag} must be at least 1 (1: every unit keeps its inputs)"),
    (("warmup", "resident_layers", "nvme_layers"), lambda v: v >= 0, "{flag} must be at least 0"),
    (("checkpoint_every",), lambda v: v >= 1, "{flag} must be at least 1"),
    (("lr", "eps"), positive, ADAM_RANGES),
    (("weight_decay",), lambda v: math.isfinite(v) and v >= 0, ADAM_RANGES),
    (("betas",), lambda v: all(0 <= b < 1 for b in v), ADAM_RANGES),
    (("max_gpu_memory", "max_host_memory"), positive, "{flag} must be a positive number of GiB, got {value}"),
    (("gpu_memory", "host_memory"), positive, "{flag} must be a positive number of GiB, got {value}"),
    (("rank_timeout",), positive, "{flag} must be a positive number of seconds, got {value}"),
    (("gpus",), lambda v: v >= 1, "{flag} must be at least 1, got {value}"),
    (("gpu_memory",), lambda v: v <= 2**20, f"{{flag}} must be at most {2**20:,}, got {{value:g}}"),
    (("host_memory",), lambda v: v <= 2**30, f"{{flag}} must be at most {2**30:,}, got {{value:g}}"),
    (("gpus",), lambda v: v <= 2**16, f"{{flag}} must be at most {2**16:,}, got {{value:g}}"),
    (("rank_timeout",), lambda v: v >= 1, "{flag} must be at least 1 second, got {value:g}"),
    (("gpu_adam_share",), lambda v: 0 <= v <= 1, "{flag} must be between 0 and 1, got {value}"),
    (("seed",), lambda v: 0 <= v <= MAX_SEED, f"{{flag}} must be between 0 and {MAX_SEED}, got {{value}}"),
)
TEXT_RANGES = (  # the same for the text flags, checked after the flags that do not go together
    (("train_tokenizer",), lambda v: v >= 257, "{flag} must be at least 257 (256 bytes, end of text), got {value}"),
    (("eval_fraction",), lambda v: 0 < v < 1, "{flag} must be between 0 and 1, got {value}"),
    (("epochs",), positive, "{flag} must be a positive number, got {value}"),
    (("eval_every", "sample_tokens", "top_k"), lambda v: v >= 1, "{flag} must be at least 1"),
    (("temperature",), lambda v: math.isfinite(v) and v >= 0, "{flag} must be 0 (greedy) or more, got {value}"),
)


def check_ranges(p: Parser, a: argparse.Namespace, rows=RANGES) -> None:
    """Each flag given outside its range (a row of `rows`): one line, exit 2."""
    for dests, in_range, refusal in rows:
        for dest in (d for d in dests if getattr(a, d) is not None and not in_range(getattr(a, d))):
            p.error(refusal.format(flag=flag_name(dest), value=getattr(a, dest)))


def check_values(p: Parser, a: argparse.Namespace) -> None:
    """Flags out of range, or whose values do not go together: the first rule broken, as one line, exit 2."""
    if a.mode != "all" and not set(a.mode.split(",")) <= set(MODES):
        p.error(f"argument --mode: {a.mode!r}: choose all, or one or more of {', '.join(MODES)} with commas")
    check_ranges(p, a)
    if a.gpu_adam_share and a.dtype == "float16":
        p.error("--gpu-adam-share must be 0 in float16: its loss scale must see every gradient before any unit steps")
    if a.clip_grad_norm is not None and not positive(a.clip_grad_norm):
        p.error(f"--clip-grad-norm must be a positive number, got {a.clip_grad_norm}")
    if a.gpu_adam_share and a.clip_grad_norm is not None:
        p.error("--gpu-adam-share must be 0 with --clip-grad-norm: the norm must see every gradient before any step")
    if a.segment and a.segment > 1 and a.offload_activations:
        p.error("--segment recomputes the inputs --offload-activations would keep on the host: give one of them")
    if a.remake_segments and (a.offload_activations or a.segment == 1):
        p.error(
            "--remake-segments remakes the inputs of segments, which --offload-activations or --segment 1 leave out"
        )
    if a.train and a.seq_len == 1:
        p.error("--seq-len must be at least 2 with --train: each token is trained to predict the next")
    if any(not prompt for prompt in a.sample):
        p.error("--sample needs a prompt: an empty one has nothing to continue")
    for prompt in filter(not_utf8, a.sample):  # a byte that is not UTF-8 comes from argv as a lone surrogate
        p.error(f"--sample {prompt!r} holds bytes that are not UTF-8: give the prompt in UTF-8")
    check_ranges(p, a, TEXT_RANGES)


def offloaded(modes) -> bool:  # whether one of `modes` streams the layers: blocked or overlapped
    return bool({"blocked", "overlapped"} & set(modes))


def reads_jsonl(a: argparse.Namespace, modes) -> bool:  # whether --data may hold JSONL: a .jsonl file, or a folder
    return a.data.endswith(".jsonl") or Path(a.data).is_dir()


TRAINING_FLAGS = ("steps", "grad_accum", "inference", "fwd_bwd_reference", "lr", "betas", "eps", "weight_decay")
TRAINING_FLAGS += ("clip_grad_norm", "offload_activations", "segment", "remake_segments", "gpu_adam_share")
TRAINING_FLAGS += ("nvme", "data")
TRAINING_FLAGS += ("sample",)
TRAINING_FLAGS += ("save_pretrained", "checkpoint", "resume")
DATA_FLAGS = ("data_glob", "text_field", "skip_undecodable", "train_tokenizer", "data_cache", "eval_fraction")
DATA_FLAGS += ("epochs", "eval_every")
OVERLAPPED_FLAGS = ("prefetch", "resident_layers", "gpu_adam_share")
OFFLOADED_FLAGS = ("profile", "offload_activations", "segment", "remake_segments", "nvme")
GPU_FLAGS = ("max_gpu_memory", "repeat")
FLAG_NEEDS = (  # flags (argparse dests), what they need to do anything, how to give it, whether run a (modes m) has it
    (TRAINING_FLAGS, ("--train", "add --train", lambda a, m: a.train)),
    (OVERLAPPED_FLAGS, ("overlapped mode", "add overlapped to --mode", lambda a, m: "overlapped" in m)),
    (OFFLOADED_FLAGS, ("an offloaded mode", "add blocked or overlapped to --mode", lambda a, m: offloaded(m))),
    (GPU_FLAGS, ("a GPU mode", "add gpu, blocked or overlapped to --mode", lambda a, m: set(m) - {"cpu"})),
    (("warmup",), ("a GPU mode or --train", "add a GPU mode or --train", lambda a, m: a.train or set(m) - {"cpu"})),
    (("nvme_layers",), ("--nvme DIR", "add --nvme DIR", lambda a, m: a.nvme)),
    (("checkpoint_every",), ("--checkpoint DIR", "add --checkpoint DIR", lambda a, m: a.checkpoint)),
    (("gpu_memory", "host_memory", "gpus", "rates"), ("--plan", "add --plan", lambda a, m: a.plan)),
    (DATA_FLAGS, ("--data PATH", "add --data PATH", lambda a, m: a.data)),
    (("data_glob",), ("a folder as --data", "give --data a folder", lambda a, m: Path(a.data).is_dir())),
    (("text_field",), ("JSONL in --data", "give --data a .jsonl file or a folder", reads_jsonl)),
    (("tokenizer",), ("--data or --sample", "add --data PATH or --sample PROMPT", lambda a, m: a.data or a.sample)),
    (("sample_tokens", "temperature"), ("--sample PROMPT", "add --sample PROMPT", lambda a, m: a.sample)),
    (("top_k",), ("--temperature above 0", "add --temperature T", lambda a, m: a.temperature)),
)
FLAG_CLASHES = (  # flags (argparse dests) that cannot be given together, and why
    (("epochs", "steps"), "--epochs sets the number of steps"),
    (("tokenizer", "train_tokenizer"), "a tokenizer is given or trained, not both"),
)
ONE_GPU_FLAGS = {"resident_layers": None, "profile": None, "fwd_bwd_reference": False}  # dest -> its value unasked
# torchrun's variables: each one's least value, and the variable it must stay under
RANK_VARIABLES = {"WORLD_SIZE": (1, None), "RANK": (0, "WORLD_SIZE"), "LOCAL_WORLD_SIZE": (1, None)}
RANK_VARIABLES["LOCAL_RANK"] = (0, "LOCAL_WORLD_SIZE")


def flag_name(dest: str) -> str:  # the flag of a dest: --no-inference for inference, --hidden-size for hidden_size
    return "--" + {"inference": "no-inference", "rates": "rate", **SIZE_FLAGS}.get(dest, dest.replace("_", "-"))


def check_flags_needed(p: Parser, a: argparse.Namespace, argv) -> None:
    """A flag given that does nothing in this run (FLAG_NEEDS), or beside one it clashes with: one line, exit 2."""
    fresh = {dest: [] for dest in vars(a)}  # values no flag makes: parsed again, a dest that changed was given
    again = vars(p.parse_args(argv, argparse.Namespace(**fresh)))
    given = {dest for dest, value in again.items() if value is not fresh[dest]}
    modes = MODES if a.mode == "all" else a.mode.split(",")
    for flags, (need, add, has) in FLAG_NEEDS:
        for dest in (d for d in flags if d in given and not has(a, modes)):
            p.error(f"{flag_name(dest)} does nothing without {need}: {add}, or leave {flag_name(dest)} out")
    for (first, second), why in FLAG_CLASHES:
        if {first, second} <= given:
            p.error(f"{flag_name(first)} and {flag_name(second)}: {why}: give one")


def rank_environment(p: Parser) -> Ranks:
    """The ranks torchrun describes in the environment, checked (else one line, exit 2); no WORLD_SIZE: one process."""
    env = os.environ
    if "WORLD_SIZE" not in env:
        return Ranks()
    values = {name: env[name] for name in RANK_VARIABLES if name in env}
    values.setdefault("LOCAL_WORLD_SIZE", env["WORLD_SIZE"])
    numbers = {"RANK": 0, "LOCAL_RANK": 0}
    for name, text in values.items():
        if not (text.strip().isascii() and text.strip().isdigit()):
            p.error(f"the environment's {name}={text!r} is not a count (0, 1, 2, ...): set it as torchrun does")
        numbers[name] = int(text)
    for name, (least, below) in RANK_VARIABLES.items():
        if numbers[name] < least or (below and numbers[name] >= numbers[below]):
            bound = f"at least {least}" + (f" and below {below}={numbers[below]}" if below else "")
            p.error(f"the environment's {name}={numbers[name]} must be {bound}: set it as torchrun does")
    if (local := numbers["LOCAL_WORLD_SIZE"]) > numbers["WORLD_SIZE"]:
        p.error(f"the environment's LOCAL_WORLD_SIZE={local} exceeds WORLD_SIZE: set both as torchrun does")
    return Ranks.from_environment()


def check_rank_flags(p: Parser, a: argparse.Namespace, world: int) -> None:
    """Under `world` ranks (torchrun's, or --plan's --gpus): offloaded modes, even micro-batches, no one-GPU flags."""
    if world == 1:
        return
    modes = MODES if a.mode == "all" else a.mode.split(",")
    if not set(modes) <= {"blocked", "overlapped"}:
        p.error(f"--mode {a.mode}: {world} ranks run an offloaded mode: use --mode overlapped or blocked")
    if a.train and a.grad_accum % world:
        split = f"the step's {a.grad_accum} micro-batches split evenly over the {world} ranks"
        p.error(f"--grad-accum {a.grad_accum}: {split}: use a multiple of {world}")
    for dest, unasked in ONE_GPU_FLAGS.items():  # what several ranks do not do yet
        if getattr(a, dest) is not unasked:
            why = "leave it out under torchrun, or run without torchrun"
            p.error(f"{flag_name(dest)} runs on one GPU only, for now: {why}")


def command_line(argv=None) -> RunConfig:
    """The command line as a RunConfig, its dtype None unless given (parse_args asks the GPU); bad flags: exit 2."""
    p = Parser()
    for add in (add_run_flags, add_training_flags, add_data_flags, add_saving_flags, add_plan_flags):
        add(p)
    a = p.parse_args(argv)
    check_values(p, a)
    check_flags_needed(p, a, argv)
    ranks = rank_environment(p)
    check_rank_flags(p, a, ranks.world if ranks.several else a.gpus or 1)
    if a.plan and ranks.several:  # each rank would print a plan, made apart
        p.error("--plan describes a run without starting one: run it once, without torchrun (--gpus N plans N ranks)")
    a.sizes = tuple((f, getattr(a, f)) for f in SIZE_FLAGS if getattr(a, f) is not None)
    if a.model is not None and (a.sizes or a.preset is not None):
        given = [f"--{SIZE_FLAGS[f]}" for f, _ in a.sizes] + ["--preset"] * (a.preset is not None)
        p.error(f"--model {a.model} brings its own sizes: drop {', '.join(given)}, or drop --model")
    a.preset = a.preset or RunConfig.preset
    a.betas, a.sample, a.rates = tuple(a.betas), tuple(a.sample), tuple(a.rates)
    return RunConfig(**{f.name: getattr(a, f.name) for f in dataclasses.fields(RunConfig) if hasattr(a, f.name)})


def check_run(run: RunConfig) -> None:
    """Everything about the run that needs neither torch nor a model: its inputs, outputs, sizes and host memory."""
    named = {"--model": run.model, "--tokenizer": run.tokenizer, "--resume": run.resume} | output_paths(run)
    for flag, path in named.items():  # --json, --save-output, --nvme and --data are Python's own to open: any bytes
        if flag in LIBRARY_PATHS and path and not_utf8(path):
            why = "torch, safetensors and tokenizers open UTF-8 paths alone"
            raise UsageError(f"{flag} {path} holds bytes that are not UTF-8, and {why}: rename it, or give another")
    check_inputs(run)
    check_outputs(run)
    sizes, origin = model_sizes(run)
    check_sizes(sizes, origin)
    check_host_holds(run, sizes)
    positions = sizes.get("max_position_embeddings") or 0
    if positions < run.seq_len:  # a preset's are at least --seq-len
        why = f"max_position_embeddings is {positions}, fewer than --seq-len {run.seq_len}: give --seq-len {positions}"
        raise UsageError(f"{origin}{why} at most")
    if run.sample and run.sample_tokens >= positions:  # positions >= --seq-len >= 1
        raise UsageError(f"--sample-tokens {run.sample_tokens}: the model has {positions} positions, prompt included")
    if run.tokenizer and not has_tokenizer(run.tokenizer):  # text in or out: given, to train, resumed or --model's
        raise UsageError(f"--tokenizer {run.tokenizer}: no tokenizer.json, tokenizer.model or vocab.json there")
    if run.tokenizer or has_tokenizer(run.model) or not (run.data or run.sample):
        return
    if not run.data:
        raise UsageError("--sample needs a tokenizer: give --tokenizer DIR, or --data with --train-tokenizer V")
    if not (run.train_tokenizer or resumes_with_tokenizer(run)):
        raise UsageError("no tokenizer: give --tokenizer DIR, or --train-tokenizer V to train one on the data")


LIBRARY_PATHS = ("--model", "--tokenizer", "--resume", "--checkpoint", "--save-pretrained", "--data-cache", "--profile")
FILE_OUTPUTS = ("--json", "--save-output", "--profile", "--profile's training trace")
ASIDE_CHARS = 18  # the most a name grows aside: .NAME.PID.tmp (write_atomically), .NAME.XXXXXXXX.tmp.old (folders)
TOKENIZER_FILE = r"tokenizer(_config)?\.json|tokenizer\.model|special_tokens_map\.json|added_tokens\.json"
TOKENIZER_FILE += r"|chat_template\.jinja|vocab\.json|merges\.txt"  # what a tokenizer's save_pretrained writes
MODEL_FILE = r"(generation_)?config\.json|model(-\d{5}-of-\d{5})?\.safetensors|model\.safetensors\.index\.json"
SAVED_MODEL_FILE = re.compile(f"{MODEL_FILE}|{TOKENIZER_FILE}")  # what save_pretrained writes, each a regular file
UNIT_FILE = r"unit\d+(\.rank\d+of\d+)?\.step\d+\.pt"  # a unit's state in a checkpoint (checkpoint_files)
# what a checkpoint write makes in its folder, each a regular file (its tokenizer's too); and its files written aside
WRITTEN_FILE = re.compile(rf"{UNIT_FILE}|\.({UNIT_FILE}|{re.escape(CHECKPOINT_FILE)})\.\d+\.tmp|{TOKENIZER_FILE}")
WRITTEN_FOLDER = re.compile(r"\.tokenizer\.[a-z0-9_]{8}\.tmp")  # the tokenizer written aside (folder_aside)


def not_utf8(text: str) -> bool:  # whether `text` holds a lone surrogate: argv's stand-in for a byte that is not UTF-8
    return any(0xD800 <= ord(c) <= 0xDFFF for c in text)


def resumes_with_tokenizer(run: RunConfig) -> bool:
    """Whether the --resume checkpoint's record names a tokenizer (an unreadable record: no; resume refuses it)."""
    if run.resume is None:
        return False
    try:
        record = parse_json((mode_folder(run.resume, run, run.modes[0]) / CHECKPOINT_FILE).read_text())
    except (OSError, ValueError):
        return False
    return isinstance(record, dict) and bool(record.get("tokenizer"))


def has_tokenizer(folder: str | None) -> bool:  # whether `folder` holds a tokenizer's files
    names = ("tokenizer.json", "tokenizer.model", "vocab.json")
    return folder is not None and any((Path(folder) / name).is_file() for name in names)


def path_kind(path: Path, flag: str = "") -> str | None:
    """What is at `path`, not following a link ('a file', 'a folder', 'a FIFO', ...; None: nothing); else refused."""
    if not str(path):
        raise UsageError(f"{flag} is empty: give a path")
    try:
        mode = os.lstat(path).st_mode
    except FileNotFoundError:
        return None
    except OSError as e:  # a file as a folder, a folder the user cannot search
        raise UsageError(f"{flag} {path} cannot be looked at ({e.strerror})".strip()) from None
    kinds = ((stat.S_ISREG, "a file"), (stat.S_ISDIR, "a folder"), (stat.S_ISLNK, "a symbolic link"))
    kinds += ((stat.S_ISFIFO, "a FIFO"), (stat.S_ISSOCK, "a socket"), (stat.S_ISCHR, "a device"))
    return next((kind for test, kind in kinds if test(mode)), "a device")


def check_inputs(run: RunConfig) -> None:
    """Every input exists, is a file or folder (through a link too) as its flag needs, and can be read."""
    inputs = {"--data": (run.data, None), "--model": (run.model, True), "--tokenizer": (run.tokenizer, True)}
    inputs["--resume"] = (run.resume, True)
    for flag, (path, folder) in inputs.items():
        if path is None:
            continue
        kind = path_kind(real_path(path) if path else "", flag)
        if kind is None:
            raise UsageError(f"{flag} {path}: no such {'folder' if folder else 'file or folder'}")
        if kind not in ("a file", "a folder") or (folder and kind != "a folder"):
            raise UsageError(f"{flag} {path} is {kind}: give {'a folder' if folder else 'a file or a folder'}")
        try:
            os.listdir(path) if kind == "a folder" else open(path, "rb").close()
        except OSError as e:
            raise UsageError(f"{flag} {path} cannot be read ({e.strerror}): give one you can read") from None
    if run.model is not None:
        model_type(Path(run.model))
    patterns = [pattern.strip() for pattern in run.data_glob.split(",") if pattern.strip()]  # none leaves --data
    if not patterns or any(Path(p).is_absolute() or ".." in Path(p).parts for p in patterns):
        why = "give patterns relative to the --data folder, such as *.txt,*.jsonl"
        raise UsageError(f"--data-glob '{run.data_glob}': {why}")


def output_paths(run: RunConfig) -> dict[str, str]:
    """Every path the run writes, by flag: the files, and the folders written into (the token cache's with --data)."""
    outputs = {"--json": run.json, "--save-output": run.save_output, "--profile": run.profile}
    outputs["--profile's training trace"] = train_trace_path(run.profile) if run.profile and run.train else None
    outputs |= {"--save-pretrained": run.save_pretrained, "--checkpoint": run.checkpoint, "--nvme": run.nvme}
    outputs["--data-cache"] = str(data_cache_folder(run)) if run.data else None
    return {flag: path for flag, path in outputs.items() if path is not None}


def check_outputs(run: RunConfig) -> None:
    """Every output can be written now, not after the run, and replaces nothing but an output of the same kind."""
    outputs = output_paths(run)
    for flag, path in outputs.items():
        kind, want = path_kind(Path(path) if path else "", flag), "a file" if flag in FILE_OUTPUTS else "a folder"
        linked_folder = kind == "a symbolic link" and flag != "--save-pretrained" and Path(path).is_dir()
        if kind in ("a file", "a folder") and kind != want:
            raise UsageError(f"{flag} {path} is {kind}: give {'a folder' if want == 'a folder' else 'a file name'}")
        if kind not in (None, want) and not (want == "a folder" and linked_folder):  # a link, FIFO, socket, device
            raise UsageError(f"{flag} {path} is {kind}, which the run would replace: give the path of {want}")
        if want == "a file" and path.endswith(os.sep):
            raise UsageError(f"{flag} {path} ends with {os.sep}: give a file name")
        folder = Path(path).parent if want == "a file" else Path(path)
        if flag == "--data-cache" and not run.data_cache:  # the default, made with its parents (~/.cache)
            folder = existing(folder)
        made = want == "a folder" and flag != "--nvme"  # the disk tier's folder is a disk's, given, not made
        check_writable(flag, path, folder, make=made, aside=flag in FILE_OUTPUTS or flag == "--save-pretrained")
    check_no_clash(run, outputs)
    for mode in run.modes if run.save_pretrained else ():  # replaced whole: only what save_pretrained writes, if any
        folder = mode_folder(run.save_pretrained, run, mode)
        if path_kind(folder) not in (None, "a folder"):
            raise UsageError(f"--save-pretrained {folder} is {path_kind(folder)}, which the run would replace")
        other = foreign_entry(folder, lambda p: path_kind(p) == "a file" and SAVED_MODEL_FILE.fullmatch(p.name))
        if other:
            what = f"{other}, which a saved model does not hold: the folder is replaced whole"
            raise UsageError(f"--save-pretrained {folder} holds {what}, so give a new one")
    for mode in run.modes if run.checkpoint else ():
        check_checkpoint_folder(mode_folder(run.checkpoint, run, mode))


def foreign_entry(folder: Path, own) -> str | None:
    """The first entry of `folder` (by name) that is not own(path), as 'notes (a folder)'; None where there is none."""
    if path_kind(folder) != "a folder":
        return None
    path = next((p for p in sorted(folder.iterdir()) if not own(p)), None)
    return None if path is None else f"{path.name} ({path_kind(path)})"


def written_by_checkpoint(path: Path) -> bool:
    """Whether `path` in a checkpoint's folder is what a checkpoint write makes: a file of its names, never a link."""
    if path.is_symlink():
        return False
    if path.is_dir():
        return bool(WRITTEN_FOLDER.fullmatch(path.name))
    return path.is_file() and bool(WRITTEN_FILE.fullmatch(path.name))


def check_checkpoint_folder(folder: Path) -> None:
    """A --checkpoint folder holds only what checkpoint writes make (nothing, a checkpoint, a first write cut short)."""
    if path_kind(folder) not in (None, "a folder"):
        raise UsageError(f"--checkpoint {folder} is {path_kind(folder)}: give a folder")
    record = path_kind(folder / CHECKPOINT_FILE) == "a file"
    other = foreign_entry(folder, lambda p: written_by_checkpoint(p) or (record and p.name == CHECKPOINT_FILE))
    if other:
        what = f"{other}, which a checkpoint does not"
        raise UsageError(f"--checkpoint {folder} holds {what}: give a new or empty folder")
    entries = list(folder.iterdir()) if folder.is_dir() else []
    if entries and not record and not any("unit" in p.name for p in entries):
        raise UsageError(f"--checkpoint {folder} holds files and no {CHECKPOINT_FILE}: give a new or empty folder")


def check_no_clash(run: RunConfig, outputs: dict[str, str]) -> None:
    """No output is, holds or lies inside an input however reached, nor nests in another; --checkpoint X --resume X."""
    given = {"--data": run.data, "--model": run.model, "--tokenizer": run.tokenizer, "--resume": run.resume}
    inputs = [(flag, f"{flag} {real_path(path)}", real_path(path)) for flag, path in given.items() if path is not None]
    for flag, path in given.items():  # and what a link inside an input folder reaches, which the run reads too
        inputs += [(flag, f"{real_path(ln)}, which {flag} reads through {ln}", real_path(ln)) for ln in links(path)]
    inputs.append(("the script", "the script", real_path(__file__)))
    seen = {}
    for flag, path in outputs.items():
        out = real_path(path)
        for other, named, place in inputs:
            if same_place(out, place) and not (flag == "--checkpoint" and other == "--resume"):
                raise UsageError(f"{flag} {path} is {named}: an output never replaces an input: give another path")
            if inside(out, place):
                raise UsageError(f"{flag} {path} lies inside {named}: an output never writes into an input")
            if inside(place, out) and flag == "--save-pretrained":
                raise UsageError(f"--save-pretrained {path} holds {named}, and its folder is replaced whole")
        for other, place in seen.items():
            if same_place(out, place):
                raise UsageError(f"{other} and {flag} both name {path}: give each output a path of its own")
            if inside(out, place) or inside(place, out):
                raise UsageError(f"{flag} {path} and {other} {place} nest: give each output a path of its own")
        seen[flag] = out


def links(path) -> list[Path]:
    """The links inside the folder `path`, not followed: what they reach is an input too (a Hugging Face cache's)."""
    if path is None or not os.path.isdir(path):
        return []
    found, folders = [], [path]
    while folders:  # scandir's entries know their type: no stat a file, for a corpus of millions
        try:
            with os.scandir(folders.pop()) as entries:
                for entry in entries:
                    if entry.is_symlink():
                        found.append(Path(entry.path))
                    elif entry.is_dir(follow_symlinks=False):
                        folders.append(entry.path)
        except OSError:  # a folder that cannot be listed: the run reads nothing from it
            continue
    return found


def same_place(a: Path, b: Path) -> bool:  # whether real paths reach one file: one path, or one device and inode
    try:
        return a == b or os.path.samefile(a, b)
    except (OSError, ValueError):  # nothing there, or it cannot be looked at
        return False


def inside(a: Path, b: Path) -> bool:  # whether real path `a` lies inside folder `b`, however `b` is reached
    return any(same_place(parent, b) for parent in a.parents)


def real_path(path) -> Path:  # `path` absolute, every link in it followed (a loop of links as far as it goes)
    return Path(os.path.realpath(path))


def train_trace_path(path: str) -> str:  # the training step's --profile trace: trace.json -> trace.train.json
    p = Path(path)
    return str(p.with_name(p.stem + ".train" + p.suffix))


def mode_folder(path: str, run: RunConfig, mode: str) -> Path:  # `path`, or path/`mode` where several modes run
    return Path(path) / mode if len(run.modes) > 1 else Path(path)


def data_cache_folder(run: RunConfig) -> Path:  # --data-cache, else offload_llama in XDG_CACHE_HOME, else in ~/.cache
    if run.data_cache:
        return Path(run.data_cache)
    return Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "offload_llama"


def check_writable(flag: str, path: str, folder: Path, make: bool, aside: bool) -> None:
    """Refuse now what fails after the run: no file can be made in `folder` (make: its parent), or the name is long."""
    name = Path(path).name
    try:
        limit = os.pathconf(existing(Path(path).parent), "PC_NAME_MAX")
    except (OSError, ValueError):
        limit = 255
    extra = ASIDE_CHARS if aside else 0
    if len(os.fsencode(name)) + extra > limit:
        raise UsageError(f"{flag}: the name {name[:40]}... is too long: give one of at most {limit - extra} bytes")
    if make and not folder.exists():
        folder = folder.parent
    if not folder.is_dir():
        raise UsageError(f"{flag} {path}: the folder {folder} does not exist")
    try:  # the permission bits do not say whether a file can be created there (/proc, a read-only mount)
        tempfile.TemporaryFile(dir=folder).close()
    except OSError as e:
        why = f"no file can be created there ({e.strerror})"
        raise UsageError(f"{flag} {path}: the folder {folder} cannot be written: {why}") from None


def existing(path: Path) -> Path:  # `path`, or its nearest existing folder (where a folder to be made will go)
    while not path.exists() and path != path.parent:
        path = path.parent
    return path


def model_type(path: Path) -> None:
    """Refuse with one line a save_pretrained folder whose config.json's model_type is not 'llama'."""
    if (kind := read_config_json(path).get("model_type")) != "llama":
        raise UsageError(f"--model {path}: model_type is {kind!r}, not 'llama'")


def first_line(e: BaseException) -> str:  # an exception's first line (200 characters at most), or its class if none
    line = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
    return line if len(line) <= 200 else line[:197] + "..."


def parse_json(text: str | bytes, finite_numbers: bool = True):
    """JSON as inputs must hold it, else a ValueError: nested too deep, or (finite_numbers) NaN, Infinity or 1e999."""

    def finite(number: str) -> float:  # a JSON number as a float, where it is one: NaN, Infinity and 1e999 are none
        value = float(number)
        if not math.isfinite(value):
            why = "is beyond a float's range" if number[-1].isdigit() else "is not a JSON number"
            raise ValueError(f"{number} {why}")
        return value

    try:
        return json.loads(text, **({"parse_constant": finite, "parse_float": finite} if finite_numbers else {}))
    except RecursionError:
        raise ValueError("nested too deeply") from None


def read_config_json(path: Path) -> dict:
    """A save_pretrained folder's config.json as a dict; refused with one line where it is missing or not JSON."""
    config_file = path / "config.json"
    if not config_file.is_file():
        raise UsageError(f"--model {path}: no config.json, so not a save_pretrained folder")
    try:
        config = parse_json(config_file.read_text())
    except OSError as e:
        raise UsageError(f"--model {path}: config.json cannot be read ({e.strerror})") from None
    except ValueError as e:  # UnicodeDecodeError too
        raise UsageError(f"--model {path}: config.json is not valid JSON ({first_line(e)})") from None
    if not isinstance(config, dict):
        raise UsageError(f"--model {path}: config.json holds no settings")
    return config


def model_sizes(run: RunConfig) -> tuple[dict, str]:
    """The model's sizes (LlamaConfig field -> value), the preset's and flags' or --model's, and where they are from."""
    if run.model is None:
        sizes = {**PRESETS[run.preset], **dict(run.sizes), "max_position_embeddings": max(4096, run.seq_len)}
        return sizes, ""
    config = read_config_json(Path(run.model))
    origin = f"--model {run.model}: config.json's "
    sizes = {field: config.get(field, LLAMA_DEFAULTS.get(field)) for field in (*SIZE_FLAGS, *LLAMA_DEFAULTS)}
    sizes["num_key_value_heads"] = sizes["num_key_value_heads"] or sizes["num_attention_heads"]
    for field in (*SIZE_FLAGS, "max_position_embeddings", "head_dim"):
        if (type(sizes[field]) is not int or sizes[field] < 1) and not (field == "head_dim" and sizes[field] is None):
            raise UsageError(f"{origin}{field} is {sizes[field]!r}, not a whole number of at least 1")
    rope = config.get("rope_parameters")  # transformers 5's home of rope_theta (older configs: the top level)
    sizes["rope_theta"] = rope.get("rope_theta", sizes["rope_theta"]) if isinstance(rope, dict) else sizes["rope_theta"]
    for field in ("rope_theta", "rms_norm_eps"):  # 0 or less: every logit NaN (parse_json: no NaN or infinity)
        if type(sizes[field]) not in (int, float) or sizes[field] <= 0:
            raise UsageError(f"{origin}{field} is {sizes[field]!r}, not a positive number: the model would compute NaN")
    pad, vocab = sizes["pad_token_id"], sizes["vocab_size"]
    if pad is not None and (type(pad) is not int or not -vocab <= pad < vocab):  # as nn.Embedding takes it
        raise UsageError(f"{origin}pad_token_id is {pad!r}, not an id of its vocab_size {vocab}")
    return sizes, origin


SMALLER_LAYERS = "fewer or smaller layers (--layers, --hidden-size, --intermediate-size, or --preset tiny)"
# LlamaConfig's defaults, where a config.json leaves a field out (None: kv heads = heads, head_dim = hidden / heads)
LLAMA_DEFAULTS = {**PRESETS["llama-7b"], "max_position_embeddings": 2048, "rope_theta": 10000.0, "rms_norm_eps": 1e-6}
LLAMA_DEFAULTS |= dict.fromkeys(("tie_word_embeddings", "attention_bias", "mlp_bias"), False)
LLAMA_DEFAULTS |= dict.fromkeys(("num_key_value_heads", "head_dim", "pad_token_id"))


def check_host_holds(run: RunConfig, sizes: dict) -> None:
    """Refuse at once a model whose parameters the host cannot hold (4 bytes each to train, a rank its share)."""
    params = parameter_count(sizes)
    per_param = 4 if run.train or run.dtype == "float32" else 2
    ranks = Ranks.from_environment() if run.gpus is None else Ranks(0, run.gpus, 0, run.gpus)
    ids = 8 * run.batch_size * run.seq_len * (run.grad_accum if run.train else 1)  # the step's int64 token ids
    needed = params * per_param * ranks.local_world // ranks.world + ids
    available = host_memory_available() if run.host_memory is None else int(run.host_memory * GiB)
    if run.max_host_memory is not None:
        available = min(available or math.inf, int(run.max_host_memory * GiB))
    if available is not None and needed > available:
        fix = "a smaller model" if run.model else SMALLER_LAYERS
        if ids > needed // 2:
            fix = "fewer or shorter sequences (--batch-size, --seq-len, --grad-accum)"
        if run.max_host_memory is not None:
            fix += ", or a larger --max-host-memory"
        need = f"{count_text(params)} parameters and {count_text(ids // 8)} token ids need at least {size_text(needed)}"
        have = f"only {size_text(available)} are available: use {fix}, or a host with more memory"
        raise UsageError(f"{need} of host memory, {have}")


def host_memory_available() -> int | None:  # MemAvailable from /proc/meminfo, in bytes (None: no such file)
    return proc_kib("/proc/meminfo", "MemAvailable")


def proc_kib(path: str, field: str) -> int | None:
    """A 'field: N kB' line of a Linux /proc file, in bytes (None where there is no such file or field)."""
    with contextlib.suppress(OSError):
        for line in Path(path).read_text().splitlines():
            if line.startswith(field + ":"):
                return int(line.split()[1]) * 1024
    return None


def check_sizes(sizes: dict, origin: str = "") -> None:
    """Refuse sizes (LlamaConfig field -> value) no LLaMA has; `origin` says where they came from in the message."""
    for field in SIZE_FLAGS:
        least = 2 if field == "vocab_size" else 1  # one token leaves nothing to predict
        if sizes[field] < least:
            name = field if origin else f"--{SIZE_FLAGS[field]}"
            raise UsageError(f"{origin}{name} must be at least {least}, got {sizes[field]}")
    h, heads, kv_heads = sizes["hidden_size"], sizes["num_attention_heads"], sizes["num_key_value_heads"]
    # each rule, and the flag to change where flags gave the sizes (a saved model's are not the user's)
    for broken, why, flag in (
        (h % heads, f"hidden size {h} is not divisible by {heads} attention heads", "--heads"),
        (heads % kv_heads, f"{heads} attention heads are not divisible by {kv_heads} key/value heads", "--kv-heads"),
        (h // heads % 2, "head dimension (hidden size / heads) must be even for rotary embeddings", "--hidden-size"),
    ):
        if broken:
            raise UsageError(f"{origin}{why}" + ("" if origin else f": change {flag}"))


# ----------------------------------------------------------------------------------------------------- running a mode
# A mode run whole: its trainer set up, resumed, placed; its steps timed, with bound rounds, checkpoints, evaluations.


def make_trainer(mode: str, model, masters: OffloadedAdam | None, micro_batches, run: RunConfig, device, plan: Plan):
    """The trainer for `mode`: the resident reference, or the streamed units with the CPU Adam (`masters` loaded)."""
    if mode not in ("blocked", "overlapped"):  # gpu, gpu_recomputed, cpu
        scaling, recompute = loss_scaling(run.torch_dtype, device), mode == "gpu_recomputed"
        return ResidentTraining(model, device, run.adam, run.clip_grad_norm, scaling, recompute)
    t0 = time.perf_counter()
    kwargs = decoder_kwargs(model, tuple(micro_batches[0].shape), run.torch_dtype, device)
    depth = plan.modes[mode].depth
    training = ShardedTraining if run.ranks.several else OffloadedTraining
    trainer = training(masters, model.config, run.torch_dtype, device, depth, model.loss_function, kwargs)
    scale_and_clip(trainer, run.clip_grad_norm)
    if plan.offload_activations:
        trainer.inputs = ActivationOffload(trainer, len(micro_batches), tuple(micro_batches[0].shape))
    elif plan.segment > 1:
        trainer.inputs = (SegmentInputs if plan.remake_segments else SegmentGraphs)(trainer, plan.segment)
    masters.setup_s["trainer"] = time.perf_counter() - t0  # the GPU's ring and buffers, the saved inputs' host ones
    return trainer


def measure_offloaded(model, store: ParamStore, input_ids, device, depth: int, run: RunConfig, resident=()):
    """An offloaded mode's inference (infer_offloaded), timed, its peak memory and its bound; the logits."""
    shell, streamer = infer_offloaded(model, store, device, depth, resident)
    ids = input_ids.to(device)
    result = {"prefetch": depth, "slots": streamer.n_slots, "resident_layers": list(resident)}
    if device.type != "cuda":
        ms, logits = median_ms(lambda: logits_of(shell, ids), device, run.warmup, run.repeat)
        return result | {"time_ms": ms}, logits.cpu()
    logits_of(shell, ids)  # the peak of one pass, before the bound's parts add theirs
    result |= gpu_memory(model.config, store.dtype, ids.numel(), len(resident) + streamer.n_slots)
    parts = inference_parts(shell, streamer, ids)
    times, logits = interleaved_ms({**parts, "pass": (device, lambda: logits_of(shell, ids))}, run.warmup, run.repeat)
    result["time_ms"] = statistics.median(times["pass"])
    result |= inference_bound(streamer, {name: min(times[name]) for name in parts}, result["time_ms"])
    if run.profile and run.profile_mode == ("overlapped" if depth else "blocked"):  # a trace of one more pass
        result["trace"] = profile_pass(lambda: logits_of(shell, ids), run.profile)
    return result, logits.cpu()


def run_mode(mode: str, model, store, input_ids, run: RunConfig, plan: Plan) -> tuple[dict, torch.Tensor | None]:
    """One mode's inference result; {'oom': True} when it does not fit the GPU (or the --max-gpu-memory cap)."""
    config, device = model.config, torch.device("cpu" if mode == "cpu" else "cuda")
    log(f"mode {mode}: inference over {input_ids.numel()} tokens ...")
    reset_peak_memory(device)
    try:
        with torch.inference_mode():
            if mode in ("gpu", "cpu"):
                result, logits = infer_resident(model, input_ids, device, run)
                if device.type == "cuda":
                    result |= gpu_memory(config, run.torch_dtype, input_ids.numel(), config.num_hidden_layers)
                return result, logits
            placed = plan.modes[mode]
            if placed.inference_resident:
                layers = ", ".join(map(str, placed.inference_resident))
                peak = gib(sum(placed.inference_gpu.values()))
                log(f"mode {mode}: decoder layers {layers} resident, predicted peak {peak} GiB")
            return measure_offloaded(model, store, input_ids, device, placed.depth, run, placed.inference_resident)
    except torch.OutOfMemoryError:
        log(f"mode {mode}: out of GPU memory")
        return {"oom": True}, None


def train_mode(mode: str, model, masters, input_ids, run: RunConfig, plan: Plan, text=None) -> dict:
    """One mode's training on a fixed batch or --data's blocks ({'oom': True} where it does not fit the GPU)."""
    device, compared, ranks = torch.device("cpu" if mode == "cpu" else "cuda"), mode in compared_modes(run), run.ranks
    if planned_oom(mode, plan, device):
        return {"oom": True}
    micro_batches = [ids.to(device) for ids in ranks.share(input_ids.chunk(run.grad_accum))]
    log(f"mode {mode}: training, {run.steps} steps of {input_ids.numel()} tokens in {run.grad_accum} micro-batch(es)")
    reset_peak_memory(device)
    trainer = None
    try:
        trainer = make_trainer(mode, model, masters, micro_batches, run, device, plan)
        manifest = checkpoint_manifest(run, model.config, mode, plan)
        placed = prepare_steps(trainer, run, mode, plan, manifest)
        profile = train_trace_path(run.profile) if run.profile and mode == run.profile_mode else None
        bound_parts = bound_parts_of(trainer, micro_batches, device)
        tokenizer = text.tokenizer if text else None  # it travels with the checkpoints and the saved model
        checkpoint = Checkpoints(trainer, run, mode, manifest, tokenizer) if run.checkpoint else None
        done, seen = manifest.get("resumed_from", 0), manifest.get("tokens_before", 0)  # by the checkpoint resumed
        evaluation = Evaluation(trainer, run, model.config, device, text, done)
        between = [task for task in (checkpoint, evaluation) if task]
        batches = step_batches(text.blocks, run, device) if text and text.blocks else None
        result = train_steps(trainer, micro_batches, run, compared, profile, bound_parts, between, done, batches, seen)
        trainer.finish()
        if checkpoint:
            checkpoint.write(run.steps)
        evaluation.after()
        result |= trained_outputs(trainer, run, model.config, mode, compared, tokenizer) | placed
        result |= evaluation.figures() | training_figures(trainer, result) | step_rates(run, model.config, mode, result)
        return rank_peaks(ranks, result, param_count(model.config))
    except torch.OutOfMemoryError as e:
        if ranks.several:  # one rank's OOM would leave the others in a collective: it ends the run (torchrun's exit)
            raise
        log(f"mode {mode}: out of GPU memory ({str(e).splitlines()[0]})")
        return {"oom": True}
    finally:  # an OOM or an interrupt too: the CPU Adam worker must stop before the buffers it steps are freed
        if trainer is not None:
            trainer.finish()


def prepare_steps(trainer, run: RunConfig, mode: str, plan: Plan, manifest: dict) -> dict:
    """Before the first step: resume, place the units and zero the CPU Adam's moments; the placement, for the JSON."""
    if run.resume:
        manifest["resumed_from"] = resume(trainer, mode_folder(run.resume, run, mode), manifest)
    if not isinstance(trainer, OffloadedTraining):
        return {}
    trainer.ranks.meet()  # the steps' collectives wait the rank timeout at most: every rank set up first
    t0 = time.perf_counter()
    placed = place_units(trainer, run, mode, plan) if trainer.device.type == "cuda" else {}
    cpu_units = [u for u, stepper in enumerate(trainer.steppers.of) if stepper is trainer.steppers.cpu_adam]
    trainer.store.zero_moments(cpu_units)  # now, not at each unit's first step: a page's first touch is slow
    trainer.store.setup_s["placed"] = time.perf_counter() - t0
    return placed | {"setup_s": dict(trainer.store.setup_s)}


def train_steps(
    trainer, micro_batches, run, keep_grads, profile=None, bound_parts=None, tasks=(), done=0, batches=None, seen=0
):
    """Run the steps, each timed to the next one's start, and between them, untimed, the bound's rounds and the tasks
    (keep_grads: keep step 1's state; done, seen: a resumed run's steps and tokens; batches(i): step i's blocks)."""
    batch = batches(done) if batches else micro_batches
    tokens = sum(ids.numel() for ids in batch) * run.ranks.world  # the step's, over every rank
    clock = StepClock(trainer, batch[0].device, done, run.steps, tokens, seen)
    rounds = bound_rounds(run) if bound_parts else []
    losses, grads, parts, extra = [], None, collections.defaultdict(list), {}
    for i in range(run.steps + 1):
        if i in rounds:
            clock.pause(i)
            for _ in range(rounds.count(i)):
                time_round(bound_parts(), parts, run.ranks)
            clock.resume(after_round=True)
        if i == run.steps:
            break
        if i == run.steps - 1 and profile:  # the last step, traced and left out of the timing
            extra["trace"] = profile_step(trainer, batch, profile)
            losses.append(extra["trace"].pop("loss"))
            continue  # to the rounds after the last step
        loss = trainer.step(batch)
        if batches and i + 1 < run.steps:  # the next step's blocks, gathered and copied while this step's kernels run
            batch = batches(done + i + 1)
        losses.append(loss.item())  # S11: a sync: this step's forward and backward have run
        if not math.isfinite(losses[-1]):
            raise Diverged(f"step {done + i + 1}'s loss is {losses[-1]}: {DIVERGED if done + i else UNTRAINED}")
        if i == 0 and keep_grads:
            grads = first_step_state(trainer)
        clock.lap(i, losses[-1])
        run_tasks(tasks, i + 1, run.steps, clock)
    if parts:
        extra["bound_parts_ms"] = {name: ms[1:] for name, ms in parts.items()}  # the first round is a warm-up
    paused = f", and {clock.paused_s:.1f} s between them (bound rounds, checkpoints, evaluations)"
    log(f"  {len(clock.times)} steps in {sum(clock.times) / 1e3:.1f} s{paused if clock.paused_s else ''}")
    return clock.result(run.warmup) | {"losses": losses, "grads": grads, "tokens_per_step": clock.tokens} | extra


def run_tasks(tasks, done: int, last: int, clock: StepClock) -> None:  # the tasks due after step `done`, clock paused
    due = [task for task in tasks if task.due(done, last)]
    if due:
        clock.pause(done)  # the updates are written first
        for task in due:
            task.run(done)
        clock.resume(after_round=True)


# ------------------------------------------------------------------------------------------------------------ the run
# The run from the command line: plan, check, build, run each mode, print the tables and write the outputs.


def parse_args(argv=None) -> RunConfig:
    """The command line as a RunConfig with its dtype: bfloat16 unless --dtype says otherwise or the GPU lacks it."""
    run, ranks = command_line(argv), Ranks.from_environment()
    if ranks.several:
        run = dataclasses.replace(run, ranks=ranks)
        if torch.cuda.is_available() and ranks.local_rank < torch.cuda.device_count():  # else refused later
            torch.cuda.set_device(run.ranks.local_rank)  # before CUDA starts on another GPU
    return run if run.dtype else dataclasses.replace(run, dtype=default_dtype())


def check_model_flags(run: RunConfig, config: LlamaConfig) -> None:
    """The flags that must fit the model: --resident-layers, --max-gpu-memory's least, --train's untied head."""
    if run.resident_layers is not None and run.resident_layers > (layers := config.num_hidden_layers):
        raise UsageError(f"--resident-layers {run.resident_layers}: the model has {layers} decoder layers")
    one_layer = layer_bytes(config, run.torch_dtype)
    if run.max_gpu_memory is not None and run.max_gpu_memory * GiB < one_layer:
        size = f"{one_layer / 2**20:.1f} MiB in {run.dtype}"
        raise UsageError(f"--max-gpu-memory {run.max_gpu_memory} GiB is less than one decoder layer ({size})")
    if run.train and config.tie_word_embeddings:
        raise UsageError("--train needs untied embeddings (tie_word_embeddings is true): the head is a unit of its own")


def check_devices(run: RunConfig, config: LlamaConfig) -> None:
    """What the model, the GPU and the host refuse before the plan (check_plan says what will not fit)."""
    check_model_flags(run, config)
    gpu_modes, local_world = [m for m in run.modes if m != "cpu"], run.ranks.local_world
    if gpu_modes and local_world > max(1, torch.cuda.device_count()):
        ranks = f"torchrun started {local_world} ranks on this host, which has {torch.cuda.device_count()} GPU(s)"
        raise UsageError(f"{ranks}: use --nproc-per-node with at most one rank per GPU")
    if run.fwd_bwd_reference and not torch.cuda.is_available():
        raise UsageError("--fwd-bwd-reference runs on a CUDA GPU, and torch.cuda.is_available() is False")
    if gpu_modes and not torch.cuda.is_available():
        why = f"mode {gpu_modes[0]} needs a CUDA GPU, and torch.cuda.is_available() is False"
        raise UsageError(f"{why}: use --mode cpu (a first try: {FIRST_CONTACT})")
    if run.gpu_adam_share and run.dtype == "float16":  # the dtype the GPU gave, where --dtype did not say
        raise UsageError("--gpu-adam-share must be 0 in float16: its loss scale sees every gradient before any step")
    if gpu_modes and run.dtype == "bfloat16" and not torch.cuda.is_bf16_supported(including_emulation=False):
        raise UsageError(f"{torch.cuda.get_device_name()} cannot compute in bfloat16: use --dtype float16 or float32")
    if run.model is not None:
        check_weights(Path(run.model), config)


def check_saving(run: RunConfig, config: LlamaConfig, plan: Plan | None = None) -> None:
    """Refuse --resume's checkpoints that do not fit, a --checkpoint that overwrites one, a folder short of room."""
    same = bool(run.resume and run.checkpoint) and real_path(run.resume) == real_path(run.checkpoint)
    for mode in run.modes if run.train else ():
        if run.resume:
            manifest = checkpoint_manifest(run, config, mode)
            read_checkpoint(mode_folder(run.resume, run, mode), manifest, model_units(config))
        if run.checkpoint and not same and (mode_folder(run.checkpoint, run, mode) / CHECKPOINT_FILE).exists():
            advice = f"go on from it with --resume {run.checkpoint}, or give another folder"
            raise UsageError(f"--checkpoint {run.checkpoint} holds a checkpoint already: {advice}")
    twice = bool(run.checkpoint_every and run.checkpoint_every < run.steps) and not same
    size = 4 * param_count(config) * len(run.modes)  # float32 weights; a checkpoint's moments too
    needs = {"--save-pretrained": (run.save_pretrained, size), "--checkpoint": (run.checkpoint, 3 * size * (1 + twice))}
    needs["--save-output"] = (run.save_output, save_output_bytes(run, config))
    for flag, (path, needed) in needs.items():
        if not path:
            continue
        folder = existing(Path(path))
        nvme_there = plan is not None and plan.disk and os.stat(folder).st_dev == os.stat(run.nvme).st_dev
        free = shutil.disk_usage(folder).free - (plan.disk if nvme_there else 0)  # the disk tier's files take theirs
        if needed > free:
            short = f"{size_text(needed)} to write, {size_text(needed - free)} more than is free there"
            raise UsageError(f"{flag} {path}: {short}; free some space or give a folder on another disk")


HELD_FOLDERS = []  # (descriptor, folder, made for the lock) of each folder this run holds (hold_checkpoint_folders)


def hold_checkpoint_folders(run: RunConfig) -> None:
    """Lock each --checkpoint folder, share a lock on each --resume one (rank 0, for all): a second run is refused."""
    if not run.train or run.ranks.rank:
        return
    written = [] if run.plan or not run.checkpoint else [Path(run.checkpoint)]
    written += [mode_folder(run.checkpoint, run, m) for m in run.modes] if written else []
    locks = {folder: ("--checkpoint", fcntl.LOCK_EX) for folder in written}
    for folder in [mode_folder(run.resume, run, mode) for mode in run.modes] if run.resume else []:
        if not any(same_place(real_path(folder), real_path(other)) for other in locks):  # --resume X --checkpoint X
            locks[folder] = ("--resume", fcntl.LOCK_SH)
    for folder, (flag, kind) in locks.items():  # the given folder first, so it goes last
        if not folder.exists() and flag == "--resume":
            continue  # nothing to read: check_run says so
        if os.path.lexists(folder) and not folder.is_dir():
            raise UsageError(f"{flag} {folder} is {path_kind(folder)}: give a folder")
        made = not folder.exists()
        try:
            folder.mkdir(exist_ok=True)
        except OSError:
            continue  # no place for it (its parent missing or not writable): check_run refuses it in one line
        HELD_FOLDERS.append((os.open(folder, os.O_RDONLY), folder, made))
        try:
            fcntl.flock(HELD_FOLDERS[-1][0], kind | fcntl.LOCK_NB)
        except BlockingIOError:
            raise UsageError(f"{flag} {folder} is in use by another run: wait for it to end, or give another") from None


def release_checkpoint_folders() -> None:  # unlock the held folders, removing those made for the lock left empty
    while HELD_FOLDERS:
        descriptor, folder, made = HELD_FOLDERS.pop()
        os.close(descriptor)
        if made:
            with contextlib.suppress(OSError):  # not empty: it holds a checkpoint
                folder.rmdir()


def save_output_bytes(run: RunConfig, config: LlamaConfig) -> int:  # --save-output's most bytes: ids, logits, masters
    tokens, modes = run.batch_size * run.seq_len, len(run.modes)
    logits = modes * tokens * config.vocab_size * 4 if run.inference else 0
    training = run.grad_accum * tokens * 8 + modes * 4 * param_count(config) if run.train else 0
    return tokens * 8 + logits + training + 2**20  # and the pickle's own records


def write_atomically(path: str, write) -> None:  # write(tmp) beside `path`, renamed over it: never a truncated file
    tmp = str(Path(path).with_name(f".{Path(path).name}.{os.getpid()}.tmp"))
    try:
        with named_errors(path, aside=tmp):
            write(tmp)
            os.replace(tmp, path)
    finally:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(tmp)


def write_json(path: str, report: dict) -> None:  # the results as indented JSON, written atomically
    write_atomically(path, lambda tmp: Path(tmp).write_text(json.dumps(report, indent=2) + "\n"))


def environment() -> dict:  # where the results come from: device, versions, CPU threads and the script's sha256
    cuda, script = torch.cuda.is_available(), Path(__file__).read_bytes()
    segments = torch.cuda.memory_snapshot() if torch.cuda.is_initialized() else []  # the allocator's, once CUDA starts
    where = {"device": torch.cuda.get_device_name() if cuda else platform.processor() or "cpu"}
    where |= {"gpu_memory_bytes": gpu_total_bytes() if cuda else None, "torch": torch.__version__}
    where |= {"transformers": transformers.__version__, "python": platform.python_version()}
    where |= {"cpu_threads": torch.get_num_threads(), "script_sha256": hashlib.sha256(script).hexdigest()}
    return where | {"expandable_segments": all(s["is_expandable"] for s in segments) if segments else None}  # in place


def run_all(run: RunConfig) -> dict:
    """Plan the run on the facts the ranks agree on, refuse what will not fit, build, run each mode, print, write."""
    config = model_config(run)
    check_devices(run, config)
    start_ranks(run.ranks)
    plan = make_plan(run, config, agreed_facts(run.ranks, measured_facts(run)))
    check_plan(run, config, plan)
    check_saving(run, config, plan)
    say_plan(run, config, plan)
    log(f"torch {torch.__version__} and transformers {transformers.__version__} imported, the run checked and planned")
    join_steps(run.ranks, plan.rank_timeout, plan.threads)
    offloaded = {"blocked", "overlapped"} & set(run.modes)
    text = agreed_text(run, config)
    blocks = text.blocks if text else None
    run = with_epochs(run, blocks)
    warn_if_long(run, config)
    model = load_model(run, config)
    if run.train and offloaded:  # after the build, whose change of torch's default dtype would fail a compile's guards
        start_adam_compile(gradient_dtype(run), plan.torch_copy_dtype, run.clip_grad_norm is not None)
    train_ids = first_batch(blocks, run) if blocks else random_input_ids(run, model.config.vocab_size, run.grad_accum)
    reference = forward_backward_reference(model, train_ids, run) if run.fwd_bwd_reference else None
    if run.max_gpu_memory is not None and any(m != "cpu" for m in run.modes):  # the allocator's fraction of the GPU
        torch.cuda.set_per_process_memory_fraction(min(1.0, run.max_gpu_memory * GiB / gpu_total_bytes()))
    input_ids = random_input_ids(run, model.config.vocab_size)
    store = param_store_of(run.ranks, model, pin=True) if offloaded and run.inference else None
    masters = training_store(run, model.config, plan) if run.train and offloaded else None
    try:
        results, logits, trained = run_modes(run, plan, model, store, masters, input_ids, train_ids, text)
    finally:
        if masters:
            masters.close()  # the disk tier's files
    host = {"host_budget_bytes": plan.facts.host_share, "peak_host_bytes_process": process_host_peak()}
    host = host_peaks(run.ranks, host)
    report = run_report(run, model.config, input_ids.numel(), results, reference, host) | {"plan": plan.as_dict()}
    if run.ranks.rank == 0:  # rank 0 writes and prints for all: the files first, whole whatever the terminal does
        write_outputs(run, report, input_ids, logits, train_ids, trained)
        print(report_tables(results, run, reference, host))
    return report


def print_plan(run: RunConfig) -> None:
    """--plan: print the plan for this machine or the one described (and --json), allocating nothing; refuse misfits."""
    config = model_config(run)
    check_model_flags(run, config)
    facts, gpu_modes = measured_facts(run), [m for m in run.modes if m != "cpu"]
    if gpu_modes and facts.gpu_bytes is None:  # its peaks and bound would be for no GPU at all
        why = f"mode {gpu_modes[0]} runs on a GPU, and this machine has none"
        raise UsageError(f"--plan: {why}: give --gpu-memory GIB to plan for one of that memory, or --mode cpu")
    plan = make_plan(run, config, facts)
    print(plan_table(plan, run, config))
    if run.json:
        report = {"run": dataclasses.asdict(run), "parameters": param_count(config), "plan": plan.as_dict()}
        write_json(run.json, report)
    check_plan(run, config, plan)
    check_saving(run, config, plan)
    for mode, placed in plan.modes.items():
        if run.train and not placed.training_fits:
            limit = gpu_limit_text(run, plan)
            log(f"note: mode {mode}'s training does not fit {limit}: a run reports it OOM and goes on with the others")


def write_outputs(run: RunConfig, report: dict, input_ids, logits: dict, train_ids, trained: dict) -> None:
    """--json's report; --save-output's input ids and logits, and the training ids, losses and float32 masters."""
    if run.json:
        write_json(run.json, report)
    if run.save_output:
        output = {"input_ids": input_ids, "logits": {m: t for m, t in logits.items() if t is not None}}
        if run.train:
            kept = {m: {"losses": r["losses"], "masters": r["masters"]} for m, r in trained.items() if not r.get("oom")}
            output["training"] = {"input_ids": train_ids, **kept}
        write_atomically(run.save_output, lambda tmp: torch_save(output, tmp, run.save_output))
    log("done")


def run_report(run: RunConfig, config: LlamaConfig, tokens: int, results: dict, reference, host: dict) -> dict:
    """--json's report: the environment, the run, the model, each mode's results, the reference and the host's peak."""
    report = {**environment(), "run": dataclasses.asdict(run), "tokens": tokens, **host}
    report |= {"parameters": param_count(config), "layer_bytes": layer_bytes(config, run.torch_dtype)}
    report |= {"config": json.loads(config.to_json_string()), "results": results}
    return report | ({"fwd_bwd_reference": reference} if reference else {})


def check_finite_logits(mode: str, logits: torch.Tensor | None) -> None:
    """Logits that are not finite end the run (Diverged), saying where the first is: never reported, nor written."""
    bad = None if logits is None else ~torch.isfinite(logits)  # (sequence, position, token)
    if bad is not None and bad.any():
        first = int(bad.flatten().to(torch.uint8).argmax()) // bad.shape[-1]  # argmax: the first of them
        what = "NaN" if logits.isnan().any() else "infinities"
        where = f"the first at sequence {first // bad.shape[1]}, position {first % bad.shape[1]}"
        raise Diverged(f"mode {mode}: the logits hold {what} ({where}): {UNTRAINED}")


def run_modes(run: RunConfig, plan: Plan, model, store, masters, input_ids, train_ids, text) -> tuple[dict, dict, dict]:
    """Each mode's inference, then its training, as planned: (results, logits, training results with tensors)."""
    results, logits, trained = {}, {}, {}
    for mode in run.modes:
        results[mode] = {}
        if run.inference:
            results[mode]["inference"], logits[mode] = run_mode(mode, model, store, input_ids, run, plan)
            check_finite_logits(mode, logits[mode])
            free_gpu_memory()
        if run.train and mode in ("blocked", "overlapped"):
            t0 = time.perf_counter()
            masters_to_device(masters)  # the units resident in every mode: their masters there alone
            if draws_units(run):
                draw_masters(masters, model, run.seed)
            masters.load(None if draws_units(run) else model)
            masters.setup_s["weights"] = time.perf_counter() - t0
            log(f"mode {mode}: the model's weights in the masters in {masters.setup_s['weights']:.1f} s")
            if run.lean:  # the masters hold the layers now: 2 bytes per parameter less on the host
                model.model.layers.to("meta")
        if run.train:
            result = trained[mode] = train_mode(mode, model, masters, train_ids, run, plan, text)
            if mode in ("blocked", "overlapped"):
                masters_off_device(masters)
            gpu = trained.get("gpu") if mode in ("blocked", "overlapped") else None
            if gpu is not None and not gpu.get("oom") and not result.get("oom"):  # then frees the tensors compared
                compare_training(result, gpu, run)
                result["grads"] = None
                if not run.save_output:
                    result["masters"] = None
            results[mode]["training"] = {k: v for k, v in result.items() if k not in ("grads", "masters")}
            free_gpu_memory()
        if run.train and mode == "gpu":  # again with the offloaded modes' recomputation: a row of the tables alone
            alone = dataclasses.replace(run, checkpoint=None, save_pretrained=None, resume=None, profile=None)
            result = train_mode("gpu_recomputed", model, None, train_ids, alone, plan)
            results["gpu_recomputed"] = {"training": {k: v for k, v in result.items() if k not in ("grads", "masters")}}
            free_gpu_memory()
    for mode in ("blocked", "overlapped"):
        if logits.get("gpu") is not None and logits.get(mode) is not None:
            results[mode]["inference"]["equal_to_gpu"] = torch.equal(logits[mode], logits["gpu"])
    return results, logits, trained


def training_store(run: RunConfig, config: LlamaConfig, plan: Plan) -> OffloadedAdam:
    """The offloaded modes' training state, pinned on the host as planned, the disk units' Adam moments on --nvme."""
    t0, layers, disk = time.perf_counter(), plan.disk_layers, None
    units, scaled = model_units(config), run.clip_grad_norm is not None
    if run.nvme and not layers:
        log("disk tier: unused, the host holds the training state")
    if layers:
        t1 = time.perf_counter()
        disk = DiskTier(run.nvme, {u: run.ranks.shard_numel(units[u].layout.numel) for u in plan.disk_units})
        on_disk = f"the Adam moments of {layers} decoder layers ({gib(disk_step_bytes(disk))} GiB)"
        io = "direct I/O" if disk.files.direct else "buffered I/O (the file system refuses O_DIRECT)"
        rates = f"write {disk.files.rates['write_gbps']:.2f} GB/s, read {disk.files.rates['read_gbps']:.2f} GB/s"
        log(f"disk tier: {on_disk} in unnamed files under {run.nvme}, reserved in {time.perf_counter() - t1:.1f} s")
        log(f"disk tier: {io}; measured: {rates}")
    try:
        copy, buffers = plan.torch_copy_dtype, plan.grad_buffers
        args = (units, run.adam, True, buffers, gradient_dtype(run), copy, scaled, moments_for(disk), run.ranks)
        on_device = dict.fromkeys(resident_everywhere(run, plan.modes), torch.device("cuda"))
        masters = OffloadedAdam(*args, update=CompiledAdamUpdate, on_device=on_device)
    except BaseException:
        if disk:
            disk.close()
        raise
    buffers = [*masters.masters, *(masters.copies or []), *masters.pool.buffers]
    pinned = sum(t.nbytes for t in buffers if not t.is_meta)  # a meta tensor: a unit's master lives on the GPU alone
    moments = sum(m.nbytes for pair in masters.moments if pair for m in pair)  # None: on the disk tier
    masters.setup_s["host_state"] = time.perf_counter() - t0
    state = f"{size_text(pinned)} pinned, {size_text(moments)} of Adam moments"
    log(f"training state on the host in {masters.setup_s['host_state']:.1f} s: {state}")
    return masters


def main(argv=None) -> int:
    """The command line's entry point: exit code 0, ended_early's or 1 for a rank lost; each output whole or absent."""
    use_expandable_segments()  # before anything starts CUDA: parse_args asks the GPU for its dtypes
    for stream in (sys.stdout, sys.stderr):  # what their encoding lacks (an ASCII terminal) as escapes, not an error
        with contextlib.suppress(AttributeError, ValueError):  # a stream that is not a TextIOWrapper
            stream.reconfigure(errors="backslashreplace")
    run = parse_args(argv)
    with signals_raised(), contextlib.ExitStack() as cleanup:
        cleanup.callback(release_checkpoint_folders)
        try:
            hold_checkpoint_folders(run)  # before the first read of a checkpoint or its folder
            check_run(run)
            if run.plan:
                print_plan(run)
                return 0
            run_all(run)
            stop_ranks()
        except (UsageError, Diverged, OSError, KeyboardInterrupt, Terminated) as e:
            return ended_early(e)
        except Exception as e:
            if not run.ranks.several:
                raise
            lost = lost_ranks(run.ranks, e)
            if lost is None:
                traceback.print_exc()
            print_error(lost or own_error(run.ranks, e))
            os._exit(1)  # without the interpreter's teardown, which would wait on collectives that never end
    return 0


def ended_early(e: BaseException) -> int:
    """Say in one line on stderr why the run ended; the exit code: 2 bad input, 1 a failure mid-way, 128 + a signal."""
    if torch.cuda.is_initialized():  # queued copies land and a CPU Adam compile ends first: the error is the last line
        torch.cuda.synchronize()
    concurrent.futures.wait(EARLY_COMPILES.values())
    if isinstance(e, UsageError):
        print_error(str(e))
        return 2
    if isinstance(e, Diverged):  # what was written before stays whole: every output is written aside
        print_error(f"{e}; no output written after it")
        return 1
    if isinstance(e, OSError):  # an output that could not be written (a full disk)
        print_error(f"{e.strerror or e}: {e.filename or 'an output'}")
        return 1
    signum = e.args[0] if isinstance(e, Terminated) else signal.SIGINT  # Ctrl-C: 130, SIGTERM: 143
    how = f"ended by {signal.Signals(signum).name}" if isinstance(e, Terminated) else "interrupted"
    print(f"offload_llama.py: {how}; each output is whole or absent", file=sys.stderr)
    return 128 + signum


class Terminated(BaseException):
    """SIGTERM or SIGHUP, raised in the main thread as Ctrl-C raises KeyboardInterrupt; args[0] is the signal."""


@contextlib.contextmanager
def signals_raised():
    """SIGINT as KeyboardInterrupt, SIGTERM and SIGHUP as Terminated in the block (main thread), then as before."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return

    def raise_signal(signum, frame) -> None:  # noted, for a wait to raise again should a callback drop this raise
        CAUGHT.append(signum)
        raise KeyboardInterrupt if signum == signal.SIGINT else Terminated(signum)

    CAUGHT.clear()
    before = {sig: signal.signal(sig, raise_signal) for sig in SIGNALS}
    try:
        yield
    finally:
        for sig, handler in before.items():
            signal.signal(sig, handler)


def use_expandable_segments() -> None:
    """Let the CUDA allocator grow segments in place unless configured (fixed ones, split by saved inputs, refuse)."""
    if "PYTORCH_ALLOC_CONF" not in os.environ and "PYTORCH_CUDA_ALLOC_CONF" not in os.environ:
        os.environ["PYTORCH_ALLOC_CONF"] = "expandable_segments:True"  # read when CUDA starts, after this


def exit_with(code: int) -> None:  # sys.exit(code), or os._exit after a signal or with a waited() thread alive
    if code >= 128 or any(thread.is_alive() for thread in LEFT_RUNNING):
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(code)
    sys.exit(code)


if __name__ == "__main__":
    exit_with(main())
