"""Recompute (``recompute`` / ``recompute_comm``): validation, path selection, and the two
mechanisms (checkpointed forward, output recompute) on a small model that follows the model
contract (``blocks()``; routing counted only outside the autograd engine).

The expected values are independent of the code under test: plain autograd without any
recompute (bitwise on CPU fp32), call counts that follow from what recompute means (a recomputed
region runs twice per step), and byte counts of the tensors involved.
"""

import copy
import importlib.util
import pathlib
import warnings

import pytest
import torch
import yaml
from torch import nn

from lit_moe.config import ConfigError, RecomputeCommConfig, RecomputeConfig
from lit_moe.strategies.comm import CommStep
from lit_moe.strategies.recompute import (
    FSDP_ALL_GATHER, RecomputeWarning, addressable_paths, apply_recompute, fsdp_reshard_after_forward,
    remove_recompute, validate_recompute)
from lit_moe.strategies.recompute.hooks import regions

ROOT = pathlib.Path(__file__).resolve().parents[1]
_spec = importlib.util.spec_from_file_location("recompute_memory", ROOT / "benchmarks" / "recompute_memory.py")
bench = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(bench)


# ----------------------------------------------------------------------------------------------
# a small model with the contract's shape
# ----------------------------------------------------------------------------------------------
CALLS: dict[str, int] = {}


def fake_all_gather(x):
    """Stands in for a sequence all-gather over two ranks: the output is twice the input."""
    CALLS["gather"] = CALLS.get("gather", 0) + 1
    return torch.cat([x, x.flip(1)], dim=1)


class RMSNorm(nn.Module):
    def __init__(self, h):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(h))

    def forward(self, x):
        CALLS["norm"] = CALLS.get("norm", 0) + 1
        return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-6) * self.weight


class Attention(nn.Module):
    def __init__(self, h):
        super().__init__()
        self.q_proj = nn.Linear(h, 2 * h, bias=False)
        self.o_proj = nn.Linear(2 * h, h, bias=False)
        self.all_gather = CommStep(fake_all_gather)  # a communication step, addressable as self_attention.all_gather
        self._private = CommStep(fake_all_gather)    # underscore attributes are not addressable
        self.plain = fake_all_gather                 # nor plain functions (recompute could only rebind them)

    def forward(self, x):
        s = x.shape[1]
        g = self.all_gather(x)             # q_proj saves the gathered tensor for its weight gradient
        y = self.o_proj(torch.tanh(self.q_proj(g)))
        return y[:, :s] + y[:, s:]


class MoE(nn.Module):
    def __init__(self, h, e=4, i=8, guard=True):
        super().__init__()
        self.router = nn.Linear(h, e, bias=False)
        self.w1 = nn.Parameter(torch.randn(e, h, i) * 0.2)
        self.w2 = nn.Parameter(torch.randn(e, i, h) * 0.2)
        self.register_buffer("tokens_per_expert", torch.zeros(e))
        self.guard = guard
        self.aux_loss = None

    def forward(self, x):
        b, s, h = x.shape
        t = x.reshape(-1, h)
        probs = torch.softmax(self.router(t), -1)
        w, idx = probs.topk(2, -1)
        counts = torch.bincount(idx.flatten(), minlength=probs.shape[-1]).float()
        # the model contract: count only in forward, not when the engine recomputes in backward
        if self.training and (not self.guard or torch._C._current_graph_task_id() == -1):
            self.tokens_per_expert += counts
        self.aux_loss = (probs.mean(0) * counts).sum() * 1e-2
        out = torch.zeros_like(t)
        for k in range(2):
            hid = torch.einsum("th,thi->ti", t, self.w1[idx[:, k]])
            out = out + w[:, k:k + 1] * torch.einsum("ti,tih->th", torch.nn.functional.silu(hid), self.w2[idx[:, k]])
        return out.view(b, s, h)


