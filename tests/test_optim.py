"""Optimizer construction: AdamW against a hand-written MindFormers AdamW update, weight-decay groups,
Muon against a hand-written Newton-Schulz update, the Muon+AdamW optimizer's state round trip and its use
under LambdaLR and Lightning, DTensor grouping, and configuration errors."""

import io
import math

import pytest
import torch
from torch import nn

from lit_moe.config import ConfigError
from lit_moe.optim.optimizers import (MuonWithAdamW, build_optimizer, param_groups, validate_optimizer_section)


class Tiny(nn.Module):
    """Names as in the DeepSeek-V3 model: embedding, a 2-D hidden matrix, a norm, a biased linear,
    3-D expert weights and the head."""

    def __init__(self):
        super().__init__()
        g = torch.Generator().manual_seed(0)
        self.embed_tokens = nn.Embedding(11, 6)
        self.q_proj = nn.Linear(6, 8, bias=False)
        self.norm = nn.LayerNorm(8)
        self.gate = nn.Linear(8, 6, bias=True)
        self.experts = nn.Parameter(torch.randn(3, 6, 6, generator=g) * 0.1)
        self.lm_head = nn.Linear(6, 11, bias=False)

    def forward(self, x):
        h = self.gate(self.norm(self.q_proj(self.embed_tokens(x))))
        h = torch.einsum("bh,ehk->bk", h, self.experts)
        return self.lm_head(h)


def loss_of(model, seed, tokens=5):
    g = torch.Generator().manual_seed(seed)
    x = torch.randint(0, 11, (tokens,), generator=g)
    y = torch.randint(0, 11, (tokens,), generator=g)
    return nn.functional.cross_entropy(model(x), y)


def grads_for(model, seed, tokens=5):
    model.zero_grad(set_to_none=True)
    loss_of(model, seed, tokens).backward()
    return {n: p.grad.detach().clone() for n, p in model.named_parameters()}


# ----------------------------------------------------------------------------------------------
# AdamW
# ----------------------------------------------------------------------------------------------
def reference_adamw(params, grads_per_step, lr, betas, eps, wd_of):
    """MindFormers' AdamW (reference/mindformers.md §2.5), written out in float64."""
    b1, b2 = betas
    p = {n: v.double().clone() for n, v in params.items()}
    m = {n: torch.zeros_like(v) for n, v in p.items()}
    v2 = {n: torch.zeros_like(v) for n, v in p.items()}
    for t, grads in enumerate(grads_per_step, start=1):
        bc1, bc2 = 1 - b1 ** t, 1 - b2 ** t
        for n in p:
            g = grads[n].double()
            p[n] = p[n] * (1 - lr * wd_of(n))
            m[n] = b1 * m[n] + (1 - b1) * g
            v2[n] = b2 * v2[n] + (1 - b2) * g * g
            p[n] = p[n] - (lr / bc1) * m[n] / ((v2[n] / bc2).sqrt() + eps)
    return p


def test_adamw_matches_mindformers_update():
    torch.manual_seed(0)
    model = Tiny()
    start = {n: p.detach().clone() for n, p in model.named_parameters()}
    section = {"type": "AdamW", "betas": [0.9, 0.95], "eps": 1.e-8, "weight_decay": 0.1}
    opt = build_optimizer(model.named_parameters(), section, 0.01)
    recorded = []
    for step in range(3):
        recorded.append(grads_for(model, step))
        opt.step()
    no_decay = {"norm.weight", "norm.bias", "gate.bias"}
    ref = reference_adamw(start, recorded, 0.01, (0.9, 0.95), 1e-8, lambda n: 0.0 if n in no_decay else 0.1)
    for n, p in model.named_parameters():
        torch.testing.assert_close(p.detach().double(), ref[n], rtol=1e-5, atol=1e-6, msg=n)


def test_weight_decay_groups_default_rules():
    model = Tiny()
    s = validate_optimizer_section({"weight_decay": 0.05})
    groups = {g["name"]: g for g in param_groups(model.named_parameters(), s, 1e-3)}
    assert set(groups) == {"adamw.decay", "adamw.no_decay"}
    # 1-D parameters and biases: no decay; embedding, head, 2-D and 3-D weights: decay
    assert sorted(groups["adamw.no_decay"]["param_names"]) == ["gate.bias", "norm.bias", "norm.weight"]
    assert sorted(groups["adamw.decay"]["param_names"]) == ["embed_tokens.weight", "experts", "gate.weight",
                                                            "lm_head.weight", "q_proj.weight"]
    assert groups["adamw.decay"]["weight_decay"] == 0.05 and groups["adamw.no_decay"]["weight_decay"] == 0.0


