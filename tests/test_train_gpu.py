"""GPU tier, training: gradients bitwise equal to gpu mode's, with and without activation offload; hostile races for
the backward prefetch, the gradient copy and the activation copies both ways; overlap of gradient copies with
backward kernels in a trace; and no memory growth over 100 steps.

Attention is eager here: sdpa's backward accumulates with atomics and is not bitwise reproducible even against
itself, so only a deterministic backward can show that offloading changes no bit."""

import functools
import gc
import statistics
import time

import pytest
import torch

import offload_llama as ol
from helpers import assert_masters_close, build, offloaded_trainer, reference_trainer, send_late, train

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
CUDA = torch.device("cuda")


SMALL = {
    "hidden_size": 256,
    "intermediate_size": 688,
    "num_attention_heads": 8,
    "num_key_value_heads": 2,
    "vocab_size": 512,
    "num_hidden_layers": 3,
}
# low arithmetic intensity: 400 MB of float32 masters per layer against 16 tokens, so a copy takes milliseconds
# and a layer's compute microseconds: a missing wait shows up as wrong numbers, not as luck
THIN = {
    "hidden_size": 2048,
    "intermediate_size": 5632,
    "num_attention_heads": 16,
    "num_key_value_heads": 16,
    "vocab_size": 256,
    "num_hidden_layers": 4,
}


def model_and_batches(sizes, dtype="bfloat16", seq_len=128, batch_size=2, k=1):
    """A random model and its batch in k micro-batches, built once per module: the tests only read them."""
    return cached_model_and_batches(tuple(sizes.items()), dtype, seq_len, batch_size, k)


@functools.cache
def cached_model_and_batches(sizes, dtype, seq_len, batch_size, k):
    run = ol.RunConfig(
        preset="tiny",
        sizes=sizes,
        dtype=dtype,
        seq_len=seq_len,
        batch_size=batch_size,
        attention="eager",
    )
    model, ids = build(run)
    return model, [b.to(CUDA) for b in ids.chunk(k)]


_references = {}


def reference(model, batches, steps=3):
    """gpu mode's run of `model` on `batches`, once per module for each (the tests only read it)."""
    key = (id(model), id(batches[0]), steps)
    if key not in _references:
        _references[key] = train(reference_trainer(model, CUDA, ol.Adam(lr=1e-3)), batches, steps)
    return _references[key]


@functools.cache
def streamed_adam_reference():
    """Three steps of the thin model with the embeddings and layers 0 and 1 on the GPU's Adam: what its races match."""
    model, batches = model_and_batches(THIN, seq_len=16, batch_size=1)
    return train(offloaded_trainer(model, CUDA, 1, batches, pin=True, gpu_adam=(0, 1, 2), reuse=True), batches, 3)


@pytest.mark.parametrize("k", [1, 2])
@pytest.mark.parametrize("depth", [0, 1, 2])
@pytest.mark.parametrize("dtype", ["bfloat16", "float32", "float16"])
def test_offloaded_grads_bitwise_equal_gpu_mode(dtype, depth, k):
    model, batches = model_and_batches(SMALL, dtype, k=k)
    grads, masters_1, masters, losses = train(offloaded_trainer(model, CUDA, depth, batches, pin=True), batches, 3)
    ref_grads, ref_masters_1, ref_masters, ref_losses = reference(model, batches)
    for name, g in grads.items():
        assert torch.equal(g, ref_grads[name]), name
    # the CPU and GPU Adam round differently; in 16-bit compute a one-ulp master difference can flip a weight's
    # rounding and so the next step's gradients: there, float32 rounding holds for the first step only
    assert losses[0] == ref_losses[0]
    if dtype == "float32":
        assert_masters_close(masters, ref_masters, 3)
    else:
        assert_masters_close(masters_1, ref_masters_1, 1)


