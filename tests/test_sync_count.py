"""The sync-counting harness (tests/sync_count.py) and the MoE layer's training step without host syncs."""

import pytest
import torch

from sync_count import SyncCounter


@pytest.mark.parametrize("call", [
    lambda t: t.sum().item(), lambda t: float(t.sum()), lambda t: bool(t.sum() > 0), lambda t: int(t[0]),
    lambda t: t.tolist(), lambda t: t.numpy(), lambda t: t.cpu(), lambda t: t.to("cpu"),
    lambda t: t.to(device="cpu"), lambda t: t.nonzero(), lambda t: t[t > 0], lambda t: t.masked_fill_(t > 0, 1)[t > 2],
    lambda t: torch.bincount(t.long()), lambda t: torch.repeat_interleave(t.long()),
])
def test_each_sync_kind_is_counted(call):
    t = torch.ones(4)
    with SyncCounter() as syncs:
        call(t)
    assert syncs.count >= 1, syncs.report()
    assert "test_sync_count.py" in syncs.calls[0][1]


def test_device_side_work_is_not_counted():
    t = torch.arange(6.0)
    with SyncCounter() as syncs:
        u = torch.where(t > 2, t, 0.0).cumsum(0)
        torch.repeat_interleave(torch.arange(3), torch.tensor([1, 2, 3]), output_size=6)
        u.to(torch.bfloat16).clamp_min(1.0).sum()
    assert syncs.count == 0, syncs.report()


@pytest.mark.parametrize("capacity", [None, "pad"])
def test_moe_training_forward_backward_and_bias_update_make_no_sync(monkeypatch, capacity):
    """Routing, dispatch, combine, their backward, the counters and the expert-bias update stay on the
    device (accelerator layout: no CPU row padding). Dropping without padding needs the kept count on
    the host by design and is not checked."""
    import lit_moe.model.moe as moe_mod
    from lit_moe.model import DeepseekV3ForCausalLM

    monkeypatch.setattr(moe_mod, "grouped_mm_row_align", lambda device: 1)
    extra = {} if capacity is None else dict(moe_expert_capacity_factor=0.5, use_pad_tokens=True)
    torch.manual_seed(0)
    model = DeepseekV3ForCausalLM(dict(
        vocab_size=64, hidden_size=16, intermediate_size=32, moe_intermediate_size=8, num_hidden_layers=2,
        num_attention_heads=2, kv_lora_rank=8, q_lora_rank=8, qk_rope_head_dim=4, qk_nope_head_dim=4,
        v_head_dim=4, n_routed_experts=8, num_experts_per_tok=2, n_group=4, topk_group=2, first_k_dense_replace=1,
        **extra)).train()
    ids = torch.randint(0, 64, (2, 12))
    with SyncCounter() as syncs:
        out = model(ids, labels=ids)
        (out.loss + out.aux_loss).backward()
        model.update_expert_bias()
    assert syncs.count == 0, syncs.report()


@pytest.mark.parametrize("inject", [False, True], ids=["built-ins", "injected-item"])
def test_fit_step_without_logging_makes_no_sync(tmp_path, monkeypatch, inject):
    """A whole non-log optimizer step of ``lit_moe fit`` (LitMoE + Trainer + AscendFSDPStrategy, the
    built-in callbacks with TensorBoard, A = 2, MoE with the expert-bias update and MTP, the skip guard
    and clipping on) makes no sync-causing call. Run as if on an accelerator: the CPU-only padded
    expert rows (which read CPU counts, no device sync) are switched off. The injected variant adds
    one ``.item()`` of the learning rate inside the optimizer step: the harness must catch it."""
    import lit_moe.model.moe as moe_mod
    import lit_moe.module as module_mod
    from helpers import tiny_config, write_config
    from lit_moe.cli import main
    from sync_count import StepWindow

    monkeypatch.setattr(moe_mod, "grouped_mm_row_align", lambda device: 1)
    if inject:
        real_step = module_mod.step_on_device

        def step_reading_the_lr(optimizer, lrs, skip):
            lrs[0].item()
            return real_step(optimizer, lrs, skip)

        monkeypatch.setattr(module_mod, "step_on_device", step_reading_the_lr)
    monkeypatch.chdir(tmp_path)
    StepWindow.counts.clear()
    cfg = tiny_config(tmp_path, steps=3, monitor={"tensorboard": {"output_dir": str(tmp_path / "tb"),
                                                                  "log_interval": 10}})
    assert cfg["training"]["max_norm"] > 0 and cfg["model"]["moe_router_enable_expert_bias"]
    cfg["callbacks"] = [{"class_path": "sync_count.StepWindow", "init_args": {"after": 1}}]
    assert main(["fit", "--config", str(write_config(tmp_path, cfg))]) == 0
    syncs = StepWindow.counts[2]
    if inject:
        assert [call for call, where in syncs.calls if "step_reading_the_lr" in where] == [
            "item", "aten._local_scalar_dense"], syncs.report()
    else:
        assert syncs.count == 0, syncs.report()
