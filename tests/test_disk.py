"""CPU tier, the disk tier (--nvme): the same Adam on moments staged from unnamed files, the plan of how many layers go
to the disk, the refused runs, and that nothing is left under the folder."""

import copy
import errno
import os
import signal
import subprocess
import sys
import threading
import time

import pytest
import torch

import offload_llama as ol
from helpers import build, machine, offloaded_trainer, table_cells, tiny_run

CPU = torch.device("cpu")


def five_layers(dtype: str, k: int = 1):
    """The tiny model with 5 layers (units 1 to 5) and k micro-batches."""
    model, ids = build(ol.dataclasses.replace(tiny_run(num_hidden_layers=5), dtype=dtype, batch_size=2 * k))
    return model, list(ids.chunk(k))


def steps(trainer, batches, n: int) -> tuple[dict, list[float]]:
    """n steps: the float32 masters after the last update, and the losses."""
    losses = [trainer.step(batches).item() for _ in range(n)]
    trainer.finish()
    return trainer.state_dict(), losses


def states(trainer) -> list[dict]:
    """Every unit's step count, master and moments (what a checkpoint holds)."""
    return [ol.unit_state(trainer, u) for u in range(len(trainer.units))]


def assert_same_states(a: list[dict], b: list[dict]) -> None:
    for unit_a, unit_b in zip(a, b, strict=True):
        assert unit_a["step"] == unit_b["step"]
        for key in ("master", "exp_avg", "exp_avg_sq"):
            assert all(torch.equal(unit_a[key][name], unit_b[key][name]) for name in unit_a[key]), key


@pytest.mark.parametrize(
    "dtype, k, slots, grad_buffers, clip",
    [
        ("bfloat16", 1, 3, None, None),
        ("bfloat16", 1, 1, 2, None),  # one staging buffer and two gradient buffers: the worker must not deadlock
        ("float32", 2, 2, None, None),
        ("float16", 1, 2, None, None),  # updates held until every unit's gradients are in, a step may be skipped
        ("float32", 1, 2, None, 0.05),
    ],
)
def test_the_disk_tier_trains_bitwise_as_the_host(dtype, k, slots, grad_buffers, clip, tmp_path, monkeypatch):
    """Units 2 to 5 (4 layers) with their moments on the disk: masters, moments and step counts after 4 steps equal
    the host-only run's bit for bit, through as few as one staging buffer."""
    monkeypatch.setattr(ol, "DISK_SLOTS", slots)
    model, batches = five_layers(dtype, k)
    host = offloaded_trainer(model, CPU, 1, batches, grad_buffers=grad_buffers, clip=clip)
    masters, losses = steps(host, batches, 4)
    disk = offloaded_trainer(
        model, CPU, 1, batches, grad_buffers=grad_buffers, clip=clip, disk=(tmp_path, (2, 3, 4, 5))
    )
    assert len(disk.store.adam_moments.disk.ring) == slots and disk.store.moments[3] is None
    disk_masters, disk_losses = steps(disk, batches, 4)
    assert disk_losses == losses
    assert all(torch.equal(disk_masters[name], m) for name, m in masters.items())
    assert_same_states(states(disk), states(host))
    assert os.listdir(tmp_path) == []  # the files have no name
    disk.store.close()


@pytest.mark.parametrize("slots", [1, 2])
def test_the_bounds_disk_cycle_moves_a_step_and_changes_no_bit(slots, tmp_path, monkeypatch):
    """The bound's disk part (disk_cycle, between steps as its rounds run): each unit's moments read once and
    written back once, through the ring; the steps after it restage what the reader had staged, and masters and
    moments after 4 steps equal the host-only run's bit for bit."""
    monkeypatch.setattr(ol, "DISK_SLOTS", slots)
    model, batches = five_layers("bfloat16")
    host = offloaded_trainer(model, CPU, 1, batches)
    steps(host, batches, 4)
    disk = offloaded_trainer(model, CPU, 1, batches, disk=(tmp_path, (2, 3, 4, 5)))
    for _ in range(2):
        disk.step(batches)
    disk.wait_updates()  # as StepClock.pause does before a round
    moved, transfer = [], ol.DiskTier.transfer

    def counted(self, call, u, buffer):
        moved.append((call.__name__, u))
        return transfer(self, call, u, buffer)

    monkeypatch.setattr(ol.DiskTier, "transfer", counted)
    waited = disk.store.adam_moments.disk.waited_s
    ol.disk_cycle(disk.store.adam_moments.disk)
    monkeypatch.setattr(ol.DiskTier, "transfer", transfer)
    assert disk.store.adam_moments.disk.waited_s == waited > 0  # the mode's waits for reads still count, rounds or not
    assert sorted(moved) == sorted((call, u) for call in ("preadv", "pwritev") for u in (2, 3, 4, 5))
    assert [u for call, u in moved if call == "preadv"] == [5, 4, 3, 2]  # the backward's order
    steps(disk, batches, 2)
    assert_same_states(states(disk), states(host))
    disk.store.close()