class Layer(nn.Module):
    def __init__(self, h, moe, guard=True):
        super().__init__()
        self.input_layernorm = RMSNorm(h)
        self.self_attention = Attention(h)
        self.pre_mlp_layernorm = RMSNorm(h)
        self.mlp = MoE(h, guard=guard) if moe else nn.Sequential(nn.Linear(h, 3 * h), nn.GELU(), nn.Linear(3 * h, h))

    def forward(self, x):
        x = x + self.self_attention(self.input_layernorm(x))
        return x + self.mlp(self.pre_mlp_layernorm(x))


class MTP(nn.Module):
    def __init__(self, h, guard=True):
        super().__init__()
        self.eh_proj = nn.Linear(2 * h, h, bias=False)
        self.layer = Layer(h, moe=True, guard=guard)


class Toy(nn.Module):
    def __init__(self, h=16, vocab=32, n_layers=3, guard=True):
        super().__init__()
        self.embed_tokens = nn.Embedding(vocab, h)
        self.layers = nn.ModuleList(Layer(h, moe=i > 0, guard=guard) for i in range(n_layers))
        self.norm = RMSNorm(h)
        self.lm_head = nn.Linear(h, vocab, bias=False)
        self.mtp = nn.ModuleList([MTP(h, guard=guard)])

    def blocks(self):
        return list(self.layers) + [m.layer for m in self.mtp]

    def moe_layers(self):
        return [b.mlp for b in self.blocks() if isinstance(b.mlp, MoE)]

    def forward(self, ids):
        x = self.embed_tokens(ids)
        for layer in self.layers:
            x = layer(x)
        h = self.norm(x)
        loss = nn.functional.cross_entropy(self.lm_head(h[:, :-1]).flatten(0, 1), ids[:, 1:].flatten())
        m = self.mtp[0]
        z = m.layer(m.eh_proj(torch.cat([self.embed_tokens(ids.roll(-1, 1)), h], -1)))
        mtp_loss = 0.3 * nn.functional.cross_entropy(self.lm_head(z[:, :-2]).flatten(0, 1), ids[:, 2:].flatten())
        aux = sum(m.aux_loss for m in self.moe_layers())
        return loss, aux, mtp_loss


def make(guard=True, seed=0):
    torch.manual_seed(seed)
    return Toy(guard=guard)


def ids(seed=1, b=2, s=12):
    return torch.randint(0, 32, (b, s), generator=torch.Generator().manual_seed(seed))


def step(model, batch):
    """One forward/backward; returns the losses, the gradients and the routing counts."""
    model.zero_grad(set_to_none=True)
    for m in model.moe_layers():
        m.tokens_per_expert.zero_()
    loss, aux, mtp = model(batch)
    (loss + aux + mtp).backward()
    grads = {n: p.grad.clone() for n, p in model.named_parameters()}
    counts = [m.tokens_per_expert.clone() for m in model.moe_layers()]
    return (loss.detach(), aux.detach(), mtp.detach()), grads, counts


def count_calls(model):
    """Forward calls per module path (forward hooks run for recomputed calls too)."""
    calls: dict[str, int] = {}
    for name, mod in model.named_modules():
        if name:
            mod.register_forward_hook(lambda m, i, o, name=name: calls.__setitem__(name, calls.get(name, 0) + 1))
    return calls


def assert_same(a, b):
    (la, ga, ca), (lb, gb, cb) = a, b
    for x, y in zip(la, lb):
        assert torch.equal(x, y)
    assert ga.keys() == gb.keys()
    for n in ga:
        assert torch.equal(ga[n], gb[n]), n
    for x, y in zip(ca, cb):
        assert torch.equal(x, y)


# ----------------------------------------------------------------------------------------------
# validation
# ----------------------------------------------------------------------------------------------
def test_yaml_ranges_are_strings_and_expand():
    rc = RecomputeConfig(**yaml.safe_load("mode: full\nfull_recompute_layer: [0, 2-3]"))
    assert rc.full_recompute_layer == [0, "2-3"]
    assert validate_recompute(rc, None, 5).full_layers == (0, 2, 3)
    assert validate_recompute({"mode": "None"}, None, 5).empty
    assert validate_recompute(None, None, 5).empty


