"""Several ranks on the CPU, gloo between them, as torchrun starts them: sharded host state, all-gathered units,
reduce-scattered gradients, against one process training on every micro-batch."""

import contextlib
import math
import os
import socket
import time

import pytest
import torch
import torch.multiprocessing as mp
from test_data import data_run

import offload_llama as ol
from helpers import assert_masters_close, build, host_for, machine, planned, run_main, tiny_run

CPU = torch.device("cpu")
STEPS = 3


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def tiny_batches(dtype: str, count: int):
    """The tiny model in `dtype` and a step of `count` micro-batches, one 48-token sequence each."""
    model, ids = build(ol.dataclasses.replace(tiny_run(), dtype=dtype, batch_size=count))
    return model, list(ids.chunk(count))


def one_process(dtype: str, count: int, depth: int = 1, overflow_at=None, **options):
    """trained()'s results of one process on all `count` micro-batches of the step, as the ranks are compared with;
    options: trainer_of's."""
    model, batches = tiny_batches(dtype, count)
    return trained(trainer_of(model, batches, count, depth, **options), batches, overflow_at)


def trainer_of(model, micro_batches, world_batches, depth, ranks=None, clip=None, gpu_adam=(), disk=None, segment=1):
    """Offloaded training of `model` on the CPU, its store this rank's shards; world_batches: the step's micro-batches
    over every rank (they set the gradients' dtype and the loss's divisor); clip: --clip-grad-norm; gpu_adam: the
    units the device's Adam steps over their state streamed from the host (StreamedAdam); disk: (folder, units)
    whose moments a disk tier keeps there (this rank's shards of them); segment: units a segment (SegmentGraphs)."""
    dtype = next(model.parameters()).dtype
    run = ol.RunConfig(dtype=str(dtype).removeprefix("torch."), grad_accum=world_batches)
    copy_dtype = dtype if dtype != torch.float32 else None
    units = ol.model_units(model.config)
    scaled = clip is not None
    args = (units, ol.Adam(lr=1e-3), False, None, ol.gradient_dtype(run), copy_dtype, scaled)
    ranks = ranks or ol.Ranks()
    tier = ol.DiskTier(disk[0], {u: ranks.shard_numel(units[u].layout.numel) for u in disk[1]}) if disk else None
    store = ol.OffloadedAdam(*args, ol.moments_for(tier), ranks, update=ol.CompiledAdamUpdate)
    store.load(model)
    kwargs = ol.decoder_kwargs(model, tuple(micro_batches[0].shape), dtype, CPU)
    training = ol.ShardedTraining if ranks.several else ol.OffloadedTraining
    trainer = training(store, model.config, dtype, CPU, depth, model.loss_function, kwargs)
    ol.scale_and_clip(trainer, clip)
    if segment > 1:
        trainer.inputs = ol.SegmentGraphs(trainer, segment)
    if gpu_adam:
        ol.place_on_gpu(trainer, (), gpu_adam, own_grads=False)
    return trainer


def trained(trainer, micro_batches, overflow_at=None, steps=STEPS):
    """(losses, final masters, gradient norms, loss scales) of `steps` steps; overflow_at: the step whose gradients
    get an inf (in the first layer's, on this process)."""
    unit_grads, losses, scales = trainer.unit_grads, [], []
    for i in range(steps):

        def overflowing(u, *args):
            """The unit's gradients, one of the first layer's inf."""
            grad_in, grads = unit_grads(u, *args)
            if u == 1:
                grads[0].view(-1)[0] = float("inf")
            return grad_in, grads

        trainer.unit_grads = overflowing if i == overflow_at else unit_grads
        losses.append(trainer.step(micro_batches).item())
        scales.append(trainer.scaling.scale)
    trainer.finish()
    return losses, trainer.state_dict(), list(trainer.grad_norms), scales


def join(rank, world, port, timeout=ol.RANK_TIMEOUT, hosts: int = 1) -> ol.Ranks:
    """This process as rank `rank` of `world`, joined to the others as torchrun's environment says, its steps'
    collectives waiting `timeout` seconds at most; over `hosts` launchers, each with world / hosts local ranks."""
    local_world = world // hosts
    env = {"RANK": rank, "WORLD_SIZE": world, "LOCAL_RANK": rank % local_world, "LOCAL_WORLD_SIZE": local_world}
    os.environ.update({key: str(value) for key, value in env.items()} | {"MASTER_ADDR": "127.0.0.1"})
    os.environ["MASTER_PORT"] = str(port)
    torch.set_num_threads(1)
    ranks = ol.Ranks.from_environment()
    ol.start_ranks(ranks)
    ol.join_steps(ranks, timeout, threads=1)
    return ranks


@contextlib.contextmanager
def joined(rank, world, port, hosts: int = 1):
    """This process as rank `rank` of `world` over `hosts` launchers (join), for the block; then it leaves the
    others."""
    try:
        yield join(rank, world, port, hosts=hosts)
    finally:
        ol.stop_ranks()