def test_a_checkpoint_loads_into_the_disk_tier(tmp_path):
    """Two steps on the host, their state loaded into a store whose last layers' moments are on the disk, two more
    steps: the same as four on the host (resume into a run with --nvme)."""
    model, batches = five_layers("bfloat16")
    host = offloaded_trainer(model, CPU, 1, batches)
    host.step(batches)
    host.step(batches)
    host.wait_updates()
    saved = copy.deepcopy(states(host))  # views of the live state otherwise
    steps(host, batches, 2)
    disk = offloaded_trainer(model, CPU, 1, batches, disk=(tmp_path, (4, 5)))
    for u, state in enumerate(saved):
        ol.load_unit(disk, u, state)
    assert_same_states(states(disk), saved)  # read back from the disk before any step
    steps(disk, batches, 2)
    assert_same_states(states(disk), states(host))
    disk.store.close()


@pytest.mark.parametrize("call", ["pwritev", "preadv"])
def test_a_failing_disk_ends_the_step_with_its_error(call, tmp_path, monkeypatch):
    """A full disk (or a read error) mid-run: the step or the wait after it raises the OSError, naming the folder;
    nothing hangs, and nothing is left under the folder."""
    model, batches = five_layers("bfloat16")
    trainer = offloaded_trainer(model, CPU, 1, batches, disk=(tmp_path, (3, 4, 5)))
    trainer.step(batches)
    trainer.wait_updates()
    trainer.store.adam_moments.disk.stop()  # the reader's next reads go through the failing call too

    def full(*args):
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))

    monkeypatch.setattr(os, call, full)
    trainer.store.adam_moments.disk.start()
    with pytest.raises(OSError) as e:
        trainer.step(batches)
        trainer.finish()
    assert e.value.errno == errno.ENOSPC and str(tmp_path) in e.value.filename and "--nvme" in e.value.filename
    with pytest.raises(OSError):
        trainer.finish()  # raises the error again, once the worker has stopped: the buffers it steps may go
    assert not trainer.steppers.cpu_adam.thread.is_alive()
    monkeypatch.undo()
    trainer.store.close()
    assert os.listdir(tmp_path) == []


def test_the_files_are_under_the_folder_and_go_with_the_process(tmp_path):
    """The tier's files live under the folder (their descriptors point there) with no name, and a process killed
    with SIGKILL leaves nothing behind."""
    child = (
        "import sys, offload_llama as ol\n"
        "tier = ol.DiskTier(sys.argv[1], {1: 2**20, 2: 2**20})\n"
        "print(*tier.files.fds.values(), flush=True)\n"
        "sys.stdin.read()\n"
    )
    root = str(ol.Path(ol.__file__).parent)
    with subprocess.Popen(
        [sys.executable, "-c", child, str(tmp_path)],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
        env={**os.environ, "PYTHONPATH": root},
    ) as process:
        fds = process.stdout.readline().split()
        assert len(fds) == 2
        for fd in fds:
            target = os.readlink(f"/proc/{process.pid}/fd/{fd}")
            assert target.startswith(f"{tmp_path}/") and target.endswith("(deleted)"), target
        assert os.listdir(tmp_path) == []
        process.send_signal(signal.SIGKILL)
    assert process.returncode == -signal.SIGKILL and os.listdir(tmp_path) == []