def test_weight_decay_include_beats_exclude_beats_defaults():
    model = Tiny()
    s = validate_optimizer_section({"weight_decay": 0.1,
                                    "weight_decay_include": ["norm.weight", "*.bias"],  # exact, wildcard
                                    "weight_decay_exclude": ["embed", "gate.bias"]})    # substring, exact
    groups = {g["name"]: sorted(g["param_names"]) for g in param_groups(model.named_parameters(), s, 1e-3)}
    assert groups["adamw.no_decay"] == ["embed_tokens.weight"]
    assert "norm.weight" in groups["adamw.decay"] and "gate.bias" in groups["adamw.decay"]


def test_wrapper_prefixes_are_removed_from_names():
    model = Tiny()
    named = [(n.replace("q_proj", "_checkpoint_wrapped_module.q_proj"), p) for n, p in model.named_parameters()]
    s = validate_optimizer_section({"weight_decay_exclude": ["q_proj.weight"]})
    groups = {g["name"]: g["param_names"] for g in param_groups(named, s, 1e-3)}
    assert "q_proj.weight" in groups["adamw.no_decay"]


def test_shared_and_frozen_parameters():
    model = Tiny()
    model.lm_head.weight = model.embed_tokens.weight  # tied (shape 11x6)
    model.norm.weight.requires_grad_(False)
    groups = param_groups(model.named_parameters(), validate_optimizer_section({}), 1e-3)
    names = [n for g in groups for n in g["param_names"]]
    assert names.count("embed_tokens.weight") == 1 and "lm_head.weight" not in names
    assert "norm.weight" not in names


# ----------------------------------------------------------------------------------------------
# Muon
# ----------------------------------------------------------------------------------------------
def newton_schulz_ref(g, steps=5, a=3.4445, b=-4.7750, c=2.0315):
    """Quintic Newton-Schulz in float64 (Keller Jordan's iteration, as MindFormers' Muon runs it)."""
    x = g.double()
    transposed = x.shape[0] > x.shape[1]
    if transposed:
        x = x.T
    x = x / x.norm().clamp(min=1e-7)
    for _ in range(steps):
        gram = x @ x.T
        x = a * x + (b * gram + c * gram @ gram) @ x
    return x.T if transposed else x


def test_muon_routes_and_steps_like_mindformers():
    torch.manual_seed(0)
    model = Tiny()
    section = {"type": "Muon", "weight_decay": 0.1, "momentum": 0.9}
    opt = build_optimizer(model.named_parameters(), section, 0.02)
    assert isinstance(opt, MuonWithAdamW) and isinstance(opt, torch.optim.Optimizer)
    groups = {g["name"]: sorted(g["param_names"]) for g in opt.param_groups}
    # 2-D hidden matrices on Muon; embedding, head, 1-D and 3-D on AdamW
    assert groups["muon.decay"] == ["gate.weight", "q_proj.weight"]
    assert groups["adamw.decay"] == ["embed_tokens.weight", "experts", "lm_head.weight"]

    w0 = model.q_proj.weight.detach().clone().double()
    e0 = model.experts.detach().clone()
    # Random Gaussian gradients are well conditioned; Newton-Schulz amplifies (bf16) noise along
    # near-zero singular directions, so a rank-deficient gradient would not compare across precisions.
    gen = torch.Generator().manual_seed(3)
    grads = [{n: torch.randn(p.shape, generator=gen) for n, p in model.named_parameters()} for _ in range(2)]
    for step_grads in grads:
        for n, p in model.named_parameters():
            p.grad = step_grads[n].clone()
        opt.step()
    g1, g2 = grads[0]["q_proj.weight"].double(), grads[1]["q_proj.weight"].double()
    # MindFormers: m = μ·m + g; nesterov input g + μ·m; p = p·(1 − lr·wd) − lr·0.2·sqrt(max(A, B))·NS(input)
    lr, wd, mu = 0.02, 0.1, 0.9
    scale = lr * 0.2 * math.sqrt(max(w0.shape))
    m = g1
    w = w0 * (1 - lr * wd) - scale * newton_schulz_ref(g1 + mu * m)
    m = mu * m + g2
    w = w * (1 - lr * wd) - scale * newton_schulz_ref(g2 + mu * m)
    # Newton-Schulz runs in bf16 inside torch.optim.Muon: entries O(0.5) with bf16 error O(0.01),
    # times the step scale (~0.011), over two steps
    torch.testing.assert_close(model.q_proj.weight.detach().double(), w, rtol=0, atol=4e-4)
    assert (model.q_proj.weight.detach().double() - w0).abs().max() > 10 * 4e-4  # it did move
    assert not torch.equal(model.experts.detach(), e0)  # 3-D experts stepped by the AdamW half


