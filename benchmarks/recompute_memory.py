"""Peak activation memory and step time without and with full recompute, on the tiny config's model.

    python benchmarks/recompute_memory.py [--config configs/tiny.yaml] [--device cpu|cuda|npu]
                                          [--batch-size B] [--seq-length S] [--steps N] [--check]

Target (issue "Selective recompute by regex"): recomputing every layer cuts peak activation memory
by at least 50% for at most 40% more step time.

What is measured, per variant, on one forward+backward of the training objective
(``loss + aux_loss + mtp_loss``), after a warm-up step so that parameter gradients already exist
(their memory is the same with and without recompute and is not counted):

* ``held``: bytes of tensors created by the forward that are still alive when it returns: what
  the forward keeps for backward (plus the scalar losses). This is the peak of activation memory:
  backward only releases these (with recompute, the one layer recomputed at a time is smaller
  than the layer inputs and output-head activations released before it). The target is judged on it.
* ``peak``: the highest number of bytes of tensors created during the step that were alive at the
  same time, forward and backward together. It adds what is not activation memory: the gradient
  buffers of backward (activation gradients, the fp32 logits gradient of both heads) -- reported
  so that the whole-step effect is visible.
* ``time``: median wall time of ``--steps`` forward+backward steps (no measurement hooks active);
  the variants take turns step by step, so a change of load on a shared machine hits both alike.

How memory is measured: on an accelerator with the allocator's own statistics
(``torch.accelerator.memory_allocated`` / ``max_memory_allocated`` relative to the start of the
step). On CPU there is no allocator statistic, and RSS or tracemalloc do not see (or blur) torch's
allocations, so :class:`LiveMemory` counts them exactly: a ``TorchDispatchMode`` sees every op's
outputs, adds the size of each newly allocated storage (storages shared with the op's inputs, i.e.
views and in-place results, are not new) and subtracts it when the storage is freed (a weak
reference callback on the storage). This counts tensor bytes, not allocator blocks, so it is a
lower bound of what a caching allocator would show; the comparison between variants is exact.
"""

from __future__ import annotations

import argparse
import copy
import pathlib
import statistics
import sys
import time
import weakref
from typing import Any, Callable

import torch
from torch.utils import _pytree as pytree
from torch.utils._python_dispatch import TorchDispatchMode

ROOT = pathlib.Path(__file__).resolve().parents[1]


class LiveMemory(TorchDispatchMode):
    """Bytes of tensor storages allocated inside the ``with`` block that are alive now (``live``)
    and at most (``peak``)."""

    def __init__(self):
        super().__init__()
        self.live = 0
        self.peak = 0
        self._alive: set[int] = set()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        inputs = {t.untyped_storage()._cdata for t in pytree.tree_leaves((args, kwargs))
                  if isinstance(t, torch.Tensor) and t.device.type != "meta"}
        out = func(*args, **kwargs)
        for t in pytree.tree_leaves(out):
            if isinstance(t, torch.Tensor) and t.device.type != "meta":
                storage = t.untyped_storage()
                key = storage._cdata
                if key not in inputs and key not in self._alive:
                    self._add(storage, key)
        return out

    def _add(self, storage: torch.UntypedStorage, key: int) -> None:
        nbytes = storage.nbytes()
        self._alive.add(key)
        self.live += nbytes
        self.peak = max(self.peak, self.live)
        weakref.finalize(storage, self._free, key, nbytes)

    def _free(self, key: int, nbytes: int) -> None:
        if key in self._alive:
            self._alive.discard(key)
            self.live -= nbytes


# ----------------------------------------------------------------------------------------------
# the model and one step
# ----------------------------------------------------------------------------------------------
def load_model_section(config_path: pathlib.Path) -> dict:
    import yaml

    with open(config_path) as f:
        cfg = yaml.safe_load(f)
    if not isinstance(cfg, dict) or not isinstance(cfg.get("model"), dict):
        raise SystemExit(f"{config_path}: no 'model:' section")
    return cfg["model"]