def rank_main(rank, world, port, dtype, k, depth, out, clip=None, overflow_at=None, gpu_adam=(), disk=None, segment=1):
    """One rank: trains on its share of the step's micro-batches, rank 0 saves the result."""
    with joined(rank, world, port) as ranks:
        model, batches = tiny_batches(dtype, world * k)
        trainer = trainer_of(model, ranks.share(batches), len(batches), depth, ranks, clip, gpu_adam, disk, segment)
        result = trained(trainer, ranks.share(batches), overflow_at if rank == world - 1 else None)
        if rank == 0:
            torch.save(result, out)


SLOW = pytest.mark.slow  # each spawns its ranks, which import torch and compile the CPU Adam: 9 to 15 s


@pytest.mark.parametrize(
    ("world", "dtype", "k", "depth"),
    [
        (2, "float32", 1, 1),
        pytest.param(2, "bfloat16", 2, 0, marks=SLOW),
        pytest.param(3, "bfloat16", 1, 1, marks=SLOW),
    ],
)
def test_ranks_train_as_one_process_on_every_micro_batch(tmp_path, world, dtype, k, depth):
    """world ranks with k micro-batches each: masters to float32 rounding of one process with world x k micro-batches,
    losses to 1e-6 relative."""
    out = tmp_path / "ranks.pt"
    mp.spawn(rank_main, args=(world, free_port(), dtype, k, depth, out), nprocs=world)
    losses, masters, _, _ = torch.load(out)
    ref_losses, ref_masters, _, _ = one_process(dtype, world * k, depth)
    assert masters.keys() == ref_masters.keys()
    assert_masters_close(masters, ref_masters, STEPS)
    assert losses == pytest.approx(ref_losses, rel=1e-6)


@SLOW
def test_ranks_clip_by_the_norm_of_every_shard_as_one_process_does(tmp_path):
    """--clip-grad-norm over 2 ranks: each step's norm that of the whole gradient (each rank's shards' squares summed),
    as clip_grad_norm_ takes it in one process, to float32 rounding, and the same clipped masters."""
    out = tmp_path / "ranks.pt"
    mp.spawn(rank_main, args=(2, free_port(), "float32", 1, 1, out, 0.05), nprocs=2)
    losses, masters, norms, _ = torch.load(out)
    ref_losses, ref_masters, ref_norms, _ = one_process("float32", 2, clip=0.05)
    assert len(norms) == STEPS and norms == pytest.approx(ref_norms, rel=1e-6)
    assert max(norms) > 0.05  # the steps were clipped
    assert_masters_close(masters, ref_masters, STEPS)
    assert losses == pytest.approx(ref_losses, rel=1e-6)


@SLOW
def test_the_devices_adam_steps_each_ranks_shard_of_its_units(tmp_path):
    """2 ranks, the embeddings and first layer stepped by the device's Adam over each rank's shard of their state
    (the summed gradients' shard taken once the reduce-scatter is done): the masters of one process placing the same
    units there, to float32 rounding."""
    out = tmp_path / "ranks.pt"
    mp.spawn(rank_main, args=(2, free_port(), "bfloat16", 1, 1, out, None, None, (0, 1)), nprocs=2)
    losses, masters, _, _ = torch.load(out)
    ref_losses, ref_masters, _, _ = one_process("bfloat16", 2, gpu_adam=(0, 1))
    assert_masters_close(masters, ref_masters, STEPS)
    assert losses == pytest.approx(ref_losses, rel=1e-6)


@SLOW
def test_ranks_in_segments_sum_each_units_gradients_before_the_next_takes_the_summed_buffer(tmp_path):
    """2 ranks in segments of 2 a micro-batch at a time, the embeddings and first layer stepped by the device's Adam:
    a segment's units are sent back to back, each reduce-scattered into the one summed buffer once the last shard
    left it; the masters of one process training the same way, to float32 rounding."""
    out = tmp_path / "ranks.pt"
    mp.spawn(rank_main, args=(2, free_port(), "bfloat16", 2, 1, out, None, None, (0, 1), None, 2), nprocs=2)
    losses, masters, _, _ = torch.load(out)
    ref_losses, ref_masters, _, _ = one_process("bfloat16", 4, gpu_adam=(0, 1), segment=2)
    assert_masters_close(masters, ref_masters, STEPS)
    assert losses == pytest.approx(ref_losses, rel=1e-6)


@SLOW
def test_each_rank_keeps_its_shard_of_the_last_layers_moments_on_the_disk(tmp_path):
    """--nvme over 2 ranks: the last two layers' moments, each rank's shard in files of its own on the disk: the
    masters of one process with no disk tier, to float32 rounding."""
    out = tmp_path / "ranks.pt"
    disk = (str(tmp_path), (2, 3))
    mp.spawn(rank_main, args=(2, free_port(), "float32", 1, 1, out, None, None, (), disk), nprocs=2)
    losses, masters, _, _ = torch.load(out)
    ref_losses, ref_masters, _, _ = one_process("float32", 2)
    assert_masters_close(masters, ref_masters, STEPS)
    assert losses == pytest.approx(ref_losses, rel=1e-6)