@pytest.mark.parametrize("dtype", ["bfloat16", "float32", "float16"])
def test_clipped_masters_match_gpu_mode(dtype):
    """--clip-grad-norm: streamed units (their gradients scaled in the CPU Adam's pass) and a resident one (scaled in
    place on the GPU) against gpu mode's clip_grad_norm_: the first step's masters to float32 rounding, the loss."""
    model, batches = model_and_batches(SMALL, dtype)
    adam = ol.Adam(lr=1e-3, weight_decay=0.1)  # the decay makes even the first step depend on the gradients' scale
    _, ref_masters_1, _, ref_losses = train(reference_trainer(model, CUDA, adam, clip=0.05), batches, 2)
    trainer = offloaded_trainer(model, CUDA, 1, batches, adam=adam, pin=True, resident=(1,), clip=0.05)
    _, masters_1, _, losses = train(trainer, batches, 2)
    assert_masters_close(masters_1, ref_masters_1, 1)
    assert losses[0] == ref_losses[0]
    _, unclipped_1, _, _ = train(reference_trainer(model, CUDA, adam), batches, 1)
    assert ol.max_abs_diff(ref_masters_1, unclipped_1) > 1e-5  # the clip scaled the gradients down


class NoWaitStream(torch.cuda.Stream):
    """A stream that ignores wait_event: removes one ordering to show it is needed."""

    def wait_event(self, event) -> None: ...


def delay_backward_copies(trainer):
    """In the backward pass each unit's weights land 20 ms late, so compute that does not wait for them reads what
    the slot held before, however long the CPU takes to issue it."""
    streamer, wait_source = trainer.streamer, trainer.streamer.writer.wait_written

    def late(u):  # called just before the unit's copy is issued
        wait_source(u)
        if streamer.window.units[0] != 0:  # the backward pass starts from the head
            sleep_on(streamer.copy_stream)

    streamer.writer.wait_written = late


def drop_backward_copied_wait(trainer):
    """In the backward pass only, compute no longer waits for a unit's weights to land."""
    delay_backward_copies(trainer)
    streamer, begin = trainer.streamer, trainer.streamer.begin

    def begin_without_wait(order, current=False):
        begin(order, current)
        if streamer.window.units[0] != 0:  # the backward pass starts from the head
            streamer.copied = [ol.InOrder() for _ in streamer.copied]

    streamer.begin = begin_without_wait


def stretch_backward(trainer):
    """Each unit's gradients are written 20 ms late, so an early copy to the host reads what was there before."""
    unit_grads = trainer.unit_grads

    def late(*args):
        torch.cuda._sleep(40_000_000)
        return unit_grads(*args)

    trainer.unit_grads = late


def drop_gradient_ready_wait(trainer):
    stretch_backward(trainer)
    trainer.steppers.cpu_adam.d2h_stream = NoWaitStream(CUDA)


RACES = {
    "backward prefetch": (delay_backward_copies, drop_backward_copied_wait),
    "gradient copy": (stretch_backward, drop_gradient_ready_wait),
}


@pytest.mark.parametrize("depth", [0, 1])
def test_float32_masters_streamed_without_a_copy_give_the_same_grads(depth):
    """Where the host has no room for the masters' bfloat16 copy the GPU casts the float32 masters: same bits."""
    model, batches = model_and_batches(SMALL)
    trainer = offloaded_trainer(model, CUDA, depth, batches, pin=True, copy=False)
    grads, masters_1, _, losses = train(trainer, batches, 3)
    ref_grads, ref_masters_1, _, ref_losses = reference(model, batches)
    assert all(torch.equal(g, ref_grads[name]) for name, g in grads.items())
    assert losses[0] == ref_losses[0]
    assert_masters_close(masters_1, ref_masters_1, 1)


