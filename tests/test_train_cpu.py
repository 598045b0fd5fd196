"""CPU tier, training: the offloaded path (per-unit autograd.Function, gradient offload, CPU Adam) with the CPU as
compute device, against the plain model and torch.optim.Adam."""

import itertools
import json
import threading
import time
import warnings

import pytest
import torch

import offload_llama as ol
from helpers import (
    assert_losses_match,
    assert_masters_close,
    build,
    cli,
    host_for,
    machine,
    offloaded_trainer,
    planned,
    reference_trainer,
    run_main,
    table_cells,
    tiny_run,
    train,
)

CPU = torch.device("cpu")


def micro(ids, k):
    return list(ids.chunk(k))


def tiny_batches(k):
    """The tiny model in bfloat16 and k micro-batches of 2 x 48 tokens."""
    model, ids = build(ol.dataclasses.replace(tiny_run(), batch_size=2 * k))
    return model, micro(ids, k)


@pytest.mark.parametrize("k", [1, 2])
@pytest.mark.parametrize("depth", [0, 1, 2])
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_offloaded_training_equals_resident(dtype, depth, k):
    model, ids = build(ol.dataclasses.replace(tiny_run(), dtype=dtype, batch_size=2))
    batches = micro(ids, k)
    grads, _, masters, losses = train(offloaded_trainer(model, CPU, depth, batches), batches, 3)
    ref_grads, _, ref_masters, ref_losses = train(reference_trainer(model, CPU, ol.Adam(lr=1e-3)), batches, 3)
    assert grads.keys() == ref_grads.keys() == {name for name, _ in model.named_parameters()}
    for name, g in grads.items():
        assert torch.equal(g, ref_grads[name]), name
    assert_masters_close(masters, ref_masters, 3)
    assert_losses_match(losses, ref_losses, dtype)


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_resident_units_whose_masters_live_on_the_device_alone_train_bit_for_bit_alike(dtype):
    """A unit resident in every mode keeps its float32 master on the device alone: the host holds a meta tensor in
    its place and no copy, the resident unit steps the store's master itself, and the training is bit for bit that of
    the resident units that copy their host masters; at the mode's end the device memory is given back, and the next
    mode trains from the same store alike."""
    model, ids = build(ol.dataclasses.replace(tiny_run(), dtype=dtype, batch_size=2))
    batches, resident = micro(ids, 1), (0, 1, 2)
    copied = train(offloaded_trainer(model, CPU, 1, batches, resident=resident), batches, 3)
    trainer = offloaded_trainer(model, CPU, 1, batches, resident=resident, masters_on_device=True)
    store, on_gpu = trainer.store, trainer.steppers.of[1]
    assert all(store.masters[u] is on_gpu.units[u].master for u in resident)
    assert all(store.copies is None or store.copies[u].is_meta for u in resident)
    assert not any(store.masters[u].is_meta for u in range(len(store.units)))
    alone = train(trainer, batches, 3)
    ol.masters_off_device(store)
    assert [u for u, master in enumerate(store.masters) if master.is_meta] == list(resident)
    ol.masters_to_device(store)  # the next mode's start, from the same store: as run_modes does
    store.load(model)
    kwargs = ol.decoder_kwargs(model, tuple(batches[0].shape), model.dtype, CPU)
    second = ol.OffloadedTraining(store, model.config, model.dtype, CPU, 1, model.loss_function, kwargs)
    ol.place_on_gpu(second, resident, (), True)
    again = train(second, batches, 3)
    for run in (alone, again):
        for got, expected in zip(run, copied, strict=True):
            assert got == expected if isinstance(got, list) else all(torch.equal(got[n], expected[n]) for n in expected)


@pytest.mark.parametrize("k", [1, 2])
@pytest.mark.parametrize("depth", [0, 1, 2])
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_units_that_keep_their_graphs_train_as_those_recomputed(dtype, depth, k):
    """Units whose forward keeps its graph (every other one: its weights' views outlive other units in its slot) and
    the rest recomputed: the same gradients, masters and losses, bit for bit, as every unit recomputed."""
    model, ids = build(ol.dataclasses.replace(tiny_run(), dtype=dtype, batch_size=2))
    batches = micro(ids, k)
    units = len(ol.model_units(model.config))
    for keep in (range(0, units, 2), range(1, units, 2)):
        kept = train(offloaded_trainer(model, CPU, depth, batches, keep=keep), batches, 3)
        recomputed = train(offloaded_trainer(model, CPU, depth, batches), batches, 3)
        for ours, theirs in zip(kept[:3], recomputed[:3], strict=True):
            assert all(torch.equal(t, theirs[name]) for name, t in ours.items())
        assert kept[3] == recomputed[3]


def scheduled(trainer, optimizer, batches, steps):
    """train()'s results with an LR schedule on `optimizer`: the lr halved after each step."""
    schedule = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: 0.5**step)
    step = trainer.step
    trainer.step = lambda micro_batches: (step(micro_batches), schedule.step())[0]
    return train(trainer, batches, steps)


@pytest.mark.parametrize("depth", [0, 1])
def test_an_lr_scheduler_steers_the_offloaded_adam_as_torch_adam(depth):
    """OffloadedAdam is the optimizer an LR scheduler steps: the lr it sets in param_groups is the next step's, as
    with torch.optim.Adam; overlapped's updates still running keep the last step's."""
    model, ids = build(ol.dataclasses.replace(tiny_run(), dtype="float32", batch_size=2))
    batches = micro(ids, 1)
    trainer = offloaded_trainer(model, CPU, depth, batches)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        _, _, masters, losses = scheduled(trainer, trainer.store, batches, 4)
    assert not [w for w in caught if "lr_scheduler.step()" in str(w.message)]  # the trainer calls the optimizer's step
    reference = reference_trainer(model, CPU, ol.Adam(lr=1e-3))
    _, _, ref_masters, ref_losses = scheduled(reference, reference.optimizer, batches, 4)
    assert trainer.store.param_groups[0]["lr"] == reference.optimizer.param_groups[0]["lr"] == 1e-3 / 16
    assert_masters_close(masters, ref_masters, 4)
    assert_losses_match(losses, ref_losses, "float32")
    _, _, unscheduled, _ = train(offloaded_trainer(model, CPU, depth, batches), batches, 4)
    assert any(not torch.equal(m, unscheduled[name]) for name, m in masters.items())


def test_the_offloaded_adams_state_dict_is_refused_for_the_checkpoint_folder():
    """torch's state_dict would hold OffloadedAdam's step counts without its moments: refused, naming --checkpoint."""
    model, batches = tiny_batches(1)
    trainer = offloaded_trainer(model, CPU, 1, batches)
    try:
        with pytest.raises(NotImplementedError, match="--checkpoint DIR"):
            trainer.store.state_dict()
        with pytest.raises(NotImplementedError, match="--resume DIR"):
            trainer.store.load_state_dict({})
    finally:
        trainer.finish()


def test_streaming_the_masters_without_a_copy_trains_the_same():
    """bfloat16 without the masters' bfloat16 copy: the float32 masters are streamed and cast, the same bits."""
    model, batches = tiny_batches(1)
    with_copy = train(offloaded_trainer(model, CPU, 1, batches), batches, 3)
    without = train(offloaded_trainer(model, CPU, 1, batches, copy=False), batches, 3)
    for ours, theirs in zip(without[:3], with_copy[:3], strict=False):
        assert all(torch.equal(t, theirs[name]) for name, t in ours.items())
    assert without[3] == with_copy[3]