def test_placement_leaves_the_disk_units_to_the_cpu_adam():
    config = ol.llama_config(ol.RunConfig(preset="7b-8l"))
    units = ol.model_units(config)  # embeddings, 8 layers, norm, head
    assert ol.gpu_adam_units(units, (), 1.0, on_disk=(7, 8)) == (0, *range(1, 7), 10)
    assert ol.gpu_adam_units(units, (), 0.3, on_disk=(1,)) == (0, 2, 3)


def test_the_disk_units_are_spread_from_the_last_layer_past_the_resident_ones():
    """The disk tier's layers are spread evenly from the last over those no mode keeps resident, so that the backward
    meets their steps at even intervals; the plan names them, apart from every mode's resident and GPU Adam units."""
    config = ol.llama_config(ol.RunConfig(preset="7b-8l"))  # units: embeddings, layers 1 to 8, norm, head
    assert ol.disk_units(config, 1) == (8,) and ol.disk_units(config, 8) == tuple(range(1, 9))
    assert ol.disk_units(config, 4) == (2, 4, 6, 8) and ol.disk_units(config, 3, (0, 1, 2)) == (4, 6, 8)
    assert ol.disk_units(config, 0) == ()
    for flags in ({"nvme_layers": 3, "resident_layers": 2}, {"nvme_layers": 3, "max_gpu_memory": 16}):
        plan = disk_plan(64, 8, **flags)
        placed = plan.modes["overlapped"]
        assert len(plan.disk_units) == 3 and placed.resident and max(placed.resident) < min(plan.disk_units)
        assert not set(plan.disk_units) & set(placed.gpu_adam)
        assert plan.disk_units == ol.disk_units(config, 3, placed.resident)


def disk_plan(host_gib: float, disk_layers: float, **flags) -> ol.Plan:
    """7b-8l's overlapped training planned with `host_gib` of host memory and room for `disk_layers` layers' moments
    on the disk."""
    run = ol.RunConfig(mode="overlapped", train=True, inference=False, nvme="/nvme", **flags)
    config = ol.llama_config(run)
    room = int(disk_layers * ol.disk_unit_bytes(config))
    return ol.make_plan(run, config, machine(host_gib=host_gib, disk_bytes=room))


def test_the_plan_takes_the_fewest_layers_the_host_needs():
    """7b-8l's lean training needs at least 24.0 GiB of the host (1 of them the process's) and HOST_MARGIN 2 more to
    plan with; a layer's moments take 1.5 GiB, and the two staging buffers cost the host 2 layers' moments, so the
    fewest layers that fit are none down to 26 GiB, 3 at 25 and 5 at 22; the search also weighs the host without
    its margin, where fewer layers' moments cross the disk: none at 25 and 4 at 22. The compute-dtype copy (3.5
    GiB) gets no room of its own: it goes where the host has none for it."""
    run = ol.RunConfig(mode="overlapped", train=True, inference=False, nvme="/nvme")
    config, each = ol.llama_config(run), [34, 28, 25, 22]
    assert [ol.disk_layers_planned(run, config, machine(host_gib=gib)) for gib in each] == [0, 0, 3, 5]
    assert [disk_plan(gib, 8).disk_layers for gib in each] == [0, 0, 0, 4]
    assert disk_plan(34, 8).copy_dtype == "bfloat16" and disk_plan(28, 8).copy_dtype is None
    assert disk_plan(64, 8, nvme_layers=4).disk_layers == 4  # as told, with room to spare
    assert disk_plan(22, 8, nvme_layers=1).disk_layers == 1  # as told: check_plan refuses it
    assert disk_plan(22, 4).disk_layers == 4  # the margin's 5 have no room there: the plan without it is taken
    with pytest.raises(ol.UsageError, match="4 layers' 6.0 GiB of Adam moments, 1.5 GiB more than is free there"):
        disk_plan(22, 3)  # no plan has room: the refusal of the one that comes nearest
    with pytest.raises(ol.UsageError, match="the model has 6 decoder layers"):
        disk_plan(64, 8, nvme_layers=7, resident_layers=2)


