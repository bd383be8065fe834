"""Muon with MindFormers' keys (per-step ``ns_coefficients``, ``ns_steps``, ``matched_adamw_rms``,
``comm_strategy``) against a hand-written float64 Newton-Schulz, and QK-clip against transformers'
DeepSeek-V3 attention logits (a capturing attention function) and hand-computed weight scales."""

from __future__ import annotations

import copy
import logging
import math

import pytest
import torch
import transformers
from torch import nn

from helpers import randomize_norms_and_biases, tiny_config, write_config
from lit_moe.config import ConfigError
from lit_moe.model import DeepseekV3ForCausalLM
from lit_moe.optim.optimizers import build_optimizer, newton_schulz, ns_schedule, validate_optimizer_section
from lit_moe.optim.qk_clip import QKClip, check_qk_clip_layout
from lit_moe.strategies import ParallelDims

V4_SCHEDULE = [[[3.4445, -4.7750, 2.0315], 8], [[2.0, -1.5, 0.5], 2]]   # DeepSeek-V4's, MindFormers' docstring


def ns_reference(g: torch.Tensor, schedule, eps=1e-8) -> torch.Tensor:
    """MindFormers' newton_schulz written out in float64: wide orientation, x / (||x|| + eps), then per
    step (a, b, c): A = x x^T, x = a x + (b A + c A A) x."""
    x = g.double()
    tall = x.shape[0] > x.shape[1]
    if tall:
        x = x.T
    x = x / (x.norm() + eps)
    for a, b, c in schedule:
        A = x @ x.T
        x = a * x + (b * A + c * A @ A) @ x
    return x.T if tall else x


# ----------------------------------------------------------------------------------------------
# ns_coefficients / ns_steps / matched_adamw_rms / comm_strategy
# ----------------------------------------------------------------------------------------------
def test_ns_coefficients_forms(caplog):
    flat = validate_optimizer_section({"type": "Muon", "ns_steps": 3, "ns_coefficients": [3.0, -3.2, 1.2]})
    assert flat.ns_coefficients == ((3.0, -3.2, 1.2),) * 3 and flat.ns_steps == 3
    with caplog.at_level(logging.WARNING):
        seg = validate_optimizer_section({"type": "Muon", "ns_steps": 5, "ns_coefficients": V4_SCHEDULE})
    assert seg.ns_steps == 10
    assert seg.ns_coefficients == ((3.4445, -4.7750, 2.0315),) * 8 + ((2.0, -1.5, 0.5),) * 2
    # MindFormers ignores ns_steps under a segmented schedule: one line says so
    assert any("ns_steps: 5 is ignored" in r.getMessage() for r in caplog.records)
    assert ns_schedule(None, 2) == ((3.4445, -4.7750, 2.0315),) * 2


@pytest.mark.parametrize("value, shown", [
    ([1.0, 2.0], "optimizer.ns_coefficients: a flat form has three numbers"),
    ([[[1.0, 2.0, 3.0], 0]], "optimizer.ns_coefficients[0]: expected [[a, b, c], count]"),
    ([[[1.0, 2.0, 3.0], 2], [[1.0, 2.0], 1]], "optimizer.ns_coefficients[1]: expected"),
    ("3.4,-4.7,2.0", "optimizer.ns_coefficients: expected [a, b, c] or"),
])
def test_bad_ns_coefficients(value, shown):
    with pytest.raises(ConfigError) as err:
        validate_optimizer_section({"type": "Muon", "ns_coefficients": value})
    assert str(err.value).startswith(shown) and "\n" not in str(err.value)


def test_comm_strategy_values():
    for value in ("allgather", "allgather_deredundency"):
        assert validate_optimizer_section({"type": "Muon", "comm_strategy": value}).comm_strategy == value
    with pytest.raises(ConfigError, match=r"^optimizer.comm_strategy: expected one of allgather, "
                                          r"allgather_deredundency, got 'ring'$"):
        validate_optimizer_section({"type": "Muon", "comm_strategy": "ring"})