@pytest.mark.parametrize("k", [1, 2])
@pytest.mark.parametrize("depth", [0, 1, 2])
def test_units_keeping_their_graphs_give_gpu_modes_grads(depth, k):
    """No recompute: every unit, then every other one, keeping its forward's graphs (over its slot's weights, copied
    back before its backward) trains as gpu mode: the same gradients, masters to float32 rounding."""
    model, batches = model_and_batches(SMALL, k=k)
    ref_grads, ref_masters_1, _, ref_losses = reference(model, batches)
    units = len(ol.model_units(model.config))
    for keep in (range(units), range(1, units, 2)):
        trainer = offloaded_trainer(model, CUDA, depth, batches, pin=True, keep=keep)
        grads, masters_1, _, losses = train(trainer, batches, 3)
        for name, g in grads.items():
            assert torch.equal(g, ref_grads[name]), (name, keep)
        assert losses[0] == ref_losses[0]
        assert_masters_close(masters_1, ref_masters_1, 1)


INPUTS = {  # where the units' saved inputs wait: depth, and offloaded_trainer's arguments
    **{f"on the host, depth {d}": (d, {"offload": True}) for d in (0, 1, 2)},
    **{f"in segments of {n}, depth {d}": (d, {"segment": n}) for d, n in ((0, 2), (1, 3), (2, 2), (2, 5))},
    **{
        f"in segments of {n} remade, depth {d}": (d, {"segment": n, "remake": True})
        for d, n in ((0, 2), (1, 3), (2, 5))
    },
}


@pytest.mark.parametrize("k", [1, 2])
@pytest.mark.parametrize("inputs", INPUTS)
def test_saved_inputs_elsewhere_give_gpu_modes_grads(inputs, k):
    """The units' inputs through the host pool and back, or only each segment's first unit keeping them, the segment's
    backward a micro-batch at a time or the rest remade: gpu mode's gradients, bit for bit."""
    depth, kwargs = INPUTS[inputs]
    model, batches = model_and_batches(SMALL, k=k)
    trainer = offloaded_trainer(model, CUDA, depth, batches, pin=True, **kwargs)
    grads, masters_1, _, losses = train(trainer, batches, 3)
    ref_grads, ref_masters_1, _, ref_losses = reference(model, batches)
    for name, g in grads.items():
        assert torch.equal(g, ref_grads[name]), name
    assert losses[0] == ref_losses[0]
    assert_masters_close(masters_1, ref_masters_1, 1)


def sleep_on(stream) -> None:
    """20 ms of nothing on `stream`, ahead of what is issued to it next."""
    with torch.cuda.stream(stream):
        torch.cuda._sleep(40_000_000)


def poison_allocator() -> None:
    """Leave NaN in the caching allocator's free small blocks, so that reading memory before it is written gives NaN,
    not the values an earlier run left there."""
    torch.cuda.empty_cache()
    blocks = [torch.full((2**17,), float("nan"), device=CUDA) for _ in range(256)]  # 512 KiB each: the small pool
    del blocks


def stretch_forward(trainer):
    """Each unit runs 20 ms late, so its outputs, the next unit's inputs, are written late."""
    run_unit = trainer.run_unit

    def late(u, module, x, k):
        if k == 0:
            torch.cuda._sleep(40_000_000)
        return run_unit(u, module, x, k)

    trainer.run_unit = late


def drop_inputs_written_wait(trainer):
    """The copy of a unit's inputs to the host no longer waits for the unit before to have written them."""
    stretch_forward(trainer)
    trainer.inputs.d2h_stream = NoWaitStream(CUDA)


def delay_inputs_out(trainer):
    """Each unit's inputs reach the host 20 ms late."""
    acts, send = trainer.inputs, trainer.inputs.send

    def late(u, xs):
        sleep_on(acts.d2h_stream)
        send(u, xs)

    acts.send = late


def drop_inputs_landed_wait(trainer):
    """Inputs come back to the GPU without waiting for them to have reached the host."""
    delay_inputs_out(trainer)
    trainer.inputs.streamer.writer.wait_written = lambda a: None


