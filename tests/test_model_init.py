"""Initialisation: N(0, initializer_range), norms 1/0, buffers 0; meta-device build == eager; layout-independent."""

import pytest
import torch
from torch import nn

from lit_moe.model import DeepseekV3ForCausalLM
from lit_moe.ops import LayerNorm, RMSNorm

CFG = dict(vocab_size=300, hidden_size=32, intermediate_size=48, moe_intermediate_size=16, num_hidden_layers=2,
           num_attention_heads=2, kv_lora_rank=16, q_lora_rank=24, qk_rope_head_dim=8, qk_nope_head_dim=8,
           v_head_dim=8, n_routed_experts=4, num_experts_per_tok=2, n_group=1, topk_group=1,
           first_k_dense_replace=1, num_nextn_predict_layers=1, initializer_range=0.05)


def state(m):
    return {k: v.clone() for k, v in m.state_dict().items()} | {
        f"buf:{k}": v.clone() for k, v in m.named_buffers()}


def test_meta_build_then_init_equals_eager_construction():
    torch.manual_seed(123)
    eager = DeepseekV3ForCausalLM(CFG)
    with torch.device("meta"):
        lazy = DeepseekV3ForCausalLM(CFG)
    assert all(p.is_meta for p in lazy.parameters())
    lazy.to_empty(device="cpu")
    lazy.init_weights(123)
    a, b = state(eager), state(lazy)
    assert a.keys() == b.keys()
    for k in a:
        assert torch.equal(a[k], b[k]), k


def test_values_follow_the_spec():
    torch.manual_seed(0)
    m = DeepseekV3ForCausalLM({**CFG, "normalization": "LayerNorm"})
    seen_norm = 0
    for mod in m.modules():
        if isinstance(mod, (RMSNorm, LayerNorm)):
            seen_norm += 1
            assert torch.equal(mod.weight, torch.ones_like(mod.weight))
            assert torch.equal(mod.bias, torch.zeros_like(mod.bias))
    assert seen_norm == 4 * 3 + 1 + 3   # 3 blocks x (2 + q/kv latents); final; MTP enorm/hnorm/final
    weights = [m.embed_tokens.weight, m.lm_head.weight, m.layers[1].mlp.router.weight,
               m.layers[1].mlp.experts.gate_up_proj, m.layers[1].mlp.experts.down_proj,
               m.layers[0].self_attention.kv_b_proj.weight, m.mtp[0].eh_proj.weight]
    for w in weights:
        assert abs(w.mean().item()) < 0.01 and w.std().item() == pytest.approx(0.05, rel=0.1)
    for moe in m.moe_layers():
        assert moe.router.expert_bias.abs().sum() == 0 and moe.tokens_per_expert.abs().sum() == 0
    # different tensors are not copies of one another
    assert not torch.equal(m.layers[0].self_attention.q_a_proj.weight, m.layers[1].self_attention.q_a_proj.weight)


def test_init_is_name_based_and_ignores_wrappers_and_depth():
    torch.manual_seed(7)
    small = DeepseekV3ForCausalLM(CFG)
    torch.manual_seed(7)
    deep = DeepseekV3ForCausalLM({**CFG, "num_hidden_layers": 3})
    for name, p in small.layers[0].named_parameters():
        assert torch.equal(p, dict(deep.layers[0].named_parameters())[name]), name
    # an activation-checkpoint wrapper adds a name part; values must not change
    from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import checkpoint_wrapper
    before = small.layers[1].mlp.experts.down_proj.clone()
    small.layers[1] = checkpoint_wrapper(small.layers[1])
    assert any("_checkpoint_wrapped_module" in n for n, _ in small.named_parameters())
    small.init_weights(7)
    assert torch.equal(small.layers[1]._checkpoint_wrapped_module.mlp.experts.down_proj, before)
    # eager construction seeds with torch.initial_seed(): the seed decides, not the RNG position
    torch.manual_seed(7)
    w7 = DeepseekV3ForCausalLM(CFG).lm_head.weight
    torch.randn(100)
    assert torch.equal(DeepseekV3ForCausalLM(CFG).lm_head.weight, w7)
    torch.manual_seed(8)
    assert not torch.equal(DeepseekV3ForCausalLM(CFG).lm_head.weight, w7)


def test_dtensor_sharded_init_keeps_the_local_shard_of_the_full_init():
    """Rank 1 of 2 (a fake process group: no peers needed); its shards must be chunks of the full init."""
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import DTensor, Shard
    from torch.testing._internal.distributed.fake_pg import FakeStore

    cfg = {**CFG, "vocab_size": 301}          # an uneven shard too
    dist.init_process_group("fake", store=FakeStore(), rank=1, world_size=2)
    try:
        mesh = init_device_mesh("cpu", (2,))
        with torch.device("meta"):
            m = DeepseekV3ForCausalLM(cfg)
        m.to_empty(device="cpu")
        for mod in m.modules():
            for name, p in list(mod.named_parameters(recurse=False)):
                local = torch.zeros(p.shape).chunk(2, dim=0)[1]
                setattr(mod, name, nn.Parameter(DTensor.from_local(local, mesh, [Shard(0)], run_check=False,
                                                                   shape=p.shape, stride=p.stride())))
        m.init_weights(99)
        sharded = {k: v.to_local().clone() for k, v in m.named_parameters()}
    finally:
        dist.destroy_process_group()
    torch.manual_seed(99)
    eager = dict(DeepseekV3ForCausalLM(cfg).named_parameters())
    assert sharded.keys() == eager.keys()
    for k, v in sharded.items():
        assert torch.equal(v, eager[k].detach().chunk(2, dim=0)[1]), k
