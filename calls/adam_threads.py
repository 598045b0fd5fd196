"""Issue 72, item 3: why the bound's CPU Adam (AdamInPlace: a share of each unit, on its own worker) runs slower per
parameter than the step's (CpuAdam: whole units, on one long-lived worker). Each case best of 4, as ns per parameter."""

import sys
import time
from concurrent.futures import ThreadPoolExecutor

import torch

sys.path.insert(0, ".")
import offload_llama as ol  # noqa: E402

UNITS, NUMEL = 7, 202_383_360  # LLaMA-7B decoder layers
print(torch.__config__.parallel_info())
update = ol.CompiledAdamUpdate(ol.Adam(), torch.bfloat16, torch.bfloat16)
PIN = torch.cuda.is_available()
state = []
for _ in range(UNITS):
    master = ol.host_zeros(NUMEL, torch.float32, PIN).normal_(0, 0.02)
    grads = ol.host_zeros(NUMEL, torch.bfloat16, PIN).normal_(0, 1e-3)
    copy = ol.host_zeros(NUMEL, torch.bfloat16, PIN)
    state.append([master, grads, torch.zeros(NUMEL), torch.zeros(NUMEL), copy, torch.zeros(())])


def steps(n: int) -> float:  # one update of each unit's first n parameters; seconds
    t0 = time.perf_counter()
    for args in state:
        update(*(a[:n] if a.dim() else a for a in args))
    return time.perf_counter() - t0


def pool() -> ThreadPoolExecutor:
    worker = ThreadPoolExecutor(1, initializer=torch.set_flush_denormal, initargs=(True,))
    worker.submit(steps, 1024).result()  # its OpenMP team started, as AdamInPlace's first call does
    return worker


share = ol.ADAM_SCRATCH // UNITS
step_worker, bound_worker = pool(), pool()
step_worker.submit(steps, NUMEL).result()  # first touch
cases = {
    "step's worker, whole units": lambda: step_worker.submit(steps, NUMEL).result() / NUMEL,
    "step's worker, shares, right after whole units": lambda: (
        step_worker.submit(steps, NUMEL).result(),
        step_worker.submit(steps, share).result() / share,
    )[1],
    "step's worker, shares, after 1 s idle": lambda: (time.sleep(1), step_worker.submit(steps, share).result() / share)[
        1
    ],
    "own worker, shares, right after the step's worker": lambda: (
        step_worker.submit(steps, NUMEL).result(),
        bound_worker.submit(steps, share).result() / share,
    )[1],
    "own worker, shares, after 1 s idle": lambda: (time.sleep(1), bound_worker.submit(steps, share).result() / share)[
        1
    ],
    "own worker, shares twice, the second": lambda: (
        bound_worker.submit(steps, share).result(),
        bound_worker.submit(steps, share).result() / share,
    )[1],
    "own worker, 4x shares, after 1 s idle": lambda: (
        time.sleep(1),
        bound_worker.submit(steps, 4 * share).result() / (4 * share),
    )[1],
}
for name, case in cases.items():
    times = [case() / UNITS * 1e9 for _ in range(4)]
    print(f"{name}: best {min(times):.3f} ns/param, all {[round(t, 3) for t in times]}", flush=True)