def muon_model_and_opt(seed=0):
    torch.manual_seed(seed)
    model = Tiny()
    return model, build_optimizer(model.named_parameters(), {"type": "Muon", "weight_decay": 0.01}, 0.01)


def test_muon_state_dict_round_trip_resumes_exactly():
    model_a, opt_a = muon_model_and_opt()
    for s in range(2):
        grads_for(model_a, s)
        opt_a.step()
    buffer = io.BytesIO()  # through bytes, as a checkpoint does (state_dict() returns live tensors)
    torch.save({"model": model_a.state_dict(), "optim": opt_a.state_dict()}, buffer)
    buffer.seek(0)
    saved = torch.load(buffer, weights_only=True)
    saved_model, saved_opt = saved["model"], saved["optim"]
    assert {"momentum_buffer", "exp_avg", "exp_avg_sq", "step"} <= {k for st in saved_opt["state"].values() for k in st}

    model_b, opt_b = muon_model_and_opt(seed=1)
    model_b.load_state_dict(saved_model)
    opt_b.load_state_dict(saved_opt)
    assert opt_b.muon.state is opt_b.state and opt_b.adamw.state is opt_b.state
    for s in range(2, 4):
        for model, opt in ((model_a, opt_a), (model_b, opt_b)):
            grads_for(model, s)
            opt.step()
    for (n, pa), pb in zip(model_a.named_parameters(), model_b.parameters()):
        assert torch.equal(pa, pb), n


def test_distributed_checkpoint_state_dict_round_trip():
    """torch.distributed.checkpoint's optimizer state dict (keyed by parameter name) saves and restores
    the Muon+AdamW optimizer like any optimizer."""
    import copy

    from torch.distributed.checkpoint.state_dict import get_optimizer_state_dict, set_optimizer_state_dict

    model_a, opt_a = muon_model_and_opt()
    before = [p.detach().clone() for p in model_a.parameters()]
    get_optimizer_state_dict(model_a, opt_a)  # a fresh optimizer: DCP initialises its state (lr 0 step)
    assert all(torch.equal(b, p) for b, p in zip(before, model_a.parameters()))
    grads_for(model_a, 0)
    opt_a.step()
    saved = copy.deepcopy(get_optimizer_state_dict(model_a, opt_a))
    assert "q_proj.weight" in saved["state"] and "momentum_buffer" in saved["state"]["q_proj.weight"]

    model_b, opt_b = muon_model_and_opt(seed=1)
    model_b.load_state_dict(model_a.state_dict())
    set_optimizer_state_dict(model_b, opt_b, saved)
    for model, opt in ((model_a, opt_a), (model_b, opt_b)):
        grads_for(model, 1)
        opt.step()
    for (n, pa), pb in zip(model_a.named_parameters(), model_b.parameters()):
        assert torch.equal(pa, pb), n


def test_lambda_lr_drives_both_halves():
    model, opt = muon_model_and_opt()
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda k: 0.5 ** k)
    grads_for(model, 0)
    opt.step()
    sched.step()
    lrs = [g["lr"] for inner in (opt.muon, opt.adamw) for g in inner.param_groups]
    assert lrs and all(lr == pytest.approx(0.005) for lr in lrs)


