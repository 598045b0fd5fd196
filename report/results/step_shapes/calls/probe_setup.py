"""Set-up physics on the GPU machine: zeroing, pinning and drawing rates, each way we could do them."""

import ctypes
import json
import mmap
import os
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import torch

GiB = 2**30
libc = ctypes.CDLL(None, use_errno=True)
libc.madvise.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
out = {}


def say(k, v):
    out[k] = v
    print(k, v, flush=True)


for f in ("enabled", "defrag"):
    try:
        say("thp_" + f, Path(f"/sys/kernel/mm/transparent_hugepage/{f}").read_text().strip())
    except OSError as e:
        say("thp_" + f, str(e))
say("uname", os.uname().release)
say("cpus", os.cpu_count())
say("torch_threads", torch.get_num_threads())
torch.cuda.init()
torch.zeros(1, device="cuda")
cudart_path = next(
    line.split()[-1] for line in Path("/proc/self/maps").read_text().splitlines() if "libcudart.so" in line
)
say("cudart", cudart_path)
cudart = ctypes.CDLL(cudart_path)
cudart.cudaHostRegister.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_uint]
cudart.cudaHostUnregister.argtypes = [ctypes.c_void_p]
tcudart = torch.cuda.cudart()


def buf(n, huge=True):
    m = mmap.mmap(-1, n)
    if huge:
        m.madvise(mmap.MADV_HUGEPAGE)
    return m, torch.frombuffer(m, dtype=torch.uint8).data_ptr()


def trial(name, count, size, fill, register, threads):
    bufs = []
    lock = threading.Lock()

    def one(_):
        m, a = buf(size)
        t0 = time.perf_counter()
        if fill == "torch":
            torch.frombuffer(m, dtype=torch.uint8).zero_()
        elif fill == "memset":
            ctypes.memset(a, 0, size)
        elif fill == "populate":
            r = libc.madvise(a, size, 23)
            if r:
                raise OSError(ctypes.get_errno(), "MADV_POPULATE_WRITE")
        t1 = time.perf_counter()
        if register == "torch":
            assert tcudart.cudaHostRegister(a, size, 0) == 0 or True
        elif register == "ctypes":
            assert cudart.cudaHostRegister(a, size, 0) == 0
        t2 = time.perf_counter()
        with lock:
            bufs.append((m, a))
        return t1 - t0, t2 - t1

    t0 = time.perf_counter()
    if threads == 1:
        parts = [one(i) for i in range(count)]
    else:
        with ThreadPoolExecutor(threads) as p:
            parts = list(p.map(one, range(count)))
    total = time.perf_counter() - t0
    # check: a copy to the GPU from one buffer is pinned-fast
    m, a = bufs[0]
    host = torch.frombuffer(m, dtype=torch.uint8)
    dev = torch.empty(size, dtype=torch.uint8, device="cuda")
    torch.cuda.synchronize()
    t = time.perf_counter()
    dev.copy_(host, non_blocking=True)
    torch.cuda.synchronize()
    gbps = size / (time.perf_counter() - t) / 1e9
    del dev, host
    for _, a in bufs:
        if register != "none":
            cudart.cudaHostUnregister(a)
    for m, _ in bufs:
        m.close()
    say(
        name,
        {
            "GiB": count * size / GiB,
            "s": round(total, 2),
            "GB/s": round(count * size / total / 1e9, 2),
            "fill_s_sum": round(sum(p[0] for p in parts), 2),
            "reg_s_sum": round(sum(p[1] for p in parts), 2),
            "h2d_GB/s_after": round(gbps, 1),
        },
    )


N, S = 8, 2 * GiB
for args in [
    ("seq_torchzero_torchreg", N, S, "torch", "torch", 1),
    ("seq_noprefill_torchreg", N, S, "none", "torch", 1),
    ("thr8_memset_torchreg", N, S, "memset", "torch", 8),
    ("thr8_memset_ctypesreg", N, S, "memset", "ctypes", 8),
    ("thr16_memset_ctypesreg", 16, GiB, "memset", "ctypes", 16),
    ("thr8_populate_ctypesreg", N, S, "populate", "ctypes", 8),
    ("thr8_memset_only", N, S, "memset", "none", 8),
    ("thr8_noprefill_ctypesreg", N, S, "none", "ctypes", 8),
]:
    try:
        trial(*args)
    except Exception as e:
        say(args[0], repr(e))
t = time.perf_counter()
xs = [torch.empty(S, dtype=torch.uint8, pin_memory=True) for _ in range(4)]
say("torch_pin_memory_4x2GiB_GB/s", round(4 * S / (time.perf_counter() - t) / 1e9, 2))
del xs

# drawing: normal_ one generator per tensor, per chunk, in threads
n = 200_000_000
for dt in (torch.bfloat16, torch.float32):
    x = torch.empty(n, dtype=dt)
    x.zero_()
    t = time.perf_counter()
    x.normal_(0, 0.02, generator=torch.Generator().manual_seed(1))
    say(f"normal_1thread_{dt}_M/s", round(n / (time.perf_counter() - t) / 1e6))
    for th in (16, 32):
        chunks = x.split(2**24)
        t = time.perf_counter()
        with ThreadPoolExecutor(th) as p:
            list(
                p.map(
                    lambda ic: ic[1].normal_(0, 0.02, generator=torch.Generator().manual_seed(ic[0])), enumerate(chunks)
                )
            )
        say(f"normal_{th}threads_chunks_{dt}_M/s", round(n / (time.perf_counter() - t) / 1e6))
x = torch.empty(n, dtype=torch.bfloat16).normal_()
y = torch.zeros(n)
t = time.perf_counter()
y.copy_(x)
say("copy_bf16_to_f32_M/s", round(n / (time.perf_counter() - t) / 1e6))
t = time.perf_counter()
x.copy_(y)
say("copy_f32_to_bf16_M/s", round(n / (time.perf_counter() - t) / 1e6))
z = torch.empty(n, dtype=torch.float32)
t = time.perf_counter()
z.zero_()
say("zero_fresh_f32_GB/s", round(4 * n / (time.perf_counter() - t) / 1e9, 1))
Path(sys.argv[1]).write_text(json.dumps(out, indent=1))
