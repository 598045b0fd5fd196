"""Where the CPU Adam idles in an overlapped step, and which split of the streamed units between the GPU's Adam over
streamed state and the CPU Adam idles it least: an experiment, not the script's code.

Runs the CLI (its arguments) with offload_llama's train_steps wrapped: before the CLI's own steps, one process, one
trainer, steps in blocks, each block with one configuration (AB_CONFIGS, "name=units[/chunked];..."; units: 0
embeddings, 1-8 layers, 9 norm, 10 head), the configurations in turn, AB_ROUNDS times; each block waits for every
update first and leaves its first step out. "/chunked": the CPU Adam steps units in chunks of AB_CHUNK parameters and,
between chunks, takes the chunk of the landed unit the next forward needs first (a prototype of preemption).
Per configuration: the median step and CPU Adam busy time, and for one step of its last block a timeline (the CPU
Adam's work, the main thread's waits for it, and GPU events: each unit's compute start in both passes, its
backward's end, its gradients landed, the GPU Adam's state in and out) written to AB_OUT as JSON."""
import json, os, statistics, sys, threading, time
import torch
sys.path.insert(0, os.getcwd())
import offload_llama as ol

ROUNDS, BLOCK = int(os.environ.get("AB_ROUNDS", 4)), int(os.environ.get("AB_BLOCK", 6))
CHUNK = int(os.environ.get("AB_CHUNK", 2**24))


def configs() -> dict:
    """name -> (GPU Adam units, chunked CPU Adam)."""
    out = {}
    for item in os.environ["AB_CONFIGS"].split(";"):
        name, spec = item.split("=")
        units, _, flag = spec.partition("/")
        out[name] = (tuple(int(u) for u in units.split(",") if u), flag == "chunked")
    return out


class ChunkedCpuAdam(ol.CpuAdam):
    """The CPU Adam stepping a unit a chunk at a time; between chunks it takes the landed unit with the lowest index
    (the one the next forward needs first), so a unit that lands late need not wait for a whole layer's update."""

    def __init__(self, n_units: int, store: ol.MasterStore):
        self.store, self.progress = store, {}  # unit -> (next chunk's start, scalars); before the worker starts
        super().__init__(n_units, store.step)

    def next_job(self):
        with self.cond:
            while not self.pending:
                self.cond.wait()
            if self.pending[0] is None:
                return None
            ready = [j for j in self.pending if j is not None and (j[0] in self.progress or j[1].query())]
            return min(ready, key=lambda j: j[0]) if ready else self.pending[0]

    def work(self) -> None:
        torch.set_flush_denormal(True)
        store = self.store
        while (job := self.next_job()) is not None:
            u, landed = job
            try:
                if u not in self.progress:
                    landed.synchronize()
                    if not store.steps[u]:
                        for m in store.moments[u]:
                            m.zero_()
                    store.steps[u] += 1
                    self.progress[u] = (0, store.update.adam.scalars(int(store.steps[u].item())))
                lo, scalars = self.progress[u]
                n = store.masters[u].numel()
                hi = min(n, lo + CHUNK)
                start = time.perf_counter()
                copy = store.copies[u][lo:hi] if store.copies else None
                with torch.no_grad():
                    store.update.compiled(store.masters[u][lo:hi], store.grads[u][lo:hi],
                                          *(m[lo:hi] for m in store.moments[u]), copy, scalars)
                self.busy_s += time.perf_counter() - start
                if RECORDING.is_set():
                    TIMELINE.append(("adam", u, start, time.perf_counter()))
                if hi < n:
                    self.progress[u] = (hi, scalars)
                    continue
                del self.progress[u]
                if not store.pool.dedicated:
                    grads, store.grads[u] = store.grads[u], None
                    store.pool.give(grads)
            except Exception as e:
                self.error = e
                self.progress.pop(u, None)
            with self.cond:
                self.pending.remove(job)
            self.done[u].set()


TIMELINE, EVENTS, RECORDING = [], [], threading.Event()


def use(trainer, units, chunked) -> None:
    """Give the GPU's Adam `units` and the CPU Adam its kind, once every update is done."""
    trainer.wait_updates()
    trainer.adam_on_gpu(units)
    if chunked != isinstance(trainer.adam, ChunkedCpuAdam):
        trainer.adam.close()
        trainer.adam = ChunkedCpuAdam(len(trainer.units), trainer.store) if chunked else \
            ol.CpuAdam(len(trainer.units), trainer.store.step)
        trainer.adam.step = timed_step(trainer.adam.step)
        trainer.adam.wait = timed_wait(trainer.adam.wait)
        trainer.streamer.source_ready = trainer.adam.updated


