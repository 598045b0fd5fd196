"""Issue 72, item 3: is the CPU Adam slower timed alone (AdamInPlace: shares of each unit, a fresh worker a round) than
in the step (CpuAdam's one long-lived worker over whole units)? The run's CompiledAdamUpdate over 7b-8l-sized units."""

import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import torch

sys.path.insert(0, ".")
import offload_llama as ol  # noqa: E402

UNITS, NUMEL = int(sys.argv[1]) if len(sys.argv) > 1 else 7, 202_383_360  # a LLaMA-7B decoder layer's parameters
update = ol.CompiledAdamUpdate(ol.Adam(), torch.bfloat16, torch.bfloat16)
print("threads", torch.get_num_threads(), "compiled", update.compiled is not None, "bytes", update.bytes_per_param)
PIN = torch.cuda.is_available()  # pinned as the run's masters, gradients and copies are
state = []
for _ in range(UNITS):
    master = ol.host_zeros(NUMEL, torch.float32, PIN).normal_(0, 0.02)
    grads = ol.host_zeros(NUMEL, torch.bfloat16, PIN).normal_(0, 1e-3)
    moments = [torch.zeros(NUMEL), torch.zeros(NUMEL)]
    copy = ol.host_zeros(NUMEL, torch.bfloat16, PIN)
    state.append([master, grads, *moments, copy, torch.zeros(())])
total = UNITS * NUMEL


def step_all(shares=None):  # one update of each unit (or of its first `shares` parameters)
    torch.set_flush_denormal(True)  # as CpuAdam.work and AdamInPlace's worker set it
    for args in state:
        n = NUMEL if shares is None else shares
        update(*(a[:n] if a.dim() else a for a in args))


def timed(fn) -> float:
    t0 = time.perf_counter()
    fn()
    return time.perf_counter() - t0


torch.set_flush_denormal(True)
step_all()  # first touch of the moments, and a first step: the state is a running one's
results = {}
for name in ("long-lived thread, whole units", "fresh executor, whole units", "fresh executor, shares", "main thread"):
    times = []
    for _ in range(4):
        share = ol.ADAM_SCRATCH // UNITS  # AdamInPlace's: the timed parameters spread over the units
        if name.startswith("long"):
            box = []
            worker = threading.Thread(target=lambda box=box: box.append(timed(step_all)))  # flush set below
            worker.start()
            worker.join()
            times.append(box[0])
        elif name == "fresh executor, whole units":
            with ThreadPoolExecutor(1, initializer=torch.set_flush_denormal, initargs=(True,)) as pool:
                times.append(pool.submit(timed, step_all).result())
        elif name == "fresh executor, shares":
            with ThreadPoolExecutor(1, initializer=torch.set_flush_denormal, initargs=(True,)) as pool:
                times.append(pool.submit(timed, lambda share=share: step_all(share)).result() * total / (share * UNITS))
        else:
            times.append(timed(step_all))
    best = min(times)
    print(
        f"{name}: best {best * 1e3:.1f} ms, all {[round(t * 1e3, 1) for t in times]},"
        f" {update.bytes_per_param * total / best / 1e9:.1f} GB/s"
    )