def test_newton_schulz_per_step_schedule_matches_reference():
    schedule = ns_schedule(V4_SCHEDULE, 5)
    g = torch.randn(24, 40, generator=torch.Generator().manual_seed(0))
    for x in (g, g.T):   # wide and tall
        ours = newton_schulz(x, schedule, 1e-8).double()
        ref = ns_reference(x, schedule)
        # bf16 iteration: measured 6.6e-3 (entries O(0.3)); a phase dropped or swapped: > 0.1
        assert (ours - ref).abs().max().item() <= 3e-2
        wrong = ns_reference(x, ns_schedule([3.4445, -4.7750, 2.0315], 10))
        assert (ours - wrong).abs().max().item() > 0.1


class TwoMatrices(nn.Module):
    def __init__(self):
        super().__init__()
        self.q_proj = nn.Linear(48, 32, bias=False)    # tall after transpose? [32, 48]: wide
        self.o_proj = nn.Linear(32, 48, bias=False)    # [48, 32]: tall


def test_muon_step_with_schedule_and_matched_rms():
    """Two steps of the Muon half with a segmented schedule and matched_adamw_rms 0.3 against the
    hand-written update: m = μ m + g, input g + μ m, p ← p (1 − lr·wd) − lr·0.3·sqrt(max(A, B))·NS."""
    torch.manual_seed(0)
    model = TwoMatrices()
    section = {"type": "Muon", "weight_decay": 0.1, "momentum": 0.9, "ns_coefficients": V4_SCHEDULE,
               "matched_adamw_rms": 0.3, "adamw_include": ["*nothing*"]}
    with pytest.raises(ConfigError, match="adamw_include"):   # the rule must match (check_rules)
        from lit_moe.optim.optimizers import check_rules
        check_rules(validate_optimizer_section(section), [n for n, _ in model.named_parameters()])
    opt = build_optimizer(model.named_parameters(), section, 0.02)
    w0 = {n: p.detach().double().clone() for n, p in model.named_parameters()}
    gen = torch.Generator().manual_seed(3)
    grads = [{n: torch.randn(p.shape, generator=gen) for n, p in model.named_parameters()} for _ in range(2)]
    for step in grads:
        for n, p in model.named_parameters():
            p.grad = step[n].clone()
        opt.step()
    lr, wd, mu = 0.02, 0.1, 0.9
    schedule = ns_schedule(V4_SCHEDULE, 5)
    for n, p in model.named_parameters():
        scale = lr * 0.3 * math.sqrt(max(p.shape))
        g1, g2 = grads[0][n].double(), grads[1][n].double()
        m = g1
        w = w0[n] * (1 - lr * wd) - scale * ns_reference(g1 + mu * m, schedule)
        m = mu * m + g2
        w = w * (1 - lr * wd) - scale * ns_reference(g2 + mu * m, schedule)
        # bf16 Newton-Schulz: measured 1.6e-4; matched_adamw_rms read as 0.2: 5e-3
        assert (p.detach().double() - w).abs().max().item() <= 1e-3, n


# ----------------------------------------------------------------------------------------------
# QK-clip
# ----------------------------------------------------------------------------------------------
CFG = dict(vocab_size=128, hidden_size=64, intermediate_size=96, moe_intermediate_size=32, num_hidden_layers=2,
           num_attention_heads=4, kv_lora_rank=32, q_lora_rank=48, qk_rope_head_dim=16, qk_nope_head_dim=16,
           v_head_dim=24, n_routed_experts=8, num_experts_per_tok=3, n_group=4, topk_group=2, n_shared_experts=1,
           first_k_dense_replace=1, position_embedding_type="yarn", scaling_factor=8.0, seq_length=32,
           max_position_embeddings=256, mscale=0.9, mscale_all_dim=0.7, compute_dtype="float32",
           initializer_range=0.3, attention_dropout=0.0)

CAPTURED: list[torch.Tensor] = []


