"""lit_moe.ops.cross_entropy: the fused output-layer loss against the formula, and in the model against
the plain logits → cross-entropy path."""

import pytest
import torch
import torch.nn.functional as F

from lit_moe.model import DeepseekV3ForCausalLM
from lit_moe.ops.cross_entropy import LMHead, linear_cross_entropy


def reference(h, w, labels, mask):
    """fp64 formula: logits rounded to the compute dtype (as the model's head GEMM), then
    sum_t mask_t (logsumexp(z_t) - z_t[label_t]) / sum(mask)."""
    z = (h @ w.t()).double()
    lab = torch.where(mask, labels, 0)
    ce = torch.logsumexp(z, -1) - z.gather(1, lab[:, None]).squeeze(1)
    return (ce * mask).sum() / mask.sum().clamp_min(1e-8)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("block_rows", [1, 37, 10_000])   # many blocks, a ragged last block, one block
@pytest.mark.parametrize("T,H", [(150, 32), (12, 64)])     # input gradients kept / logits' gradient kept
def test_loss_and_gradients_match_formula(dtype, block_rows, T, H):
    torch.manual_seed(0)
    V = 500
    h = torch.randn(T, H).to(dtype).requires_grad_()
    w = (torch.randn(V, H) * 0.5).to(dtype).requires_grad_()
    labels = torch.randint(0, V, (T,))
    labels[::7] = -100                       # ignored positions, labels out of range there
    labels[1] = V - 1
    mask = labels != -100
    loss = linear_cross_entropy(h, w, labels, mask, block_bytes=4 * V * block_rows)
    (loss * 0.25).backward()                 # the incoming gradient scales both input gradients

    h64 = h.detach().double().requires_grad_()
    w64 = w.detach().double().requires_grad_()
    ref = reference(h64, w64, labels, mask)
    (ref * 0.25).backward()
    assert loss.dtype == torch.float32
    tol = dict(atol=1e-6, rtol=1e-6) if dtype == torch.float32 else dict(atol=2e-2, rtol=2e-2)
    torch.testing.assert_close(loss.double(), ref.detach(), **({"atol": 1e-5, "rtol": 1e-5}
                                                               if dtype == torch.float32 else {"atol": 2e-2, "rtol": 0}))
    for got, want in ((h.grad, h64.grad), (w.grad, w64.grad)):
        assert got.dtype == dtype
        scale = want.abs().max()
        torch.testing.assert_close(got.double() / scale, want / scale, atol=tol["atol"], rtol=0)


def test_empty_mask_gives_zero_loss_and_gradients():
    h = torch.randn(6, 8, requires_grad=True)
    w = torch.randn(10, 8, requires_grad=True)
    labels = torch.full((6,), -100)
    loss = linear_cross_entropy(h, w, labels, labels != -100)
    loss.backward()
    assert loss.item() == 0.0
    assert torch.count_nonzero(h.grad) == 0 and torch.count_nonzero(w.grad) == 0


def test_float_mask_weights_tokens():
    torch.manual_seed(1)
    h, w = torch.randn(5, 4, dtype=torch.float64), torch.randn(7, 4, dtype=torch.float64)
    labels = torch.tensor([1, 2, 3, 4, 5])
    mask = torch.tensor([1.0, 0.0, 1.0, 1.0, 0.0])
    got = linear_cross_entropy(h.float(), w.float(), labels, mask)
    torch.testing.assert_close(got.double(), reference(h, w, labels, mask > 0), atol=1e-6, rtol=1e-6)


def test_head_without_labels_is_a_linear_layer():
    head = LMHead(8, 10)
    torch.nn.init.normal_(head.weight)
    x = torch.randn(2, 3, 8, dtype=torch.bfloat16)
    assert torch.equal(head(x), F.linear(x, head.weight.to(torch.bfloat16)))


def test_dtype_mismatch_is_an_error():
    with pytest.raises(ValueError, match="dtypes differ"):
        linear_cross_entropy(torch.randn(2, 4), torch.randn(3, 4, dtype=torch.bfloat16),
                             torch.tensor([0, 1]), torch.tensor([True, True]))


CFG = dict(vocab_size=96, hidden_size=32, intermediate_size=48, moe_intermediate_size=16, num_hidden_layers=2,
           num_attention_heads=2, kv_lora_rank=16, q_lora_rank=24, qk_rope_head_dim=8, qk_nope_head_dim=8,
           v_head_dim=8, n_routed_experts=4, num_experts_per_tok=2, n_group=2, topk_group=1,
           first_k_dense_replace=1, num_nextn_predict_layers=1, seq_length=16, moe_aux_loss_coeff=0.01)