def test_the_disk_takes_no_layer_the_gpu_could_keep_resident():
    """A 141 GiB GPU and a 20 GiB host: with no layer on the disk the whole model stays resident and the host holds the
    rest, so the plan puts none there (planned from the disk's layers first, it put 6 there and kept 3 units
    resident, 8.4 s a step against 0.1); under a 30 GiB cap with 18 GiB of host, the same."""
    for host, cap in ((20, 141), (18, 30)):
        run = ol.RunConfig(mode="overlapped", train=True, nvme="/nvme", max_gpu_memory=cap)
        config = ol.llama_config(run)
        plan = ol.make_plan(run, config, machine(gpu_gib=141, host_gib=host, process=ol.PROCESS_BYTES))
        ol.check_plan(run, config, plan)
        assert plan.disk_layers == 0 and len(plan.modes["overlapped"].resident) >= 8, host


def test_blocked_plans_the_disk_after_its_adam_and_a_gradient_buffer_a_unit():
    """blocked runs every part in turn, its Adam as the moments are read: its predicted step counts the disk's part.
    The host it plans the disk's layers for holds a gradient buffer for every unit, as blocked steps them (planned
    with two, this run was refused 42.3 MiB short, though it fits with all eight layers on the disk)."""
    run = ol.RunConfig(mode="blocked,overlapped", train=True, nvme="/nvme", max_gpu_memory=30)
    config = ol.llama_config(run)
    plan = ol.make_plan(run, config, machine(gpu_gib=141, host_gib=24, process=ol.PROCESS_BYTES))
    ol.check_plan(run, config, plan)
    blocked = plan.modes["blocked"]
    assert plan.disk_layers == 8 and blocked.step_ms >= blocked.bound_ms["disk_ms"] + blocked.bound_ms["gpu_compute_ms"]


def test_ranks_on_one_host_share_its_disk():
    """Two ranks on one host each keep half of every disk layer's moments on its one disk: the disk's part of the bound
    is the same as one rank's with the whole layers, not half of it."""
    run = ol.RunConfig(mode="overlapped", train=True, inference=False, nvme="/nvme", nvme_layers=8)
    config = ol.llama_config(run)
    one = ol.make_plan(run, config, machine(host_gib=64)).modes["overlapped"].bound_ms["disk_ms"]
    run = ol.dataclasses.replace(run, grad_accum=2)
    two = ol.make_plan(run, config, machine(host_gib=64, world=2)).modes["overlapped"].bound_ms["disk_ms"]
    assert two == pytest.approx(one, rel=0.01)


def test_a_run_the_host_cannot_hold_is_refused_for_the_host():
    """Even with every layer's moments on the disk the host is too small: refused for the host, not the disk."""
    plan = disk_plan(14, 2)
    assert plan.disk_layers == 8
    run = ol.RunConfig(mode="overlapped", train=True, inference=False, nvme="/nvme")
    with pytest.raises(ol.UsageError, match="host memory"):
        ol.check_host(run, ol.llama_config(run), plan)
    with pytest.raises(ol.UsageError, match="host memory"):
        ol.check_host(run, ol.llama_config(run), disk_plan(22, 8, nvme_layers=1))


@pytest.mark.parametrize(
    "args, message",
    [
        (["--nvme", "{tmp}"], "--nvme does nothing without --train: add --train"),
        (["--train", "--nvme-layers", "2"], "--nvme-layers does nothing without --nvme DIR"),
        (["--train", "--nvme", "{tmp}/missing"], "does not exist"),
        (["--train", "--nvme", "{tmp}/file"], "is a file: give a folder"),
        (["--train", "--nvme", "/proc"], "cannot be written"),
        (["--train", "--max-host-memory", "-1"], "--max-host-memory must be a positive number"),
        (["--train", "--mode", "gpu,cpu", "--nvme", "{tmp}"], "add blocked or overlapped to --mode"),
        (
            ["--plan", "--gpu-memory", "80", "--train", "--preset", "tiny", "--nvme", "{tmp}", "--nvme-layers", "2"],
            "more than is free there",
        ),  # the plan's refusal: a run without a GPU is refused for that first
    ],
)
def test_bad_disk_tier_flags_are_refused_before_the_run(args, message, tmp_path, capsys, monkeypatch):
    """Refused with one line and exit code 2 (main, in this process: the refusals come before any model is built),
    on a disk with 64 KiB free."""
    monkeypatch.setattr(ol.shutil, "disk_usage", lambda _: ol.shutil._ntuple_diskusage(0, 0, 2**16))
    (tmp_path / "file").write_text("")
    try:
        code = ol.main(["--mode", "overlapped", *(a.replace("{tmp}", str(tmp_path)) for a in args)])
    except SystemExit as e:  # argparse's refusals
        code = e.code
    err = capsys.readouterr().err
    assert code == 2 and message in err, err
    assert len(err.strip().splitlines()) == 1 and sorted(os.listdir(tmp_path)) == ["file"]