def test_lightning_accepts_the_muon_optimizer(tmp_path):
    import lightning.pytorch as pl

    class Module(pl.LightningModule):
        def __init__(self):
            super().__init__()
            self.automatic_optimization = False
            self.model = Tiny()

        def training_step(self, batch, batch_idx):
            opt = self.optimizers()
            loss = loss_of(self.model, batch_idx)
            self.manual_backward(loss)
            opt.step()
            opt.zero_grad()
            self.lr_schedulers().step()

        def configure_optimizers(self):
            opt = build_optimizer(self.model.named_parameters(), {"type": "Muon"}, 0.01)
            sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda k: 1.0 / (k + 1))
            return {"optimizer": opt, "lr_scheduler": {"scheduler": sched, "interval": "step"}}

        def train_dataloader(self):
            return torch.utils.data.DataLoader(torch.zeros(3, 1), batch_size=1)

    module = Module()
    before = module.model.q_proj.weight.detach().clone()
    trainer = pl.Trainer(max_steps=3, accelerator="cpu", logger=False, enable_checkpointing=False,
                         enable_progress_bar=False, enable_model_summary=False, default_root_dir=tmp_path)
    trainer.fit(module)
    assert not torch.equal(before, module.model.q_proj.weight)
    opt = trainer.optimizers[0]
    assert isinstance(opt, MuonWithAdamW)
    assert opt.param_groups[0]["lr"] == pytest.approx(0.01 / 4)


# ----------------------------------------------------------------------------------------------
# DTensor grouping (one process, world size 1)
# ----------------------------------------------------------------------------------------------
@pytest.fixture
def gloo_world():
    import torch.distributed as dist

    if dist.is_initialized():
        yield
        return
    # an in-memory store: one rank needs no port (a port picked free can be taken before it is bound)
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        yield
    finally:
        dist.destroy_process_group()


@pytest.mark.parametrize("kind", ["AdamW", "Muon"])
def test_plain_tensors_and_dtensors_get_separate_groups(gloo_world, kind):
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import DTensor, Replicate, Shard, distribute_tensor

    dp = init_device_mesh("cpu", (1,), mesh_dim_names=("dp",))
    ep = init_device_mesh("cpu", (1, 1), mesh_dim_names=("ep", "fsdp"))
    torch.manual_seed(0)
    w, e, b = torch.randn(4, 4), torch.randn(2, 4, 4), torch.randn(4)
    gw, ge, gb = torch.randn(4, 4), torch.randn(2, 4, 4), torch.randn(4)
    sharded = [("q_proj.weight", nn.Parameter(distribute_tensor(w, dp, [Shard(0)]))),
               ("experts.w", nn.Parameter(distribute_tensor(e, ep, [Shard(0), Replicate()]))),
               ("norm.weight", nn.Parameter(b.clone()))]  # a plain tensor next to DTensors
    plain = [("q_proj.weight", nn.Parameter(w.clone())), ("experts.w", nn.Parameter(e.clone())),
             ("norm.weight", nn.Parameter(b.clone()))]
    for (_, p), g in zip(sharded, (gw, ge, gb)):
        p.grad = distribute_tensor(g, p.device_mesh, p.placements) if isinstance(p, DTensor) else g.clone()
    for (_, p), g in zip(plain, (gw, ge, gb)):
        p.grad = g.clone()
    # foreach over a list mixing plain tensors and DTensors raises in torch; the groups keep them apart
    opt = build_optimizer(sharded, {"type": kind, "foreach": True} if kind == "AdamW" else {"type": kind}, 0.1)
    ref = build_optimizer(plain, {"type": kind}, 0.1)
    for g in opt.param_groups:
        assert len({isinstance(p, DTensor) for p in g["params"]}) == 1, g["name"]
    opt.step()
    ref.step()
    for (n, p), (_, q) in zip(sharded, plain):
        full = p.full_tensor() if isinstance(p, DTensor) else p
        torch.testing.assert_close(full, q, msg=n)


# ----------------------------------------------------------------------------------------------
# configuration errors and accepted extras
# ----------------------------------------------------------------------------------------------
def test_unknown_type_lists_supported():
    with pytest.raises(ConfigError, match=r"^optimizer.type: unknown optimizer 'SGD'; supported: AdamW, Muon$"):
        build_optimizer(Tiny().named_parameters(), {"type": "SGD"}, 1e-3)


