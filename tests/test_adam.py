"""CPU tier, the CPU Adam update: one fused pass (torch.compile) or its fallback (torch.optim.Adam's fused kernel and
a cast), each against torch.optim.Adam over several steps."""

import pytest
import torch

import offload_llama as ol

N = 3 * 2**16 + 5  # not a multiple of the vector width: the loop's tail runs too
STEPS = 5


def gradients(master: torch.Tensor, step: int, dtype: torch.dtype) -> torch.Tensor:
    """Gradients of Adam's scale with the sign of the weight decay's term (weight * decay), so the two never cancel
    to near zero, where Adam turns a last-bit difference into an lr-sized move."""
    g = torch.randn(master.shape, generator=torch.Generator().manual_seed(step)).abs_().add_(0.1).mul_(1e-3)
    return (g * master.sign()).to(dtype)


def run_update(update: ol.AdamUpdate, dtype: torch.dtype, grad_dtype: torch.dtype, multiplier: float = 1.0):
    """STEPS steps of `update` from one start, beside torch.optim.Adam on float32 copies of the same gradients (times
    `multiplier`, as clip_grad_norm_ scales them): (master, moments, copy) and torch's (master, moments)."""
    master = torch.randn(N, generator=torch.Generator().manual_seed(0))
    exp_avg, exp_avg_sq, step = torch.zeros(N), torch.zeros(N), torch.zeros(())
    copy = torch.empty(N, dtype=dtype) if dtype != torch.float32 else None
    reference = torch.nn.Parameter(master.clone())
    optimizer = update.adam.optimizer([reference])
    for s in range(1, STEPS + 1):
        grads = gradients(master, s, grad_dtype)
        reference.grad = grads.float() * multiplier
        update(master, grads, exp_avg, exp_avg_sq, copy, step, multiplier)
        optimizer.step()
    state = optimizer.state[reference]
    return (master, exp_avg, exp_avg_sq, copy, step), (reference.detach(), state["exp_avg"], state["exp_avg_sq"])


def assert_adam_close(ours, theirs):
    (master, exp_avg, exp_avg_sq, copy, step), (ref_master, ref_exp_avg, ref_exp_avg_sq) = ours, theirs
    assert step.item() == STEPS
    for ours, theirs in ((master, ref_master), (exp_avg, ref_exp_avg), (exp_avg_sq, ref_exp_avg_sq)):
        atol = ol.masters_tolerance(theirs.abs().max().item(), STEPS)  # float32 rounding, at each tensor's scale
        torch.testing.assert_close(ours, theirs, rtol=0, atol=atol)
    if copy is not None:
        assert torch.equal(copy, master.to(copy.dtype)), "the copy is the new master, rounded to nearest even"


@pytest.mark.parametrize("weight_decay", [0.0, 0.01])
@pytest.mark.parametrize(
    "dtype, grad_dtype",
    [
        (torch.bfloat16, torch.bfloat16),
        (torch.bfloat16, torch.float32),
        (torch.float16, torch.float32),
        (torch.float32, torch.float32),
    ],
)
def test_fused_update_equals_torch_adam(dtype, grad_dtype, weight_decay):
    update = ol.CompiledAdamUpdate(
        ol.Adam(lr=1e-3, weight_decay=weight_decay), grad_dtype, dtype if dtype != torch.float32 else None
    )
    assert update.compiled is not None, "this machine has a C++ compiler: the update must compile"
    assert update.grad_dtype == grad_dtype
    assert_adam_close(*run_update(update, dtype, grad_dtype))


@pytest.mark.parametrize("kind", ["AdamUpdate", "CompiledAdamUpdate"])
@pytest.mark.parametrize("weight_decay", [0.0, 0.01])
def test_the_plain_update_is_torch_adam_and_a_cast(monkeypatch, weight_decay, kind):
    """The plain AdamUpdate, and CompiledAdamUpdate where the update does not compile: the gradients come in float32 and
    torch.optim.Adam's own kernel steps, bitwise torch's masters and moments."""
    monkeypatch.setattr(ol, "compiled_adam_update", lambda grad_dtype, copy_dtype, scaled: None)
    kind = getattr(ol, kind)
    update = kind(ol.Adam(lr=1e-3, weight_decay=weight_decay), torch.bfloat16, torch.bfloat16)
    assert update.grad_dtype == torch.float32 and update.bytes_per_param == 24 + 4 + 2 + 4
    clipped = kind(ol.Adam(), torch.bfloat16, torch.bfloat16, scaled=True)  # scales the gradients first
    assert clipped.bytes_per_param == update.bytes_per_param + 8
    ours, theirs = run_update(update, torch.bfloat16, update.grad_dtype)
    assert all(torch.equal(a, b) for a, b in zip(ours[:3], theirs, strict=False))
    assert_adam_close(ours, theirs)


def test_compile_failure_falls_back_and_says_so(monkeypatch, capsys):
    def no_compiler(*args, **kwargs):
        raise RuntimeError("no C++ compiler")

    monkeypatch.setattr(ol.torch, "compile", no_compiler)
    assert ol.compiled_adam_update.__wrapped__(torch.bfloat16, torch.bfloat16) is None
    assert "torch.optim.Adam(fused=True) and a cast" in capsys.readouterr().err


def test_fused_update_moves_28_bytes_per_parameter():
    """float32 master and moments read and written, 16-bit gradients read and copy written."""
    assert ol.CompiledAdamUpdate(ol.Adam(), torch.bfloat16, torch.bfloat16).bytes_per_param == 28
    assert ol.CompiledAdamUpdate(ol.Adam(), torch.float32, None).bytes_per_param == 28


@pytest.mark.parametrize("grad_dtype", [torch.bfloat16, torch.float32])
def test_scaled_update_equals_torch_adam_on_scaled_gradients(grad_dtype):
    """--clip-grad-norm's update: the gradients times the step's multiplier in the same pass (float32 product)."""
    update = ol.CompiledAdamUpdate(ol.Adam(lr=1e-3, weight_decay=0.01), grad_dtype, torch.bfloat16, scaled=True)
    assert update.compiled is not None
    assert_adam_close(*run_update(update, torch.bfloat16, grad_dtype, multiplier=0.37))
