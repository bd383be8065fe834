"""Multi-token prediction: shifting, masking, loss scaling, depth > 1, input order [emb | hidden]."""

import pytest
import torch
import torch.nn.functional as F

from lit_moe.model import AttentionContext, DeepseekV3ForCausalLM

CFG = dict(vocab_size=50, hidden_size=16, intermediate_size=24, moe_intermediate_size=8, num_hidden_layers=2,
           num_attention_heads=2, kv_lora_rank=8, q_lora_rank=12, qk_rope_head_dim=4, qk_nope_head_dim=4,
           v_head_dim=4, n_routed_experts=4, num_experts_per_tok=2, n_group=1, topk_group=1,
           first_k_dense_replace=1, compute_dtype="float32", initializer_range=0.3, mtp_loss_scaling_factor=0.3)


def build(depth, **kw):
    torch.manual_seed(0)
    return DeepseekV3ForCausalLM({**CFG, "num_nextn_predict_layers": depth, **kw}).eval()


def reference_mtp_loss(m, ids, labels, mask):
    """Shift by hand (zero fill, no wrap-around) and run the MTP modules depth by depth."""
    captured = {}
    handle = m.norm.register_forward_hook(lambda mod, inp, out: captured.setdefault("h", out))
    m(ids)
    handle.remove()
    h = captured["h"]
    B, S = ids.shape
    pos = torch.arange(S).expand(B, S)
    ctx = AttentionContext.build(m.config, pos)
    total = 0.0
    for k, layer in enumerate(m.mtp, 1):
        def shift(t):
            out = torch.zeros_like(t)
            out[:, : S - k] = t[:, k:]
            return out
        ids_k, lab_k, mask_k, pos_k = shift(ids), shift(labels), shift(mask), shift(pos)
        h = layer(h, m.embed_tokens(ids_k), ctx.with_positions(m.config, pos_k))
        ce = F.cross_entropy(m.lm_head(h).reshape(-1, 50), lab_k.reshape(-1), reduction="none")
        total = total + (ce * mask_k.reshape(-1)).sum() / mask_k.sum()
    return total * 0.3 / len(m.mtp)


@pytest.mark.parametrize("depth", [1, 2])
def test_mtp_loss_matches_hand_shifted_reference(depth):
    m = build(depth)
    torch.manual_seed(1)
    ids = torch.randint(0, 50, (2, 9))
    labels = torch.randint(0, 50, (2, 9))
    mask = (torch.rand(2, 9) > 0.2).float()
    with torch.no_grad():
        out = m(ids, labels=labels, loss_mask=mask)
        ref = reference_mtp_loss(m, ids, labels, mask)
    torch.testing.assert_close(out.mtp_loss, ref, atol=1e-6, rtol=1e-6)
    ce = F.cross_entropy(out.logits.reshape(-1, 50), labels.reshape(-1), reduction="none")
    torch.testing.assert_close(out.loss, (ce * mask.reshape(-1)).sum() / mask.sum(), atol=1e-6, rtol=1e-6)


def test_depth_one_prediction_sees_exactly_one_token_ahead():
    m = build(1)
    torch.manual_seed(2)
    ids = torch.randint(0, 50, (1, 10))
    labels = torch.randint(0, 50, (1, 10))
    i = 4
    mask = torch.zeros(1, 10)
    mask[0, i + 1] = 1.0       # depth 1 at position i uses mask[i + 1] (shifted left by one)

    def mtp_at_i(x):
        with torch.no_grad():
            return m(x, labels=labels, loss_mask=mask).mtp_loss

    base = mtp_at_i(ids)
    for j, matters in ((i + 1, True), (i + 2, False), (0, True)):
        other = ids.clone()
        other[0, j] = (ids[0, j] + 7) % 50
        assert (not torch.allclose(mtp_at_i(other), base, atol=1e-6)) == matters, j


def test_mtp_input_order_is_embedding_then_hidden():
    m = build(1)
    torch.manual_seed(3)
    ids = torch.randint(0, 50, (1, 8))
    H = 16

    def mtp_loss_after_changing_main_layers(mm):
        with torch.no_grad():
            a = mm(ids, labels=ids).mtp_loss
            mm.layers[0].self_attention.o_proj.weight.mul_(3.0)
            b = mm(ids, labels=ids).mtp_loss
            mm.layers[0].self_attention.o_proj.weight.div_(3.0)
        return a, b

    with torch.no_grad():
        m.mtp[0].eh_proj.weight[:, H:] = 0        # drop the hidden-state half: main layers no longer matter
    a, b = mtp_loss_after_changing_main_layers(m)
    torch.testing.assert_close(a, b, atol=1e-7, rtol=0)
    m = build(1)
    with torch.no_grad():
        m.mtp[0].eh_proj.weight[:, :H] = 0        # drop the embedding half instead
    a, b = mtp_loss_after_changing_main_layers(m)
    assert not torch.allclose(a, b, atol=1e-5)


def test_no_mtp_and_no_labels():
    m = build(0)
    ids = torch.randint(0, 50, (1, 5))
    out = m(ids, labels=ids)
    assert out.mtp_loss.item() == 0 and len(m.mtp) == 0
    m2 = build(2)
    out2 = m2(ids)
    assert out2.loss is None and out2.mtp_loss is None and out2.logits.shape == (1, 5, 50)
    assert [b.layer_idx for b in m2.blocks()] == [0, 1, 2, 3]
    assert len(m2.moe_layers()) == 3          # the MTP layers copy the last (MoE) layer


def test_mtp_aux_loss_scaled_by_depth():
    m = build(2, moe_aux_loss_coeff=0.1).train()
    ids = torch.randint(0, 50, (2, 6))
    out = m(ids, labels=ids)
    main, *mtp = [moe.last_stats["aux_loss"] for moe in m.moe_layers()]
    torch.testing.assert_close(out.aux_loss, main + sum(mtp) / 2)


def test_int32_batches_as_the_dataset_returns_them():
    m = build(1)
    ids = torch.randint(0, 50, (2, 7))
    labels = torch.randint(0, 50, (2, 7))
    labels[0, 3] = -100
    mask = torch.ones(2, 7)
    with torch.no_grad():
        a = m(ids, labels=labels, loss_mask=mask, position_ids=torch.arange(7)[None].expand(2, 7))
        b = m(ids.int(), labels=labels.int(), loss_mask=mask.int(), position_ids=torch.arange(7, dtype=torch.int32)[None])
    assert torch.equal(a.loss, b.loss) and torch.equal(a.mtp_loss, b.mtp_loss)
    keep = (labels != -100).reshape(-1).float()
    ce = F.cross_entropy(a.logits.reshape(-1, 50), labels.clamp_min(0).reshape(-1), reduction="none")
    torch.testing.assert_close(a.loss, (ce * keep).sum() / keep.sum())