def test_blocked_steps_every_unit_before_its_step_returns():
    """blocked is the naive offload: the host's Adam steps every unit after the backward, and the step waits for it,
    so each unit's step count is up as soon as the step returns (overlapped's updates may still run then)."""
    model, ids = build(ol.dataclasses.replace(tiny_run(), dtype="float32"))
    trainer = offloaded_trainer(model, CPU, 0, [ids])
    try:
        for step in (1, 2):
            trainer.step([ids])
            assert [int(s) for s in trainer.store.steps] == [step] * len(trainer.units)
    finally:
        trainer.finish()
    with pytest.raises(ValueError, match="blocked steps every unit after the backward"):
        offloaded_trainer(model, CPU, 0, [ids], grad_buffers=2)


def test_a_finished_trainer_refuses_another_step_instead_of_hanging():
    """After finish() the CPU Adam's worker is gone: another step raises at its first update, where its next forward
    would have waited forever for an update nobody runs."""
    model, batches = tiny_batches(1)
    trainer = offloaded_trainer(model, CPU, 1, batches)
    trainer.step(batches)
    trainer.finish()
    outcome = []

    def step():
        try:
            trainer.step(batches)
        except RuntimeError as e:
            outcome.append(str(e))

    thread = threading.Thread(target=step, daemon=True)
    thread.start()
    thread.join(30)
    assert len(outcome) == 1 and "worker has stopped" in outcome[0], outcome


class Recorded(ol.InOrder):
    """The compute stream's stand-in, noting in `log` when the host waits for it."""

    def __init__(self, log):
        self.log = log

    def synchronize(self) -> None:
        self.log.append("backward done")


@pytest.mark.parametrize("depth", [0, 1])
def test_blocked_hands_no_unit_to_adam_before_the_whole_backward_is_done(depth):
    """Blocked's host waits for the compute stream (all the backward and its gradient copies) before the first update
    is handed to the CPU Adam, so the Adam overlaps no GPU work; overlapped hands each unit over as it lands."""
    model, ids = build(ol.dataclasses.replace(tiny_run(), dtype="float32"))
    trainer = offloaded_trainer(model, CPU, depth, [ids])
    log = []
    trainer.streamer.compute_stream = Recorded(log)
    update = trainer.steppers.update
    trainer.steppers.update = lambda u, multiplier: log.append(u) or update(u, multiplier)
    try:
        trainer.step([ids])
    finally:
        trainer.finish()
    units = list(reversed(range(len(trainer.units))))
    assert log == (["backward done", *units] if depth == 0 else units), log


def test_the_resident_model_recomputed_trains_as_the_plain_one():
    """gpu mode's recomputed row: each decoder layer recomputed in its backward, the same losses and masters."""
    run = ol.dataclasses.replace(tiny_run(), dtype="float32", attention="eager")
    model, ids = build(run)
    results = []
    for recompute in (False, True):
        trainer = ol.ResidentTraining(model, CPU, ol.Adam(lr=1e-3), recompute=recompute)
        losses = [trainer.step(list(ids.chunk(2))).item() for _ in range(3)]
        results.append((losses, trainer.state_dict(trainer.masters)))
    (plain, plain_masters), (recomputed, masters) = results
    assert recomputed == plain and all(torch.equal(masters[k], plain_masters[k]) for k in masters)


@pytest.mark.parametrize("k", [1, 2])
@pytest.mark.parametrize("depth", [1, 2])  # overlapped: blocked steps every unit on the CPU Adam
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_adam_over_streamed_state_trains_as_the_cpu_adam(dtype, depth, k, monkeypatch):
    """Units the device's Adam steps over state streamed from the host, in chunks of 1000 through two slots taken in
    turn (the first layer's 3 of them): the same gradients as the CPU Adam's run, masters to float32 rounding
    (torch's fused kernel against the compiled update), the same losses."""
    monkeypatch.setattr(ol, "GPU_ADAM_CHUNK", 1000)
    model, ids = build(ol.dataclasses.replace(tiny_run(), dtype=dtype, batch_size=2))
    batches = micro(ids, k)
    ref_grads, _, ref_masters, ref_losses = train(offloaded_trainer(model, CPU, depth, batches), batches, 3)
    trainer = offloaded_trainer(model, CPU, depth, batches, gpu_adam=(0, 5, 1))
    assert len(ol.streamed_adam(trainer).chunks(1)) >= 3
    grads, _, masters, losses = train(trainer, batches, 3)
    assert all(torch.equal(g, ref_grads[name]) for name, g in grads.items())
    assert_masters_close(masters, ref_masters, 3)
    assert_losses_match(losses, ref_losses, dtype)


def test_adam_over_streamed_state_takes_the_embeddings_then_the_first_layers_and_the_head_last():
    config = ol.llama_config(ol.RunConfig(preset="7b-8l"))
    units = ol.model_units(config)  # embeddings, 8 layers, norm, head; a layer is 10.7% of the parameters
    assert ol.gpu_adam_units(units, (), 0.3) == (0, 1, 2)
    assert ol.gpu_adam_units(units, (), 0.4) == (0, 1, 2, 3)
    assert ol.gpu_adam_units(units, (), 0.0) == ()
    assert ol.gpu_adam_units(units, (0, 1, 2), 0.4) == (3, 4)  # of the streamed ones, the resident ones left out
    assert ol.gpu_adam_units(units, (), 1.0) == (0, *range(1, 9), 10)  # the norm stays on the CPU Adam
    assert ol.RunConfig(dtype="float16").gpu_adam == 0 and ol.RunConfig().gpu_adam == ol.GPU_ADAM_SHARE


def test_float16_keeps_every_streamed_unit_on_the_cpu_adam():
    model, batches = tiny_batches(1)
    model = model.to(torch.float16)
    with pytest.raises(ValueError, match="float16"):
        offloaded_trainer(model, CPU, 1, batches, gpu_adam=(0,))


def test_resident_training_is_torch_adam():
    """The reference recipe in float32 is plain training with torch.optim.Adam on the model's own parameters."""
    model, ids = build(ol.dataclasses.replace(tiny_run(), dtype="float32"))
    grads, _, masters, _ = train(ol.ResidentTraining(model, CPU, ol.Adam(lr=1e-3)), [ids], 3)
    plain = ol.copy.deepcopy(model)
    optimizer = torch.optim.Adam(plain.parameters(), lr=1e-3)
    for step in range(3):
        optimizer.zero_grad()
        plain(ids, labels=ids, use_cache=False).loss.backward()
        if step == 0:
            for name, p in plain.named_parameters():
                assert torch.equal(grads[name], p.grad), name
        optimizer.step()
    assert_masters_close(masters, dict(plain.named_parameters()), 3)


@pytest.mark.parametrize("depth", [0, 1, 2])
def test_backward_pass_reuses_the_units_the_forward_left_in_the_slots(depth):
    model, ids = build(tiny_run())
    trainer = offloaded_trainer(model, CPU, depth, [ids])
    streamer, copies = trainer.streamer, []
    wait_source = streamer.writer.wait_written  # called once per unit copied
    streamer.writer.wait_written = lambda u: (copies.append(u), wait_source(u))
    n = len(trainer.units)
    for _ in range(2):
        copies.clear()
        trainer.step([ids])
        # the forward copies a unit whose update is done ahead of one whose update still runs
        assert sorted(copies[:n]) == list(range(n))
        assert copies[n:] == list(reversed(range(n - streamer.n_slots)))
    trainer.finish()