@pytest.mark.parametrize("section, total, field", [
    ({"mode": "all"}, 4, "recompute.mode"),
    ({"mode": "full"}, 4, "recompute.full_recompute_layer"),
    ({"mode": "full", "full_recompute_layer": []}, 4, "recompute.full_recompute_layer"),
    ({"mode": "full", "full_recompute_layer": ["0-4"]}, 4, "recompute.full_recompute_layer"),
    ({"mode": "full", "full_recompute_layer": [2, "0-1"]}, 4, "recompute.full_recompute_layer"),
    ({"mode": "full", "full_recompute_layer": ["0-2", 2]}, 4, "recompute.full_recompute_layer"),
    ({"mode": "full", "full_recompute_layer": ["3-1"]}, 4, "recompute.full_recompute_layer"),
    ({"mode": "full", "full_recompute_layer": ["x"]}, 4, "recompute.full_recompute_layer"),
    ({"mode": "select"}, 4, "recompute.select_module"),
    ({"mode": "select", "select_module": ["mlp"]}, 4, "recompute.select_module"),
    ({"mode": "select", "select_module": {"mlp(": [0]}}, 4, "recompute.select_module['mlp(']"),
    ({"mode": "select", "select_module": {"mlp": ["0-9"]}}, 4, "recompute.select_module['mlp']"),
    ({"mode": "select", "select_module": {"mlp": []}}, 4, "recompute.select_module['mlp']"),
    ({"mode": "select", "full_recompute_layer": [7], "select_module": {"mlp": [0]}}, 4,
     "recompute.full_recompute_layer"),
    ({"mode": "full", "bogus": 1}, 4, "recompute.bogus: unknown key"),
])
def test_bad_recompute_is_named(section, total, field):
    with pytest.raises(ConfigError) as e:
        validate_recompute(section, None, total)
    assert str(e.value).startswith(field), str(e.value)
    assert "\n" not in str(e.value)


def test_bad_recompute_comm_is_named():
    with pytest.raises(ConfigError, match=r"^recompute_comm.select_module: recompute_comm.enable is true"):
        validate_recompute(None, RecomputeCommConfig(enable=True), 4)
    with pytest.raises(ConfigError, match=r"^recompute_comm.select_module\['mlp.router.all_gather'\]: layer 5"):
        validate_recompute(None, {"enable": True, "select_module": {"mlp.router.all_gather": ["0-5"]}}, 4)
    with pytest.raises(ConfigError, match=r"^recompute_comm.enable"):
        validate_recompute(None, {"enable": "yes", "select_module": {"a": [0]}}, 4)
    # disabled: the (here out-of-range) selection is not applied, so it is not an error
    assert validate_recompute(None, {"enable": False, "select_module": {"a": ["0-9"]}}, 4).empty


def test_ignored_settings_warn():
    with pytest.warns(RecomputeWarning, match="recompute.mode is None"):
        validate_recompute({"full_recompute_layer": [0]}, None, 4)
    with pytest.warns(RecomputeWarning, match="select_module is ignored"):
        plan = validate_recompute({"mode": "full", "full_recompute_layer": [1], "select_module": {"mlp": [0]}}, None, 4)
    assert plan.full_layers == (1,) and plan.select == ()


def test_select_plan_keeps_full_layers_and_patterns():
    plan = validate_recompute({"mode": "select", "full_recompute_layer": ["0-1"],
                               "select_module": {"self_attention": ["0-1"], r".*\.matmul": ["0-3"]}},
                              {"enable": True, "select_module": {"mlp.router.all_gather": [3]}}, 4)
    assert plan.full_layers == (0, 1)
    assert plan.select == (("self_attention", (0, 1)), (r".*\.matmul", (0, 1, 2, 3)))
    assert plan.comm == (("mlp.router.all_gather", (3,)),)


# ----------------------------------------------------------------------------------------------
# path selection
# ----------------------------------------------------------------------------------------------
def test_addressable_paths_are_modules_and_public_callables():
    layer = make().layers[1]
    paths = addressable_paths(layer)
    assert paths["self_attention"] == (layer.self_attention, None)
    assert paths["self_attention.q_proj"] == (layer.self_attention.q_proj, None)
    assert paths["self_attention.all_gather"] == (layer.self_attention, "all_gather")
    assert not {"self_attention._private", "self_attention.plain", "self_attention.forward"} & set(paths)
    assert "mlp.router" in paths and "mlp.tokens_per_expert" not in paths and "mlp.w1" not in paths
    depths = [p.count(".") for p in paths]
    assert depths == sorted(depths)