def delay_inputs_in(trainer):
    """In the backward pass each unit's inputs land on the GPU 20 ms late."""
    acts = trainer.inputs.streamer
    wait_source = acts.writer.wait_written

    def late(a):
        wait_source(a)
        sleep_on(acts.copy_stream)

    acts.writer.wait_written = late


def drop_inputs_copied_wait(trainer):
    """The backward no longer waits for a unit's inputs to land in their slot."""
    delay_inputs_in(trainer)
    trainer.inputs.streamer.copied = [ol.InOrder() for _ in trainer.inputs.streamer.copied]


ACTIVATION_RACES = {
    "inputs written before they leave": (stretch_forward, drop_inputs_written_wait),
    "inputs on the host before they come back": (delay_inputs_out, drop_inputs_landed_wait),
    "inputs back on the GPU before the backward": (delay_inputs_in, drop_inputs_copied_wait),
}


def drop_slot_freed_wait(trainer):
    """A stretched backward whose copies no longer wait for the slot's last unit to have run (S2)."""
    stretch_backward(trainer)
    trainer.streamer.freed = [ol.InOrder() for _ in trainer.streamer.freed]


@pytest.mark.parametrize("remake", [False, True])
@pytest.mark.parametrize("depth", [1, 2])
def test_race_segments_copy_into_a_slot_after_its_release(depth, remake):
    """A segment's backward holds its units in their slots while the next segment's copies go ahead into the slots run
    from least recently, or (remade) runs units twice: with a stretched backward each copy still waits for its slot's
    release (S2) and gives gpu mode's gradients; without the wait it overwrites weights still in use."""
    model, batches = model_and_batches(THIN, seq_len=16, batch_size=1)
    ref_grads, *_ = reference(model, batches, steps=1)
    for hook, should_match in ((stretch_backward, True), (drop_slot_freed_wait, False)):
        trainer = offloaded_trainer(model, CUDA, depth, batches, pin=True, reuse=True, segment=3, remake=remake)
        hook(trainer)
        grads, *_ = train(trainer, batches, 1)
        matches = all(torch.equal(g, ref_grads[name]) for name, g in grads.items())
        assert matches == should_match, "intact" if should_match else "wait removed"


def test_race_a_segments_gradient_buffer_waits_for_its_last_copy_out():
    """In segments of 2 units 3 and 1 sum their gradients in the same one of the two buffers: with unit 3's copy to the
    host held back 20 ms the intact wait (S8, that buffer's) gives gpu mode's gradients; without it unit 3's Adam
    reads unit 1's."""
    model, batches = model_and_batches(SMALL, k=2)
    ref_grads, *_ = reference(model, batches, steps=1)
    for drop, should_match in ((False, True), (True, False)):
        trainer = offloaded_trainer(model, CUDA, 1, batches, pin=True, segment=2)
        send_late(trainer, 3, drop)
        grads, *_ = train(trainer, batches, 1)
        matches = all(torch.equal(g, ref_grads[name]) for name, g in grads.items())
        assert matches == should_match, "intact" if should_match else "wait removed"


@pytest.mark.parametrize("depth", [0, 1])
@pytest.mark.parametrize("race", [*RACES, *ACTIVATION_RACES])
def test_race_each_training_wait_is_needed(race, depth):
    """Each hook pair: the intact wait survives a stretched kernel or a delayed copy, the removed one does not. With
    activation offload the caching allocator poisons what it hands out again, so a read of freed inputs shows."""
    model, batches = model_and_batches(THIN, seq_len=16, batch_size=1)
    ref_grads, *_ = reference(model, batches, steps=1)
    offload = race in ACTIVATION_RACES
    for hook, should_match in zip((RACES | ACTIVATION_RACES)[race], (True, False), strict=False):
        trainer = offloaded_trainer(model, CUDA, depth, batches, pin=True, offload=offload, reuse=True)
        if hook:
            hook(trainer)
        if offload:
            poison_allocator()
        grads, *_ = train(trainer, batches, 1)
        matches = all(torch.equal(g, ref_grads[name]) for name, g in grads.items())
        assert matches == should_match, f"{race}, {'intact' if should_match else 'wait removed'}"


