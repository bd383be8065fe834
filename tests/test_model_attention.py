"""MLA and attention masks: causal, explicit (Megatron polarity), document-causal, sliding window."""

import pytest
import torch

from lit_moe.model import AttentionContext, DeepseekV3ForCausalLM
from lit_moe.model.attention import CoreAttention, allowed_mask
from lit_moe.model.rope import rope_inv_freq

TINY = dict(vocab_size=97, hidden_size=32, intermediate_size=48, moe_intermediate_size=16, num_hidden_layers=2,
            num_attention_heads=2, kv_lora_rank=16, q_lora_rank=24, qk_rope_head_dim=8, qk_nope_head_dim=8,
            v_head_dim=12, n_routed_experts=4, num_experts_per_tok=2, n_group=2, topk_group=1,
            first_k_dense_replace=1, position_embedding_type="yarn", scaling_factor=4.0, seq_length=16,
            max_position_embeddings=64, compute_dtype="float32", initializer_range=0.2)


def model(**overrides):
    torch.manual_seed(0)
    return DeepseekV3ForCausalLM({**TINY, **overrides}).eval()


def logits(m, ids, **kw):
    with torch.no_grad():
        return m(ids, **kw).logits


@pytest.mark.parametrize("flash", [True, False])
def test_packed_documents_equal_separate_runs(flash):
    m = model(use_flash_attention=flash)
    torch.manual_seed(1)
    a, b = torch.randint(0, 97, (1, 5)), torch.randint(0, 97, (1, 7))
    packed = torch.cat([a, b], 1)
    reset_pos = torch.tensor([[0, 1, 2, 3, 4, 0, 1, 2, 3, 4, 5, 6]])
    out = logits(m, packed, position_ids=reset_pos, actual_seq_len=torch.tensor([[5, 12, 12]]))
    torch.testing.assert_close(out[:, :5], logits(m, a), atol=1e-5, rtol=0)
    torch.testing.assert_close(out[:, 5:], logits(m, b), atol=1e-5, rtol=0)
    # without a position reset the second document keeps its offset (rotary is relative: same logits)
    out2 = logits(m, packed, actual_seq_len=torch.tensor([[5, 12]]))
    torch.testing.assert_close(out2[:, 5:], logits(m, b), atol=1e-5, rtol=0)
    # rotary angles follow position_ids: a gap inside the document changes what comes after it
    gap = logits(m, b, position_ids=torch.tensor([[0, 1, 2, 9, 10, 11, 12]]))
    torch.testing.assert_close(gap[:, :3], out[:, 5:8], atol=1e-5, rtol=0)
    assert not torch.allclose(gap[:, 3:], out[:, 8:], atol=1e-3)


def test_actual_seq_len_formats_and_megatron_mask_agree():
    m = model()
    torch.manual_seed(2)
    ids = torch.randint(0, 97, (2, 8))
    per_sample = torch.tensor([[3, 8, 8], [5, 5, 5]])        # padded with S / with the last value
    flat = torch.tensor([3, 8, 13, 16])                      # cumulative over the flattened micro-batch
    ref = logits(m, ids, actual_seq_len=per_sample)
    torch.testing.assert_close(logits(m, ids, actual_seq_len=flat), ref, atol=0, rtol=0)
    # the same structure as a dense Megatron mask: True = blocked
    doc = torch.tensor([[0, 0, 0, 1, 1, 1, 1, 1], [0, 0, 0, 0, 0, 1, 1, 1]])
    causal = torch.ones(8, 8, dtype=torch.bool).tril()
    blocked = ~(causal & (doc[:, :, None] == doc[:, None, :]))
    torch.testing.assert_close(logits(m, ids, attention_mask=blocked[:, None]), ref, atol=1e-6, rtol=0)
    torch.testing.assert_close(logits(m, ids, attention_mask=blocked.int()), ref, atol=1e-6, rtol=0)
    # an all-False mask is plain causal
    torch.testing.assert_close(logits(m, ids, attention_mask=torch.zeros(2, 1, 8, 8, dtype=torch.bool)),
                               logits(m, ids), atol=1e-6, rtol=0)


def test_blocked_key_has_no_influence():
    m = model(num_hidden_layers=1, first_k_dense_replace=1)
    torch.manual_seed(3)
    ids = torch.randint(0, 97, (1, 6))
    blocked = torch.zeros(1, 6, 6, dtype=torch.bool)
    blocked[0, 5, 2] = True                     # query 5 may not see key 2
    other = ids.clone()
    other[0, 2] = (ids[0, 2] + 1) % 97
    a, b = logits(m, ids, attention_mask=blocked), logits(m, other, attention_mask=blocked)
    torch.testing.assert_close(a[0, 5], b[0, 5], atol=1e-6, rtol=0)
    assert not torch.allclose(a[0, 4], b[0, 4], atol=1e-4)     # query 4 still sees key 2


@pytest.mark.parametrize("flash", [True, False])
def test_sliding_window_receptive_field(flash):
    m = model(num_hidden_layers=1, first_k_dense_replace=1, window_size=(2, 0), use_flash_attention=flash)
    torch.manual_seed(4)
    ids = torch.randint(0, 97, (1, 8))
    base = logits(m, ids)
    for j, visible in ((4, False), (5, True)):        # query 7 sees keys 5, 6, 7
        other = ids.clone()
        other[0, j] = (ids[0, j] + 1) % 97
        changed = not torch.allclose(logits(m, other)[0, 7], base[0, 7], atol=1e-5)
        assert changed == visible, j