@pytest.mark.parametrize("section, field, shown", [
    ({"betas": [0.9, 1.0]}, "optimizer.betas[1]", "1.0"),
    ({"betas": [-0.1, 0.9]}, "optimizer.betas[0]", "-0.1"),
    ({"betas": [0.9, 0.95, 0.99]}, "optimizer.betas", "[0.9, 0.95, 0.99]"),
    ({"eps": -1e-8}, "optimizer.eps", "-1e-08"),
    ({"weight_decay": -0.01}, "optimizer.weight_decay", "-0.01"),
    ({"weight_decay": True}, "optimizer.weight_decay", "True"),
    ({"weight_decay_exclude": "  "}, "optimizer.weight_decay_exclude", "'  '"),
    ({"weight_decay_include": [1]}, "optimizer.weight_decay_include", "[1]"),
    ({"enable_cpu_offload": True}, "optimizer.enable_cpu_offload", "True"),
    ({"fused": True, "foreach": True}, "optimizer.fused", "both"),
    ({"type": "Muon", "momentum": 1.5}, "optimizer.momentum", "1.5"),
    ({"type": "Muon", "ns_steps": 0}, "optimizer.ns_steps", "0"),
    ({"type": "Muon", "matched_adamw_rms": -0.3}, "optimizer.matched_adamw_rms", "-0.3"),
    ({"type": "Muon", "qk_clip_threshold": 0}, "optimizer.qk_clip_threshold", "0"),
])
def test_bad_values(section, field, shown):
    with pytest.raises(ConfigError) as err:
        validate_optimizer_section(section)
    msg = str(err.value)
    assert msg.startswith(field) and shown in msg and "\n" not in msg


def test_low_precision_parameter_is_an_error():
    p = nn.Parameter(torch.zeros(2, 2, dtype=torch.bfloat16))
    with pytest.raises(ConfigError, match=r"model.params_dtype: .* 'layers.0.w' is bfloat16"):
        build_optimizer([("layers.0.w", p)], {}, 1e-3)


def test_extras_accepted_and_unused_ones_named(caplog):
    section = {"type": "AdamW", "eps": "1e-8", "accumulate_allreduce_grads_in_fp32": True, "swap": True,
               "my_typo": 1}
    with caplog.at_level("WARNING", logger="lit_moe.optim.optimizers"):
        s = validate_optimizer_section(section)
    assert s.eps == 1e-8
    assert "AdamW ignores my_typo" in caplog.text
    assert "accumulate_allreduce_grads_in_fp32" not in caplog.text


def test_fused_request_reaches_torch():
    opt = build_optimizer(Tiny().named_parameters(), {"use_fused": True}, 1e-3)
    assert all(g["fused"] for g in opt.param_groups)
    # Unset: plain tensors on a device with fused kernels (CPU here) get the fused kernel by default.
    opt = build_optimizer(Tiny().named_parameters(), {}, 1e-3)
    assert all(g["fused"] for g in opt.param_groups)
    opt = build_optimizer(Tiny().named_parameters(), {"fused": False}, 1e-3)
    assert all(not g["fused"] and g["foreach"] is None for g in opt.param_groups)


@pytest.mark.parametrize("section", [{}, {"fused": False}, {"foreach": True}, {"type": "Muon"}])
def test_step_on_device_skips_exactly(section):
    """A guarded step with skip=True leaves parameters and optimizer state as they were (fused AdamW
    through ``found_inf``, the other kernels and Muon by not stepping); skip=False is the plain step
    at the given learning rate."""
    from lit_moe.optim.optimizers import step_on_device

    def run(skips):
        torch.manual_seed(0)
        model = Tiny()
        opt = build_optimizer(model.named_parameters(), section, 1e-2)
        for skip in skips:
            for p in model.parameters():
                p.grad = torch.randn_like(p)
            lrs = [torch.tensor(3e-3, dtype=torch.float64) for _ in opt.param_groups]
            step_on_device(opt, lrs, None if skip is None else torch.tensor(skip))
        return model, opt

    stepped, opt_a = run([None, False])
    skipped, opt_b = run([None, True])
    plain, opt_c = run([None])
    for a, b, c in zip(stepped.parameters(), skipped.parameters(), plain.parameters()):
        assert torch.equal(b, c)           # the skipped step changed nothing
        assert not torch.equal(a, c)       # the taken one did
    for pb, pc in zip(skipped.parameters(), plain.parameters()):
        for key, value in opt_c.state[pc].items():
            assert torch.equal(torch.as_tensor(opt_b.state[pb][key]), torch.as_tensor(value)), key
    # the taken step used the tensor learning rate, and the groups keep their host floats
    assert all(isinstance(g["lr"], float) for g in opt_a.param_groups)


