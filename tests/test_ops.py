"""lit_moe.ops: norms, gated activations, rotary kernel, casting Linear — against hand-written formulas."""

import math

import pytest
import torch

from lit_moe.ops import GatedActivation, LayerNorm, Linear, RMSNorm, apply_rotary, build_norm


def test_rmsnorm_matches_formula_and_casts_back():
    torch.manual_seed(0)
    x = torch.randn(3, 5, 16, dtype=torch.bfloat16)
    norm = RMSNorm(16, eps=1e-6, compute_dtype=torch.float32)
    with torch.no_grad():
        norm.weight.copy_(torch.linspace(0.5, 1.5, 16))
    xf = x.float()
    expected = xf / torch.sqrt(xf.pow(2).mean(-1, keepdim=True) + 1e-6) * norm.weight
    y = norm(x)
    assert y.dtype == torch.bfloat16
    assert torch.equal(y, expected.to(torch.bfloat16))


def test_layernorm_matches_formula_and_casts_back():
    torch.manual_seed(0)
    x = torch.randn(4, 16, dtype=torch.bfloat16)
    norm = LayerNorm(16, eps=1e-5)
    with torch.no_grad():
        norm.weight.copy_(torch.linspace(0.5, 1.5, 16))
        norm.bias.copy_(torch.linspace(-1, 1, 16))
    xf = x.float()
    mu = xf.mean(-1, keepdim=True)
    var = xf.var(-1, unbiased=False, keepdim=True)
    expected = (xf - mu) / torch.sqrt(var + 1e-5) * norm.weight + norm.bias
    y = norm(x)
    assert y.dtype == torch.bfloat16
    torch.testing.assert_close(y.float(), expected.to(torch.bfloat16).float(), atol=1e-2, rtol=0)


def test_norm_compute_dtype_is_honoured():
    seen = []

    class Spy(torch.overrides.TorchFunctionMode):
        def __torch_function__(self, func, types, args=(), kwargs=None):
            if func is torch.nn.functional.rms_norm:
                seen.append((args[0].dtype, (kwargs or {}).get("weight", args[2] if len(args) > 2 else None).dtype))
            return func(*args, **(kwargs or {}))

    x = torch.randn(2, 8)
    with Spy():
        RMSNorm(8, compute_dtype=torch.bfloat16)(x)
        RMSNorm(8, compute_dtype=torch.float32)(x.to(torch.bfloat16))
    assert seen == [(torch.bfloat16, torch.bfloat16), (torch.float32, torch.float32)]


def test_build_norm_errors():
    with pytest.raises(ValueError, match=r"fused_norm.*False.*only fused normalization"):
        build_norm("RMSNorm", 8, 1e-6, fused_norm=False)
    with pytest.raises(ValueError, match=r"normalization: 'BatchNorm'.*'RMSNorm', 'LayerNorm'"):
        build_norm("BatchNorm", 8, 1e-6)
    assert isinstance(build_norm("LayerNorm", 8, 1e-6), LayerNorm)
    assert isinstance(build_norm("RMSNorm", 8, 1e-6), RMSNorm)


@pytest.mark.parametrize("approximate", ["none", "tanh"])
def test_gelu_gated(approximate):
    torch.manual_seed(0)
    g, u = torch.randn(6, 10), torch.randn(6, 10)
    if approximate == "none":
        gelu = 0.5 * g * (1 + torch.erf(g / math.sqrt(2)))
    else:
        gelu = 0.5 * g * (1 + torch.tanh(math.sqrt(2 / math.pi) * (g + 0.044715 * g ** 3)))
    act = GatedActivation("gelu", approximate=approximate)
    torch.testing.assert_close(act(g, u), gelu * u)
    torch.testing.assert_close(act.forward_packed(torch.cat([g, u], -1)), gelu * u)