def build_model(model_section: dict, device: torch.device, seed: int = 0) -> torch.nn.Module:
    from lit_moe.model import DeepseekV3Config, DeepseekV3ForCausalLM

    torch.manual_seed(seed)
    model = DeepseekV3ForCausalLM(DeepseekV3Config(**model_section))  # built and initialised on CPU
    model.init_weights(seed)
    return model.to(device).train()


def make_batch(vocab: int, batch: int, seq: int, device: torch.device, seed: int = 1) -> dict:
    g = torch.Generator().manual_seed(seed)
    tokens = torch.randint(2, vocab, (batch, seq + 1), generator=g)
    return dict(input_ids=tokens[:, :-1].to(device), labels=tokens[:, 1:].to(device),
                loss_mask=torch.ones(batch, seq, device=device))


def objective(model: torch.nn.Module, batch: dict) -> torch.Tensor:
    out = model(**batch)
    total = out.loss
    for extra in (out.aux_loss, out.mtp_loss):
        if extra is not None:
            total = total + extra
    return total


def _memory(name: str, device: torch.device) -> Callable[..., Any]:
    # torch.accelerator has the allocator statistics from torch 2.9; older builds: torch.<device type>'s
    return getattr(torch.accelerator, name, None) or getattr(getattr(torch, device.type), name)


def _sync(device: torch.device) -> None:
    if device.type != "cpu":
        torch.accelerator.synchronize()


def measure_memory(model: torch.nn.Module, batch: dict, device: torch.device) -> tuple[int, int]:
    """(held after forward, peak during forward+backward), bytes beyond what existed before."""
    if device.type == "cpu":
        with LiveMemory() as mem:
            loss = objective(model, batch)
            held = mem.live
            loss.backward()
            del loss
        return held, mem.peak
    _sync(device)
    base = _memory("memory_allocated", device)()
    _memory("reset_peak_memory_stats", device)()
    loss = objective(model, batch)
    _sync(device)
    held = _memory("memory_allocated", device)() - base
    loss.backward()
    del loss
    _sync(device)
    return held, _memory("max_memory_allocated", device)() - base


def measure_times(models: dict, batch: dict, device: torch.device, steps: int) -> dict[str, tuple[float, float]]:
    """Median (step time, forward time) per model; the models take turns step by step, so that a
    change in machine load (shared CPUs) affects them alike."""
    times: dict[str, list[tuple[float, float]]] = {name: [] for name in models}
    for _ in range(steps):
        for name, model in models.items():
            _sync(device)
            t0 = time.perf_counter()
            loss = objective(model, batch)
            _sync(device)
            t1 = time.perf_counter()
            loss.backward()
            del loss
            _sync(device)
            times[name].append((time.perf_counter() - t0, t1 - t0))
    return {name: (statistics.median(t for t, _ in ts), statistics.median(f for _, f in ts))
            for name, ts in times.items()}