def timed_step(step):
    def wrapped(u):
        t0 = time.perf_counter()
        step(u)
        if RECORDING.is_set():
            TIMELINE.append(("adam", u, t0, time.perf_counter()))
    return wrapped


def timed_wait(wait):
    def wrapped(u):
        t0 = time.perf_counter()
        wait(u)
        t1 = time.perf_counter()
        if RECORDING.is_set() and t1 - t0 > 2e-4:
            TIMELINE.append(("main_waits", u, t0, t1))
    return wrapped


def mark(what, u, stream):
    """A timing event on `stream`, named (what, u)."""
    if RECORDING.is_set():
        e = torch.cuda.Event(enable_timing=True)
        e.record(stream)
        EVENTS.append((what, u, e))


def instrument(trainer) -> None:
    """Mark each unit's compute start, backward end, gradients landed and GPU Adam state in and out."""
    acquire, send = trainer.streamer.acquire, trainer.send
    trainer.adam.step = timed_step(trainer.adam.step)
    trainer.adam.wait = timed_wait(trainer.adam.wait)

    def acq(u):
        module = acquire(u)
        mark("compute", u, trainer.streamer.compute_stream)
        return module

    def snd(u):
        mark("bwd_end", u, trainer.streamer.compute_stream)
        send(u)
        if trainer.on_gpu_adam(u):
            mark("gpu_state_in", u, trainer.gpu_adam.s_in)
            mark("gpu_stepped", u, trainer.gpu_adam.s_out)
        elif u not in trainer.resident:
            mark("landed", u, trainer.d2h_stream)

    trainer.streamer.acquire, trainer.send = acq, snd


def ab(trainer, micro_batches) -> dict:
    """The configurations in turn, ROUNDS times, BLOCK steps each; their step times, busy times, one timeline each."""
    instrument(trainer)
    out = {name: {"step_ms": [], "busy_ms": []} for name in CONFIGS}
    for r in range(ROUNDS):
        for name, (units, chunked) in CONFIGS.items():
            use(trainer, units, chunked)
            t, busy = time.perf_counter(), trainer.adam.busy_s
            for i in range(BLOCK):
                capture = r == ROUNDS - 1 and i == BLOCK - 2
                if capture:
                    TIMELINE.clear(), EVENTS.clear(), RECORDING.set()
                    step_start = t
                loss = trainer.step(micro_batches)
                if capture:
                    end = torch.cuda.Event(enable_timing=True)
                    end.record(trainer.streamer.compute_stream)
                loss = loss.item()
                now = time.perf_counter()
                if capture:
                    end.synchronize()
                    t_end = time.perf_counter()
                if i > 0:
                    out[name]["step_ms"].append((now - t) * 1e3)
                    out[name]["busy_ms"].append((trainer.adam.busy_s - busy) * 1e3)
                t, busy = now, trainer.adam.busy_s
            trainer.wait_updates()
            if r == ROUNDS - 1:
                RECORDING.clear()
                torch.cuda.synchronize()
                ms = lambda x: round((x - step_start) * 1e3, 2)
                out[name]["timeline"] = {
                    "step_end": ms(t_end),
                    "cpu": [(what, u, ms(a), ms(b)) for what, u, a, b in TIMELINE],
                    "gpu": [(what, u, round(ms(t_end) - e.elapsed_time(end), 2)) for what, u, e in EVENTS]}
            print(f"round {r} {name}: " + " ".join(f"{x:.0f}" for x in out[name]["step_ms"][-(BLOCK - 1):]),
                  flush=True)
    for name, o in out.items():
        step, busy = statistics.median(o["step_ms"]), statistics.median(o["busy_ms"])
        o["median_step_ms"], o["median_busy_ms"] = step, busy
        units, chunked = CONFIGS[name]
        print(f"{name:10s} units {','.join(map(str, units)) or '-':14s} chunked {chunked!s:5s} "
              f"step {step:6.1f} ms  busy {busy:6.1f} ms  step-busy {step - busy:6.1f} ms", flush=True)
    return out


train_steps = ol.train_steps


def wrapped_train_steps(trainer, micro_batches, run, *args, **kwargs):
    if isinstance(trainer, ol.OffloadedTraining):
        result = ab(trainer, micro_batches)
        with open(os.environ["AB_OUT"], "w") as f:
            json.dump({"configs": {k: [list(v[0]), v[1]] for k, v in CONFIGS.items()}, "chunk": CHUNK,
                       "block": BLOCK, "rounds": ROUNDS, "results": result}, f)
        use(trainer, trainer.gpu_adam.units if trainer.gpu_adam else (), False)
    return train_steps(trainer, micro_batches, run, *args, **kwargs)


if __name__ == "__main__":
    CONFIGS = configs()
    ol.train_steps = wrapped_train_steps
    sys.exit(ol.main(sys.argv[1:]))