def test_grad_accumulation_equals_one_big_batch():
    # sums in another order differ in rounding, and Adam's first step moves lr * g / (|g| + eps), which a change dg in
    # g moves by up to lr / eps * dg: with gradients near the default eps (1e-8) that rounding turns into lr-sized
    # moves, and near 1e-6 a gradient of 4e-7 that two sums put 2e-9 apart moved its master by 1e-6, past the
    # tolerance. At 1e-4 a dg of 1e-8 moves a master by 1e-7 at most: float32-close gradients, float32-close masters
    adam = ol.Adam(lr=1e-3, eps=1e-4)
    model, ids = build(ol.dataclasses.replace(tiny_run(), dtype="float32", batch_size=4))
    grads, _, masters, _ = train(offloaded_trainer(model, CPU, 1, micro(ids, 4), adam), micro(ids, 4), 2)
    big_grads, _, big_masters, _ = train(ol.ResidentTraining(model, CPU, adam), [ids], 2)
    for name, g in grads.items():
        torch.testing.assert_close(g, big_grads[name], rtol=1e-5, atol=1e-7, msg=name)
    assert_masters_close(masters, big_masters, 2)


@pytest.mark.parametrize("k", [1, 2, 3])
def test_a_units_gradients_are_first_written_after_two_micro_batches(k):
    """The buffer's first write of a unit's gradients waits for the last unit's to leave it: unit_backward makes it
    after the second micro-batch's backward (the first's held till then, the sum the same), after the only one's with
    one micro-batch; the other micro-batches' follow it."""
    model, batches = tiny_batches(k)
    trainer = offloaded_trainer(model, CPU, 1, batches)
    calls = []
    unit_grads, wait_to_write = trainer.unit_grads, trainer.steppers.wait_to_write
    trainer.unit_grads = lambda u, *args: calls.append(("grads", u)) or unit_grads(u, *args)
    trainer.steppers.wait_to_write = lambda u, stream: calls.append(("write", u)) or wait_to_write(u, stream)
    trainer.step(batches)
    trainer.finish()
    for u in range(len(trainer.units)):
        first = min(k, 2)
        assert [what for what, unit in calls if unit == u] == ["grads"] * first + ["write"] + ["grads"] * (k - first)


def test_loss_decreases_over_10_steps():
    model, ids = build(tiny_run())
    *_, losses = train(offloaded_trainer(model, CPU, 1, [ids]), [ids], 10)
    assert all(b < a for a, b in zip(losses, losses[1:], strict=False)), losses


def test_float16_skips_the_step_whose_gradients_overflow():
    model, ids = build(ol.dataclasses.replace(tiny_run(), dtype="float16"))
    trainer = offloaded_trainer(model, CPU, 1, [ids])
    scale = trainer.scaling.scale
    before = trainer.store.named_flats()
    unit_grads = trainer.unit_grads

    def overflowing(u, *args):  # one element of layer 1's gradients is inf
        grad_in, grads = unit_grads(u, *args)
        if u == 2:
            grads[0].view(-1)[0] = float("inf")
        return grad_in, grads

    trainer.unit_grads = overflowing
    trainer.step([ids])
    trainer.steppers.cpu_adam.wait_all()
    after = trainer.store.named_flats()
    assert all(torch.equal(after[name], m) for name, m in before.items()), "an overflowing step must not update"
    assert trainer.scaling.scale == scale / 2
    trainer.unit_grads = unit_grads
    trainer.step([ids])
    trainer.finish()
    assert not torch.equal(trainer.store.named_flats()["lm_head.weight"], before["lm_head.weight"])


def test_master_store_holds_16_bytes_per_parameter():
    """bfloat16, one micro-batch: float32 master and two Adam moments, the gradients and the masters' copy in bfloat16;
    alignment padding is under 0.1% at 7B sizes."""
    config = ol.llama_config(ol.RunConfig(preset="7b-8l"))
    units = ol.model_units(config)
    padded = sum(u.layout.numel for u in units)
    assert padded < 1.001 * ol.param_count(config)
    model, ids = build(tiny_run())
    trainer = offloaded_trainer(model, CPU, 1, [ids])
    trainer.step([ids])
    trainer.finish()
    store = trainer.store
    state = [t for pair in store.moments for t in pair]
    assert [g.dtype for g in store.grads] == [c.dtype for c in store.copies] == [torch.bfloat16] * len(store.units)
    total = sum(t.nbytes for t in store.masters + store.grads + store.copies + state)
    assert total == 16 * sum(u.layout.numel for u in store.units)


def test_cli_train_json_and_saved_masters(tmp_path):
    out, saved = tmp_path / "r.json", tmp_path / "out.pt"
    r = cli(
        "--preset",
        "tiny",
        "--seq-len",
        "32",
        "--mode",
        "cpu",
        "--train",
        "--steps",
        "3",
        "--grad-accum",
        "2",
        "--json",
        out,
        "--save-output",
        saved,
    )
    assert r.returncode == 0, r.stderr
    assert "Table 2 (training)" in r.stdout and "step 2: loss" in r.stderr
    t = json.loads(out.read_text())["results"]["cpu"]["training"]
    assert len(t["losses"]) == 3 and t["tokens_per_step"] == 64 and t["peak_host_bytes"] > 0
    masters = torch.load(saved)["training"]["cpu"]["masters"]
    assert masters["model.layers.0.mlp.up_proj.weight"].dtype == torch.float32


@pytest.mark.parametrize(
    "args, message",
    [
        (["--steps", "0"], "--steps must be at least 1"),
        (["--grad-accum", "0"], "--grad-accum must be at least 1"),
        (["--lr", "-1"], "Adam needs --lr > 0"),
        (["--betas", "0.9", "1.0"], "betas in [0, 1)"),
        (["--gpu-adam-share", "1.5"], "--gpu-adam-share must be between 0 and 1"),
        (["--gpu-adam-share", "0.2", "--dtype", "float16"], "--gpu-adam-share must be 0 in float16"),
        (["--clip-grad-norm", "0"], "--clip-grad-norm must be a positive number"),
        (["--clip-grad-norm", "nan"], "--clip-grad-norm must be a positive number"),
        (["--clip-grad-norm", "1", "--gpu-adam-share", "0.3"], "--gpu-adam-share must be 0 with --clip-grad-norm"),
    ],
)
def test_bad_training_flags(args, message, capsys):
    code, _, err = run_main(capsys, "--preset", "tiny", "--mode", "cpu", "--train", *args)
    assert code == 2 and message in err and len(err.strip().splitlines()) == 1, err


def test_train_refuses_tied_embeddings(tmp_path, capsys):
    config = ol.LlamaConfig(**ol.PRESETS["tiny"], tie_word_embeddings=True)
    ol.LlamaForCausalLM(config).save_pretrained(tmp_path)
    code, _, err = run_main(capsys, "--model", tmp_path, "--mode", "cpu", "--train", "--seq-len", "64")
    assert code == 2 and "untied embeddings" in err, err


@pytest.mark.parametrize("k", [1, 2])
@pytest.mark.parametrize("depth", [0, 1, 2])
def test_activation_offload_changes_no_bit(depth, k):
    """The units' inputs through the host pool and back: the same gradients, masters and losses as kept in place."""
    model, batches = tiny_batches(k)
    kept = train(offloaded_trainer(model, "cpu", depth, batches), batches, 3)
    offloaded = train(offloaded_trainer(model, "cpu", depth, batches, offload=True), batches, 3)
    for ours, theirs in zip(offloaded[:3], kept[:3], strict=False):
        assert all(torch.equal(t, theirs[name]) for name, t in ours.items())
    assert offloaded[3] == kept[3]