def main(argv: list[str] | None = None) -> int:
    from lit_moe.strategies.recompute import apply_recompute

    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--config", default=str(ROOT / "configs" / "tiny.yaml"))
    p.add_argument("--device", default=None, help="cpu, cuda, npu (default: the accelerator if any)")
    p.add_argument("--batch-size", type=int, default=None, help="default: training.local_batch_size")
    p.add_argument("--seq-length", type=int, default=None, help="default: model.seq_length")
    p.add_argument("--steps", type=int, default=5, help="timed steps per variant (median)")
    p.add_argument("--threads", type=int, default=None, help="torch CPU threads")
    p.add_argument("--variants", default="none,full", help="comma-separated: none, full, select, outputs")
    p.add_argument("--check", action="store_true", help="exit 1 when the target is missed")
    args = p.parse_args(argv)

    if args.threads:
        torch.set_num_threads(args.threads)
    if args.device:
        device = torch.device(args.device)
    else:
        acc = torch.accelerator.current_accelerator() if torch.accelerator.is_available() else None
        device = acc if acc is not None else torch.device("cpu")
    if device.type != "cpu":
        torch.accelerator.set_device_index(device.index or 0)

    import yaml

    section = load_model_section(pathlib.Path(args.config))
    with open(args.config) as f:
        training = (yaml.safe_load(f) or {}).get("training") or {}
    batch_size = args.batch_size or int(training.get("local_batch_size", 1))
    seq = args.seq_length or int(section.get("seq_length", 128))

    base = build_model(section, device)
    total_layers = len(base.blocks())
    batch = make_batch(base.config.vocab_size, batch_size, seq, device)
    every = [f"0-{total_layers - 1}"]
    known = {
        "none": (None, None),
        "full": ({"mode": "full", "full_recompute_layer": every}, None),
        # informational: attention and the routed experts only
        "select": ({"mode": "select", "select_module": {"self_attention": every, r"mlp\.experts": every}}, None),
        # informational: output recompute (the recompute_comm mechanism) of the dense and shared
        # MLPs' gated activations: their inputs are kept for backward anyway, their outputs not
        "outputs": (None, {"enable": True, "select_module": {r"mlp(\.shared_experts)?\.act": every}}),
    }
    names = ["none"] + [v for v in args.variants.split(",") if v and v != "none"]
    for v in names:
        if v not in known:
            raise SystemExit(f"--variants: unknown variant {v!r} (known: {', '.join(known)})")
    variants = {v: (lambda m, v=v: apply_recompute(m, *known[v])) for v in names}
    models, results = {}, {}
    for name, prepare in variants.items():
        model = copy.deepcopy(base)
        prepare(model)
        objective(model, batch).backward()          # warm-up; parameter gradients now exist
        held, peak = measure_memory(model, batch, device)
        models[name], results[name] = model, dict(held=held, peak=peak)
    for name, (t, fwd) in measure_times(models, batch, device, args.steps).items():
        results[name]["time"], results[name]["fwd"] = t, fwd
    grads = {}
    for name, model in models.items():                # the same weights: recompute must not change gradients
        model.zero_grad(set_to_none=True)
        objective(model, batch).backward()
        grads[name] = [p.grad for p in model.parameters()]
    for name in models:
        results[name]["same"] = all(torch.equal(a, b) for a, b in zip(grads["none"], grads[name]))
        results[name]["diff"] = max(float((a.float() - b.float()).abs().max())
                                    for a, b in zip(grads["none"], grads[name]))

    mib = 2 ** 20
    print(f"device={device.type} batch={batch_size} seq={seq} layers={total_layers} "
          f"(decoder+MTP) memory={'allocator statistics' if device.type != 'cpu' else 'LiveMemory (tensor bytes)'}")
    print(f"{'variant':<8}{'held after fwd MiB':>20}{'peak MiB':>12}{'step ms':>10}{'fwd ms':>8}{'held':>7}{'peak':>7}"
          f"{'time':>7}  gradients vs none")
    none = results["none"]
    for name, r in results.items():
        print(f"{name:<8}{r['held'] / mib:>20.2f}{r['peak'] / mib:>12.2f}{r['time'] * 1e3:>10.1f}{r['fwd'] * 1e3:>8.1f}"
              f"{r['held'] / none['held']:>7.2f}{r['peak'] / none['peak']:>7.2f}{r['time'] / none['time']:>7.2f}"
              f"  {'bitwise identical' if r['same'] else 'max abs diff %.3g' % r['diff']}")
    if "full" not in results:
        return 0
    full = results["full"]
    held_cut = 1 - full["held"] / none["held"]
    peak_cut = 1 - full["peak"] / none["peak"]
    slow = full["time"] / none["time"] - 1
    print(f"full vs none: held -{held_cut:.0%}, peak -{peak_cut:.0%}, step time {slow:+.0%} "
          f"(the forward is {none['fwd'] / none['time']:.0%} of a step without recompute: recomputing every "
          f"layer costs about the layers' share of it)")
    ok = held_cut >= 0.5 and slow <= 0.4
    print(f"target (activation memory -50% or better, step time +40% or less): {'met' if ok else 'MISSED'}"
          f" (activation memory = held after forward; the step peak also counts gradient buffers and"
          f" the output head, which layer recompute does not touch)")
    return 0 if ok or not args.check else 1


if __name__ == "__main__":
    sys.path.insert(0, str(ROOT))
    sys.exit(main())