def test_select_wraps_exactly_the_matches_and_keeps_names():
    model = make()
    keys = list(model.state_dict())
    params = [n for n, _ in model.named_parameters()]
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # every pattern below matches something
        apply_recompute(model, RecomputeConfig(mode="select", select_module={
            "self_attention": [0, 3],                 # layer 3 is the MTP layer
            "self_attention.q_proj": [0, 1],         # child of a selected parent in layer 0: dropped
            r"mlp\.(router|w1)": ["1-2"],             # w1 is a parameter, not addressable
        }), None)
    wrapped = {f"{i}.{n}" if n else str(i) for i, b in enumerate(model.blocks())
               for n, m in b.named_modules() if regions(m)}
    assert wrapped == {"0.self_attention", "1.self_attention.q_proj", "1.mlp.router", "2.mlp.router",
                       "3.self_attention"}
    assert [type(r).__name__ for r in regions(model.mtp[0].layer.self_attention)] == ["_Checkpointed"]
    assert all("forward" not in vars(m) for m in model.modules())   # nothing rebound: forward hooks
    assert list(model.state_dict()) == keys and [n for n, _ in model.named_parameters()] == params


def test_unmatched_select_pattern_is_an_error_naming_nearest_paths():
    # MindFormers only warns; a selection that recomputes nothing is one error line here
    with pytest.raises(ConfigError, match=r"recompute.select_module: '.\*\\\\.matmul' matches no module .*nearest"):
        apply_recompute(make(), {"mode": "select", "select_module": {r".*\.matmul": ["0-3"], "mlp": [1]}}, None)


def test_unmatched_comm_pattern_warns_by_name():
    with pytest.warns(RecomputeWarning, match=r"recompute_comm.select_module\['mlp.router.all_gather'\]"):
        apply_recompute(make(), None, {"enable": True, "select_module": {"mlp.router.all_gather": ["0-3"]}})


def test_apply_is_idempotent_and_removable():
    model = make()
    rc = RecomputeConfig(mode="full", full_recompute_layer=["0-3"])
    apply_recompute(model, rc, None)
    first = regions(model.layers[0])
    apply_recompute(model, rc, None)  # configure_model may run twice
    assert regions(model.layers[0]) == first and len(first) == 1 and first[0].call.module is model.layers[0]
    with pytest.raises(RuntimeError, match="different recompute"):
        apply_recompute(model, RecomputeConfig(mode="full", full_recompute_layer=[0]), None)
    remove_recompute(model)
    assert not any(regions(m) or m._forward_hooks for b in model.blocks() for m in b.modules())
    apply_recompute(model, None, {"enable": True, "select_module": {"self_attention.all_gather": [0]}})
    step = model.layers[0].self_attention.all_gather
    assert type(step.recompute).__name__ == "_OutputRecomputed" and step.recompute.call is fake_all_gather
    remove_recompute(model)
    assert model.layers[0].self_attention.all_gather is step and step.recompute is None and step.fn is fake_all_gather
    assert not regions(model.layers[0]) and not model.layers[0]._forward_hooks


# ----------------------------------------------------------------------------------------------
# behaviour: identical numbers, recomputed regions run twice, less memory
# ----------------------------------------------------------------------------------------------
@pytest.mark.parametrize("recompute", [
    RecomputeConfig(mode="full", full_recompute_layer=["0-3"]),
    RecomputeConfig(mode="full", full_recompute_layer=[1, 3]),
    RecomputeConfig(mode="select", full_recompute_layer=[0], select_module={"mlp": ["1-3"], "self_attention": [2]}),
])
def test_gradients_losses_and_counts_identical(recompute):
    batch = ids()
    ref = step(make(), batch)
    model = make()
    apply_recompute(model, recompute, None)
    got = step(model, batch)
    assert_same(ref, got)
    assert all(c.sum() > 0 for c in got[2])
    # and a second step (the counters and caches carry no state between steps)
    assert_same(step(make(), ids(2)), step(model, ids(2)))