@SLOW
def test_a_step_that_overflows_on_one_rank_is_skipped_on_every_rank(tmp_path):
    """float16 over 2 ranks, the second step's gradients overflowing on rank 1 alone: both ranks skip it and halve the
    loss scale, so the masters are those of one process whose second step overflowed."""
    out = tmp_path / "ranks.pt"
    mp.spawn(rank_main, args=(2, free_port(), "float16", 1, 1, out, None, 1), nprocs=2)
    losses, masters, _, scales = torch.load(out)
    ref_losses, ref_masters, _, ref_scales = one_process("float16", 2, overflow_at=1)
    assert scales == ref_scales and scales[1] == scales[0] / 2
    assert_masters_close(masters, ref_masters, STEPS)
    assert losses == pytest.approx(ref_losses, rel=1e-3)  # float16 losses


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["--mode", "all", "--train"], "--mode all: 2 ranks run an offloaded mode"),
        (["--mode", "gpu"], "--mode gpu: 2 ranks run an offloaded mode"),
        (["--mode", "overlapped", "--train", "--grad-accum", "3"], "split evenly over the 2 ranks: use a multiple"),
        (["--mode", "overlapped", "--train", "--grad-accum", "2", "--profile", "/tmp/t.json"], "--profile runs"),
        (["--mode", "overlapped", "--train", "--grad-accum", "2", "--resident-layers", "1"], "--resident-layers runs"),
        (["--mode", "overlapped", "--train", "--grad-accum", "2", "--fwd-bwd-reference"], "--fwd-bwd-reference runs"),
        (["--mode", "overlapped", "--train", "--grad-accum", "2"], "torchrun started 2 ranks on this host, which has"),
    ],
)
def test_what_several_ranks_refuse_in_one_line(capsys, monkeypatch, args, message):
    """Under torchrun's environment (2 ranks): a flag several ranks do not take, or a batch they cannot split, or more
    ranks than GPUs, refused with one line and exit 2 before the model is built."""
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    env = {"RANK": "0", "WORLD_SIZE": "2", "LOCAL_RANK": "0", "LOCAL_WORLD_SIZE": "2"}
    for key, value in env.items():
        monkeypatch.setenv(key, value)
    code, out, err = run_main(capsys, "--preset", "tiny", "--seq-len", "64", "--batch-size", "2", *args)
    assert code == 2, err
    assert message in err and len(err.strip().splitlines()) == 1, err


def rank_checkpoint(rank, world, port, folder, out):
    """One rank: 4 steps with a checkpoint after 2, then 2 steps resumed from it in a new trainer; rank 0 saves both
    runs' final masters."""
    with joined(rank, world, port) as ranks:
        model, step = tiny_batches("float32", world)
        batches = ranks.share(step)
        run = ol.RunConfig(preset="tiny", dtype="float32", grad_accum=world, ranks=ranks)
        manifest = ol.checkpoint_manifest(run, model.config, "overlapped")
        trainer = trainer_of(model, batches, world, 1, ranks)
        trainer.step(batches)
        trainer.step(batches)
        ol.write_checkpoint(trainer, folder, manifest, 2)
        uninterrupted = trained(trainer, batches, steps=2)[1]
        resumed = trainer_of(model, batches, world, 1, ranks)
        assert ol.resume(resumed, folder, manifest) == 2
        after = trained(resumed, batches, steps=2)[1]
        if rank == 0:
            torch.save((uninterrupted, after), out)


@SLOW
def test_each_rank_checkpoints_its_shards_and_resumes_bitwise(tmp_path):
    """--checkpoint over 2 ranks: a file a unit and rank, the record written last; resumed by 2 ranks, the run goes on
    bit for bit as if uninterrupted."""
    out, folder = tmp_path / "ranks.pt", tmp_path / "checkpoint"
    mp.spawn(rank_checkpoint, args=(2, free_port(), folder, out), nprocs=2)
    uninterrupted, resumed = torch.load(out)
    assert all(torch.equal(resumed[name], m) for name, m in uninterrupted.items())
    saved = ol.json.loads((folder / ol.CHECKPOINT_FILE).read_text())
    units = len(ol.model_units(ol.llama_config(tiny_run())))
    assert saved["ranks"] == 2 and len(saved["files"]) == 2 * units
    assert sorted(p.name for p in folder.iterdir()) == sorted([*saved["files"], ol.CHECKPOINT_FILE])


def whole_state(trainer, u: int) -> dict:
    """One process's unit u: its flat float32 master and moments (padding included) and its step count."""
    master, exp_avg, exp_avg_sq, step = trainer.steppers.of[u].adam_state(u)
    return {"step": step.item(), "master": master, "exp_avg": exp_avg, "exp_avg_sq": exp_avg_sq}


def shard_of(flat: torch.Tensor, rank: int, world: int) -> torch.Tensor:
    """Rank `rank` of `world`'s shard of a unit's flat buffer, as the store cuts it (zero padding past the end)."""
    size = ol.Ranks(world=world).shard_numel(flat.numel())
    padded = torch.cat([flat, flat.new_zeros(size * world - flat.numel())])
    return padded[rank * size : (rank + 1) * size]