@pytest.mark.parametrize("compute_dtype", ["float32", "bfloat16"])
def test_model_training_loss_and_grads_equal_the_plain_head(monkeypatch, compute_dtype):
    """A training forward with labels uses the fused head (logits None); its losses and every parameter
    gradient equal those of the plain logits → masked cross-entropy path (main head and MTP)."""
    torch.manual_seed(0)
    ids = torch.randint(0, 96, (2, 16))
    labels = ids.roll(-1, 1)
    labels[:, -2:] = -100
    loss_mask = torch.ones(2, 16)
    loss_mask[0, :3] = 0

    def run(fused):
        torch.manual_seed(0)
        m = DeepseekV3ForCausalLM({**CFG, "compute_dtype": compute_dtype}).train()
        if not fused:
            monkeypatch.setattr(m, "_fused_loss", lambda: False)
        out = m(ids, labels=labels, loss_mask=loss_mask)
        (out.loss + out.mtp_loss + out.aux_loss).backward()
        return out, {n: p.grad for n, p in m.named_parameters()}

    fused, g_fused = run(True)
    plain, g_plain = run(False)
    assert fused.logits is None and plain.logits is not None
    tol = 1e-6 if compute_dtype == "float32" else 1e-5
    torch.testing.assert_close(fused.loss, plain.loss, atol=tol, rtol=tol)
    torch.testing.assert_close(fused.mtp_loss, plain.mtp_loss, atol=tol, rtol=tol)
    for name, g in g_plain.items():
        scale = g.abs().max().clamp_min(1e-12)
        # bf16: the head's input gradient is rounded to bf16 after (fused) or before (plain) the loss
        # scale, which moves the last bit of a few values
        torch.testing.assert_close(g_fused[name] / scale, g / scale, atol=1e-5 if compute_dtype == "float32"
                                   else 2e-2, rtol=0, msg=name)


def test_model_without_grad_returns_logits():
    torch.manual_seed(0)
    m = DeepseekV3ForCausalLM(CFG).train()
    ids = torch.randint(0, 96, (2, 16))
    with torch.no_grad():
        out = m(ids, labels=ids)
    assert out.logits is not None and out.logits.shape == (2, 16, 96) and out.logits.dtype == torch.float32


def test_only_the_wanted_gradients_and_none_without_grad():
    h = torch.randn(6, 8)
    w = torch.randn(10, 8, requires_grad=True)
    labels = torch.arange(6)
    linear_cross_entropy(h, w, labels, labels >= 0).backward()
    assert h.grad is None and w.grad is not None
    h.requires_grad_()
    with torch.no_grad():
        loss = linear_cross_entropy(h, w, labels, labels >= 0)
    assert not loss.requires_grad
    torch.testing.assert_close(loss.double(), reference(h.detach().double(), w.detach().double(), labels,
                                                        labels >= 0), atol=1e-6, rtol=1e-6)


def test_second_derivative_is_refused():
    h = torch.randn(6, 8, requires_grad=True)
    w = torch.randn(10, 8, requires_grad=True)
    labels = torch.arange(6)
    loss = linear_cross_entropy(h, w, labels, labels >= 0) + (h ** 3).sum()
    with pytest.raises(RuntimeError, match="no second derivative"):   # not a silently partial Hessian
        torch.autograd.grad(loss, h, create_graph=True)


def test_compiled_loss_is_one_row_block_and_matches_eager():
    """Under torch.compile the row-block loop is not unrolled: dynamo would turn every block into its
    own kernels and slice copies (on the CPU benchmark the compiled head took 3x the eager time). The
    default block size is a CPU cache's, so eagerly these shapes run in several blocks; compiled, the
    captured graph holds one softmax (one row maximum) and no slices, and loss and gradients match
    the fp64 formula."""
    from functorch.compile import make_boxed_func
    from torch._dynamo.backends.common import aot_autograd

    from lit_moe.ops.cross_entropy import row_block_bytes

    T, H, V = 1100, 16, 1000
    assert T * V * 4 > 2 * row_block_bytes(torch.device("cpu"))      # eagerly: at least three blocks
    ops = []

    def record_forward(gm, example_inputs):    # AOT autograd's forward graph: aten ops
        ops.extend(str(n.target) for n in gm.graph.nodes if n.op == "call_function")
        return make_boxed_func(gm)

    recording = aot_autograd(fw_compiler=record_forward, bw_compiler=lambda gm, _: make_boxed_func(gm))

    torch.manual_seed(0)
    h = torch.randn(T, H, requires_grad=True)
    w = torch.randn(V, H, requires_grad=True)
    labels = torch.randint(0, V, (T,))
    mask = torch.rand(T) > 0.1
    torch._dynamo.reset()
    loss_c = torch.compile(linear_cross_entropy, backend=recording, fullgraph=True)(h, w, labels, mask)
    gh_c, gw_c = torch.autograd.grad(loss_c, (h, w))
    assert sum(op.startswith("aten.amax") for op in ops) == 1, ops
    assert not any("slice" in op for op in ops), ops
    h64 = h.detach().double().requires_grad_()
    w64 = w.detach().double().requires_grad_()
    ref = reference(h64, w64, labels, mask)
    ref.backward()
    torch.testing.assert_close(loss_c.double(), ref.detach(), atol=1e-5, rtol=1e-5)
    for got, want in ((gh_c, h64.grad), (gw_c, w64.grad)):
        scale = want.abs().max()
        torch.testing.assert_close(got.double() / scale, want / scale, atol=1e-6, rtol=0)
