"""The same model on a CUDA device: fp32 logits equal the CPU ones, bf16 trains, grouped_mm runs there.

Skipped on machines without CUDA (they run the CPU tests only)."""

import pytest
import torch
import torch.nn.functional as F

from lit_moe.model import DeepseekV3ForCausalLM
from lit_moe.model.moe import grouped_mm_usable

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")

CFG = dict(vocab_size=256, hidden_size=128, intermediate_size=256, moe_intermediate_size=64, num_hidden_layers=3,
           num_attention_heads=4, kv_lora_rank=64, q_lora_rank=96, qk_rope_head_dim=32, qk_nope_head_dim=32,
           v_head_dim=48, n_routed_experts=8, num_experts_per_tok=3, n_group=4, topk_group=2,
           first_k_dense_replace=1, position_embedding_type="yarn", scaling_factor=8.0, seq_length=64,
           max_position_embeddings=512, num_nextn_predict_layers=1, moe_aux_loss_coeff=0.01,
           initializer_range=0.05)


def test_fp32_cuda_logits_equal_cpu_logits():
    torch.backends.cuda.matmul.allow_tf32 = False
    torch.manual_seed(0)
    cpu = DeepseekV3ForCausalLM({**CFG, "compute_dtype": "float32"}).eval()
    with torch.device("cuda"):
        gpu = DeepseekV3ForCausalLM({**CFG, "compute_dtype": "float32"}).eval()
    gpu.load_state_dict(cpu.state_dict())
    ids = torch.randint(0, 256, (2, 64))
    docs = torch.tensor([[20, 64], [64, 64]])
    with torch.no_grad():
        a = cpu(ids, actual_seq_len=docs).logits
        b = gpu(ids.cuda(), actual_seq_len=docs.cuda()).logits.cpu()
    assert (a - b).abs().max().item() <= 1e-4


def test_bf16_training_step_on_cuda():
    torch.manual_seed(0)
    with torch.device("cuda"):
        m = DeepseekV3ForCausalLM(CFG).train()
    ids = torch.randint(0, 256, (2, 64), device="cuda")
    out = m(ids, labels=ids)
    (out.loss + out.aux_loss + out.mtp_loss).backward()
    assert torch.isfinite(out.loss) and torch.isfinite(out.mtp_loss) and out.aux_loss.item() > 0
    assert all(torch.isfinite(p.grad).all() for p in m.parameters())
    assert m.moe_layers()[0].tokens_per_expert.sum().item() == 2 * 64 * 3
    m.update_expert_bias()
    assert m.moe_layers()[0].router.expert_bias.abs().sum().item() > 0


def test_grouped_mm_runs_on_cuda_and_matches_per_expert_gemms():
    torch.manual_seed(0)
    with torch.device("cuda"):
        m = DeepseekV3ForCausalLM(CFG)
    experts = m.moe_layers()[0].experts
    counts = torch.tensor([5, 0, 17, 3, 0, 9, 1, 12], device="cuda")
    x = torch.randn(int(counts.sum()), 128, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    w1 = experts.gate_up_proj.to(torch.bfloat16)
    assert grouped_mm_usable(x, w1, experts.down_proj.to(torch.bfloat16))
    outs = []
    for use in (True, False):
        experts.use_grouped_mm = use
        x.grad = None
        y = experts(x, counts)
        y.backward(torch.ones_like(y))
        outs.append((y.float(), x.grad.float()))
    torch.testing.assert_close(outs[0][0], outs[1][0], atol=2e-2, rtol=2e-2)
    torch.testing.assert_close(outs[0][1], outs[1][1], atol=2e-2, rtol=2e-2)
    assert F.grouped_mm is not None