def write_as(folder, trainer, run: ol.RunConfig, world: int) -> dict:
    """`trainer`'s state (one process's) written as a checkpoint of `world` ranks would hold it: one file a unit, or
    a file a unit and rank, each rank's flat shards; returns the manifest of a run of `world` ranks."""
    ranks, units = ol.Ranks(world=world), len(trainer.units)
    manifest = ol.checkpoint_manifest(ol.dataclasses.replace(run, ranks=ranks), ol.llama_config(run), "overlapped")
    files = ol.checkpoint_files(units, 2, ranks)
    for i, name in enumerate(files):
        r, u = divmod(i, units)
        if world == 1:
            state = ol.unit_state(trainer, u)
        else:
            state = {key: shard_of(t, r, world) if key != "step" else t for key, t in whole_state(trainer, u).items()}
        torch.save(state, folder / name)
    record = manifest | {"files": files, "steps": 2, "loss_scale": 1.0, "good_steps": 0}
    (folder / ol.CHECKPOINT_FILE).write_text(ol.json.dumps(record))
    return manifest


RESHARDED = [(1, 2), (2, 3), (3, 1)]  # the other pairings of 1 to 4 ranks behind the slow marker: 1.2 s each
PAIRINGS = [(n, m) if (n, m) in RESHARDED else pytest.param(n, m, marks=SLOW) for n in range(1, 5) for m in range(1, 5)]


@pytest.mark.parametrize(("saved", "now"), PAIRINGS)
def test_a_checkpoint_of_n_ranks_resumes_on_m_bitwise(tmp_path, saved, now):
    """A checkpoint written by `saved` ranks (cut as their stores cut the state) resumed by `now` ranks: each rank's
    shard of every unit's master and moments, and the step counts, bit for bit those of the state it was made of
    (the padding between parameters, never read, left out: a stepped unit's holds what the gradient buffer did)."""
    model, batches = tiny_batches("float32", 12)
    run = ol.RunConfig(preset="tiny", dtype="float32", grad_accum=12)
    trainer = trainer_of(model, batches, 12, 1)
    trainer.step(batches)
    trainer.step(batches)
    trainer.wait_updates()
    write_as(tmp_path, trainer, run, saved)
    for rank in range(now):
        ranks = ol.Ranks(rank=rank, world=now)
        manifest = ol.checkpoint_manifest(ol.dataclasses.replace(run, ranks=ranks), model.config, "overlapped")
        resumed = trainer_of(model, ranks.share(batches), 12, 1, ranks)
        assert ol.read_checkpoint(tmp_path, manifest, resumed.units).get("ranks", 1) == saved
        assert ol.resume(resumed, tmp_path, manifest) == 2
        for u, unit in enumerate(trainer.units):
            expected, got = whole_state(trainer, u), whole_state(resumed, u)
            assert got["step"] == expected["step"] == 2
            for key in ("master", "exp_avg", "exp_avg_sq"):  # the parameters' elements: padding is never read
                start = rank * got[key].numel()
                pieces = zip(
                    ol.pieces(unit.layout, got[key], start),
                    ol.pieces(unit.layout, shard_of(expected[key], rank, now), start),
                    strict=True,
                )
                assert all(torch.equal(a, b) for a, b in pieces), (u, key)
        resumed.finish()
    trainer.finish()


STEP = 6  # micro-batches a step: a share for 1, 2 or 3 ranks


def resharded_run(ranks: ol.Ranks, folder, again) -> tuple[dict, dict]:
    """Resume the checkpoint in `folder` on `ranks` and train 2 steps; and the same from a checkpoint that these ranks
    write of the state they resumed (in `again`): both runs' final masters."""
    model, step = tiny_batches("float32", STEP)
    batches = ranks.share(step)
    run = ol.RunConfig(preset="tiny", dtype="float32", grad_accum=STEP, ranks=ranks)
    manifest = ol.checkpoint_manifest(run, model.config, "overlapped")
    masters = []
    for source in (folder, again):
        trainer = trainer_of(model, batches, STEP, 1, ranks)
        assert ol.resume(trainer, source, manifest) == 2
        if source == folder:
            ol.write_checkpoint(trainer, again, manifest | {"resumed_from": 2}, 0)  # the state it resumed
        masters.append(trained(trainer, batches, steps=2)[1])
    return masters[0], masters[1]


def rank_reshard(rank, world, port, folder, out, write: bool):
    """One rank: (write) 2 steps and a checkpoint, then 2 more; or resharded_run from that checkpoint. Rank 0 saves
    the masters."""
    with joined(rank, world, port) as ranks:
        if write:
            model, step = tiny_batches("float32", STEP)
            run = ol.RunConfig(preset="tiny", dtype="float32", grad_accum=STEP, ranks=ranks)
            trainer = trainer_of(model, ranks.share(step), STEP, 1, ranks)
            trainer.step(ranks.share(step))
            trainer.step(ranks.share(step))
            ol.write_checkpoint(trainer, folder, ol.checkpoint_manifest(run, model.config, "overlapped"), 2)
            result = trained(trainer, ranks.share(step), steps=2)[1]
        else:
            result = resharded_run(ranks, folder, out.with_suffix(".again"))
        if rank == 0:
            torch.save(result, out)


