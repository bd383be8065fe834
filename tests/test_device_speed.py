"""The device-speed probes (lit_moe/runtime/device_speed.py): the MFU peak probe keeps to its time budget on a
device of any speed, and ``compute_dtype: auto`` / an explicit ``bfloat16`` follow the bf16 check's
answer. The matmuls are faked with a clock that advances by n³ / rate (no wall-clock timing)."""

from __future__ import annotations

import pytest
import torch

from lit_moe.runtime import device_speed


class FakeDevice:
    """A device whose ``n³`` matmul in ``dtype`` takes ``2 n³ / rates[dtype]`` seconds of a fake clock."""

    def __init__(self, rates: dict):
        self.rates = rates
        self.now = 0.0
        self.sizes: list[int] = []

    def perf_counter(self) -> float:
        return self.now

    def timed_matmul(self, a: torch.Tensor, b: torch.Tensor) -> float:
        n = a.shape[0]
        self.sizes.append(n)
        seconds = 2.0 * n ** 3 / self.rates[a.dtype]
        self.now += seconds
        return seconds


@pytest.fixture
def fake_device(monkeypatch):
    def make(rates: dict) -> FakeDevice:
        dev = FakeDevice(rates)
        monkeypatch.setattr(device_speed, "time", dev)   # the module's clock only
        monkeypatch.setattr(device_speed, "_timed_matmul", dev.timed_matmul)
        monkeypatch.setattr(device_speed, "_PEAKS", {})
        monkeypatch.setattr(device_speed, "_CHECKS", {})
        return dev
    return make


@pytest.mark.parametrize("gflops", [0.3, 2.5, 22.0, 1500.0])   # emulated bf16 ... AMX bf16
def test_peak_probe_stays_within_its_budget(fake_device, gflops):
    dev = fake_device({torch.bfloat16: gflops * 1e9})
    peak = device_speed.measure_matmul_peak("cpu", torch.bfloat16)
    # the only allowed overrun: warm-up + one timed START_N matmul on a device too slow for them
    first_two = 2 * 2.0 * device_speed.START_N ** 3 / (gflops * 1e9)
    assert dev.now <= max(device_speed.PEAK_BUDGET_S, first_two)
    assert peak == pytest.approx(gflops * 1e9)
    assert device_speed.measure_matmul_peak("cpu", torch.bfloat16) == peak   # cached: no second probe


def test_peak_probe_grows_to_the_largest_size_on_a_fast_device(fake_device):
    dev = fake_device({torch.float32: 400e9})
    device_speed.measure_matmul_peak("cpu", torch.float32)
    assert max(dev.sizes) == 2048 and dev.now <= device_speed.PEAK_BUDGET_S
    # an emulated-bf16 CPU never gets past the small sizes (2048³ would take ~60 s there)
    dev = fake_device({torch.bfloat16: 0.3e9})
    device_speed.measure_matmul_peak("cpu", torch.bfloat16)
    assert max(dev.sizes) == device_speed.START_N


def _decision(monkeypatch, bf16_gflops: float, fp32_gflops: float, query):
    calls = []

    def rates(device, budget_s, samples=3):
        calls.append(budget_s)
        return bf16_gflops * 1e9, fp32_gflops * 1e9

    monkeypatch.setattr(device_speed, "_interleaved_rates", rates)
    monkeypatch.setattr(device_speed, "bf16_capability", lambda device: query)
    monkeypatch.setattr(device_speed, "_CHECKS", {})
    return calls


# the two kinds of CPU, with the rates measured here (512³; AMX vs ONEDNN_MAX_CPU_ISA=AVX2)
NATIVE = (1500.0, 430.0)
EMULATED = (2.4, 430.0)


@pytest.mark.parametrize("rates, query, native", [(NATIVE, True, True), (EMULATED, False, False),
                                                  (NATIVE, None, True), (EMULATED, None, False)])
def test_auto_follows_the_bf16_check(monkeypatch, rates, query, native):
    calls = _decision(monkeypatch, *rates, query)
    chosen, line = device_speed.resolve_compute_dtype("auto", "cpu")
    assert chosen == ("bfloat16" if native else "float32")
    assert line.startswith(f"model.compute_dtype auto → {chosen} on cpu")
    assert f"{rates[0]:.1f} GFLOP/s" in line and f"{rates[1]:.1f} GFLOP/s" in line
    assert len(calls) == 1   # query and measurement agree (or no query): measured once


