"""Small models and runs shared by the CPU and GPU tests."""

import copy
import json
import os
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest
import torch

import offload_llama as ol

SCRIPT = Path(__file__).resolve().parents[1] / "offload_llama.py"


def tiny_run(**sizes) -> ol.RunConfig:
    return ol.RunConfig(preset="tiny", sizes=tuple(sizes.items()), batch_size=2, seq_len=48)


def build(run: ol.RunConfig):
    """A random model from `run`, its input ids, and its logits from the plain HF forward on the CPU."""
    model = ol.build_model(run, ol.llama_config(run))
    ids = ol.random_input_ids(run, model.config.vocab_size)
    return model, ids


def machine(gpu_gib=80.0, host_gib=None, disk_bytes=None, process=ol.GiB, world=1) -> ol.Facts:
    """The facts of a machine to plan for: a GPU of `gpu_gib` (None: no GPU), `host_gib` of host memory available
    (None: not known), `disk_bytes` free on the --nvme disk, a process of `process` bytes, 16 cores, `world` ranks on
    one host."""
    gpu = None if gpu_gib is None else int(gpu_gib * ol.GiB)
    host = None if host_gib is None else int(host_gib * ol.GiB)
    return ol.Facts(gpu, host, disk_bytes, process, 16, world, world)