@SLOW
def test_a_checkpoint_of_two_ranks_goes_on_over_three_and_over_one(tmp_path):
    """2 ranks write a checkpoint after 2 steps and train 2 more; 3 ranks, and one process, resume it and train 2
    steps: each as its own ranks go on from a checkpoint they wrote of the same state (bitwise), and the masters those
    of the 2 ranks to float32 rounding (the gradients' sums go in another order)."""
    folder = tmp_path / "two"
    mp.spawn(rank_reshard, args=(2, free_port(), folder, tmp_path / "two.pt", True), nprocs=2)
    uninterrupted = torch.load(tmp_path / "two.pt")
    mp.spawn(rank_reshard, args=(3, free_port(), folder, tmp_path / "three.pt", False), nprocs=3)
    results = {"three": torch.load(tmp_path / "three.pt"), "one": resharded_run(ol.Ranks(), folder, tmp_path / "1")}
    for name, (resumed, again) in results.items():
        assert all(torch.equal(resumed[key], m) for key, m in again.items()), name
        assert_masters_close(resumed, uninterrupted, 4)


def rank_save(rank, world, port, folder, out):
    """One rank: 2 steps, then --save-pretrained's folder (rank 0 writes); rank 0 saves the masters."""
    with joined(rank, world, port) as ranks:
        model, step = tiny_batches("float32", world)
        batches = ranks.share(step)
        trainer = trainer_of(model, batches, world, 1, ranks)
        masters = trained(trainer, batches, steps=2)[1]
        ol.save_pretrained(trainer, model.config, folder)
        if rank == 0:
            torch.save(masters, out)


@SLOW
def test_rank_0_saves_a_folder_from_pretrained_reads_a_unit_at_a_time(tmp_path):
    """--save-pretrained over 2 ranks: a safetensors file a unit, each gathered from both ranks' shards; HF's
    from_pretrained reads back the trained masters bit for bit."""
    out, folder = tmp_path / "masters.pt", tmp_path / "saved"
    mp.spawn(rank_save, args=(2, free_port(), folder, out), nprocs=2)
    masters = torch.load(out)
    model = ol.LlamaForCausalLM.from_pretrained(folder, dtype=torch.float32)
    params = dict(model.named_parameters())
    assert params.keys() == masters.keys()
    assert all(torch.equal(params[name].detach(), m) for name, m in masters.items())
    units = len(ol.model_units(model.config))
    assert len(list(folder.glob("model-*.safetensors"))) == units


def test_each_rank_trains_on_its_share_of_the_steps_blocks(tmp_path):
    """--data over 3 ranks: rank r's micro-batches are r and r + 3 of the step's 6, the blocks one process takes."""
    run = data_run(tmp_path, grad_accum=6, batch_size=2)
    blocks, _ = ol.prepare_data(run, 512)
    alone = ol.step_batches(blocks, run, CPU)
    for rank in range(3):
        ranks = ol.Ranks(rank, 3, rank, 3)
        share = ol.step_batches(blocks, ol.dataclasses.replace(run, ranks=ranks), CPU)
        for step in (0, 5):
            assert [b.tolist() for b in share(step)] == [b.tolist() for b in alone(step)[rank::3]]


def rank_text(rank, world, port, tmp, hosts, out):
    """One rank of `world` over `hosts` launchers, each host tokenizing into a token cache of its own: 2 steps on its
    share of the text's blocks; rank 0 saves the masters."""
    with joined(rank, world, port, hosts) as ranks:
        host = rank // (world // hosts)
        run = data_run(tmp, grad_accum=2 * world, data_cache=str(tmp / f"cache{hosts}.{host}"), ranks=ranks)
        model, _ = build(tiny_run(vocab_size=512))
        text = ol.agreed_text(run, model.config)
        step = ol.step_batches(text.blocks, run, CPU)
        trainer = trainer_of(model, step(0), 2 * world, 1, ranks)
        for i in range(2):
            trainer.step(step(i))
        trainer.finish()
        masters = trainer.state_dict()
        if rank == 0:
            torch.save(masters, out)


@SLOW
def test_two_launchers_train_as_one_each_host_with_its_own_token_cache(tmp_path):
    """2 ranks from two launchers (a local rank 0 each, as `torchrun --nnodes 2` starts them), each host tokenizing
    the corpus into its own --data-cache: the masters of 2 ranks from one launcher, bit for bit."""
    data_run(tmp_path)  # the corpus, before the ranks read it
    for hosts in (1, 2):
        mp.spawn(rank_text, args=(2, free_port(), tmp_path, hosts, tmp_path / f"{hosts}.pt"), nprocs=2)
    one, two = torch.load(tmp_path / "1.pt"), torch.load(tmp_path / "2.pt")
    assert all(torch.equal(two[name], m) for name, m in one.items())
    assert [len(list((tmp_path / f"cache2.{host}").glob("tokens-*.bin"))) for host in (0, 1)] == [1, 1]