def test_window_mask_matches_definition_and_skip_freq_layers():
    mask = allowed_mask(1, 6, torch.device("cpu"), window_left=2)[0, 0]
    i, j = torch.arange(6)[:, None], torch.arange(6)[None]
    assert torch.equal(mask, (j <= i) & (i - j <= 2))
    m = model(num_hidden_layers=4, window_size=(3, 0), window_attn_skip_freq=2)
    assert [blk.self_attention.use_window for blk in m.blocks()] == [True, False, True, False]


@pytest.mark.parametrize("kind", ["causal", "mask", "docs", "window"])
def test_flash_and_explicit_attention_agree(kind):
    kw, extra = {}, {}
    ids = torch.randint(0, 97, (2, 10), generator=torch.Generator().manual_seed(5))
    if kind == "mask":
        kw["attention_mask"] = torch.rand(2, 10, 10, generator=torch.Generator().manual_seed(6)) > 0.7
    if kind == "docs":
        kw["actual_seq_len"] = torch.tensor([[4, 10], [7, 10]])
    if kind == "window":
        extra["window_size"] = (3, 0)
    a = logits(model(use_flash_attention=True, **extra), ids, **kw)
    b = logits(model(use_flash_attention=False, **extra), ids, **kw)
    assert torch.isfinite(a).all()
    torch.testing.assert_close(a, b, atol=1e-5, rtol=0)


def test_fully_blocked_row_gives_zeros_not_nan():
    q, k, v = torch.randn(1, 2, 4, 8), torch.randn(1, 2, 4, 8), torch.randn(1, 2, 4, 6)
    allowed = torch.ones(1, 1, 4, 4, dtype=torch.bool).tril()
    allowed[..., 2, :] = False
    for flash in (True, False):
        out = CoreAttention(0.3, use_flash_attention=flash)(q, k, v, allowed)
        assert torch.isfinite(out).all() and torch.equal(out[:, :, 2], torch.zeros(1, 2, 6))


@pytest.mark.parametrize("q_lora", [True, False])
def test_mla_equals_weight_absorbed_form(q_lora):
    """deepseek_math §1: scores = (W_UK^T q_nope) . c_kv + q_pe . k_pe; o = W_UV sum_t a c_kv."""
    m = model(q_lora_rank=24 if q_lora else None)
    attn = m.layers[0].self_attention
    B, S, n, dn, dr, dv, r = 2, 7, 2, 8, 8, 12, 16
    torch.manual_seed(7)
    x = torch.randn(B, S, 32)
    pos = torch.arange(S)[None].expand(B, S)
    with torch.no_grad():
        ours = attn(x, AttentionContext.build(m.config, pos))
        q = attn.q_b_proj(attn.q_a_layernorm(attn.q_a_proj(x))) if q_lora else attn.q_proj(x)
        q = q.view(B, S, n, dn + dr)
        q_nope, q_pe = q[..., :dn], q[..., dn:]
        latent, k_pe = attn.kv_a_proj_with_mqa(x).split([r, dr], -1)
        c_kv = attn.kv_a_layernorm(latent)
        w = attn.kv_b_proj.weight.view(n, dn + dv, r)
        w_uk, w_uv = w[:, :dn], w[:, dn:]
        # rotary as complex multiplication of interleaved pairs, angles p * theta'_i
        inv, factor = rope_inv_freq(m.config)
        rot = torch.polar(torch.full((S, dr // 2), factor), pos[0, :, None].float() * inv)

        def rotate(t):
            z = torch.view_as_complex(t.reshape(*t.shape[:-1], dr // 2, 2).contiguous())
            z = z * (rot[:, None] if z.dim() == 4 else rot)
            return torch.view_as_real(z).flatten(-2)

        q_pe, k_pe = rotate(q_pe), rotate(k_pe)
        q_abs = torch.einsum("bsnd,ndr->bsnr", q_nope, w_uk)
        scores = torch.einsum("bsnr,btr->bnst", q_abs, c_kv) + torch.einsum("bsnd,btd->bnst", q_pe, k_pe)
        scores = scores * attn.core_attention.scale
        scores = scores.masked_fill(~torch.ones(S, S, dtype=torch.bool).tril(), float("-inf"))
        a = scores.softmax(-1)
        o = torch.einsum("bnst,btr->bsnr", a, c_kv)
        o = torch.einsum("bsnr,ndr->bsnd", o, w_uv).reshape(B, S, n * dv)
        absorbed = attn.o_proj(o)
    torch.testing.assert_close(ours, absorbed, atol=1e-5, rtol=1e-5)


def test_mask_shape_errors():
    m = model()
    ids = torch.randint(0, 97, (2, 6))
    with pytest.raises(ValueError, match=r"attention_mask: expected .* got \(2, 1, 5, 5\)"):
        m(ids, attention_mask=torch.zeros(2, 1, 5, 5, dtype=torch.bool))
    with pytest.raises(ValueError, match=r"actual_seq_len: expected shape .* got \(3, 2\)"):
        m(ids, actual_seq_len=torch.tensor([[3, 6]] * 3))


def test_none_and_learned_absolute_positions():
    torch.manual_seed(8)
    ids = torch.randint(0, 97, (1, 6))
    m = model(position_embedding_type="none")
    assert all(not blk.self_attention.use_rope for blk in m.blocks())
    la = model(position_embedding_type="learned_absolute")
    assert la.position_embeddings.weight.shape == (64, 32)
    shifted = logits(la, ids, position_ids=torch.arange(1, 7)[None])
    assert not torch.allclose(logits(la, ids), shifted, atol=1e-4)    # absolute positions matter
    nope = model(nope_layer_interval=1)
    assert [blk.self_attention.use_rope for blk in nope.blocks()] == [True, False]