def slow_cpu_adam(trainer):
    """Each unit's update starts 20 ms late, so a copy that does not wait for it streams the last step's weights."""
    step = trainer.steppers.cpu_adam.step
    trainer.steppers.cpu_adam.step = lambda u, multiplier: (time.sleep(0.02), step(u, multiplier))


def drop_update_done_wait(trainer):
    """The next forward streams a unit without waiting for its update to have written the master and its copy."""
    slow_cpu_adam(trainer)
    trainer.streamer.writer.wait_written = lambda u: None


@pytest.mark.parametrize("copy", [True, False])
def test_race_the_forward_streams_a_unit_once_its_update_is_written(copy):
    """The CPU Adam writes the master and, in the same pass, the compute-dtype copy the copy stream reads: the third
    step's forward, issued while the second step's updates still run, must wait for them. The intact wait survives
    a slow Adam; without it the step trains on stale or torn weights."""
    model, batches = model_and_batches(THIN, seq_len=16, batch_size=1)
    ref_trainer = offloaded_trainer(model, CUDA, 1, batches, pin=True, copy=copy, reuse=True)
    _, _, ref_masters, ref_losses = train(ref_trainer, batches, 3)
    for hook, should_match in ((slow_cpu_adam, True), (drop_update_done_wait, False)):
        trainer = offloaded_trainer(model, CUDA, 1, batches, pin=True, copy=copy, reuse=True)
        hook(trainer)
        _, _, masters, losses = train(trainer, batches, 3)
        matches = losses == ref_losses and all(torch.equal(m, ref_masters[name]) for name, m in masters.items())
        assert matches == should_match, f"copy {copy}, {'intact' if should_match else 'wait removed'}"


@pytest.mark.parametrize("k", [1, 2])
@pytest.mark.parametrize("dtype", ["bfloat16", "float32"])
def test_adam_over_streamed_state_grads_bitwise_equal_gpu_mode(dtype, k, monkeypatch):
    """The embeddings, the head and the first layer stepped by the GPU's Adam over state streamed through two slots
    in chunks (several per layer): the gradients are gpu mode's bits, the masters its to float32 rounding."""
    monkeypatch.setattr(ol, "GPU_ADAM_CHUNK", 2**14)
    model, batches = model_and_batches(SMALL, dtype, k=k)
    trainer = offloaded_trainer(model, CUDA, 1, batches, pin=True, gpu_adam=(0, 5, 1))
    assert len(ol.streamed_adam(trainer).chunks(1)) >= 3
    grads, masters_1, masters, losses = train(trainer, batches, 3)
    ref_grads, ref_masters_1, ref_masters, ref_losses = reference(model, batches)
    assert all(torch.equal(g, ref_grads[name]) for name, g in grads.items())
    assert losses[0] == ref_losses[0]
    if dtype == "float32":
        assert_masters_close(masters, ref_masters, 3)
    else:
        assert_masters_close(masters_1, ref_masters_1, 1)


class SkipWaits(torch.cuda.Stream):
    """A stream that ignores the waits on the events `skip(event)` picks: removes one ordering to show it is
    needed."""

    def __new__(cls, skip):
        return super().__new__(cls, CUDA)

    def __init__(self, skip):
        self.skip = skip

    def wait_event(self, event) -> None:
        if not self.skip(event):
            super().wait_event(event)


def delay(obj, name):
    """obj.name (a method that issues copies or kernels on the current stream) first sleeps 20 ms on that stream."""
    fn = getattr(obj, name)
    setattr(obj, name, lambda *a, **kw: (torch.cuda._sleep(40_000_000), fn(*a, **kw))[1])