@pytest.mark.parametrize("name,inplace", [("silu", False), ("silu", True), ("fusedswiglu", False)])
def test_swiglu_variants_agree_with_formula_and_gradients(name, inplace):
    torch.manual_seed(0)
    gate_up = torch.randn(5, 12, requires_grad=True)
    act = GatedActivation(name, inplace=inplace)
    y = act.forward_packed(gate_up)
    g, u = gate_up.detach().chunk(2, -1)
    torch.testing.assert_close(y, g * torch.sigmoid(g) * u)
    y2 = act(gate_up[:, :6] * 1.0, gate_up[:, 6:])   # *1.0: an in-place silu must not touch the leaf
    torch.testing.assert_close(y2, y)
    (y + y2).backward(torch.ones_like(y) / 2)
    ref = gate_up.detach().clone().requires_grad_(True)
    rg, ru = ref.chunk(2, -1)
    (rg * torch.sigmoid(rg) * ru).sum().backward()
    torch.testing.assert_close(gate_up.grad, ref.grad)


def test_activation_errors_list_supported():
    with pytest.raises(ValueError, match=r"hidden_act.*'relu'.*'gelu', 'silu', 'fusedswiglu'"):
        GatedActivation("relu")
    with pytest.raises(ValueError, match=r"gelu_approximate.*'sigmoid'"):
        GatedActivation("gelu", approximate="sigmoid")
    with pytest.raises(ValueError, match=r"use_fused_swiglu"):
        GatedActivation("gelu", use_fused_swiglu=True)