def test_explicit_bf16_is_kept_and_named_when_slow(monkeypatch):
    _decision(monkeypatch, *EMULATED, False)
    chosen, line = device_speed.resolve_compute_dtype("bfloat16", "cpu")
    assert chosen == "bfloat16"
    assert "0.00558x the fp32 rate" in line and "set model.compute_dtype: auto (or float32)" in line
    _decision(monkeypatch, *NATIVE, True)
    assert device_speed.resolve_compute_dtype("bfloat16", "cpu") == ("bfloat16", None)
    assert device_speed.resolve_compute_dtype("float32", "cpu") == ("float32", None)


def test_a_disagreeing_query_gets_a_longer_measurement(monkeypatch):
    calls = _decision(monkeypatch, *EMULATED, True)   # e.g. a loaded machine, or a query that is wrong
    assert device_speed.bf16_check("cpu").native is False   # the measurement decides
    assert calls == [device_speed.DTYPE_BUDGET_S, 10 * device_speed.DTYPE_BUDGET_S]


def test_accelerators_answer_from_the_query(monkeypatch):
    _decision(monkeypatch, *EMULATED, False)
    assert device_speed.resolve_compute_dtype("auto", "cuda")[0] == "float32"
    _decision(monkeypatch, *EMULATED, None)   # no query (Ascend): native
    assert device_speed.resolve_compute_dtype("auto", "npu")[0] == "bfloat16"


def test_model_section_resolution(monkeypatch):
    _decision(monkeypatch, *EMULATED, False)
    section = {"compute_dtype": "auto", "hidden_size": 64}
    resolved, note = device_speed.resolve_model_section(section, "cpu")
    assert resolved == {"compute_dtype": "float32", "hidden_size": 64} and section["compute_dtype"] == "auto"
    assert note.startswith("model.compute_dtype auto → float32")


def test_fit_prints_the_decision_once_and_a_bad_config_only_its_error(monkeypatch, tmp_path, capsys):
    from helpers import tiny_config, write_config

    from lit_moe.cli import main

    _decision(monkeypatch, *EMULATED, False)
    monkeypatch.chdir(tmp_path)
    bad = tiny_config(tmp_path)
    bad["training"]["global_batch_size"] = 1   # below local_batch_size 2
    assert main(["fit", "--config", str(write_config(tmp_path, bad))]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("lit_moe: error:") and "global_batch_size" in err[0]
    good = tiny_config(tmp_path, steps=1)
    assert main(["fit", "--config", str(write_config(tmp_path, good))]) == 0
    err = capsys.readouterr().err
    assert err.count("lit_moe: model.compute_dtype auto → float32 on cpu") == 1


@pytest.mark.parametrize("rates, chosen", [(NATIVE, "bfloat16"), (EMULATED, "float32")])
def test_a_model_config_built_directly_resolves_auto_for_this_machine(monkeypatch, rates, chosen):
    from lit_moe.model import DeepseekV3Config

    _decision(monkeypatch, *rates, None)
    monkeypatch.setattr(device_speed, "available_accelerator", lambda: "cpu")
    assert DeepseekV3Config(compute_dtype="auto").compute_dtype == chosen


def test_the_real_check_agrees_with_the_independent_rates():
    """The real probe on this machine against an independent timing of bigger matmuls (fp32 and
    bf16 at 512³, best of a few): the same verdict."""
    import time

    def rate(dtype):
        a = torch.randn(512, 512, dtype=dtype)
        a @ a
        best = float("inf")
        for _ in range(3):
            t = time.perf_counter()
            a @ a
            best = min(best, time.perf_counter() - t)
        return 2 * 512 ** 3 / best

    check = device_speed.bf16_check("cpu")
    threads = torch.get_num_threads()
    torch.set_num_threads(1)   # as the probe: other work on a shared machine stalls no thread barrier
    try:
        bf16, fp32 = rate(torch.bfloat16), rate(torch.float32)
    finally:
        torch.set_num_threads(threads)
    # measured here: 3.5x (AMX) and 0.006x (ONEDNN_MAX_CPU_ISA=AVX2); the threshold 0.5 is far from both
    assert check.native == (bf16 >= device_speed.NATIVE_RATIO * fp32)