def test_hosts_whose_text_differs_are_refused_in_one_line(tmp_path, monkeypatch):
    """Each host's tokenizer and token ids hashed (text_fingerprint) and compared: another corpus on one host is one
    line naming the ranks' hashes, not ranks training on different data."""
    run = data_run(tmp_path)
    text = ol.prepare_text(run, ol.llama_config(ol.dataclasses.replace(run, sizes=(("vocab_size", 512),))))
    fingerprint = ol.text_fingerprint(text)
    assert fingerprint == ol.text_fingerprint(ol.Text(ol.Blocks(text.blocks.ids.clone(), 32, 0.1, 0), text.tokenizer))
    other = text.blocks.ids.numpy().copy()  # 16-bit ids, which torch cannot add to
    other[0] ^= 1
    assert ol.text_fingerprint(ol.Text(ol.Blocks(torch.from_numpy(other), 32, 0.1, 0), text.tokenizer)) != fingerprint
    ranks = ol.Ranks(0, 2, 0, 1)
    monkeypatch.setattr(ol.Ranks, "each", lambda self, value: [value, "another"])
    with pytest.raises(ol.UsageError, match="the ranks differ in their text: each host's tokenizer and token ids"):
        ol.check_same(ranks, fingerprint, "their text: each host's tokenizer and token ids")


def rank_generate(rank, world, port, out):
    """One rank: a step, then generate through the streamed shell over the shards, synced; rank 1's text ends after
    its first token, rank 0's runs on. Rank 0 saves its output."""
    with joined(rank, world, port) as ranks:
        model, step = tiny_batches("float32", world)
        batches = ranks.share(step)
        trainer = trainer_of(model, batches, world, 1, ranks)
        trainer.step(batches)
        trainer.wait_updates()
        prompt = step[0][:, :5]
        first = ol.forward_model(trainer, model.config, CPU).generate(prompt, max_new_tokens=1, do_sample=False)
        end = first[0, -1].item() if rank == 1 else None
        shell = ol.forward_model(trainer, model.config, CPU)
        text = shell.generate(prompt, max_new_tokens=8, do_sample=False, eos_token_id=end, synced_gpus=True)
        if rank == 0:
            torch.save(text, out)


@SLOW
def test_ranks_generate_in_step_when_one_ranks_text_ends_first(tmp_path):
    """generate through the shell over 2 ranks' shards, synced as --sample runs it: rank 1 ends at once, rank 0 goes
    on to 8 tokens (every pass gathers the units on both), the tokens one process generates."""
    out = tmp_path / "text.pt"
    mp.spawn(rank_generate, args=(2, free_port(), out), nprocs=2)
    model, batches = tiny_batches("float32", 2)
    trainer = trainer_of(model, batches, 2, 1)
    trainer.step(batches)
    trainer.wait_updates()
    shell = ol.forward_model(trainer, model.config, CPU)
    expected = shell.generate(batches[0][:, :5], max_new_tokens=8, do_sample=False, eos_token_id=None)
    trainer.finish()
    assert torch.equal(torch.load(out), expected) and expected.shape[1] == 13


def rank_lost(rank, world, port, stalls, out):
    """One rank, its steps' collectives waiting LOST_TIMEOUT at most: a whole step, then rank 1 ends (or stalls) in
    the next step's backward; rank 0 saves how long its step took to fail and the line it ends on, and leaves at once
    (main's way)."""
    ranks = join(rank, world, port, timeout=LOST_TIMEOUT)
    model, step = tiny_batches("float32", world)
    batches = ranks.share(step)
    trainer = trainer_of(model, batches, world, 1, ranks)
    trainer.step(batches)
    unit_grads = trainer.unit_grads

    def ending(u, *args):
        """Rank 1 ends, or sleeps past every timeout, at the first layer's backward."""
        if rank == 1 and u == 1:
            time.sleep(3600) if stalls else os._exit(3)
        return unit_grads(u, *args)

    trainer.unit_grads = ending
    started = time.perf_counter()
    try:
        trainer.step(batches)
    except RuntimeError as e:
        torch.save({"seconds": time.perf_counter() - started, "line": ol.lost_ranks(ranks, e)}, out)
    os._exit(0)


LOST_TIMEOUT = 12  # seconds: the rank timeout of rank_lost's steps (a plan's, or --rank-timeout's)


@SLOW
@pytest.mark.parametrize("stalls", [False, True])
def test_a_rank_that_ends_or_stalls_mid_step_ends_the_others_in_one_line(tmp_path, stalls):
    """Rank 1 of 2 ends mid-step (its connection drops), or stalls: rank 0's step fails at once, or after
    the rank timeout, never hangs (every step collective is in the group with that timeout); its line says so."""
    out = tmp_path / "lost.pt"
    context, port = mp.get_context("spawn"), free_port()
    ranks = [context.Process(target=rank_lost, args=(r, 2, port, stalls, out), daemon=True) for r in range(2)]
    for process in ranks:
        process.start()
    ranks[0].join(timeout=LOST_TIMEOUT + 90)  # setting up takes 10 to 20 s
    for process in ranks:
        process.kill()
    lost = torch.load(out)
    assert lost["seconds"] < (LOST_TIMEOUT + 10 if stalls else 10)
    assert f"({LOST_TIMEOUT} s in a step" in lost["line"]  # the timeout the steps' group was made with
    assert lost["line"].startswith("rank 0 of 2 stops: another rank ended, or stalled past the timeout"), lost["line"]


