"""The host memory's rates, to set a training step's host traffic against: the CPU alone (a STREAM add on every
core), the pinned copies alone (H2D and D2H on every GPU at once), and both together, as a step runs them. Report
tooling: prints one line and writes the JSON that report/build_report.py reads (key host_probe).

    python3 report/host_probe.py --json host_probe.json
"""

from __future__ import annotations

import argparse
import json
import os
import threading
import time

import torch

ELEMENTS = 2**28  # a float32 tensor of 1 GiB
SECONDS = 2.0  # how long each rate is measured
COPY_CORES = 2  # cores left to the copies' thread (it waits on the streams) while the CPU adds beside them


def cpu_add(threads: int):
    """A step of c = a + b over 1 GiB tensors on `threads` of torch's threads; each call returns the bytes it moved
    (STREAM's count: two reads and a write)."""
    torch.set_num_threads(max(1, threads))
    a, b, c = torch.ones(ELEMENTS), torch.ones(ELEMENTS), torch.empty(ELEMENTS)

    def step() -> int:
        """One add; the bytes it moved."""
        torch.add(a, b, out=c)
        return 3 * a.nbytes

    return step


def gpu_copies():
    """A step of pinned copies on every GPU, H2D and D2H at once, each on its own stream; each call returns the bytes
    it moved once all have landed."""
    jobs = []
    for g in range(torch.cuda.device_count()):
        device = torch.device("cuda", g)
        for dst, src in (
            (torch.empty(ELEMENTS, device=device), torch.ones(ELEMENTS).pin_memory()),
            (torch.empty(ELEMENTS).pin_memory(), torch.ones(ELEMENTS, device=device)),
        ):
            jobs.append((torch.cuda.Stream(device), dst, src))

    def step() -> int:
        """One copy of each job; the bytes moved."""
        for stream, dst, src in jobs:
            with torch.cuda.stream(stream):
                dst.copy_(src, non_blocking=True)
        for stream, _, _ in jobs:
            stream.synchronize()
        return sum(dst.nbytes for _, dst, _ in jobs)

    return step


def rate(step, stop) -> float:
    """GB/s of step() (it returns the bytes it moved), run until stop(), after one unmeasured step."""
    step()
    moved, start = 0, time.perf_counter()
    while not stop():
        moved += step()
    return moved / (time.perf_counter() - start) / 1e9


def for_seconds():
    """A stop() that turns true SECONDS from now."""
    end = time.perf_counter() + SECONDS
    return lambda: time.perf_counter() > end


def together(cpu_step, copy_step) -> dict[str, float]:
    """Both rates with the CPU's adds and the copies running at once, the copies in a thread of their own."""
    rates, stop = {}, threading.Event()
    thread = threading.Thread(target=lambda: rates.update(copies=rate(copy_step, stop.is_set)))
    thread.start()
    rates["cpu"] = rate(cpu_step, for_seconds())
    stop.set()
    thread.join()
    return rates


def main() -> None:
    """Measure the three rates and write them."""
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--json", required=True, help="where to write the rates")
    args = p.parse_args()
    cores = len(os.sched_getaffinity(0))
    result = {"cores": cores, "gpus": torch.cuda.device_count(), "tensor_gib": ELEMENTS * 4 / 2**30}
    result["cpu_gbs"] = rate(cpu_add(cores), for_seconds())
    copy_step = gpu_copies()
    result["copies_gbs"] = rate(copy_step, for_seconds())
    both = together(cpu_add(cores - COPY_CORES), copy_step)
    result["together"] = {**{f"{k}_gbs": v for k, v in both.items()}, "cpu_threads": max(1, cores - COPY_CORES)}
    result["together"]["sum_gbs"] = both["cpu"] + both["copies"]
    print(
        f"host memory: CPU add {result['cpu_gbs']:.1f} GB/s on {cores} cores; pinned copies on {result['gpus']} GPUs, "
        f"both ways, {result['copies_gbs']:.1f} GB/s; together {both['cpu']:.1f} + {both['copies']:.1f} = "
        f"{result['together']['sum_gbs']:.1f} GB/s"
    )
    with open(args.json, "w") as f:
        json.dump(result, f, indent=1)


if __name__ == "__main__":
    main()
