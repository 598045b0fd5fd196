"""Several ranks on the CPU, gloo between them, as torchrun starts them: sharded host state, all-gathered units,
reduce-scattered gradients, against one process training on every micro-batch."""

import contextlib
import os
import socket
import time

import pytest
import torch
import torch.multiprocessing as mp
from test_data import data_run

import offload_llama as ol
from helpers import assert_masters_close, build, run_main, tiny_run

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


def trainer_of(model, micro_batches, world_batches, depth, ranks=None, clip=None, gpu_adam=(), disk=None):
    """Offloaded training of `model` on the CPU, its store this rank's shards; world_batches: the step's micro-batches
    over every rank (they set the gradients' dtype and the loss's divisor); clip: --clip-grad-norm; gpu_adam: the
    units the device's Adam steps over their state streamed from the host (StreamedAdam); disk: (folder, units)
    whose moments a disk tier keeps there (this rank's shards of them)."""
    dtype = next(model.parameters()).dtype
    run = ol.RunConfig(dtype=str(dtype).removeprefix("torch."), grad_accum=world_batches)
    copy_dtype = dtype if dtype != torch.float32 else None
    units = ol.model_units(model.config)
    scaled = clip is not None
    args = (units, ol.Adam(lr=1e-3), False, None, ol.gradient_dtype(run), copy_dtype, scaled)
    ranks = ranks or ol.Ranks()
    tier = ol.DiskTier(disk[0], {u: ranks.shard_numel(units[u].layout.numel) for u in disk[1]}) if disk else None
    store = ol.MasterStore(*args, tier, ranks)
    store.load(model)
    kwargs = ol.decoder_kwargs(model, tuple(micro_batches[0].shape), dtype, CPU)
    trainer = ol.OffloadedTraining(store, model.config, dtype, CPU, depth, model.loss_function, kwargs, clip)
    if gpu_adam:
        trainer.place((), gpu_adam, own_grads=False)
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


def join(rank, world, port) -> ol.Ranks:
    """This process as rank `rank` of `world`, joined to the others as torchrun's environment says."""
    env = {"RANK": rank, "WORLD_SIZE": world, "LOCAL_RANK": rank, "LOCAL_WORLD_SIZE": world}
    os.environ.update({key: str(value) for key, value in env.items()} | {"MASTER_ADDR": "127.0.0.1"})
    os.environ["MASTER_PORT"] = str(port)
    torch.set_num_threads(1)
    ranks = ol.Ranks.from_environment()
    ol.start_ranks(ranks)
    return ranks


@contextlib.contextmanager
def joined(rank, world, port):
    """This process as rank `rank` of `world` (join), for the block; then it leaves the others."""
    try:
        yield join(rank, world, port)
    finally:
        ol.stop_ranks()


def rank_main(rank, world, port, dtype, k, depth, out, clip=None, overflow_at=None, gpu_adam=(), disk=None):
    """One rank: trains on its share of the step's micro-batches, rank 0 saves the result."""
    with joined(rank, world, port) as ranks:
        model, batches = tiny_batches(dtype, world * k)
        trainer = trainer_of(model, ranks.share(batches), len(batches), depth, ranks, clip, gpu_adam, disk)
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
        (["--mode", "overlapped"], "ranks, which train together: add --train"),
        (["--mode", "all", "--train"], "--mode all: 2 ranks train an offloaded mode"),
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


@pytest.mark.parametrize(
    ("saved", "now", "advice"), [(2, 1, "under torchrun with 2 ranks"), (1, 3, "without torchrun")]
)
def test_a_checkpoint_resumes_with_as_many_ranks_as_wrote_it(tmp_path, saved, now, advice):
    """A checkpoint of 2 ranks resumed by one process, or one process's by 3 ranks: refused with one line."""
    run = ol.RunConfig(preset="tiny", dtype="float32")
    manifest = ol.checkpoint_manifest(run, ol.llama_config(run), "overlapped")
    record = {**manifest, "files": [], "steps": 1} | ({"ranks": saved} if saved > 1 else {})
    (tmp_path / ol.CHECKPOINT_FILE).write_text(ol.json.dumps(record))
    with pytest.raises(ol.UsageError, match=f"a checkpoint of {saved} rank.*this run has {now}: resume {advice}"):
        ol.read_checkpoint(tmp_path, manifest | ({"ranks": now} if now > 1 else {}))


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
    """One rank: a whole step, then rank 1 ends (or stalls) in the next step's backward; rank 0 saves how long its
    step took to fail and the line it ends on, and leaves at once (main's way)."""
    ranks = join(rank, world, port)
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


@SLOW
@pytest.mark.parametrize("stalls", [False, True])
def test_a_rank_that_ends_or_stalls_mid_step_ends_the_others_in_one_line(tmp_path, stalls):
    """Rank 1 of 2 ends mid-step (its connection drops), or stalls: rank 0's step fails at once, or after
    RANK_TIMEOUT, never hangs (every step collective is in the group with that timeout); its one line says so."""
    out = tmp_path / "lost.pt"
    context, port = mp.get_context("spawn"), free_port()
    ranks = [context.Process(target=rank_lost, args=(r, 2, port, stalls, out), daemon=True) for r in range(2)]
    for process in ranks:
        process.start()
    ranks[0].join(timeout=ol.RANK_TIMEOUT + 90)  # setting up takes 10 to 20 s
    for process in ranks:
        process.kill()
    lost = torch.load(out)
    assert lost["seconds"] < (ol.RANK_TIMEOUT + 10 if stalls else 10)
    assert lost["line"].startswith("rank 0 of 2 stops: another rank ended, or stalled past the timeout"), lost["line"]


def rank_plan(rank, world, port, out):
    """One rank: its own measurements and budget (rank 1 measures more and has less); rank 0 saves what they agree."""
    with joined(rank, world, port) as ranks:
        agreed = ol.agreed_plan(ranks, {"saved inputs": 10 + rank, "other": 7 - rank}, 100 - rank)
        if rank == 0:
            torch.save(agreed, out)


@SLOW
def test_every_rank_plans_from_the_largest_measurements_and_the_smallest_budget(tmp_path):
    """The placement's inputs agreed over 2 ranks, so both make one plan: each part's largest, the smallest budget."""
    out = tmp_path / "plan.pt"
    mp.spawn(rank_plan, args=(2, free_port(), out), nprocs=2)
    assert torch.load(out) == ({"saved inputs": 11, "other": 7}, 99)
    assert ol.agreed_plan(ol.Ranks(), {"other": 3}, None) == ({"other": 3}, None)  # one process: its own