@pytest.mark.parametrize("remake", [False, True])
@pytest.mark.parametrize("k", [1, 2])
@pytest.mark.parametrize("depth, segment", [(0, 2), (1, 2), (1, 3), (2, 4), (1, 99)])
def test_segments_change_no_bit(depth, segment, k, remake):
    """Only each segment's first unit keeping its inputs, each segment's backward run micro-batch by micro-batch from
    them, or the rest remade by running the segment's forwards again: the same gradients, masters and losses as every
    unit keeping its own; the backward copies each unit once a run, and no inputs are left."""
    model, batches = tiny_batches(k)
    kept = train(offloaded_trainer(model, "cpu", depth, batches), batches, 3)
    trainer = offloaded_trainer(model, "cpu", depth, batches, segment=segment, remake=remake)
    copies = []
    prefetch = trainer.streamer.prefetch
    trainer.streamer.prefetch = lambda p: (copies.append(trainer.streamer.window.units[p]), prefetch(p))
    segmented = train(trainer, batches, 3)
    for ours, theirs in zip(segmented[:3], kept[:3], strict=False):
        assert all(torch.equal(t, theirs[name]) for name, t in ours.items())
    assert segmented[3] == kept[3]
    n = len(trainer.units)
    order = trainer.inputs.backward_order(n)
    assert len(copies) == 3 * (n + len(order)) and not trainer.inputs.inputs  # each run asked for; none left
    starts = list(reversed(range(0, n, segment)))
    if remake:
        assert ol.remade_units(order) == [u for u in range(n - 1) if u % segment < segment - 1]
    else:
        assert order == [u for first in starts for u in range(first, min(first + segment, n))]


@pytest.mark.parametrize("remake", [False, True])
def test_segments_keep_no_graphs_and_a_pass_from_the_slots_is_not_run_again(remake):
    """A graph kept over its forward's slot, which a backward in segments may not run from again, is refused; so is
    running again a pass begun from the units the slots hold (its first copies skipped)."""
    model, batches = tiny_batches(1)
    with pytest.raises(ValueError, match="keep no graphs"):
        offloaded_trainer(model, "cpu", 1, batches, keep=(1,), segment=2, remake=remake)
    trainer = offloaded_trainer(model, "cpu", 1, batches, segment=2, remake=remake)
    streamer, n = trainer.streamer, len(trainer.units)
    for order, current in ((range(n), False), (trainer.inputs.backward_order(n), True)):
        streamer.begin(order, current=current)  # the backward from the units the forward left in the slots
        for u in order:
            streamer.acquire(u)
            streamer.release(u)
    assert streamer.window.kept
    with pytest.raises(RuntimeError, match="cannot run again"):
        streamer.acquire(4)
    trainer.finish()


def test_segment_window_reuses_slots_only_past_their_release():
    """A backward that remakes segments runs units twice: each copy goes to a slot last run from at least a ring's
    length of positions back (its release recorded, S2), or the unit is still in its slot and is not copied."""
    for n_slots, segment in itertools.product([1, 2, 3, 4], [1, 2, 3, 5, 8]):
        forward = ol.CopyWindow.over(range(11), (), [None] * n_slots, range(n_slots))
        window = ol.CopyWindow.over(ol.segment_order(11, segment), (), forward.holds, forward.recent)
        last = {}  # slot -> the position last run from it
        for p, s in enumerate(window.slots):
            assert p in window.kept or p - last.get(s, -n_slots) >= n_slots, (n_slots, segment, p)
            last[s] = p


def test_segment_window_copies_only_into_slots_no_unit_of_the_segment_holds():
    """A backward in SegmentGraphs holds a segment's units at once, its copies running as many more ahead: each copy
    issued while a segment is held goes to a slot last run from before the segment began (its release recorded, S2),
    or the unit is still in its slot and is not copied."""
    for depth, segment in itertools.product([0, 1, 2], [1, 2, 3, 5, 8]):
        n_slots, ahead = ol.ring_slots(depth, segment, 11), ol.copies_ahead(depth, segment)
        forward = ol.CopyWindow.over(range(11), (), [None] * n_slots, range(n_slots))
        window = ol.CopyWindow.over(ol.segment_order(11, segment, remade=False), (), forward.holds, forward.recent)
        slots = window.slots  # each position's
        for first in range(0, 11, segment):
            held = [p for p, u in enumerate(window.units) if first <= u < first + segment]  # the segment's positions
            for q in range(held[0], min(held[-1] + ahead + 1, len(slots))):  # those issued while it is held
                taken = [p for p in range(held[0], q) if slots[p] == slots[q]]  # held, or copied and not yet run
                assert q in window.kept or not taken, (depth, segment, q)


def test_activation_pool_is_allocated_once_and_read_back():
    model, batches = tiny_batches(2)
    trainer = offloaded_trainer(model, "cpu", 1, batches, offload=True)
    pool = [t.data_ptr() for t in trainer.inputs.host]
    hidden = model.config.hidden_size
    assert len(pool) == model.config.num_hidden_layers + 2  # the layers', the norm's and the head's inputs
    assert all(t.numel() == 2 * batches[0].numel() * hidden for t in trainer.inputs.host)
    trainer.step(batches)
    trainer.step(batches)
    assert [t.data_ptr() for t in trainer.inputs.host] == pool
    assert all(t.abs().sum() > 0 for t in trainer.inputs.host)  # every unit's inputs went through it
    trainer.finish()


def test_activations_that_do_not_come_back_are_caught():
    """Negative control: a pool whose copies back never run gives other gradients."""
    model, batches = tiny_batches(1)
    kept = train(offloaded_trainer(model, "cpu", 1, batches), batches, 1)
    trainer = offloaded_trainer(model, "cpu", 1, batches, offload=True)
    trainer.inputs.streamer.prefetch = lambda p: None
    grads = train(trainer, batches, 1)[0]
    assert not all(torch.equal(g, kept[0][name]) for name, g in grads.items())


@pytest.mark.parametrize("buffers", [1, 2])
def test_shared_gradient_pool_trains_the_same(buffers):
    """Fewer gradient buffers than units: the backward waits for the CPU Adam to hand one back, nothing else
    changes."""
    model, batches = tiny_batches(2)
    _, _, dedicated, losses = train(offloaded_trainer(model, "cpu", 1, batches), batches, 3)
    trainer = offloaded_trainer(model, "cpu", 1, batches, grad_buffers=buffers)
    trainer.step(batches)
    shared = [trainer.step(batches).item() for _ in range(2)]
    trainer.finish()
    assert shared == losses[1:]
    assert all(torch.equal(m, dedicated[name]) for name, m in trainer.store.named_flats().items())
    largest = max(u.layout.numel for u in trainer.units)
    assert [b.numel() for b in trainer.store.pool.buffers] == [largest] * buffers


def test_a_failed_update_with_a_shared_gradient_pool_raises_instead_of_hanging():
    """The CPU Adam's update of the head fails while the backward waits for the one buffer of the pool: the buffer still
    goes back, so the backward goes on and the error comes out of the trainer, not a backward stuck forever."""
    model, batches = tiny_batches(1)
    trainer = offloaded_trainer(model, "cpu", 1, batches, grad_buffers=1)
    update, head = trainer.store.update, trainer.store.masters[-1]

    def failing(master, *args):
        if master.data_ptr() == head.data_ptr():
            time.sleep(0.5)  # the backward meanwhile asks for the one buffer
            raise RuntimeError("the update failed")
        update(master, *args)

    failing.adam = update.adam  # the settings the step checks against param_groups'
    trainer.store.update = failing
    outcome = []

    def step_and_finish():
        try:
            try:
                trainer.step(batches)
            finally:  # the worker stops, its other updates done: none may run on into the next test's model build
                trainer.finish()
        except RuntimeError as e:
            outcome.append(str(e))

    thread = threading.Thread(target=step_and_finish, daemon=True)
    thread.start()
    thread.join(30)
    assert outcome == ["the update failed"]