def test_full_recompute_reruns_each_layer_once():
    batch = ids()
    base = make()
    base_calls = count_calls(base)
    step(base, batch)
    model = make()
    apply_recompute(model, RecomputeConfig(mode="full", full_recompute_layer=["0-3"]), None)
    calls = count_calls(model)
    step(model, batch)
    for name, n in base_calls.items():
        inside_block = name.startswith("layers.") and name.count(".") >= 2 or name.startswith("mtp.0.layer.")
        # a recomputed sub-module runs again in backward; early stop may skip the last ones
        # of a layer (nothing after them is needed), never the first
        assert calls[name] >= n if inside_block else calls[name] == n, name
    assert calls["layers.0.input_layernorm"] == 2 * base_calls["layers.0.input_layernorm"]
    assert calls["mtp.0.layer.self_attention.q_proj"] == 2 * base_calls["mtp.0.layer.self_attention.q_proj"]
    assert calls["layers.0"] == base_calls["layers.0"]  # the block's own hooks stay outside


def test_without_the_counting_guard_recompute_would_count_twice():
    """Shows that recompute really re-runs the router, so the model's guard is what keeps counts exact."""
    batch = ids()
    ref = step(make(guard=False), batch)[2]
    model = make(guard=False)
    apply_recompute(model, RecomputeConfig(mode="select", select_module={"mlp": ["1-3"]}), None)
    got = step(model, batch)[2]
    for r, g in zip(ref, got):
        assert torch.equal(g, 2 * r)


def live_after_forward(model, batch):
    """Bytes of tensors created by the forward that are still alive when it returns (what is kept
    for backward, plus the three scalar losses)."""
    with bench.LiveMemory() as mem:
        out = model(batch)
        held = mem.live
        sum(out).backward()
    return held, mem.peak


def test_full_recompute_keeps_only_layer_inputs():
    batch = ids(b=4, s=32)
    held_ref, _ = live_after_forward(make(), batch)
    model = make()
    apply_recompute(model, RecomputeConfig(mode="full", full_recompute_layer=["0-3"]), None)
    held, _ = live_after_forward(model, batch)
    assert held < 0.6 * held_ref, (held, held_ref)


# ----------------------------------------------------------------------------------------------
# output recompute (recompute_comm, and function attributes in select mode)
# ----------------------------------------------------------------------------------------------
COMM = {"enable": True, "select_module": {"self_attention.all_gather": ["0-3"]}}


def test_comm_output_is_recomputed_not_kept():
    batch = ids(b=4, s=32)
    h = 16
    CALLS.clear()
    ref = step(make(), batch)
    assert CALLS["gather"] == 4
    held_ref, _ = live_after_forward(make(), batch)

    model = make()
    apply_recompute(model, None, COMM)
    CALLS.clear()
    got = step(model, batch)
    assert_same(ref, got)
    assert CALLS["gather"] == 8  # once in forward, once in backward for q_proj's weight gradient
    held, _ = live_after_forward(model, batch)
    gathered, local = 4 * 2 * 32 * h * 4, 4 * 32 * h * 4  # bytes of one gathered / local activation, fp32
    # each of the 4 layers no longer holds its gathered tensor but holds the gather's input instead
    # (the local shard: nothing else kept it, as torch.cat saves nothing)
    assert held_ref - held == 4 * (gathered - local)


def test_select_function_attribute_is_output_recomputed():
    batch = ids()
    ref = step(make(), batch)
    model = make()
    apply_recompute(model, {"mode": "select", "select_module": {r".*\.all_gather": [1, 2]}}, None)
    CALLS.clear()
    assert_same(ref, step(model, batch))
    assert CALLS["gather"] == 6