def _capture_attention(module, query, key, value, attention_mask, scaling=None, dropout=0.0, **kwargs):
    """transformers' eager attention, keeping each head's largest allowed scaled logit."""
    from transformers.models.deepseek_v3.modeling_deepseek_v3 import eager_attention_forward

    logits = torch.matmul(query, key.transpose(2, 3)) * scaling
    S, K = logits.shape[-2:]
    allowed = torch.ones(S, K, dtype=torch.bool).tril() if attention_mask is None else attention_mask[..., :K] == 0
    assert attention_mask is None or attention_mask.is_floating_point()
    CAPTURED.append(logits.masked_fill(~allowed, float("-inf")).amax(dim=(0, 2, 3)).clamp(min=0))
    return eager_attention_forward(module, query, key, value, attention_mask, scaling=scaling, dropout=dropout,
                                   **kwargs)


def ours_and_hf(tmp_path, q_lora: bool):
    torch.manual_seed(0)
    ours = DeepseekV3ForCausalLM({**CFG, "q_lora_rank": 48 if q_lora else None})
    randomize_norms_and_biases(ours, seed=1)
    ours.save_pretrained(tmp_path)
    from transformers.masking_utils import AttentionMaskInterface, eager_mask

    transformers.AttentionInterface.register("lit_moe_capture", _capture_attention)
    AttentionMaskInterface.register("lit_moe_capture", eager_mask)   # additive masks, as eager attention
    hf = transformers.DeepseekV3ForCausalLM.from_pretrained(tmp_path, attn_implementation="lit_moe_capture")
    return ours, hf.eval()


def tracked(qk: QKClip) -> torch.Tensor:
    return torch.stack([layer.core_attention.max_logits for _, layer in qk.layers])