def test_host_holds_12_bytes_per_parameter_and_the_gradient_pool():
    model, _ = build(tiny_run())
    store = ol.OffloadedAdam(ol.model_units(model.config), ol.Adam(), pin=False, grad_buffers=2)
    state = [t for pair in store.moments for t in pair]
    numel = sum(u.layout.numel for u in store.units)
    pool = sum(b.nbytes for b in store.pool.buffers)
    assert store.copies is None and sum(t.nbytes for t in store.masters + state) == 12 * numel
    assert pool == 2 * 4 * max(u.layout.numel for u in store.units) < 4 * numel  # two float32 buffers


def test_float16_needs_a_gradient_buffer_per_unit():
    model, ids = build(ol.dataclasses.replace(tiny_run(), dtype="float16"))
    with pytest.raises(ValueError, match="give each unit a gradient buffer"):
        offloaded_trainer(model, "cpu", 1, [ids], grad_buffers=2)


def pages_present(t: torch.Tensor) -> int:
    """How many of the pages under `t` the process has touched (the present bit of /proc/self/pagemap)."""
    size = 4096
    first, last = t.data_ptr() // size, (t.data_ptr() + t.nbytes - 1) // size
    with open("/proc/self/pagemap", "rb") as pagemap:
        pagemap.seek(first * 8)
        entries = pagemap.read((last - first + 1) * 8)
    return sum(entries[i + 7] >> 7 for i in range(0, len(entries), 8))


@pytest.mark.skipif(not ol.Path("/proc/self/pagemap").exists(), reason="needs Linux's /proc/self/pagemap")
def test_loading_the_store_touches_no_moment(monkeypatch):
    """The moments take their host memory at the unit's first step, once a lean run has freed the model's layers.
    Huge pages off: the kernel merges neighbouring buffers into one mapping, and a master's 2 MiB page may reach into
    a moment's first pages."""
    monkeypatch.setattr(ol.mmap, "MADV_HUGEPAGE", ol.mmap.MADV_NOHUGEPAGE)
    model, _ = build(tiny_run())
    store = ol.OffloadedAdam(ol.model_units(model.config), ol.Adam(), pin=False, grad_buffers=2)
    store.load(model)
    assert all(pages_present(m) > 0 for m in store.masters)
    assert sum(pages_present(t) for pair in store.moments for t in pair) == 0


def test_reloading_the_store_starts_adam_afresh():
    """A second load (the next offloaded mode) gives the same first steps: each unit's first step zeroes its moments."""
    model, _ = build(tiny_run())
    store = ol.OffloadedAdam(ol.model_units(model.config), ol.Adam(lr=1e-3), pin=False, grad_buffers=2)
    grads = [
        torch.randn(m.numel(), generator=torch.Generator().manual_seed(u)).to(store.grad_dtype)
        for u, m in enumerate(store.masters)
    ]

    def two_steps():
        store.load(model)
        for _ in range(2):
            for u, g in enumerate(grads):
                store.take_grads(u).copy_(g)
                store.step_unit(u)
        return {name: t.clone() for name, t in store.named_flats().items()}

    first = two_steps()
    assert all(torch.equal(t, first[name]) for name, t in two_steps().items())


@pytest.mark.parametrize(
    "steps, warmup, repeat, rounds",
    [
        (10, 2, 5, [2, 4, 6, 8, 10]),  # blocks of two steps: four, not five
        (70, 5, 5, [5, 18, 31, 44, 57, 70]),
        (6, 1, 2, [1, 3, 6]),
        (2, 1, 3, [2, 2, 2, 2]),  # one step after the warm-up: every round after it
        (1, 2, 1, [1, 1]),
    ],
)
def test_bound_rounds_share_the_timed_steps(steps, warmup, repeat, rounds):
    assert ol.bound_rounds(ol.RunConfig(steps=steps, warmup=warmup, repeat=repeat)) == rounds


def test_bound_rounds_run_between_steps_with_every_update_done():
    """Each round's parts run once each, after the CPU Adam has stepped every unit; the step after a round is not
    timed, the warm-up round is not counted, and the steps train as they would without rounds."""
    model, ids = build(tiny_run())
    trainer = offloaded_trainer(model, CPU, 1, [ids])
    events, step = [], trainer.step
    trainer.step = lambda micro_batches: events.append("step") or step(micro_batches)

    def part():
        assert all(trainer.steppers.cpu_adam.written(u) for u in range(len(trainer.units)))
        events.append("part")

    def parts():
        return {"a": (CPU, part), "b": (CPU, lambda: None)}

    run = ol.RunConfig(steps=6, warmup=1, repeat=2)
    r = ol.train_steps(trainer, [ids], run, keep_grads=False, bound_parts=parts)
    trainer.finish()
    assert events == ["step", "part", "step", "step", "part", "step", "step", "step", "part"]
    assert r["timed_steps"] == [2, 4, 5] and r["time_ms"] == ol.statistics.median(r["step_ms"][i] for i in [2, 4, 5])
    assert sorted(r["bound_parts_ms"]) == ["a", "b"] and len(r["bound_parts_ms"]["a"]) == 2
    *_, losses = train(offloaded_trainer(model, CPU, 1, [ids]), [ids], 6)
    assert r["losses"] == losses


def test_every_rank_starts_each_bound_part_together(monkeypatch):
    """With several ranks, each part of a round waits for every rank first (meet), as the ranks share the host in a
    step: a part one rank timed while another waited would count the host as its own."""
    events, parts = [], ol.collections.defaultdict(list)
    monkeypatch.setattr(ol.Ranks, "meet", lambda self: events.append("meet"))
    fns = {"a": (CPU, lambda: events.append("a")), "b": (CPU, lambda: events.append("b"))}
    ol.time_round(fns, parts, ol.Ranks())
    assert events == ["meet", "a", "meet", "b"] and sorted(parts) == ["a", "b"]


def test_compute_parts_are_timed_first_after_running_for_the_settling_time(monkeypatch):
    """A round times the GPU compute parts (Compute) first, once they have run in turn, untimed, for SETTLE_S: the
    clocks of a GPU under a step's load settle below their boost, and a part timed from idle would beat the step."""
    events, parts, clock = [], ol.collections.defaultdict(list), [0.0]
    monkeypatch.setattr(ol.time, "perf_counter", lambda: clock[0])

    def compute(name):
        """A compute part that takes 0.5 s of the fake clock."""
        return ol.Compute(lambda: (events.append(name), clock.__setitem__(0, clock[0] + 0.5)))

    fns = {"copy": (CPU, lambda: events.append("copy")), "a": (CPU, compute("a")), "b": (CPU, compute("b"))}
    ol.time_round(fns, parts, ol.Ranks())
    rounds = ol.math.ceil(ol.SETTLE_S / 1.0)  # each round of a and b takes 1 s
    assert events == ["a", "b"] * rounds + ["a", "b", "copy"] and list(parts) == ["a", "b", "copy"]