def test_comm_module_output_recompute():
    """A module path in recompute_comm: its output is recomputed from its inputs in backward, once
    per layer however many ops saved it (the router and the expert einsums save views of it)."""
    batch = ids()
    CALLS.clear()
    ref = step(make(), batch)
    assert CALLS["norm"] == 9  # 2 per layer, 4 layers, plus the final norm
    held_ref, _ = live_after_forward(make(), batch)
    model = make()
    apply_recompute(model, None, {"enable": True, "select_module": {"pre_mlp_layernorm": ["0-3"]}})
    calls = count_calls(model)
    CALLS.clear()
    assert_same(ref, step(model, batch))
    assert CALLS["norm"] == 9 + 4
    assert calls["layers.1.pre_mlp_layernorm"] == 1  # module hooks stay outside: the re-run is the bare forward
    held, _ = live_after_forward(model, batch)
    assert held < held_ref


def test_comm_inside_recomputed_region_is_not_wrapped_twice():
    batch = ids()
    ref = step(make(), batch)
    model = make()
    apply_recompute(model, {"mode": "select", "full_recompute_layer": [0], "select_module": {"self_attention": [1]}},
                    COMM)
    assert model.layers[0].self_attention.all_gather.recompute is None
    assert model.layers[1].self_attention.all_gather.recompute is None
    assert type(model.layers[2].self_attention.all_gather.recompute).__name__ == "_OutputRecomputed"
    CALLS.clear()
    assert_same(ref, step(model, batch))
    assert CALLS["gather"] == 8  # layers 0, 1: checkpoint re-run; layers 2, 3: output recompute


def test_comm_recompute_under_autocast_matches():
    batch = ids()

    def run(model):
        with torch.autocast("cpu", dtype=torch.bfloat16):
            return step(model, batch)

    ref = run(make())
    model = make()
    apply_recompute(model, None, COMM)
    assert_same(ref, run(model))


def test_comm_recompute_detects_inplace_change_of_input():
    class Bad(nn.Module):
        def __init__(self):
            super().__init__()
            self.lin = nn.Linear(4, 4)
            self.all_gather = CommStep(fake_all_gather)

        def forward(self, x):
            x = x * 1.0
            y = self.lin(self.all_gather(x))
            x.add_(1.0)  # the gather's input changes after the call
            return y

    class M(nn.Module):
        def __init__(self):
            super().__init__()
            self.b = Bad()

        def blocks(self):
            return [self.b]

    m = M()
    apply_recompute(m, None, {"enable": True, "select_module": {"all_gather": [0]}})
    out = m.b(torch.randn(2, 3, 4))
    with pytest.raises(RuntimeError, match="modified in place"):
        out.sum().backward()


def test_fsdp_all_gather_virtual_path():
    model = make()
    with pytest.warns(RecomputeWarning, match="nothing_here"):
        plan = apply_recompute(model, None, {"enable": True,
                                             "select_module": {FSDP_ALL_GATHER: [1, 3], "nothing_here": [0]}})
    assert [fsdp_reshard_after_forward(plan, i, False) for i in range(4)] == [False, True, False, True]
    # also in a layer that is recomputed whole: re-gathering parameters is independent of that
    full = make()
    full_plan = apply_recompute(full, {"mode": "full", "full_recompute_layer": [1]},
                                {"enable": True, "select_module": {".*": [1]}})
    assert [fsdp_reshard_after_forward(full_plan, i, False) for i in range(4)] == [False, True, False, False]
    assert all(fsdp_reshard_after_forward(plan, i, True) for i in range(4))
    assert not any(fsdp_reshard_after_forward(None, i, False) for i in range(4))   # no recompute sections
    # the FSDP decision is the plan's: nothing is left on the modules for FSDP to read
    assert not any(k.startswith("_lit_moe") for b in model.blocks() for k in vars(b))


def test_deepcopy_of_a_recomputed_model_is_independent():
    model = make()
    apply_recompute(model, RecomputeConfig(mode="full", full_recompute_layer=["0-3"]), COMM)
    clone = copy.deepcopy(model)
    region = regions(clone.layers[0])[0]
    assert region.call.module is clone.layers[0] and region is not regions(model.layers[0])[0]
    assert_same(step(model, ids()), step(clone, ids()))