@pytest.mark.parametrize("q_lora", [True, False], ids=["q_lora", "no_q_lora"])
def test_max_logits_match_transformers_and_clip_to_the_threshold(tmp_path, q_lora):
    ours, hf = ours_and_hf(tmp_path, q_lora)
    x = torch.randint(0, 128, (2, 24), generator=torch.Generator().manual_seed(2))
    qk = QKClip(ours, threshold=1.0)
    ours.train()
    with torch.no_grad():
        ours(x)
        CAPTURED.clear()
        hf(x)
    maxima = tracked(qk)
    reference = torch.stack(CAPTURED)
    # measured 1.4e-6 relative (logits O(30)); head order or the softmax scale wrong: O(0.1)
    torch.testing.assert_close(maxima, reference, rtol=1e-5, atol=0)
    # a second micro-batch folds in as a running maximum
    with torch.no_grad():
        ours(x[:, :8])
    assert torch.equal(tracked(qk), maxima)

    # clip at a threshold some heads reach: γ = τ / m for m >= τ
    tau = float(maxima.flatten().sort().values[maxima.numel() // 2])
    gammas = torch.where(maxima >= tau, tau / maxima, torch.ones_like(maxima)).double()
    layer = qk.layers[0][1]
    q = layer.q_proj if layer.q_lora_rank is None else layer.q_b_proj
    q0, kv0 = q.weight.detach().clone(), layer.kv_b_proj.weight.detach().clone()
    kva0 = layer.kv_a_proj_with_mqa.weight.detach().clone()
    qk.threshold = tau
    assert qk.apply() == int((maxima >= tau).sum())
    assert all(layer.core_attention.max_logits is None for _, layer in qk.layers)   # restarted
    # weights by hand: head h rows [nope | rope] of q, [k_nope | v] of kv_b_proj
    nope, rope, v = 16, 16, 24
    for h in range(4):
        g = float(gammas[0, h])
        qh, qh0 = q.weight[h * 32:(h + 1) * 32], q0[h * 32:(h + 1) * 32]
        torch.testing.assert_close(qh[:nope], qh0[:nope] * math.sqrt(g), rtol=1e-6, atol=0)
        torch.testing.assert_close(qh[nope:], qh0[nope:] * g, rtol=1e-6, atol=0)
        kh, kh0 = layer.kv_b_proj.weight[h * 40:(h + 1) * 40], kv0[h * 40:(h + 1) * 40]
        torch.testing.assert_close(kh[:nope], kh0[:nope] * math.sqrt(g), rtol=1e-6, atol=0)
        assert torch.equal(kh[nope:], kh0[nope:])                       # values untouched
    assert torch.equal(layer.kv_a_proj_with_mqa.weight, kva0)           # the shared rope key untouched
    # every logit of a head scales by γ: the first layer's clipped heads (same input) now peak at τ,
    # its other heads are unchanged
    with torch.no_grad():
        ours(x)
    first = tracked(qk)[0]
    # measured 4.8e-7 relative
    torch.testing.assert_close(first, (maxima[0] * gammas[0]).float(), rtol=1e-5, atol=0)
    assert bool((gammas[0] < 1).any())


def test_muon_step_clips_after_the_update():
    """build_optimizer with the model: the step's update, then QK-clip from the forward's maxima
    (MindFormers clips after the optimizer step, with the logits of the step's forward)."""
    torch.manual_seed(0)
    model = DeepseekV3ForCausalLM(CFG).train()
    twin = copy.deepcopy(model)
    x = torch.randint(0, 128, (2, 24), generator=torch.Generator().manual_seed(2))
    section = {"type": "Muon", "qk_clip_threshold": 18.0}
    opt = build_optimizer(model.named_parameters(), section, 0.01, model=model)
    plain = build_optimizer(twin.named_parameters(), {**section, "qk_clip_enabled": False}, 0.01, model=twin)
    assert opt.qk_clip is not None and plain.qk_clip is None
    for m in (model, twin):
        m(x, labels=x).loss.backward()
    maxima = opt.qk_clip.max_logits()
    assert bool((maxima >= 18.0).any()) and bool((maxima < 18.0).any())
    opt.step()
    plain.step()
    for i, (name, layer) in enumerate(opt.qk_clip.layers):
        gamma = torch.where(maxima[i] >= 18.0, 18.0 / maxima[i], torch.ones_like(maxima[i]))
        q_twin = twin.get_submodule(name).q_b_proj.weight.detach()
        expect = q_twin.view(4, 32, -1).clone()
        expect[:, :16] *= gamma.sqrt()[:, None, None]
        expect[:, 16:] *= gamma[:, None, None]
        torch.testing.assert_close(layer.q_b_proj.weight.detach(), expect.view_as(q_twin), rtol=1e-6, atol=0)
        kv_twin = twin.get_submodule(name).kv_b_proj.weight.detach().view(4, 40, -1)
        kv = layer.kv_b_proj.weight.detach().view(4, 40, -1)
        torch.testing.assert_close(kv[:, :16], kv_twin[:, :16] * gamma.sqrt()[:, None, None], rtol=1e-6, atol=0)
        assert torch.equal(kv[:, 16:], kv_twin[:, 16:])


@pytest.mark.parametrize("dims, lora, shown", [
    (dict(tp=2), None, "optimizer.qk_clip_enabled: QK-clip does not run with tensor_parallel 2 yet"),
    (dict(cp=2), None, "optimizer.qk_clip_enabled: QK-clip does not run with context_parallel 2 yet"),
    (dict(pp=2), None, "optimizer.qk_clip_enabled: QK-clip does not run with pipeline_stage 2 yet"),
    (dict(), {"lora_rank": 4}, "optimizer.qk_clip_enabled: QK-clip does not run with lora_config"),
])
def test_refused_where_it_cannot_run(dims, lora, shown):
    with pytest.raises(ConfigError) as err:
        check_qk_clip_layout(ParallelDims(world_size=2, **dims), lora)
    assert str(err.value).startswith(shown) and str(err.value).endswith("set qk_clip_enabled: false")


def test_fit_with_muon_and_qk_clip(tmp_path, capsys, caplog):
    """``lit_moe fit`` in-process with Muon's defaults (QK-clip on) at a threshold the tiny model
    reaches: it clips and trains; under tensor_parallel 2 the run is refused in one line."""
    from lit_moe.cli import main

    cfg = tiny_config(tmp_path, steps=1, optimizer={"type": "Muon", "qk_clip_threshold": 0.06,
                                                    "ns_coefficients": V4_SCHEDULE})
    with caplog.at_level(logging.DEBUG, logger="lit_moe.optim.qk_clip"):
        assert main(["fit", "--config", str(write_config(tmp_path, cfg))]) == 0
    assert any("QK-clip:" in r.getMessage() and "heads clipped" in r.getMessage() for r in caplog.records)
    capsys.readouterr()
    cfg["parallelism"] = {**(cfg.get("parallelism") or {}), "tensor_parallel": 2}
    cfg["trainer"] = {**(cfg.get("trainer") or {}), "devices": 2}
    assert main(["fit", "--config", str(write_config(tmp_path, cfg, "tp.yaml"))]) == 2
    err = [ln for ln in capsys.readouterr().err.splitlines() if ln.strip()]
    assert len(err) == 1 and err[0].startswith("lit_moe: error: optimizer.qk_clip_enabled: QK-clip does not run with "
                                               "tensor_parallel 2 yet"), err


def _dp_worker(rank, port, out_path):
    """One data-parallel rank: its own half of the batch; the maxima are reduced (MAX) over the ranks
    before clipping, and a Shard(0) DTensor weight is scaled shard by shard."""
    import os

    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Shard, distribute_tensor

    from lit_moe.optim.qk_clip import _scale_rows

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=2)
    from lit_moe.runtime.distributed import release_process_groups_at_exit
    release_process_groups_at_exit()  # no gloo thread outlives the interpreter
    try:
        torch.manual_seed(0)
        model = DeepseekV3ForCausalLM(CFG).train()
        qk = QKClip(model, threshold=18.0)
        with torch.no_grad():
            model(DP_BATCH[rank:rank + 1])
        maxima = qk.max_logits()
        qk.apply()
        mesh = init_device_mesh("cpu", (2,), mesh_dim_names=("dp",))
        w = torch.arange(24.0).view(6, 4)
        dw = distribute_tensor(w, mesh, [Shard(0)])
        _scale_rows(dw, torch.arange(1.0, 7.0))
        full = dw.full_tensor()
        if rank == 0:
            torch.save({"maxima": maxima, "state": model.state_dict(), "dtensor": full}, out_path)
    finally:
        dist.destroy_process_group()


DP_BATCH = torch.randint(0, 128, (2, 24), generator=torch.Generator().manual_seed(5))


def test_data_parallel_ranks_clip_with_the_global_maxima(tmp_path):
    """Two gloo processes, one sample each, against one process with both samples: the same maxima
    and the same clipped weights (bit-equal: the scales come from the same numbers)."""
    import socket

    import torch.multiprocessing as mp

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    out = tmp_path / "rank0.pt"
    mp.start_processes(_dp_worker, args=(port, str(out)), nprocs=2, join=True, start_method="spawn")
    got = torch.load(out)
    torch.manual_seed(0)
    model = DeepseekV3ForCausalLM(CFG).train()
    qk = QKClip(model, threshold=18.0)
    with torch.no_grad():
        model(DP_BATCH)
    maxima = qk.max_logits()
    assert bool((maxima >= 18.0).any()) and bool((maxima < 18.0).any())
    qk.apply()
    # one sample per rank: the per-sample maxima differ; measured 0 (fp32, same kernels per sample)
    torch.testing.assert_close(got["maxima"], maxima, rtol=1e-6, atol=0)
    for name, t in model.state_dict().items():
        torch.testing.assert_close(got["state"][name], t, rtol=1e-6, atol=0, msg=name)
    assert torch.equal(got["dtensor"], torch.arange(24.0).view(6, 4) * torch.arange(1.0, 7.0)[:, None])