@pytest.mark.parametrize("k", [1, 2])
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_clipped_training_equals_clip_grad_norm(dtype, k):
    """--clip-grad-norm: the reference is torch.nn.utils.clip_grad_norm_ before torch.optim.Adam; the offloaded
    path takes the norm unit by unit and scales the gradients in the CPU Adam's pass: masters to float32 rounding,
    the first loss the same and the others to float32 rounding (this machine's kernels round the two recipes' masters
    a little apart), and far from an unclipped run's."""
    model, ids = build(ol.dataclasses.replace(tiny_run(), dtype=dtype, batch_size=2))
    batches = micro(ids, k)
    plain = ol.copy.deepcopy(model).float()
    optimizer = torch.optim.Adam(plain.parameters(), lr=1e-3)
    for _ in range(3):
        optimizer.zero_grad()
        for part in batches:
            (plain(part, labels=part, use_cache=False).loss / k).backward()
        norm = torch.nn.utils.clip_grad_norm_(plain.parameters(), 0.05)
        optimizer.step()
    assert norm > 0.05  # the clip scaled the gradients down
    reference = reference_trainer(model, CPU, ol.Adam(lr=1e-3), clip=0.05)
    _, _, ref_masters, ref_losses = train(reference, batches, 3)
    _, _, masters, losses = train(offloaded_trainer(model, CPU, 1, batches, clip=0.05), batches, 3)
    _, _, unclipped, _ = train(offloaded_trainer(model, CPU, 1, batches), batches, 3)
    if dtype == "float32":  # the reference recipe is plain training with clip_grad_norm_
        assert_masters_close(ref_masters, dict(plain.named_parameters()), 3)
    assert_masters_close(masters, ref_masters, 3)
    assert losses[0] == ref_losses[0]  # from the same masters; the later ones from masters equal to float32 rounding
    torch.testing.assert_close(losses, ref_losses, rtol=2e-6, atol=0)
    assert ol.max_abs_diff(masters, unclipped) > 1e-4


def test_clipping_needs_a_gradient_buffer_per_unit_and_no_gpu_adam():
    model, batches = tiny_batches(1)
    with pytest.raises(ValueError, match="give each unit a gradient buffer"):
        offloaded_trainer(model, CPU, 1, batches, grad_buffers=2, clip=1.0)
    store = ol.OffloadedAdam(ol.model_units(model.config), ol.Adam(), False, scaled_grads=True)
    store.load(model)
    kwargs = ol.decoder_kwargs(model, tuple(batches[0].shape), model.dtype, CPU)
    trainer = ol.OffloadedTraining(store, model.config, model.dtype, CPU, 1, model.loss_function, kwargs)
    ol.scale_and_clip(trainer, 1.0)
    with pytest.raises(ValueError, match="the streamed units stay on the CPU Adam"):
        ol.place_on_gpu(trainer, gpu_adam=(0,))
    trainer.finish()
    unscaled = offloaded_trainer(model, CPU, 1, batches)
    with pytest.raises(ValueError, match="build the store with scaled_grads"):
        ol.GradClip(unscaled.store, 1.0, CPU)
    unscaled.finish()


@pytest.mark.slow  # a process of its own: 11 s; the clipped steps themselves are tested in-process above
def test_cli_clipping_reports_each_steps_norm(tmp_path):
    out = tmp_path / "r.json"
    r = cli(
        *["--preset", "tiny", "--seq-len", "16", "--mode", "cpu", "--train", "--no-inference", "--steps", "3"],
        "--clip-grad-norm",
        "0.5",
        "--json",
        out,
    )
    assert r.returncode == 0, r.stderr
    norms = json.loads(out.read_text())["results"]["cpu"]["training"]["grad_norms"]
    assert len(norms) == 3 and min(norms) > 0.5
    assert "cpu training: gradient norm" in r.stdout and "before clipping to 0.5" in r.stdout


def test_clipping_without_host_room_for_every_gradient_is_refused():
    """Clipping keeps every unit's gradients on the host until the norm is known: a buffer per unit, before any copy
    of the masters; refused where the host lacks even that, saying how much is short."""
    run = ol.RunConfig(preset="7b-8l", mode="overlapped", train=True, inference=False, clip_grad_norm=1.0)
    config = ol.llama_config(run)
    units = len(ol.model_units(config))
    least = sum(ol.host_parts(run, config, machine(), None, units).values())  # no copy, a buffer per unit
    with pytest.raises(ol.UsageError, match=r"; 1\.0 GiB short; the largest parts: .*gradient buffers"):
        planned(run, machine(host_gib=host_for(least - ol.GiB) / ol.GiB))
    plan = planned(run, machine(host_gib=host_for(least) / ol.GiB))
    assert plan.grad_buffers == units and plan.copy_dtype is None


def test_float16_overflow_check_reads_only_the_gradients():
    """The padding between a unit's parameters in a gradient buffer is never written: stale NaN there (as from
    memory a buffer reuses) must not count as an overflow, or float16 would skip every step."""
    model, ids = build(ol.dataclasses.replace(tiny_run(), dtype="float16"))
    trainer = offloaded_trainer(model, CPU, 1, [ids], resident=(1,))
    for buffer in (trainer.steppers.buffers[0], trainer.steppers.grads(1)):
        buffer.fill_(float("nan"))
    for _ in range(2):
        trainer.step([ids])
    trainer.finish()
    assert trainer.scaling.scale == 2.0**16, "a step was skipped for an overflow"
    assert [s.item() for s in trainer.store.steps] == [2, 0, 2, 2, 2, 2]  # unit 1 steps on the device


def test_a_held_step_is_bound_by_its_backward_then_the_longer_of_forward_and_adam():
    """Clipping holds every update until the backward ends: the bound gets that part, from stand-in times (no GPU
    here), and the notes say it next to the bound were the updates not held."""
    model, batches = tiny_batches(1)
    trainer = offloaded_trainer(model, CPU, 1, batches, clip=1.0)
    kinds = ("embed", "layer", "norm", "head")
    best = {kind: 3.0 for kind in kinds} | {f"{kind}_forward": 1.0 for kind in kinds}
    best |= {"h2d": 1.0, "d2h": 1.0, "adam": 2.0, "adam_small": 0.5, "host": 2.5}
    result = {"time_ms": 1e6, "bound_parts_ms": {name: [ms] for name, ms in best.items()}, "grad_norms": [0.5]}
    t = result | ol.training_figures(trainer, result)
    units = len(trainer.units)  # each takes 3 ms, 1 of them its forward
    assert t["gpu_compute_ms"] == 3 * units and t["gpu_forward_ms"] == units
    assert t["held_updates_ms"] == 2 * units + max(units, t["cpu_adam_ms"])
    assert t["bound_ms"] == t["held_updates_ms"] > t["unheld_bound_ms"] and t["bound_by"] == "held_updates"
    notes = "\n".join(ol.training_notes("overlapped", t, ol.RunConfig(train=True, clip_grad_norm=1.0)))
    assert "updates held for the whole backward (clipping)" in notes
    assert f"{t['unheld_bound_ms']:.1f} ms were they not held" in notes
    trainer.finish()


@pytest.mark.parametrize("head, h2d_ms", [("cpu", 1.0), ("resident", 1.0), ("cpu", 50.0)])
def test_an_overlapped_step_is_bound_by_the_cpu_adam_then_the_least_chain_to_its_next_gradients(head, h2d_ms):
    """Whichever unit the CPU Adam updates last, the next forward copies it in and runs from it through the head, and
    the Adam waits for the backward down to the first unit it steps and that unit's gradients: the bound gets the
    Adam and the least such chain in turn, from stand-in times (no GPU here), and the notes say it."""
    model, batches = tiny_batches(1)
    n = len(ol.model_units(model.config))
    trainer = offloaded_trainer(model, CPU, 1, batches, resident=(n - 1,) if head == "resident" else ())
    forward = {"embed": 0.5, "layer": 1.0, "norm": 0.25, "head": 2.0}
    best = {kind: 3 * ms for kind, ms in forward.items()} | {f"{kind}_forward": ms for kind, ms in forward.items()}
    best |= {"h2d": h2d_ms, "d2h": 1.0, "adam": 2.0, "adam_small": 0.5, "host": 2.5}
    result = {"time_ms": 1e6, "bound_parts_ms": {name: [ms] for name, ms in best.items()}}
    t = result | ol.training_figures(trainer, result)
    store = trainer.store
    last = n - 1 if head == "cpu" else n - 2  # the first unit the CPU Adam steps: the head, or the norm
    # the least chain starts at `last` where copies are quick, at the norm (the fewest weights) where they are slow
    start = last if h2d_ms == 1.0 else n - 2
    h2d = store.weights[start].nbytes / t["h2d_bytes"] * h2d_ms  # its share of the step's H2D
    d2h = store.masters[last].numel() * store.grad_dtype.itemsize / t["d2h_bytes"]
    forward = sum([0.25, 2.0][start - (n - 2) :])  # the norm's and the head's, or the head's
    backward = 4.0 if head == "cpu" else 4.5  # down to `last`: the head's alone, or the head's and the norm's
    chain = h2d + forward + backward + d2h
    assert t["adam_chain_ms"] == pytest.approx(chain)
    assert t["cpu_adam_chain_ms"] == t["cpu_adam_ms"] + t["adam_chain_ms"]
    notes = "\n".join(ol.training_notes("overlapped", t, ol.RunConfig(train=True)))
    assert "the CPU Adam and then the least the GPU runs between its last update and" in notes
    assert f"{t['cpu_adam_chain_ms']:.1f} ms (of them {t['adam_chain_ms']:.1f})" in notes
    trainer.finish()