def slow_take(trainer):
    """The GPU Adam copies each unit's gradients out of the gradient buffer 20 ms late."""
    take, gpu_adam = ol.streamed_adam(trainer).take, ol.streamed_adam(trainer)

    def late(*args):
        with torch.cuda.stream(gpu_adam.s_adam):
            torch.cuda._sleep(40_000_000)
        return take(*args)

    gpu_adam.take = late


def slow_adam_step(trainer):
    """Each chunk's Adam step runs 20 ms late (the GPU Adam's copies of the chunk stay as they are)."""
    step = ol.torch_adam_step
    ol.torch_adam_step = lambda *a: (torch.cuda._sleep(40_000_000), step(*a))[1]


def without_gpu_adam_waits(trainer):
    """The next forward streams a unit the GPU's Adam steps without waiting for its state to be written back."""
    wait = trainer.streamer.writer.wait_written
    trainer.streamer.writer.wait_written = lambda u: None if u in ol.streamed_adam(trainer).written_back else wait(u)


def without_gradients_written_wait(trainer):
    """The GPU Adam takes a unit's gradients without waiting for the backward to have written them."""
    stretch_backward(trainer)
    gpu_adam = ol.streamed_adam(trainer)
    gpu_adam.s_adam = SkipWaits(lambda event: event not in gpu_adam.landed)


def without_taken_wait(trainer):
    """The next unit's backward overwrites the gradient buffer without waiting for the GPU Adam to have taken it."""
    slow_take(trainer)
    gpu_adam = ol.streamed_adam(trainer)
    take = gpu_adam.take

    def take_and_forget(*args):
        take(*args)
        return ol.InOrder()

    gpu_adam.take = take_and_forget


def without_event(name):
    """A hook that replaces the GPU Adam's two events `name` by stand-ins that order nothing, after delaying."""

    def hook(trainer, delayed):
        delayed(trainer)
        setattr(ol.streamed_adam(trainer), name, [ol.InOrder()] * 2)

    return hook


def delay_copy_in(trainer):
    delay(ol.streamed_adam(trainer), "copy_in")


def delay_copy_out(trainer):
    delay(ol.streamed_adam(trainer), "copy_out")


STREAMED_ADAM_RACES = {  # name: (hook that delays, hook that also removes the wait that covers the delay)
    "gradients written before they are taken": (stretch_backward, without_gradients_written_wait),
    "gradient buffer reused once they are taken": (slow_take, without_taken_wait),
    "a chunk in before it is stepped": (delay_copy_in, lambda t: without_event("landed")(t, delay_copy_in)),
    "a chunk stepped before it leaves": (slow_adam_step, lambda t: without_event("stepped")(t, slow_adam_step)),
    "a slot emptied before the next chunk fills it": (
        delay_copy_out,
        lambda t: without_event("left")(t, delay_copy_out),
    ),
    "the state written back before the next forward streams the unit": (
        delay_copy_out,
        lambda t: (delay_copy_out(t), without_gpu_adam_waits(t)),
    ),
}


@pytest.mark.parametrize("race", STREAMED_ADAM_RACES)
def test_race_each_wait_of_the_adam_over_streamed_state_is_needed(race, monkeypatch):
    """Each hook pair: the intact waits survive a delayed copy or a stretched kernel of the GPU Adam over streamed
    state, the removed one does not: three steps with the embeddings and two layers on it (chunks of 2^22, 13 per
    layer) change no bit, or change some."""
    monkeypatch.setattr(ol, "GPU_ADAM_CHUNK", 2**22)
    model, batches = model_and_batches(THIN, seq_len=16, batch_size=1)
    ref = streamed_adam_reference()
    adam_step = ol.torch_adam_step
    for hook, should_match in zip(STREAMED_ADAM_RACES[race], (True, False), strict=False):
        monkeypatch.setattr(ol, "torch_adam_step", adam_step)  # a hook may replace it; undone after the test
        trainer = offloaded_trainer(model, CUDA, 1, batches, pin=True, gpu_adam=(0, 1, 2), reuse=True)
        hook(trainer)
        got = train(trainer, batches, 3)
        matches = got[3] == ref[3] and all(
            torch.equal(t, r[name]) for ours, r in zip(got[:3], ref[:3], strict=False) for name, t in ours.items()
        )
        assert matches == should_match, f"{race}, {'intact' if should_match else 'wait removed'}"