def test_rotary_is_complex_rotation_of_interleaved_pairs():
    torch.manual_seed(0)
    d = 8
    x = torch.randn(2, 3, d, dtype=torch.float64)
    angle = torch.rand(2, 3, d // 2, dtype=torch.float64) * 6
    out = apply_rotary(x, angle.cos(), angle.sin())
    z = torch.view_as_complex(x.view(2, 3, d // 2, 2).contiguous()) * torch.polar(torch.ones_like(angle), angle)
    # the output holds [real parts | imaginary parts] (de-interleaved, as HF/Megatron)
    torch.testing.assert_close(out, torch.cat([z.real, z.imag], -1))


def test_rotary_computes_in_cos_dtype_and_casts_back():
    torch.manual_seed(0)
    x = torch.randn(4, 16, dtype=torch.bfloat16)
    angle = torch.rand(4, 8) * 100
    out = apply_rotary(x, angle.cos(), angle.sin())
    ref = apply_rotary(x.float(), angle.cos(), angle.sin()).to(torch.bfloat16)
    assert out.dtype == torch.bfloat16 and torch.equal(out, ref)


def test_linear_casts_weight_to_input_dtype():
    lin = Linear(4, 3, dtype=torch.float32)
    with torch.no_grad():
        lin.weight.copy_(torch.arange(12.0).view(3, 4) / 10)
    x = torch.randn(2, 4, dtype=torch.bfloat16, requires_grad=True)
    y = lin(x)
    assert y.dtype == torch.bfloat16 and lin.weight.dtype == torch.float32
    y.float().sum().backward()
    assert lin.weight.grad.dtype == torch.float32
    assert lin.bias is None


def test_fused_linear_is_one_gemm_equal_to_the_modules_and_respects_hooks():
    from lit_moe.ops import Linear, fused_linear

    torch.manual_seed(0)
    a, b = Linear(16, 8), Linear(16, 4)
    with torch.no_grad():
        a.weight.normal_(), b.weight.normal_()
    x = torch.randn(3, 16, dtype=torch.float64)
    calls = []

    class Count(torch.overrides.TorchFunctionMode):
        def __torch_function__(self, func, types, args=(), kwargs=None):
            if func is torch.nn.functional.linear:
                calls.append(func)
            return func(*args, **(kwargs or {}))

    with Count():
        y = fused_linear(x, a, b)
    assert len(calls) == 1 and y.shape == (3, 12)
    torch.testing.assert_close(y, torch.cat([a(x), b(x)], -1), atol=0, rtol=0)
    hooked = []
    b.register_forward_hook(lambda m, i, o: hooked.append(o.shape))   # e.g. tensor parallel, recompute
    calls.clear()
    with Count():
        y2 = fused_linear(x, a, b)
    assert len(calls) == 2 and hooked == [(3, 4)]
    torch.testing.assert_close(y2, y, atol=0, rtol=0)


# ----------------------------------------------------------------------------------------------
# SDPA backend choice (CUDA); checked on CPU with stand-in availability tables
# ----------------------------------------------------------------------------------------------
# flash is asked about the padded value (d_v = d_qk), the others about the real one
@pytest.mark.parametrize("available,expected,asked", [
    ({"cudnn", "flash", "efficient"}, ("cudnn", False), [("cudnn", 128)]),
    ({"flash", "efficient"}, ("flash", True), [("cudnn", 128), ("flash", 192)]),
    ({"efficient"}, ("efficient", False), [("cudnn", 128), ("flash", 192), ("efficient", 128)]),
    (set(), (None, False), [("cudnn", 128), ("flash", 192), ("efficient", 128)]),
])
def test_sdpa_backend_priority_and_logged_once(monkeypatch, caplog, available, expected, asked):
    import lit_moe.ops.sdpa as sdpa_mod

    seen = []

    def fake(backend, q_shape, v_dim, *rest):
        seen.append((backend, v_dim))
        return backend in available

    monkeypatch.setattr(sdpa_mod, "_can_use", fake)
    sdpa_mod._choose.cache_clear()
    with caplog.at_level("INFO", logger="lit_moe.ops.sdpa"):
        for _ in range(3):
            got = sdpa_mod.sdpa_backend((2, 16, 64, 192), 128, torch.bfloat16, torch.device("cpu"), False, 0.0, True)
    sdpa_mod._choose.cache_clear()
    assert got == expected and seen == asked                  # decided once for the three calls
    assert len([r for r in caplog.records if r.name == "lit_moe.ops.sdpa"]) == 1


def test_sdpa_padded_value_matches_unpadded(monkeypatch):
    """The flash route of ``sdpa``: v zero-padded to d_qk, the output sliced back; values and all
    gradients equal plain SDPA, with and without a mask (the math backend stands in for flash)."""
    import lit_moe.ops.sdpa as sdpa_mod
    from torch.nn.attention import SDPBackend

    monkeypatch.setattr(sdpa_mod, "_backend_for", lambda *a: ("flash", True))
    monkeypatch.setitem(sdpa_mod._BACKENDS, "flash", SDPBackend.MATH)
    padded = []
    original = sdpa_mod.padded_value
    monkeypatch.setattr(sdpa_mod, "padded_value", lambda v, d: padded.append(d) or original(v, d))
    g = torch.Generator().manual_seed(0)
    q, k = (torch.randn(2, 3, 10, 12, dtype=torch.float64, generator=g).requires_grad_() for _ in range(2))
    v = torch.randn(2, 3, 10, 8, dtype=torch.float64, generator=g).requires_grad_()
    do = torch.randn(2, 3, 10, 8, dtype=torch.float64, generator=g)
    mask = (torch.rand(1, 1, 10, 10, generator=g) > 0.3) | torch.eye(10, dtype=torch.bool)
    for allowed in (None, mask):
        ref = torch.nn.functional.scaled_dot_product_attention(q, k, v, attn_mask=allowed, is_causal=allowed is None,
                                                               scale=0.3)
        want = torch.autograd.grad((ref * do).sum(), (q, k, v))
        out = sdpa_mod.sdpa(q, k, v, allowed, 0.0, 0.3)
        got = torch.autograd.grad((out * do).sum(), (q, k, v))
        assert out.shape == ref.shape
        torch.testing.assert_close(out, ref, atol=1e-12, rtol=0)
        for a, b in zip(got, want):
            torch.testing.assert_close(a, b, atol=1e-12, rtol=0)
    assert padded == [12, 12]
