"""Mixed precision: every dtype field decides the dtype of its computation (recorded op by op)."""

import torch
import torch.nn.functional as F

import lit_moe.model.attention as attention_mod
from lit_moe.model import DeepseekV3ForCausalLM

CFG = dict(vocab_size=64, hidden_size=32, intermediate_size=48, moe_intermediate_size=16, num_hidden_layers=2,
           num_attention_heads=2, kv_lora_rank=16, q_lora_rank=24, qk_rope_head_dim=8, qk_nope_head_dim=8,
           v_head_dim=8, n_routed_experts=4, num_experts_per_tok=2, n_group=2, topk_group=1,
           first_k_dense_replace=1, num_nextn_predict_layers=1, position_embedding_type="yarn",
           scaling_factor=4.0, seq_length=8, use_flash_attention=False, moe_aux_loss_coeff=0.01)
E = 4


class Recorder(torch.overrides.TorchFunctionMode):
    def __init__(self):
        super().__init__()
        self.calls = []

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        self.calls.append((func, args, kwargs, out))
        return out

    def dtypes(self, func, pick=lambda a, k: a[0], where=lambda a, k: True):
        return {pick(a, k).dtype for f, a, k, _ in self.calls if f is func and where(a, k)}


def run(monkeypatch, **overrides):
    torch.manual_seed(0)
    m = DeepseekV3ForCausalLM({**CFG, **overrides}).train()
    rotary = []
    original = attention_mod.apply_rotary

    def spy(x, cos, sin, fused=None):
        out = original(x, cos, sin, fused)
        rotary.append((x.dtype, cos.dtype, out.dtype))
        return out

    monkeypatch.setattr(attention_mod, "apply_rotary", spy)
    ids = torch.randint(0, 64, (2, 8))
    rec = Recorder()
    with rec:
        out = m(ids, labels=ids)
        (out.loss + out.aux_loss + out.mtp_loss).backward()
    return m, rec, rotary, out


def is_router(a, k):
    w = a[1] if len(a) > 1 else k.get("weight")
    return w is not None and w.shape[0] == E and w.dim() == 2


def test_default_mixed_precision(monkeypatch):
    m, rec, rotary, out = run(monkeypatch)
    assert {p.dtype for p in m.parameters()} == {torch.float32}                        # params_dtype
    assert {moe.router.expert_bias.dtype for moe in m.moe_layers()} == {torch.float32}
    assert rec.dtypes(F.linear, where=lambda a, k: not is_router(a, k)) == {torch.bfloat16}     # compute_dtype
    assert rec.dtypes(F.linear, pick=lambda a, k: a[1], where=lambda a, k: not is_router(a, k)) == {torch.bfloat16}
    assert rec.dtypes(torch._grouped_mm) == {torch.bfloat16}   # (F.grouped_mm dispatches here)
    assert rec.dtypes(F.rms_norm) == {torch.float32}                                    # layernorm_compute_dtype
    assert rec.dtypes(torch.softmax) == {torch.float32}                                 # softmax_compute_dtype
    assert rec.dtypes(F.linear, where=is_router) == {torch.float32}                      # router_dense_type
    assert rec.dtypes(torch.sigmoid) == {torch.float32}
    assert rotary and {(c, o) for _, c, o in rotary} == {(torch.float32, torch.bfloat16)}   # rotary_dtype
    # training with labels: the fused head (lit_moe.ops.cross_entropy) gives an fp32 loss, no logits
    assert out.logits is None and out.loss.dtype == torch.float32 and out.mtp_loss.dtype == torch.float32
    with rec, torch.no_grad():
        logits = m(torch.randint(0, 64, (2, 8)), labels=torch.randint(0, 64, (2, 8))).logits
    assert rec.dtypes(F.cross_entropy) == {torch.float32}                               # plain head: fp32 loss
    assert logits.dtype == torch.float32
    assert all(p.grad is not None and p.grad.dtype == torch.float32 for p in m.parameters() if p.requires_grad)