def disk_run(folder, ranks: ol.Ranks) -> ol.RunConfig:
    """The tiny model's overlapped training on 2 ranks of one host, float32, with --nvme and no --nvme-layers."""
    return ol.RunConfig(
        preset="tiny",
        mode="overlapped",
        train=True,
        inference=False,
        dtype="float32",
        grad_accum=2,
        nvme=str(folder),
        ranks=ranks,
    )


def hosts_apart(folder) -> list[int]:
    """Host memory available for ranks 0 and 1, a few KiB apart: planned alone, rank 0 would keep layers' moments on
    the disk, rank 1 none (it holds every unit's without the host's margin, which the plan weighs, and the disk is
    slower)."""
    run = disk_run(folder, ol.Ranks(0, 2, 0, 2))
    config = ol.llama_config(run)
    facts = ol.Facts(None, None, 10**12, ol.GiB, 1, 2, 2)
    need = host_for(2 * sum(ol.host_parts(run, config, facts, None, 2).values()))  # 2 ranks, no margin
    return [need - 8192, need]


def rank_plans(rank, world, port, folder, out):
    """One rank, its host memory available its own (hosts_apart): plans from the facts the ranks agree on, trains 3
    steps with that plan's disk tier and finishes, its masters gathered to rank 0 alone as --save-output gathers them;
    then a bound round whose parts differ between the ranks. Rank 0 saves every rank's plan, its losses and the line
    the round ended on."""
    with joined(rank, world, port) as ranks:
        ol.host_memory_available = lambda: hosts_apart(folder)[rank]
        ol.process_rss = lambda: ol.GiB
        run = disk_run(folder, ranks)
        config = ol.llama_config(run)
        plan = ol.make_plan(run, config, ol.agreed_facts(ranks, ol.measured_facts(run)))
        plans = ranks.each(plan)
        model, step = tiny_batches("float32", world)
        batches = ranks.share(step)
        disk = (folder, plan.disk_units) if plan.disk_layers else None
        trainer = trainer_of(model, batches, world, 1, ranks, disk=disk)
        losses, everywhere = trained(trainer, batches)[:2]
        on_first = trainer.state_dict(on_first=True)  # --save-output's: gathered to rank 0 alone, a unit at a time
        assert on_first == {} if rank else all(torch.equal(t, everywhere[name]) for name, t in on_first.items())
        assert rank or on_first.keys() == everywhere.keys()
        try:
            ol.time_round({"h2d": (CPU, lambda: None), **({"disk": (CPU, lambda: None)} if rank else {})}, {}, ranks)
        except ol.UsageError as e:
            line = str(e)
        if rank == 0:
            torch.save({"plans": plans, "losses": losses, "line": line}, out)


@SLOW
def test_ranks_whose_facts_differ_make_one_plan_and_finish(tmp_path):
    """Two ranks whose hosts have a few KiB more or less memory available: alone, one would keep layers' moments on
    the disk and the other none, and their bound rounds would stop pairing up (a hang). The facts are agreed first
    (the smallest memory), so both make one plan, train with it and finish; a bound round whose parts differ anyway
    ends on every rank with one line naming the difference."""
    run = disk_run(tmp_path, ol.Ranks(0, 2, 0, 2))
    config = ol.llama_config(run)
    alone = [ol.make_plan(run, config, ol.Facts(None, host, 10**12, ol.GiB, 1, 2, 2)) for host in hosts_apart(tmp_path)]
    assert alone[0].disk_layers > 0 == alone[1].disk_layers
    out = tmp_path / "plans.pt"
    mp.spawn(rank_plans, args=(2, free_port(), tmp_path, out), nprocs=2)
    saved = torch.load(out, weights_only=False)
    assert saved["plans"][0] == saved["plans"][1] and saved["plans"][0].disk_layers == alone[0].disk_layers
    assert len(saved["losses"]) == STEPS and saved["losses"][-1] < saved["losses"][0]
    assert "the ranks differ in the bound's parts (rank 0: ['h2d']; rank 1: ['h2d', 'disk'])" in saved["line"]


def test_agreed_facts_are_the_smallest_machine_and_the_slowest_rates():
    """Each rank plans from the same facts: one process's are its own."""
    facts = ol.Facts(80 * ol.GiB, 100 * ol.GiB, None, ol.GiB, 16, 2, 2)
    assert ol.agreed_facts(ol.Ranks(), facts) == facts