def test_the_bound_and_the_notes_count_the_disk(tmp_path):
    """The step's bound gets a disk part, the best round of the tier's reads and write-backs of a step, and the
    tables' notes say where the moments are (made from stand-in times: no GPU here)."""
    model, batches = five_layers("bfloat16")
    trainer = offloaded_trainer(model, CPU, 1, batches, disk=(tmp_path, (4, 5)))
    steps(trainer, batches, 1)
    kinds = ("embed", "layer", "norm", "head")
    parts = (*kinds, *(f"{kind}_forward" for kind in kinds), "h2d", "d2h", "adam", "adam_small", "host")
    result = {"time_ms": 1e6, "bound_parts_ms": {name: [1.0] for name in parts} | {"disk": [3.0, 2.0]}}
    t = result | ol.training_figures(trainer, result)
    disk = trainer.store.adam_moments.disk
    assert t["disk_tier"]["units"] == 2 and t["disk_bytes"] == ol.disk_step_bytes(disk) >= 8 * 2 * 46336
    assert t["disk_ms"] == 2.0 and t["disk_gbps"] == pytest.approx(2 * t["disk_bytes"] / 2e6)  # the best round
    notes = "\n".join(ol.training_notes("overlapped", t, ol.RunConfig(train=True)))
    assert "the Adam moments of 2 units" in notes and f", disk {t['disk_ms']:.1f} ms" in notes
    assert table_cells("training", 0, t)[-2] == ol.gib(t["disk_bytes"])  # Table 1: on the disk
    disk.close()
    disk.close()  # closing again does nothing


def test_a_mode_that_ends_mid_step_leaves_the_next_one_a_fresh_cycle(tmp_path):
    """A mode ends mid-backward (out of GPU memory, say) with moments staged for steps that never come; the next mode
    loads the same store, as run_modes does, and its steps run (the reader starts its cycle anew)."""
    model, batches = five_layers("bfloat16")
    first = offloaded_trainer(model, CPU, 1, batches, disk=(tmp_path, (2, 3, 4, 5)))
    send = first.send

    def send_then_fail(u, views):
        send(u, views)
        if u == 5:
            raise torch.OutOfMemoryError("after the first disk unit's gradients")

    first.send = send_then_fail
    with pytest.raises(torch.OutOfMemoryError):
        first.step(batches)
    first.finish()
    store = first.store
    store.load(model)
    kwargs = ol.decoder_kwargs(model, tuple(batches[0].shape), model.dtype, CPU)
    second = ol.OffloadedTraining(store, model.config, model.dtype, CPU, 1, model.loss_function, kwargs)
    losses = steps(second, batches, 3)[1]
    assert len(losses) == 3 and losses[2] < losses[0]
    store.close()


def test_a_read_error_with_shared_gradient_buffers_ends_the_run(tmp_path, monkeypatch):
    """A read fails while the backward waits for a shared gradient buffer: the buffers go back to the pool and the
    error reaches the main thread (it used to wait for a buffer for ever)."""
    model, batches = five_layers("bfloat16")
    trainer = offloaded_trainer(model, CPU, 1, batches, grad_buffers=2, disk=(tmp_path, (2, 3, 4, 5)))
    preadv, reads = os.preadv, []

    def failing(*args):
        reads.append(args)
        if len(reads) > 5:
            raise OSError(errno.EIO, os.strerror(errno.EIO))
        return preadv(*args)

    monkeypatch.setattr(os, "preadv", failing)
    with pytest.raises(OSError, match="Input/output error"):
        for _ in range(4):
            trainer.step(batches)
        trainer.finish()
    monkeypatch.undo()
    with pytest.raises(OSError):  # the worker's error stays, for every wait
        trainer.finish()
    assert trainer.store.pool.free.qsize() == 2  # the worker has stopped: every buffer it held is back
    trainer.store.close()
    assert os.listdir(tmp_path) == []