def test_every_field_switches_its_computation(monkeypatch):
    m, rec, rotary, out = run(monkeypatch, params_dtype="bfloat16", compute_dtype="float32",
                              layernorm_compute_dtype="bfloat16", softmax_compute_dtype="bfloat16",
                              rotary_dtype="bfloat16", router_dense_type="bfloat16")
    assert {p.dtype for p in m.parameters()} == {torch.bfloat16}
    assert rec.dtypes(F.linear, where=lambda a, k: not is_router(a, k)) == {torch.float32}
    assert rec.dtypes(F.rms_norm) == {torch.bfloat16}
    assert rec.dtypes(torch.softmax) == {torch.bfloat16}
    assert rec.dtypes(F.linear, where=is_router) == {torch.bfloat16}
    assert {(c, o) for _, c, o in rotary} == {(torch.bfloat16, torch.float32)}
    assert out.loss.dtype == torch.float32
    assert torch.isfinite(out.loss)


def test_runs_with_bf16_weights_as_under_fsdp_mixed_precision(monkeypatch):
    torch.manual_seed(0)
    m = DeepseekV3ForCausalLM(CFG).train()
    for p in m.parameters():          # FSDP2's MixedPrecisionPolicy casts parameters, not buffers
        p.data = p.data.to(torch.bfloat16)
    rec = Recorder()
    ids = torch.randint(0, 64, (2, 8))
    with rec:
        out = m(ids, labels=ids)
        (out.loss + out.aux_loss + out.mtp_loss).backward()
    assert rec.dtypes(F.rms_norm) == {torch.float32}
    assert rec.dtypes(F.linear, where=is_router) == {torch.float32}
    assert m.moe_layers()[0].router.expert_bias.dtype == torch.float32
    assert torch.isfinite(out.loss)


def test_flash_path_keeps_compute_dtype_inputs(monkeypatch):
    _, rec, _, _ = run(monkeypatch, use_flash_attention=True)
    assert rec.dtypes(F.scaled_dot_product_attention) == {torch.bfloat16}
    assert not rec.dtypes(torch.softmax)


GROUPS = {  # parameter groups whose bf16 gradients are pinned separately (a name may be in several)
    "embedding": r"^embed_tokens\.", "attention": r"self_attention\.", "dense_mlp": r"^layers\.0\.mlp\.",
    "routed_experts": r"\.mlp\.experts\.", "shared_experts": r"\.shared_experts\.", "router": r"router\.weight",
    "norms": r"norm\.weight$", "mtp": r"^mtp\.", "head": r"^lm_head\.",
}


def _step_grads(compute_dtype):
    from helpers import randomize_norms_and_biases

    torch.manual_seed(0)
    m = DeepseekV3ForCausalLM({**CFG, "compute_dtype": compute_dtype, "params_dtype": "float32"}).train()
    randomize_norms_and_biases(m, seed=3)
    ids = torch.randint(0, 64, (8, 8), generator=torch.Generator().manual_seed(1))
    out = m(ids, labels=ids)
    (out.loss + out.aux_loss + out.mtp_loss).backward()
    losses = torch.stack([out.loss, out.aux_loss, out.mtp_loss]).detach().double()
    return losses, {n: p.grad.double() for n, p in m.named_parameters()}


def test_bf16_step_per_parameter_group_against_fp32():
    """bf16 compute (fp32 weights) against the same step in fp32, per parameter group: zeroed experts or
    a group whose gradients are lost in the bf16 path give a relative error of 1 in that group."""
    import re

    l16, g16 = _step_grads("bfloat16")
    l32, g32 = _step_grads("float32")
    loss_err = ((l16 - l32).abs() / l32.abs()).tolist()
    errs = {}
    for group, pattern in GROUPS.items():
        names = [n for n in g32 if re.search(pattern, n)]
        assert names, group
        diff = torch.sqrt(sum((g16[n] - g32[n]).pow(2).sum() for n in names))
        ref = torch.sqrt(sum(g32[n].pow(2).sum() for n in names))
        assert ref > 0, group
        errs[group] = float(diff / ref)
    # measured (this CPU): losses 3.0e-6 (main), 7.5e-6 (aux), 1.1e-5 (MTP); gradients 3.8e-3 (head) to
    # 8.1e-3 (attention), every group in 3.8e-3..8.1e-3; the bounds are <= 10x the smallest of each
    assert max(loss_err) <= 3e-5, loss_err
    assert max(errs.values()) <= 3.5e-2, errs