# ----------------------------------------------------------------------------------------------
# hooks of the parallel steps (registered before recompute) are recomputed with the forward
# ----------------------------------------------------------------------------------------------
def add_local_param_hooks(module, stack):
    """Like tensor parallel's ``use_local_params``: the forward sees a stand-in for ``weight``
    (here 2 * weight), swapped in by a pre-hook and swapped back by an always-call post-hook."""
    def pre(mod, args):
        stack.append(mod._parameters["weight"])
        mod._parameters["weight"] = stack[-1] * 2.0

    def post(mod, args, out):
        mod._parameters["weight"] = stack.pop()

    module.register_forward_pre_hook(pre)
    return module.register_forward_hook(post, always_call=True)


@pytest.mark.parametrize("target", ["self_attention.q_proj", "self_attention"])
def test_hooks_present_at_apply_time_are_recomputed_with_the_forward(target):
    batch = ids()

    def hooked(model):
        stack = []
        add_local_param_hooks(model.layers[1].self_attention.q_proj, stack)
        return stack

    ref_model = make()
    hooked(ref_model)
    ref = step(ref_model, batch)
    model = make()
    stack = hooked(model)
    apply_recompute(model, {"mode": "select", "select_module": {target: [1]}}, None)
    q = model.layers[1].self_attention.q_proj
    # the parallel step's hooks stay on the module, inside the region around them
    assert len(q._forward_pre_hooks) == 1 + (target == "self_attention.q_proj")
    assert_same(ref, step(model, batch))
    assert stack == [] and isinstance(q._parameters["weight"], nn.Parameter)
    remove_recompute(model)
    assert len(q._forward_pre_hooks) == 1 and len(q._forward_hooks) == 1 and q._forward_hooks_always_called
    assert_same(ref, step(model, batch))


def test_hooks_added_after_apply_stay_outside_and_would_be_wrong_inside():
    """The reason hooks are captured: a parameter-swapping hook left outside the recomputed region
    is not re-run by the recompute, and the gradients come out wrong."""
    batch = ids()
    ref_model = make()
    add_local_param_hooks(ref_model.layers[1].self_attention.q_proj, [])
    ref = step(ref_model, batch)
    model = make()
    apply_recompute(model, {"mode": "select", "select_module": {"self_attention.q_proj": [1]}}, None)
    add_local_param_hooks(model.layers[1].self_attention.q_proj, [])  # after: outside the region
    got = step(model, batch)
    # the recomputed linear sees the restored weight, not the stand-in: the input gradient is half
    name = "layers.1.input_layernorm.weight"
    assert not torch.allclose(got[1][name], ref[1][name])


def test_always_call_hooks_close_on_early_stop_of_a_recompute():
    """Non-reentrant checkpoint stops a recompute once it has every saved tensor (by raising inside
    the forward); post-hooks marked always_call must still run, as nn.Module.__call__ does."""
    model = make()
    opened = []

    def pre(mod, args):
        opened.append(1)

    def post(mod, args, out):
        opened.pop()

    # the MTP layer's dense-free MoE: its last ops save nothing the backward needs last
    for block in model.blocks():
        block.mlp.register_forward_pre_hook(pre)
        block.mlp.register_forward_hook(post, always_call=True)
    apply_recompute(model, {"mode": "select", "select_module": {"mlp": ["0-3"]}}, None)
    step(model, ids())
    assert opened == []


def test_output_recompute_replays_random_numbers():
    """A recomputed call that draws random numbers (dropout) gets the same ones again in backward."""
    def noisy_gather(x):
        return nn.functional.dropout(fake_all_gather(x), 0.5, training=True)

    def run(recompute_comm, preserve=True):
        model = make()
        for layer in model.blocks():
            layer.self_attention.all_gather = CommStep(noisy_gather)
        apply_recompute(model, None, recompute_comm)
        if not preserve:  # what would happen without the replay
            for layer in model.blocks():
                layer.self_attention.all_gather.recompute.preserve_rng_state = False
        torch.manual_seed(3)
        return step(model, ids())

    ref = run(None)
    assert_same(ref, run(COMM))
    wrong = run(COMM, preserve=False)[1]["layers.0.self_attention.q_proj.weight"]
    assert not torch.equal(wrong, ref[1]["layers.0.self_attention.q_proj.weight"])