@pytest.mark.filterwarnings("ignore:Detected call of `lr_scheduler.step\\(\\)` before")   # no optimizer here
def test_device_lambda_lr_host_view_follows_the_schedule_without_device_reads():
    """``DeviceLambdaLR`` against torch's ``LambdaLR`` stepped by hand: after every ``advance`` the
    groups' host ``lr`` (what Lightning's LearningRateMonitor reads each step) already has the next
    update's value, without ``sync_host``. After a skip decided on the device the host view is one
    position ahead while the device value stays put; ``sync_host`` (log steps) and ``state_dict``
    make the host exact again."""
    from lit_moe.optim.optimizers import DeviceLambdaLR

    def groups():
        a, b = nn.Parameter(torch.zeros(2)), nn.Parameter(torch.zeros(2))
        return [{"params": [a], "lr": 0.1}, {"params": [b], "lr": 0.02}]

    warmup = lambda k: min(1.0, (k + 1) / 4)          # noqa: E731
    decay = lambda k: 0.9 ** k                         # noqa: E731
    sched = DeviceLambdaLR(torch.optim.SGD(groups()), [warmup, decay])
    ref_opt = torch.optim.SGD(groups())
    ref = torch.optim.lr_scheduler.LambdaLR(ref_opt, [warmup, decay])

    def host(s):
        return [g["lr"] for g in s.optimizer.param_groups]

    def device(s):
        return [float(v) for v in s.device_lrs(torch.device("cpu"))]

    for _ in range(3):
        sched.advance(torch.tensor(True))             # applied, decided on the device
        ref.step()
        assert host(sched) == host(ref) and sched.last_epoch == ref.last_epoch
    assert device(sched) == host(ref)
    sched.advance(torch.tensor(False))                # skipped: the schedule must not move
    assert device(sched) == host(ref)
    ref.step()
    assert host(sched) == host(ref)                   # the host view assumed the update was applied
    sched.sync_host()
    ref_at_3 = torch.optim.lr_scheduler.LambdaLR(torch.optim.SGD(groups()), [warmup, decay])
    for _ in range(3):
        ref_at_3.step()
    assert host(sched) == host(ref_at_3) and sched.last_epoch == 3
    sched.advance()                                   # known applied (no skip guard)
    assert host(sched) == host(ref) and sched.state_dict()["last_epoch"] == 4


# ----------------------------------------------------------------------------------------------
# bf16 moments (exp_avg_dtype / exp_avg_sq_dtype)
# ----------------------------------------------------------------------------------------------
BF16_MOMENTS = {"exp_avg_dtype": "bf16", "exp_avg_sq_dtype": "bfloat16"}


def _tiny_deepseek(seed=0):
    from test_checkpoint_hf import TINY

    from helpers import randomize_norms_and_biases
    from lit_moe.model import DeepseekV3Config, DeepseekV3ForCausalLM

    torch.manual_seed(seed)
    model = DeepseekV3ForCausalLM(DeepseekV3Config(**TINY))
    randomize_norms_and_biases(model, seed=seed)
    return model


def _train(section, steps, lr=3e-3):
    model = _tiny_deepseek()
    opt = build_optimizer(model.named_parameters(), section, lr)
    g = torch.Generator().manual_seed(5)
    tokens = torch.randint(0, 96, (2, 17), generator=g)
    losses = []
    for _ in range(steps):
        opt.zero_grad(set_to_none=True)
        out = model(tokens[:, :-1], labels=tokens[:, 1:])
        (out.loss + 0.3 * out.mtp_loss).backward()
        losses.append(out.loss.item())
        opt.step()
    return model, opt, losses


def test_stored_moments_in_float32_are_torch_adamw_exactly():
    """The bf16-moment optimizer's update is torch's: with float32 storage it gives torch's AdamW bit for bit."""
    from lit_moe.optim.optimizers import AdamWStoredMoments

    torch.manual_seed(0)
    ref, ours = Tiny(), Tiny()
    ours.load_state_dict(ref.state_dict())
    settings = validate_optimizer_section({"weight_decay": 0.1})
    opt_ref = torch.optim.AdamW(param_groups(ref.named_parameters(), settings, 0.01), lr=0.01, betas=settings.betas,
                                eps=settings.eps, foreach=False)
    opt = AdamWStoredMoments(param_groups(ours.named_parameters(), settings, 0.01), lr=0.01, betas=settings.betas,
                             eps=settings.eps, exp_avg_dtype=torch.float32, exp_avg_sq_dtype=torch.float32)
    for s in range(4):
        for model, o in ((ref, opt_ref), (ours, opt)):
            grads_for(model, s)
            o.step()
    for (n, a), b in zip(ref.named_parameters(), ours.parameters()):
        assert torch.equal(a, b), n