def test_segments_bound_counts_remade_forwards_or_the_whole_segments_backward():
    """In segments of 2 remade, the backward runs the embeddings, layer 1 and the norm forward again: the bound's
    compute gains their forwards, and the chain to the head's gradients the norm's, remade before the head's backward;
    a micro-batch at a time, no forward runs twice and the chain gains the norm's backward, which the head's segment
    runs before its gradients leave. The copies are those the windows issue."""
    model, batches = tiny_batches(1)
    forward = {"embed": 0.5, "layer": 1.0, "norm": 0.25, "head": 2.0}
    best = {kind: 3 * ms for kind, ms in forward.items()} | {f"{kind}_forward": ms for kind, ms in forward.items()}
    best |= {"h2d": 1e-9, "d2h": 1.0, "adam": 2.0, "adam_small": 0.5, "host": 2.5}
    figures, slots = {}, {}
    for segment, remake in ((1, False), (2, True), (2, False)):
        trainer = offloaded_trainer(model, CPU, 1, batches, segment=segment, remake=remake)
        result = {"time_ms": 1e6, "bound_parts_ms": {name: [ms] for name, ms in best.items()}}
        figures[segment, remake], slots[segment, remake] = (
            ol.training_figures(trainer, result),
            trainer.streamer.n_slots,
        )
        trainer.finish()
    assert len(trainer.units) == 6  # (0, 1), (2, 3), (4, 5): the norm and the head one segment
    plain, remade, graphs = figures[1, False], figures[2, True], figures[2, False]
    assert remade["gpu_compute_ms"] == pytest.approx(plain["gpu_compute_ms"] + 0.5 + 1.0 + 0.25)
    assert remade["adam_chain_ms"] == pytest.approx(plain["adam_chain_ms"] + forward["norm"])
    assert graphs["gpu_compute_ms"] == pytest.approx(plain["gpu_compute_ms"])
    assert graphs["adam_chain_ms"] == pytest.approx(plain["adam_chain_ms"] + 2 * forward["norm"])
    assert slots == {(1, False): 2, (2, True): 2, (2, False): 4}  # a micro-batch at a time: 2 held and 2 ahead
    for (segment, remake), t in figures.items():
        copied = ol.step_copies(ol.segment_order(6, segment, remake), (), slots[segment, remake])
        assert t["h2d_bytes"] == sum(trainer.store.weights[u].nbytes for u in copied)


def test_a_blocked_step_is_bound_by_the_sum_of_its_parts():
    """Blocked overlaps nothing: its bound is compute, both copies and then the CPU Adam (timed alone), in turn."""
    model, batches = tiny_batches(1)
    trainer = offloaded_trainer(model, CPU, 0, batches)
    best = {kind: 3.0 for kind in ("embed", "layer", "norm", "head")} | {"h2d": 1.0, "d2h": 1.5, "adam": 2.0}
    best |= {"adam_small": 0.5, "host": 2.5}
    result = {"time_ms": 1e6, "bound_parts_ms": {name: [ms] for name, ms in best.items()}}
    t = result | ol.training_figures(trainer, result)
    assert t["serial_ms"] == t["gpu_compute_ms"] + t["h2d_ms"] + t["d2h_ms"] + t["cpu_adam_ms"] == t["bound_ms"]
    assert t["bound_by"] == "serial" and "held_updates_ms" not in t
    notes = "\n".join(ol.training_notes("blocked", t, ol.RunConfig(train=True)))
    assert f"every part in turn (blocked: nothing overlaps) {t['serial_ms']:.1f} ms" in notes
    trainer.finish()


def test_the_bound_scales_up_the_cpu_adams_parameters_not_its_calls():
    """The CPU Adam is timed in one call over a share of its parameters, and over 1/ADAM_FIT of that share: the line
    through the two gives a call's fixed cost, which a step pays a unit, and the rest is scaled to every parameter."""
    model, batches = tiny_batches(1)
    trainer = offloaded_trainer(model, CPU, 1, batches)
    kinds = ("embed", "layer", "norm", "head")
    best = {kind: 0.1 for kind in kinds} | {f"{kind}_forward": 0.05 for kind in kinds} | {"h2d": 0.1, "d2h": 0.1}
    best |= {"adam": 2.0, "adam_small": 0.5, "host": 3.0}  # 0.4 ms of its call, 1.6 ms of parameters
    result = {"time_ms": 1e6, "bound_parts_ms": {name: [ms] for name, ms in best.items()}}
    t = ol.training_figures(trainer, result)
    on_cpu, _ = ol.cpu_and_gpu_adam_units(trainer)
    scale = sum(on_cpu.values()) / ol.adam_timed_numel(on_cpu)
    call = (ol.ADAM_FIT * 0.5 - 2.0) / (ol.ADAM_FIT - 1)
    assert t["adam_calls_ms"] == pytest.approx(len(on_cpu) * call)
    assert t["cpu_adam_ms"] == pytest.approx(len(on_cpu) * call + (2.0 - call) * scale)
    assert t["host_memory_ms"] == pytest.approx(len(on_cpu) * call + (3.0 - call) * scale)
    trainer.finish()


def test_executed_flops_count_the_recompute_only_of_units_that_do_not_keep_their_graphs(monkeypatch):
    """A step executes three passes of each unit, and a fourth of each recomputed one: the offloaded step recomputing
    all executes 4/3 of the gpu mode's FLOPs, one keeping every graph as many as it; segments remade run a fifth of
    each unit they remake (the units before each segment's last), as the trainer's backward order says."""
    monkeypatch.setattr(ol, "dense_peak_flops", lambda: None)  # no GPU here to name
    run = tiny_run()
    config = build(run)[0].config
    every = ["lm_head", *(f"model.layers.{i}" for i in range(config.num_hidden_layers))]
    result = {"time_ms": 10.0, "tokens_per_step": 4096}

    def executed(mode: str, kept: list[str]) -> float:
        return ol.step_rates(run, config, mode, result | {"kept_graph_units": kept})["executed_tflops"]

    assert executed("overlapped", []) == pytest.approx(4 / 3 * executed("gpu", []))
    assert executed("overlapped", every) == pytest.approx(executed("gpu", []))
    assert executed("gpu", []) < executed("overlapped", every[:1]) < executed("overlapped", [])
    model, batches = tiny_batches(1)
    trainer = offloaded_trainer(model, CPU, 1, batches, segment=2, remake=True)
    remade = ol.remade_units(trainer.inputs.backward_order(len(trainer.units)))
    trainer.finish()
    names = [trainer.units[u].name for u in remade]
    assert names == ["model.embed_tokens", "model.layers.1", "model.norm"]  # of (0, 1), (2, 3), (4, 5): a layer's FLOPs
    per_layer = executed("overlapped", []) - executed("overlapped", ["model.layers.0"])  # a layer's fourth pass
    with_segments = ol.step_rates(run, config, "overlapped", result | {"kept_graph_units": [], "remade_units": names})
    assert with_segments["executed_tflops"] == pytest.approx(executed("overlapped", []) + per_layer)