def test_trace_shows_gradient_copies_under_backward_kernels(tmp_path):
    sizes = {**THIN, "vocab_size": 32000}
    # 8192 tokens: a layer's backward runs several times as long as its gradients' copy, so the copies find kernels to
    # run under though a busy host delays the launches or the copies (at 4096 they at times did not)
    model, batches = model_and_batches(sizes, seq_len=8192, batch_size=1)
    trainer = offloaded_trainer(model, CUDA, 1, batches, pin=True)
    trainer.step(batches)
    d2h = ol.profile_step(trainer, batches, str(tmp_path / "t.json"))["d2h"]  # the gradients' copies
    # held to what this step's copies could hide under: their time before the other streams' kernels ended (a busy host
    # can hold a step's copies past them); the compute stream has gaps between kernels, so half of it
    assert d2h["overlap_ms"] > 0.5 * d2h["hideable_ms"] > 0, d2h
    assert set(d2h["copy_streams"]) - set(d2h["kernel_streams"]), "gradients must leave on a stream of their own"


def test_blocked_training_overlaps_nothing(tmp_path):
    """blocked is the naive offload: its weights' copies wait for compute in one slot, its gradients leave on the
    compute stream and its Adam runs after the backward, so no copy runs under a kernel of another stream."""
    sizes = {**THIN, "vocab_size": 32000}
    model, batches = model_and_batches(sizes, seq_len=4096, batch_size=1)
    trainer = offloaded_trainer(model, CUDA, 0, batches, pin=True)
    assert trainer.d2h_stream == torch.cuda.current_stream()
    trainer.step(batches)
    trace = ol.profile_step(trainer, batches, str(tmp_path / "t.json"))
    for copies in (trace["h2d"], trace["d2h"]):
        assert copies["copy_ms"] > 0 and copies["overlap_ms"] < 0.05 * copies["copy_ms"], trace


@pytest.mark.parametrize("offload, gpu_adam", [(False, ()), (True, ()), (False, (0, 5, 1))])
def test_100_steps_grow_no_memory(offload, gpu_adam):
    model, batches = model_and_batches(SMALL, k=2)
    trainer = offloaded_trainer(model, CUDA, 1, batches, pin=True, offload=offload, gpu_adam=gpu_adam)
    pinned = getattr(torch.cuda, "host_memory_stats", lambda: {})

    def memory():
        trainer.wait_updates()
        torch.cuda.synchronize()
        gc.collect()  # an earlier test's garbage, freed by a collection during the steps, would read as a change
        return torch.cuda.memory_allocated(), pinned().get("allocated_bytes.current")

    torch.cuda.reset_peak_memory_stats()
    for _ in range(5):
        trainer.step(batches)
    before, peak_early = memory(), torch.cuda.max_memory_allocated()
    torch.cuda.reset_peak_memory_stats()
    for _ in range(95):
        trainer.step(batches)
    assert memory() == before
    assert torch.cuda.max_memory_allocated() <= peak_early
    trainer.finish()


