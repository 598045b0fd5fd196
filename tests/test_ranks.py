"""Several ranks on the CPU, gloo between them, as torchrun starts them: sharded host state, all-gathered units,
reduce-scattered gradients, against one process training on every micro-batch."""

import os
import socket

import pytest
import torch
import torch.multiprocessing as mp

import offload_llama as ol
from helpers import assert_masters_close, build, run_main, tiny_run

CPU = torch.device("cpu")
STEPS = 3


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def trainer_of(model, micro_batches, world_batches, depth, ranks=None, clip=None):
    """Offloaded training of `model` on the CPU, its store this rank's shards; world_batches: the step's micro-batches
    over every rank (they set the gradients' dtype and the loss's divisor); clip: --clip-grad-norm."""
    dtype = next(model.parameters()).dtype
    run = ol.RunConfig(dtype=str(dtype).removeprefix("torch."), grad_accum=world_batches)
    copy_dtype = dtype if dtype != torch.float32 else None
    units = ol.model_units(model.config)
    scaled = clip is not None
    args = (units, ol.Adam(lr=1e-3), False, None, ol.gradient_dtype(run), copy_dtype, scaled)
    store = ol.MasterStore(*args, ranks=ranks)
    store.load(model)
    kwargs = ol.decoder_kwargs(model, tuple(micro_batches[0].shape), dtype, CPU)
    return ol.OffloadedTraining(store, model.config, dtype, CPU, depth, model.loss_function, kwargs, clip)


def trained(trainer, micro_batches, overflow_at=None):
    """(losses, final masters, gradient norms, loss scales) of STEPS steps; overflow_at: the step whose gradients
    get an inf (in the first layer's, on this process)."""
    unit_grads, losses, scales = trainer.unit_grads, [], []
    for i in range(STEPS):

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


def rank_main(rank, world, port, dtype, k, depth, out, clip=None, overflow_at=None):
    """One rank: joins the others as torchrun's environment says, trains on its share, rank 0 saves the result."""
    env = {"RANK": rank, "WORLD_SIZE": world, "LOCAL_RANK": rank, "LOCAL_WORLD_SIZE": world}
    os.environ.update({key: str(value) for key, value in env.items()} | {"MASTER_ADDR": "127.0.0.1"})
    os.environ["MASTER_PORT"] = str(port)
    torch.set_num_threads(1)
    ranks = ol.Ranks.from_environment()
    ol.start_ranks(ranks)
    try:
        model, ids = build(ol.dataclasses.replace(tiny_run(), dtype=dtype, batch_size=world * k))
        batches = list(ids.chunk(world * k))
        trainer = trainer_of(model, ranks.share(batches), len(batches), depth, ranks, clip)
        result = trained(trainer, ranks.share(batches), overflow_at if rank == world - 1 else None)
        if rank == 0:
            torch.save(result, out)
    finally:
        ol.stop_ranks()


@pytest.mark.parametrize(
    ("world", "dtype", "k", "depth"), [(2, "float32", 1, 1), (2, "bfloat16", 2, 0), (3, "bfloat16", 1, 1)]
)
def test_ranks_train_as_one_process_on_every_micro_batch(tmp_path, world, dtype, k, depth):
    """world ranks with k micro-batches each: masters to float32 rounding of one process with world x k micro-batches,
    losses to 1e-6 relative."""
    out = tmp_path / "ranks.pt"
    mp.spawn(rank_main, args=(world, free_port(), dtype, k, depth, out), nprocs=world)
    losses, masters, _, _ = torch.load(out)
    model, ids = build(ol.dataclasses.replace(tiny_run(), dtype=dtype, batch_size=world * k))
    batches = list(ids.chunk(world * k))
    ref_losses, ref_masters, _, _ = trained(trainer_of(model, batches, len(batches), depth), batches)
    assert masters.keys() == ref_masters.keys()
    assert_masters_close(masters, ref_masters, STEPS)
    assert losses == pytest.approx(ref_losses, rel=1e-6)


def test_ranks_clip_by_the_norm_of_every_shard_as_one_process_does(tmp_path):
    """--clip-grad-norm over 2 ranks: each step's norm that of the whole gradient (each rank's shards' squares summed),
    as clip_grad_norm_ takes it in one process, to float32 rounding, and the same clipped masters."""
    out = tmp_path / "ranks.pt"
    mp.spawn(rank_main, args=(2, free_port(), "float32", 1, 1, out, 0.05), nprocs=2)
    losses, masters, norms, _ = torch.load(out)
    model, ids = build(ol.dataclasses.replace(tiny_run(), dtype="float32", batch_size=2))
    batches = list(ids.chunk(2))
    ref_losses, ref_masters, ref_norms, _ = trained(trainer_of(model, batches, 2, 1, clip=0.05), batches)
    assert len(norms) == STEPS and norms == pytest.approx(ref_norms, rel=1e-6)
    assert max(norms) > 0.05  # the steps were clipped
    assert_masters_close(masters, ref_masters, STEPS)
    assert losses == pytest.approx(ref_losses, rel=1e-6)


def test_a_step_that_overflows_on_one_rank_is_skipped_on_every_rank(tmp_path):
    """float16 over 2 ranks, the second step's gradients overflowing on rank 1 alone: both ranks skip it and halve the
    loss scale, so the masters are those of one process whose second step overflowed."""
    out = tmp_path / "ranks.pt"
    mp.spawn(rank_main, args=(2, free_port(), "float16", 1, 1, out, None, 1), nprocs=2)
    losses, masters, _, scales = torch.load(out)
    model, ids = build(ol.dataclasses.replace(tiny_run(), dtype="float16", batch_size=2))
    batches = list(ids.chunk(2))
    ref_losses, ref_masters, _, ref_scales = trained(trainer_of(model, batches, 2, 1), batches, overflow_at=1)
    assert scales == ref_scales and scales[1] == scales[0] / 2
    assert_masters_close(masters, ref_masters, STEPS)
    assert losses == pytest.approx(ref_losses, rel=1e-3)  # float16 losses


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["--mode", "overlapped"], "ranks, which train together: add --train"),
        (["--mode", "all", "--train"], "--mode all: 2 ranks train an offloaded mode"),
        (["--mode", "overlapped", "--train", "--grad-accum", "3"], "split evenly over the 2 ranks: use a multiple"),
        (["--mode", "overlapped", "--train", "--grad-accum", "2", "--gpu-adam-share", "0.2"], "--gpu-adam-share runs"),
        (["--mode", "overlapped", "--train", "--grad-accum", "2", "--resident-layers", "1"], "--resident-layers runs"),
        (["--mode", "overlapped", "--train", "--grad-accum", "2", "--nvme", "/tmp"], "--nvme runs on one GPU"),
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