def host_for(planned: int) -> int:
    """The least host memory (one rank's) that plans for `planned` bytes: ol.HOST_SLACK percent of it stays free."""
    return -(-planned * 100 // (100 - ol.HOST_SLACK))


def planned(run: ol.RunConfig, facts: ol.Facts) -> ol.Plan:
    """`run`'s plan on the machine `facts` describe, checked as a run checks it (check_plan refuses what won't fit)."""
    config = ol.llama_config(run)
    plan = ol.make_plan(run, config, facts)
    ol.check_plan(run, config, plan)
    return plan


def streamed_logits(model, ids, device, depth, pin=False, streamer_hook=None, resident=()):
    """Logits of the offloaded model with layers streamed at `depth`, but for the `resident` ones; the store is built
    from `model`."""
    store = ol.ParamStore(model, pin=pin)
    streamer = ol.layer_streamer(store, model.config, torch.device(device), depth, resident)
    if streamer_hook:
        streamer_hook(streamer)
    shell = ol.offloaded_model(model, streamer, torch.device(device))
    with torch.inference_mode():
        return ol.logits_of(shell, ids.to(device)).cpu()


def resident_logits(model, ids, device):
    with torch.inference_mode():
        return ol.logits_of(copy.deepcopy(model).to(device), ids.to(device)).cpu()


def cli(*args, timeout=600):
    """The command line in a process of its own, which may cache the bytecode it compiles: where the environment
    says not to (PYTHONDONTWRITEBYTECODE, as on the GPU machine), each process compiles transformers anew, 10 s."""
    env = {name: value for name, value in os.environ.items() if name != "PYTHONDONTWRITEBYTECODE"}
    command = [sys.executable, str(SCRIPT), *map(str, args)]
    return subprocess.run(command, capture_output=True, text=True, timeout=timeout, env=env)


def run_main(capsys, *args) -> tuple[int, str, str]:
    """main() in this process on the command line `args`: (exit code, stdout, stderr). For refusals, which end before
    a model is built: a process of its own spends seconds importing torch and transformers (cli for whole runs)."""
    try:
        code = ol.main([str(a) for a in args])
    except SystemExit as e:  # argparse's errors
        code = e.code
    captured = capsys.readouterr()
    return code, captured.out, captured.err


def cli_all(commands: dict, workers: int = 5) -> dict:
    """Run the command lines (name -> args) side by side, `workers` at a time. Only for runs that are judged on
    memory, never on time: each process has its own allocator, peaks and cap, whatever runs beside it."""
    with ThreadPoolExecutor(workers) as pool:
        futures = {name: pool.submit(cli, *args) for name, args in commands.items()}
    return {name: future.result() for name, future in futures.items()}


_stores = {}  # the last pinned store built with reuse, by what it was built for


def master_store(
    model, adam, pin, grad_buffers, grad_dtype, copy_dtype, reuse, scaled=False, disk=None, on_device=None
):
    """A OffloadedAdam loaded from `model`. reuse: the last one built for the same model and settings, its gradient
    buffers and moments filled with NaN first, so a read before a write shows; pinning a new one takes seconds. disk:
    (folder, units): a disk tier in that folder keeps those units' moments (never reused). on_device: unit -> the
    device its master lives on alone (OffloadedAdam's)."""
    key = (model.config.to_json_string(), str(adam), pin, grad_buffers, grad_dtype, copy_dtype, scaled, str(on_device))
    store = _stores.get(key) if reuse and not disk else None
    if store is None:
        units = ol.model_units(model.config)
        tier = ol.DiskTier(disk[0], {u: units[u].layout.numel for u in disk[1]}) if disk else None
        args = (units, adam, pin, grad_buffers, grad_dtype, copy_dtype, scaled, ol.moments_for(tier))
        store = ol.OffloadedAdam(*args, update=ol.CompiledAdamUpdate, on_device=on_device)
    else:
        torch.cuda.synchronize()  # the last trainer's copies from and to the store have landed
        for t in [*store.pool.buffers, *(m for pair in store.moments if pair for m in pair)]:
            t.fill_(float("nan"))
    if reuse:
        _stores.clear()
        _stores[key] = store
    ol.masters_to_device(store)
    store.load(model)
    return store


def offloaded_trainer(
    model,
    device,
    depth,
    micro_batches,
    adam=None,
    pin=False,
    offload=False,
    grad_buffers=None,
    copy=True,
    resident=(),
    own_grads=True,
    gpu_adam=(),
    reuse=False,
    clip=None,
    disk=None,
    keep=(),
    masters_on_device=False,
    segment=1,
    remake=False,
):
    """The blocked (depth 0) or overlapped training of `model` on `device`, as the CLI builds it; offload: the units'
    saved inputs wait on the host (--offload-activations); grad_buffers: a shared gradient pool of that many; copy:
    the GPU streams the masters' compute-dtype copy (False: the float32 masters, cast on the GPU); resident: the
    units kept on the device and stepped there, with gradients of their own or (own_grads False) shared; gpu_adam: the
    streamed units the device's Adam steps over their state streamed from the host, their first step's gradients
    kept on the host for first_step_state; reuse: the last such store, poisoned (master_store); clip: the gradients'
    largest norm (--clip-grad-norm); disk: (folder, units) whose moments a disk tier keeps there (--nvme); keep: the
    units whose forward keeps its graph for the backward (no recompute); masters_on_device: the resident units' float32
    masters live on the device alone, as for units resident in every mode; segment: units a segment, only the first
    of each keeping its inputs (--segment), the backward a micro-batch at a time with the segment's graphs (remake:
    running the segment's forwards again, SegmentInputs)."""
    adam = adam or ol.Adam(lr=1e-3)
    dtype = next(model.parameters()).dtype
    run = ol.RunConfig(dtype=str(dtype).removeprefix("torch."), grad_accum=len(micro_batches))
    copy_dtype = dtype if copy and dtype != torch.float32 else None
    scaled = clip is not None
    on_device = dict.fromkeys(resident, torch.device(device)) if masters_on_device else None
    args = (model, adam, pin, grad_buffers, ol.gradient_dtype(run), copy_dtype, reuse, scaled, disk, on_device)
    store = master_store(*args)
    kwargs = ol.decoder_kwargs(model, tuple(micro_batches[0].shape), dtype, torch.device(device))
    args = (store, model.config, dtype, torch.device(device), depth, model.loss_function, kwargs)
    trainer = ol.OffloadedTraining(*args)
    ol.scale_and_clip(trainer, clip)
    trainer.keep = frozenset(keep)
    if offload:
        trainer.inputs = ol.ActivationOffload(trainer, len(micro_batches), tuple(micro_batches[0].shape))
    if segment > 1:
        trainer.inputs = (ol.SegmentInputs if remake else ol.SegmentGraphs)(trainer, segment)
    if resident or gpu_adam:
        ol.place_on_gpu(trainer, resident, gpu_adam, own_grads)
    return trainer


def send_late(trainer, late_unit: int, drop: bool) -> None:
    """The trainer's sends, `late_unit`'s gradients leaving 20 ms late (a sleep on the D2H stream ahead of their copy);
    drop: the next unit to write its gradient buffer no longer waits for them (S8)."""
    send = trainer.send

    def late(u, views):  # send unit u's gradients, late for late_unit's
        if u == late_unit:
            with torch.cuda.stream(trainer.d2h_stream):
                torch.cuda._sleep(40_000_000)
        send(u, views)
        if u == late_unit and drop:
            trainer.steppers.last_landed[u % len(trainer.steppers.buffers)] = ol.InOrder()

    trainer.send = late


def train(trainer, micro_batches, steps):
    """(first step's float32 gradients, masters after it, final masters, losses), tensors with HF names on the CPU."""
    losses = [trainer.step(micro_batches).item()]
    grads, masters_1 = ol.first_step_state(trainer)
    losses += [trainer.step(micro_batches).item() for _ in range(steps - 1)]
    trainer.finish()
    masters = trainer.state_dict(trainer.masters) if isinstance(trainer, ol.ResidentTraining) else trainer.state_dict()
    return grads, masters_1, masters, losses


def assert_losses_match(losses, expected, dtype: str) -> None:
    """The losses of two trainers whose masters agree to float32 rounding: equal where the units compute in a 16-bit
    copy (its rounding absorbs the masters' last bits); in float32 the units run the masters themselves, so after the
    first update the losses agree to float32 rounding (which bits differ depends on the CPU and the compiler)."""
    if dtype == "float32":
        assert losses[0] == expected[0] and losses == pytest.approx(expected, rel=1e-6, abs=0)
    else:
        assert losses == expected


def assert_masters_close(masters, expected, steps):
    largest = max(m.abs().max().item() for m in expected.values())
    for name, m in masters.items():
        torch.testing.assert_close(m, expected[name], rtol=0, atol=ol.masters_tolerance(largest, steps), msg=name)


def checkpoint_state(folder) -> tuple[dict, list[dict]]:
    """A checkpoint's record and each unit's state."""
    saved = json.loads((folder / ol.CHECKPOINT_FILE).read_text())
    return saved, [torch.load(folder / name) for name in saved["files"]]


def assert_same_checkpoint(a, b) -> None:
    """Two checkpoints hold the same step counts, masters and moments, bit for bit."""
    (saved_a, units_a), (saved_b, units_b) = checkpoint_state(a), checkpoint_state(b)
    assert saved_a["steps"] == saved_b["steps"]
    for unit_a, unit_b in zip(units_a, units_b, strict=True):
        assert unit_a["step"] == unit_b["step"] <= saved_a["steps"]  # fewer: float16 skipped an overflowing step
        for key in ("master", "exp_avg", "exp_avg_sq"):
            if isinstance(unit_a[key], torch.Tensor):  # a rank's shard, flat
                assert torch.equal(unit_a[key], unit_b[key]), key
                continue
            assert unit_a[key].keys() == unit_b[key].keys()
            assert all(torch.equal(unit_a[key][n], unit_b[key][n]) for n in unit_a[key]), key


def table_cells(part: str, table: int, r: dict) -> list[str]:
    """The cells a result `r` gets in a printed table: REPORT_TABLES[part][table]'s columns."""
    return [cell(r) for _, cell in ol.REPORT_TABLES[part][table][1]]


def reference_trainer(model, device, adam, **options) -> ol.ResidentTraining:
    """gpu or cpu mode's trainer, as the command line makes it: float16's loss scale installed."""
    return ol.ResidentTraining(model, device, adam, scaling=ol.loss_scaling(model.dtype, device), **options)