def test_bound_parts_are_timed_in_rounds_between_the_steps():
    model, batches = model_and_batches(SMALL)
    trainer = offloaded_trainer(model, CUDA, 1, batches, pin=True)
    run = ol.RunConfig(steps=6, warmup=1, repeat=2)
    r = ol.train_steps(
        trainer, batches, run, keep_grads=False, bound_parts=lambda: ol.train_bound_parts(trainer, batches, CUDA)
    )
    trainer.finish()
    assert r["timed_steps"] == [2, 4, 5]
    kinds, host = {"embed", "layer", "norm", "head"}, {"h2d", "d2h", "adam", "adam_small", "host"}
    assert set(r["bound_parts_ms"]) == kinds | {f"{k}_forward" for k in kinds} | host  # forwards: the Adam's chain
    assert all(len(ms) == 2 and min(ms) > 0 for ms in r["bound_parts_ms"].values())
    t = ol.training_figures(trainer, r)
    assert t["efficiency"] == t["bound_ms"] / r["time_ms"] <= 1.02, "a part timed alone took longer than the step"
    weights = [w.nbytes for w in trainer.store.weights]  # every unit streamed; the backward finds the last two there
    assert t["h2d_bytes"] == 2 * sum(weights) - sum(weights[-2:])


def test_a_clipped_step_times_each_forward_for_its_held_bound():
    """Clipping holds the updates for the whole backward: each kind's forward is timed alone too, and the bound is at
    least the backward followed by the longer of the forward and the CPU Adam."""
    model, batches = model_and_batches(SMALL)
    trainer = offloaded_trainer(model, CUDA, 1, batches, pin=True, clip=1.0)
    run = ol.RunConfig(steps=4, warmup=1, repeat=2, clip_grad_norm=1.0)
    r = ol.train_steps(
        trainer, batches, run, keep_grads=False, bound_parts=lambda: ol.train_bound_parts(trainer, batches, CUDA)
    )
    trainer.finish()
    kinds = {"embed", "layer", "norm", "head"}
    host = {"h2d", "d2h", "adam", "adam_small", "host"}
    assert set(r["bound_parts_ms"]) == kinds | {f"{k}_forward" for k in kinds} | host
    t = ol.training_figures(trainer, r)
    assert 0 < t["gpu_forward_ms"] < t["gpu_compute_ms"]
    backward = t["gpu_compute_ms"] - t["gpu_forward_ms"]
    assert t["bound_ms"] >= t["held_updates_ms"] == backward + max(t["gpu_forward_ms"], t["cpu_adam_ms"])


def test_bound_counts_the_state_the_gpu_adam_streams():
    """With units on the GPU's Adam over streamed state, the copies carry their float32 master and moments in and
    those and the bfloat16 copy out instead of their gradients, and the CPU Adam's parts count the other units."""
    model, batches = model_and_batches(SMALL)
    trainer = offloaded_trainer(model, CUDA, 1, batches, pin=True, gpu_adam=(0, 5))
    run = ol.RunConfig(steps=6, warmup=1, repeat=2)
    r = ol.train_steps(
        trainer, batches, run, keep_grads=False, bound_parts=lambda: ol.train_bound_parts(trainer, batches, CUDA)
    )
    trainer.finish()
    t = ol.training_figures(trainer, r)
    numels = [m.numel() for m in trainer.store.masters]
    weights = [2 * n for n in numels]
    gpu = numels[0] + numels[5]
    # the backward finds its first two units in the slots
    assert t["h2d_bytes"] == 2 * sum(weights) - sum(weights[-2:]) + 12 * gpu
    assert t["d2h_bytes"] == 2 * (sum(numels) - gpu) + 14 * gpu and t["gpu_adam_params"] == gpu
    largest_on_cpu = max(numels[1:5])
    call = ol.adam_call_ms(min(r["bound_parts_ms"]["adam"]), min(r["bound_parts_ms"]["adam_small"]))
    scaled = len(numels[1:5]) * call + (min(r["bound_parts_ms"]["adam"]) - call) * (sum(numels) - gpu) / largest_on_cpu
    busy = statistics.median(r["cpu_adam_busy_ms"][i] for i in r["timed_steps"])
    assert t["cpu_adam_ms"] == pytest.approx(min(scaled, busy))  # timed alone, or the steps' own where it took less