def test_bf16_moments_follow_fp32_moments_on_the_tiny_model():
    """20 AdamW steps of the tiny DeepSeek-V3 (MTP, MoE) on one batch: bf16 moments against fp32 moments.
    Measured: largest loss difference 1.9e-4 (losses 4.53 -> 2.27), largest parameter difference 6.6e-4
    (updates of up to 0.06)."""
    steps = 20
    ref, _, ref_losses = _train({"fused": False}, steps)
    model, opt, losses = _train(BF16_MOMENTS, steps)
    assert {st[k].dtype for st in opt.state.values() for k in ("exp_avg", "exp_avg_sq")} == {torch.bfloat16}
    assert ref_losses[-1] < ref_losses[0] - 1.0          # it trains: the comparison means something
    diffs = [abs(a - b) for a, b in zip(ref_losses, losses)]
    assert max(diffs) < 2e-3, diffs
    assert diffs[-1] > 0                                   # the moments really are stored in bf16
    worst = max((a - b).abs().max().item() for a, b in zip(ref.parameters(), model.parameters()))
    assert worst < 6e-3, worst


def test_bf16_moments_save_and_resume_exactly(tmp_path):
    """Saved with lit_moe's checkpoint writer after 2 steps, loaded by ``load_optimizers`` into a fresh
    optimizer: the moments stay bf16 and 2 more steps equal the run that did not stop."""
    from lit_moe.checkpoint.comm import Comm
    from lit_moe.checkpoint.iteration import (IterationReader, SaveJob, fqn_optimizer_state, load_optimizers,
                                              make_common, prepare, split_optimizer_state, write_and_commit)
    from lit_moe.checkpoint.sharded import pieces_of

    torch.manual_seed(0)
    model_a = Tiny()
    opt_a = build_optimizer(model_a.named_parameters(), BF16_MOMENTS, 1e-2)
    for s in range(2):
        grads_for(model_a, s)
        opt_a.step()
    osd = fqn_optimizer_state(opt_a.state_dict(), opt_a, model_a)
    tensors, other = split_optimizer_state(0, osd)
    comm = Comm(None)
    groups = [[dict(g) for g in osd["param_groups"]]]
    prepare(comm, tmp_path, 2)
    path = write_and_commit(comm, SaveJob(tmp_path, 2, "x", pieces_of(model_a.state_dict()), pieces_of(tensors),
                                          other, rng_json="{}",
                                          common=make_common(2, 1, "x", True, optimizers=groups)))

    model_b = Tiny()
    model_b.load_state_dict(model_a.state_dict())
    opt_b = build_optimizer(model_b.named_parameters(), BF16_MOMENTS, 1e-2)
    load_optimizers(model_b, [opt_b], IterationReader(path))
    for pa, pb in zip(model_a.parameters(), model_b.parameters()):
        for key in ("exp_avg", "exp_avg_sq"):
            assert opt_b.state[pb][key].dtype == torch.bfloat16
            assert torch.equal(opt_a.state[pa][key], opt_b.state[pb][key]), key
    for s in range(2, 4):
        for model, opt in ((model_a, opt_a), (model_b, opt_b)):
            grads_for(model, s)
            opt.step()
    for (n, pa), pb in zip(model_a.named_parameters(), model_b.parameters()):
        assert torch.equal(pa, pb), n


@pytest.mark.parametrize("section, shown", [
    ({"exp_avg_dtype": "float16"}, "optimizer.exp_avg_dtype"),
    ({"exp_avg_sq_dtype": 3}, "optimizer.exp_avg_sq_dtype"),
    ({**BF16_MOMENTS, "fused": True}, "optimizer.fused"),
    ({**BF16_MOMENTS, "amsgrad": True}, "optimizer.amsgrad"),
])
def test_bad_moment_dtypes(section, shown):
    with pytest.raises(ConfigError, match=shown):
        validate_optimizer_section(section)