def test_a_ranks_host_plan_counts_its_shards():
    """LLaMA-7B on 2 ranks of one host: each rank holds its shard of the masters, moments, copy and gradient buffers,
    so with 110 GiB available the bfloat16 copy stays, and with 126 GiB every unit gets a float32 gradient buffer (a
    plan sized for the whole model dropped the copy at 110 GiB and gave a rank only a few buffers)."""
    run = ol.RunConfig(preset="llama-7b", mode="overlapped", train=True, inference=False, grad_accum=2)
    run = ol.dataclasses.replace(run, ranks=ol.Ranks(0, 2, 0, 2))
    config = ol.llama_config(run)
    shards = ol.shard_numels(config, ol.Ranks(0, 2, 0, 2))
    assert 2 * sum(shards) - ol.param_count(config) < 4 * ol.ALIGN * len(shards)  # half a model each, padded
    plans = {gib: ol.make_plan(run, config, machine(host_gib=gib, world=2)) for gib in (110, 126)}
    assert plans[110].copy_dtype == "bfloat16" and plans[110].host["float32 masters"] == 4 * sum(shards)
    assert plans[126].grad_buffers == len(shards) and plans[126].host["gradient buffers"] == 4 * sum(shards)


def test_a_placement_past_the_cap_is_refused_on_every_rank_alike():
    """Under a cap that holds the least a rank needs but not its placement: the same one line on every rank, before
    anything is allocated, not an OOM on one rank that leaves the others waiting."""
    lines = set()
    for rank in range(2):
        run = ol.RunConfig(preset="7b-8l", mode="overlapped", train=True, inference=False, grad_accum=2)
        run = ol.dataclasses.replace(run, max_gpu_memory=3, ranks=ol.Ranks(rank, 2, rank, 2))
        with pytest.raises(ol.UsageError, match=r"mode overlapped: the plan needs 3\.7 GiB of GPU memory a rank") as e:
            planned(run, machine(world=2))
        lines.add(str(e.value))
    assert len(lines) == 1


def test_the_rank_timeout_follows_the_plan_or_the_flag():
    """The steps' collectives wait 5 times the plan's longest step part, 60 s at least; --rank-timeout says else."""
    run = ol.parse_args(
        ["--preset", "llama-7b", "--mode", "overlapped", "--train", "--nvme", "/tmp", "--nvme-layers", "30"]
    )
    plan = ol.make_plan(run, ol.llama_config(run), machine())
    assert plan.rank_timeout == math.ceil(5 * max(plan.modes["overlapped"].bound_ms.values()) / 1e3) > 60
    assert (
        ol.make_plan(ol.parse_args(["--mode", "overlapped", "--train"]), ol.llama_config(run), machine()).rank_timeout
        == 60
    )
    timed = ol.parse_args(["--mode", "overlapped", "--train", "--rank-timeout", "7"])
    assert timed.rank_timeout == 7 and ol.make_plan(timed, ol.llama_config(run), machine()).rank_timeout == 7


def test_an_error_of_a_ranks_own_is_its_own_with_its_place():
    """A collective's failure because another rank ended is said as such; any other error is this rank's, with the
    place in the script it was raised at (also one that torch.distributed raises, for a call it refuses)."""
    ranks = ol.Ranks(1, 2, 1, 2)
    lost = RuntimeError("[../third_party/gloo/gloo/transport/tcp/pair.cc:534] Connection closed by peer [127.0.0.1]:1")
    assert ol.lost_ranks(ranks, lost).startswith("rank 1 of 2 stops: another rank ended, or stalled past the timeout")
    errors = []
    for fails in (lambda: ol.Ranks(0, 2, 0, 2).shard_numel(None), lambda: ol.Ranks(0, 2, 0, 2).each(1)):  # no group
        try:
            fails()
        except Exception as e:
            errors.append(e)
    assert [ol.lost_ranks(ranks, e) for e in errors] == [None, None]
    lines = [ol.own_error(ranks, e) for e in errors]
    assert lines[0].startswith("rank 1 of 2 stops: TypeError: ") and "(offload_llama.py:" in lines[0]
    assert lines[0].endswith(", in shard_numel)") and lines[1].endswith(", in each)")


def rank_inference(rank, world, port, depth, out):
    """One rank: the offloaded forward, this rank copying its shard of each layer, the others' gathered; its logits
    saved."""
    model, ids = build(tiny_run())  # outside inference mode: the draw's threads write the weights in place
    with joined(rank, world, port) as ranks, torch.inference_mode():
        store = ol.param_store_of(ranks, model, pin=False)
        shell = ol.offloaded_model(model, ol.layer_streamer(store, model.config, CPU, depth), CPU)
        torch.save({"shard": store.flats[0].numel(), "logits": ol.logits_of(shell, ids)}, out / f"{rank}.pt")


@pytest.mark.parametrize("world", [2, pytest.param(3, marks=SLOW)])
def test_ranks_run_the_forward_each_copying_its_shard_of_every_layer(tmp_path, world):
    """Every rank runs the whole batch through every layer, copying 1/world of each (its shard: the layer's elements
    split evenly, padded) and gathering the rest: each rank's logits equal Hugging Face's forward, bit for bit."""
    mp.spawn(rank_inference, args=(world, free_port(), world - 1, tmp_path), nprocs=world)
    model, ids = build(tiny_run())
    with torch.inference_mode():
        expected = model(ids).logits
    layer = ol.FlatLayout.of(model.model.layers[0]).numel
    for rank in range(world):
        saved = torch.load(tmp_path / f"{rank}.pt")
        assert saved["shard"] * world >= layer > (saved["shard"] - ol.ALIGN) * world  # a share, not the whole layer
        assert torch.equal(saved["logits"], expected), rank