def test_a_cpu_adam_timed_alone_slower_than_in_the_steps_is_a_failed_measurement():
    """Where the steps' own CPU Adam (its median busy time) took less than the part timed alone, the bound takes the
    steps' and the notes say the alone time failed; where it took more, the alone time stands."""
    model, batches = tiny_batches(1)
    trainer = offloaded_trainer(model, CPU, 0, batches)
    best = {kind: 0.1 for kind in ("embed", "layer", "norm", "head")} | {"h2d": 0.1, "d2h": 0.1}
    best |= {"adam": 2.0, "adam_small": 0.5, "host": 3.0}
    parts = {name: [ms] for name, ms in best.items()}
    alone = ol.training_figures(trainer, {"time_ms": 1e6, "bound_parts_ms": parts})["cpu_adam_ms"]
    for busy, expected in ((alone / 2, alone / 2), (2 * alone, alone)):
        result = {"time_ms": 1e6, "bound_parts_ms": parts, "timed_steps": [1, 2, 3]}
        result["cpu_adam_busy_ms"] = [1e9, busy, busy, 1e9]  # step 0 untimed; the median of 1 to 3 is busy
        t = result | ol.training_figures(trainer, result)
        assert t["cpu_adam_ms"] == pytest.approx(expected)
        assert t["serial_ms"] == pytest.approx(t["gpu_compute_ms"] + t["h2d_ms"] + t["d2h_ms"] + expected)
        notes = "\n".join(ol.training_notes("blocked", t, ol.RunConfig(train=True)))
        assert ("a failed measurement" in notes) == (busy < alone)
    trainer.finish()


def test_a_bound_above_its_step_is_reported_as_a_failed_measurement():
    """A step whose parts timed alone add up to more than the step itself (beyond BOUND_SLACK) has no efficiency:
    the notes say the bound failed and by which part; within the slack the efficiency stands."""
    model, batches = tiny_batches(1)
    trainer = offloaded_trainer(model, CPU, 1, batches)
    kinds = ("embed", "layer", "norm", "head")
    best = {kind: 10.0 for kind in kinds} | {f"{kind}_forward": 3.0 for kind in kinds} | {"h2d": 0.1, "d2h": 0.1}
    parts = {name: [ms] for name, ms in (best | {"adam": 2.0, "adam_small": 0.5, "host": 3.0}).items()}
    bound = ol.training_figures(trainer, {"time_ms": 1e6, "bound_parts_ms": parts})["bound_ms"]
    for step, failed in ((bound, False), (bound / ol.BOUND_SLACK * 1.001, False), (bound / 1.03, True)):
        t = {"time_ms": step, "bound_parts_ms": parts}
        t |= ol.training_figures(trainer, t)
        assert t.get("bound_failed", False) == failed and (t["efficiency"] is None) == failed
        notes = "\n".join(ol.training_notes("overlapped", t, ol.RunConfig(train=True)))
        assert ("a failed measurement: the gpu compute part" in notes) == failed
    trainer.finish()


@pytest.mark.parametrize("calls", [(2.0, 0.1), (2.0, 2.0), (2.0, 3.0)])
def test_the_cpu_adams_fixed_cost_stays_within_its_small_time(calls):
    """Noisy times give the line's fixed cost no more than the small share took, and never below nothing."""
    assert 0.0 <= ol.adam_call_ms(*calls) <= calls[1]


@pytest.mark.parametrize("grad_buffers", [None, 2])
def test_the_bounds_adam_is_timed_on_the_units_own_state_and_puts_it_back(grad_buffers):
    """The bound times the CPU Adam on a share of each unit's own masters, moments and copy (not on scratch state);
    after the round they are bitwise as before, and the timed updates did change them meanwhile."""
    model, batches = tiny_batches(1)
    trainer = offloaded_trainer(model, CPU, 1, batches, grad_buffers=grad_buffers)
    try:
        trainer.step(batches)
        trainer.wait_updates()
        store = trainer.store
        state = lambda u: [t.clone() for t in (store.masters[u], *store.moments_of(u), store.steps[u])]  # noqa: E731
        before = {u: state(u) for u in (1, 2)}
        adam = ol.AdamInPlace(store, {1: 64, 2: 32})  # its worker steps the shares once, untimed, to start its threads
        assert all(store.steps[u] == before[u][3] + 1 for u in (1, 2))
        adam()
        for u, n in ((1, 64), (2, 32)):
            assert not torch.equal(store.masters[u][:n], before[u][0][:n]) and store.steps[u] == before[u][3] + 2
            assert torch.equal(store.masters[u][n:], before[u][0][n:])  # only the share timed
        parts = ol.collections.defaultdict(list)
        ol.time_round(
            {"adam": (CPU, adam), "adam_small": (CPU, ol.functools.partial(adam, ol.ADAM_FIT))}, parts, ol.ONE_PROCESS
        )
        assert len(parts["adam"]) == len(parts["adam_small"]) == 1
        assert all(all(map(torch.equal, state(u), before[u])) for u in (1, 2))
    finally:
        trainer.finish()


def test_table_1_gives_the_hosts_bytes_a_parameter_and_the_set_up_seconds():
    """Training Table 1: after the peak host memory, its bytes a parameter; last, the set-up's parts summed."""
    r = {"peak_host_bytes": 3 * 2**30, "host_bytes_per_parameter": 16.04, "resident_units": [], "units": 3}
    r["setup_s"] = {"host_state": 1.2, "weights": 2.0, "placed": 0.5}
    assert table_cells("training", 0, r)[3:] == ["3.00", "16.0", "", "3.7"]
    lines = ol.training_notes("overlapped", r, ol.RunConfig())
    assert "set-up 3.7 s before the first step: host state 1.2, weights 2.0, placed 0.5" in "\n".join(lines)


@pytest.mark.parametrize("nvme_layers", [0, 1])
def test_the_training_store_is_built_as_a_run_builds_it(nvme_layers, tmp_path, monkeypatch, capsys):
    """training_store, which only a GPU run reaches: a master and moments for every unit (the moments on the host, or
    one layer's on the disk tier), and the set-up line that counts the host's moments."""
    monkeypatch.setattr(ol.HostBuffer, "pin", lambda self: None)  # no GPU to pin for
    disk = {"nvme": str(tmp_path), "nvme_layers": nvme_layers} if nvme_layers else {}
    run = ol.RunConfig(preset="tiny", mode="overlapped", train=True, inference=False, seq_len=48, **disk)
    config = ol.llama_config(run)
    masters = ol.training_store(run, config, planned(run, machine(host_gib=64)))
    try:
        moments = list(masters.moments)
        assert len(moments) == len(masters.masters) == len(ol.model_units(config))
        assert sum(pair is None for pair in moments) == nvme_layers
        host = sum(m.nbytes for pair in moments if pair for m in pair)
        assert host == sum(2 * m.nbytes for m, pair in zip(masters.masters, moments, strict=True) if pair)
        assert f"{ol.size_text(host)} of Adam moments" in capsys.readouterr().err
    finally:
        masters.close()