def test_stopping_the_reader_as_it_takes_a_unit_does_not_hang(tmp_path):
    """Hostile: stop() comes while the reader marks the one disk unit as being read (the event it waits on next), as
    before a bound's round or a mode's load; stop() returns, and the reader with it."""
    model, batches = five_layers("bfloat16")
    trainer = offloaded_trainer(model, CPU, 1, batches, disk=(tmp_path, (5,)))
    disk, inside = trainer.store.adam_moments.disk, threading.Event()

    class SlowClear(threading.Event):
        """An event whose clear() lets stop() come first."""

        def clear(self):
            inside.set()
            time.sleep(0.1)  # stop() comes now
            super().clear()

    disk.settled[5] = SlowClear()
    disk.settled[5].set()
    disk.start()
    assert inside.wait(5)
    stopper = threading.Thread(target=disk.stop, daemon=True)
    stopper.start()
    stopper.join(5)
    assert not stopper.is_alive() and disk.reader is None
    trainer.store.close()


def test_a_checkpoint_on_the_disk_of_the_tier_counts_its_files(monkeypatch, tmp_path):
    """--checkpoint on the file system of --nvme: the room it needs comes after the tier's files."""
    run = ol.RunConfig(mode="overlapped", train=True, nvme=str(tmp_path), nvme_layers=4, checkpoint=str(tmp_path / "c"))
    config = ol.llama_config(run)
    needed = 12 * ol.param_count(config)  # a checkpoint: float32 masters and moments
    tier = 4 * ol.disk_unit_bytes(config)
    for free in (needed + tier, needed + tier - 1):
        monkeypatch.setattr(ol.shutil, "disk_usage", lambda _, free=free: ol.shutil._ntuple_diskusage(0, 0, free))
        plan = ol.make_plan(run, config, machine(disk_bytes=free))
        if free < needed + tier:
            with pytest.raises(ol.UsageError, match="more than is free there"):
                ol.check_saving(run, config, plan)
        else:
            ol.check_saving(run, config, plan)


@pytest.mark.parametrize("units", [(5,), (2, 3, 4, 5)])
@pytest.mark.parametrize("slow", ["pwritev", "preadv"])
def test_slow_disk_io_changes_no_bit(slow, units, tmp_path, monkeypatch):
    """Hostile: every write-back (or read) of the disk tier takes 20 ms longer, so a read that did not wait for the
    last write-back of its unit would stage stale moments (one unit, a slot free for it at once), and a step that did
    not wait for its read would step what the slot held before; the masters and moments after 4 steps still equal
    the host-only run's bit for bit."""
    model, batches = five_layers("bfloat16")
    host = offloaded_trainer(model, CPU, 1, batches)
    steps(host, batches, 4)
    transfer = ol.DiskTier.transfer

    def slow_transfer(self, call, u, buffer):
        if call.__name__ == slow:
            time.sleep(0.02)
        return transfer(self, call, u, buffer)

    monkeypatch.setattr(ol.DiskTier, "transfer", slow_transfer)
    disk = offloaded_trainer(model, CPU, 1, batches, disk=(tmp_path, units))
    steps(disk, batches, 4)
    assert_same_states(states(disk), states(host))
    disk.store.close()


def test_a_host_short_for_units_the_gpu_cannot_keep_resident_says_the_gpu_is_short():
    """Five layers resident under an 8 GiB cap do not fit the GPU, so the host counts their state and is short: the
    refusal names the GPU's part in it first, then the host's advice."""
    run = ol.RunConfig(mode="overlapped", train=True, nvme="/nvme", nvme_layers=3, resident_layers=5, max_gpu_memory=8)
    config = ol.llama_config(run)
    plan = ol.make_plan(run, config, machine(gpu_gib=141, host_gib=24, process=ol.PROCESS_BYTES))
    assert not plan.modes["overlapped"].training_fits
    with pytest.raises(ol.UsageError, match="mode overlapped does not fit the GPU with its 5 resident units, so the"):
        ol.check_host(run, config, plan)
