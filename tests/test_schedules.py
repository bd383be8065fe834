"""LR schedules against hand-computed values of the MindFormers formulas (reference/mindformers.md §1.2,
mindformers/core/lr/lr_schedule.py), LambdaLR reproduction, and the configuration errors."""

import math

import pytest
import torch

from lit_moe.config import ConfigError
from lit_moe.optim.schedules import SUPPORTED_SCHEDULES, build_lr_lambda, learning_rate_at


def lrs(section, total, steps):
    return [learning_rate_at(section, total, t) for t in steps]


# ----------------------------------------------------------------------------------------------
# curves (every expected value below is worked out by hand from the formulas)
# ----------------------------------------------------------------------------------------------
def test_constant_warmup():
    sec = {"type": "ConstantWarmUpLR", "learning_rate": 0.005, "warmup_steps": 10}
    # warm-up 0.005 * t / 10, then constant; update k uses lr(k) so update 0 has lr 0
    assert lrs(sec, 20, [0, 1, 9, 10, 19]) == pytest.approx([0.0, 0.0005, 0.0045, 0.005, 0.005])
    sec["warmup_lr_init"] = 0.001  # 0.001 + (0.005 - 0.001) * 5 / 10
    assert learning_rate_at(sec, 20, 5) == pytest.approx(0.003)


def test_warmup_ratio_truncates_like_mindformers():
    # W = int(100 * 0.29) = int(28.999999999999996) = 28
    sec = {"type": "ConstantWarmUpLR", "learning_rate": 1.0, "warmup_ratio": 0.29}
    assert learning_rate_at(sec, 100, 27) == pytest.approx(27 / 28)
    assert learning_rate_at(sec, 100, 28) == 1.0
    # ratio wins over warmup_steps, as in MindFormers
    sec["warmup_steps"] = 50
    assert learning_rate_at(sec, 100, 28) == 1.0


def test_no_warmup_keys_means_no_warmup():
    assert learning_rate_at({"type": "ConstantWarmUpLR", "learning_rate": 0.1}, 10, 0) == pytest.approx(0.1)
    assert learning_rate_at({"type": "ConstantWarmUpLR", "learning_rate": 0.1, "warmup_ratio": 0}, 10, 0) == 0.1


def test_linear():
    sec = {"type": "LinearWithWarmUpLR", "learning_rate": 0.005, "warmup_steps": 10}
    # after warm-up: 0.005 * max(0, (20 - t) / 10)
    assert lrs(sec, 20, [5, 10, 15, 19, 20, 25]) == pytest.approx([0.0025, 0.005, 0.0025, 0.0005, 0.0, 0.0])


def test_cosine():
    sec = {"type": "CosineWithWarmUpLR", "learning_rate": 0.005, "warmup_steps": 10}
    # t=15: p = 0.5, 0.5 * (1 + cos(2π · 0.5 · 0.5)) = 0.5
    assert learning_rate_at(sec, 20, 15) == pytest.approx(0.0025)
    # t=12: p = 0.2, 0.5 * (1 + cos(0.2π))
    assert learning_rate_at(sec, 20, 12) == pytest.approx(0.005 * 0.5 * (1 + math.cos(0.2 * math.pi)))
    sec["lr_end"] = 0.001  # 0.001 + 0.004 * 0.5
    assert learning_rate_at(sec, 20, 15) == pytest.approx(0.003)
    assert learning_rate_at(sec, 20, 20) == pytest.approx(0.001)  # t >= decay_steps (= T)
    sec["decay_steps"] = 12
    assert learning_rate_at(sec, 20, 12) == pytest.approx(0.001)
    # decay_steps is checked before the warm-up: decay_ratio 0.25 -> 5 steps
    sec2 = {"type": "CosineWithWarmUpLR", "learning_rate": 0.005, "warmup_steps": 10, "decay_ratio": 0.25,
            "lr_end": 0.0001}
    assert learning_rate_at(sec2, 20, 4) == pytest.approx(0.002)
    assert learning_rate_at(sec2, 20, 5) == pytest.approx(0.0001)


def test_cosine_with_restarts():
    sec = {"type": "CosineWithRestartsAndWarmUpLR", "learning_rate": 0.004, "num_cycles": 2}
    # p = t/20; percent = 0.5 * (1 + cos(π · ((2p) mod 1)))
    assert lrs(sec, 20, [0, 5, 10, 15]) == pytest.approx([0.004, 0.002, 0.004, 0.002])
    assert learning_rate_at(sec, 20, 2) == pytest.approx(0.004 * 0.5 * (1 + math.cos(math.pi * 0.2)))


def test_polynomial():
    sec = {"type": "PolynomialWithWarmUpLR", "learning_rate": 0.005, "warmup_steps": 10, "power": 2.0}
    # default lr_end 1e-7: (0.005 - 1e-7) * (1 - 5/10)^2 + 1e-7
    assert learning_rate_at(sec, 20, 15) == pytest.approx(0.001250075, rel=1e-12)
    assert learning_rate_at(sec, 20, 10) == pytest.approx(0.005)
    assert learning_rate_at(sec, 20, 5) == pytest.approx(0.0025)
    assert learning_rate_at(sec, 20, 21) == pytest.approx(1e-7)
    # decay shorter than the run: ends at lr_end (clamped; documented deviation)
    sec.update(decay_steps=4, lr_end=0.001)
    assert learning_rate_at(sec, 20, 12) == pytest.approx(0.004 * 0.25 + 0.001)
    assert learning_rate_at(sec, 20, 16) == pytest.approx(0.001)


def test_warmup_stable_decay():
    sec = {"type": "WarmUpStableDecayLR", "learning_rate": 0.005, "warmup_steps": 5, "decay_start_steps": 10,
           "lr_end": 0.001}
    # warm-up, stable at 0.005 until 10, then 0.005 - 0.004 * (t - 10) / 10
    assert lrs(sec, 20, [2, 7, 10, 15, 19]) == pytest.approx([0.002, 0.005, 0.005, 0.003, 0.0014])
    sec2 = dict(sec, decay_start_ratio=0.5)
    del sec2["decay_start_steps"]
    assert learning_rate_at(sec2, 20, 15) == pytest.approx(0.003)
    no_warm = {"type": "WarmUpStableDecayLR", "learning_rate": 0.005, "decay_start_steps": 10}
    assert learning_rate_at(no_warm, 20, 0) == pytest.approx(0.005)  # MindFormers: 0/0


def test_constant_with_cooldown():
    # the example of MindFormers' ConstantWithCoolDownLR docstring
    sec = {"type": "ConstantWithCoolDownLR", "learning_rate": 0.005, "warmup_steps": 10, "keep_steps": 10,
           "decay_steps": 10, "final_steps": 10, "lr_end1": 0.002, "lr_end2": 0.001}
    assert lrs(sec, 50, [1, 15, 25, 35, 45]) == pytest.approx([0.0005, 0.005, 0.0035, 0.002, 0.001])
    assert learning_rate_at(sec, 50, 22) == pytest.approx(0.002 + 0.003 * 0.5 * (1 + math.cos(0.2 * math.pi)))
    sec.pop("lr_end2")  # defaults to lr_end1
    assert learning_rate_at(sec, 50, 45) == pytest.approx(0.002)


@pytest.mark.parametrize("kind", SUPPORTED_SCHEDULES)
def test_lambda_lr_reproduces_the_schedule(kind):
    sec = {"type": kind, "learning_rate": 0.003, "warmup_steps": 3, "lr_end": 0.0003, "decay_start_steps": 6,
           "keep_steps": 2, "decay_steps": 4, "lr_end1": 0.0005}
    total = 12
    peak, fn = build_lr_lambda(sec, total)
    assert peak == 0.003
    p = torch.nn.Parameter(torch.zeros(2))
    opt = torch.optim.SGD([p], lr=peak)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, fn)
    used = []
    for _ in range(total):
        used.append(opt.param_groups[0]["lr"])  # the lr of this update
        p.grad = torch.ones_like(p)
        opt.step()
        sched.step()
    assert used == pytest.approx(lrs(sec, total, range(total)), rel=1e-12, abs=1e-15)


def test_numeric_string_learning_rate():
    # PyYAML reads `1e-5` (no dot) as a string
    assert learning_rate_at({"type": "ConstantWarmUpLR", "learning_rate": "1e-5"}, 10, 3) == pytest.approx(1e-5)


# ----------------------------------------------------------------------------------------------
# errors: one line naming lr_scheduler.<key> and the value
# ----------------------------------------------------------------------------------------------
@pytest.mark.parametrize("extra, field, shown", [
    ({"warmup_ratio": 1.5}, "lr_scheduler.warmup_ratio", "1.5"),
    ({"warmup_ratio": -0.1}, "lr_scheduler.warmup_ratio", "-0.1"),
    ({"warmup_steps": -1}, "lr_scheduler.warmup_steps", "-1"),
    ({"warmup_steps": 2.5}, "lr_scheduler.warmup_steps", "2.5"),
    ({"warmup_steps": True}, "lr_scheduler.warmup_steps", "True"),
    ({"learning_rate": 0}, "lr_scheduler.learning_rate", "0"),
    ({"learning_rate": -1e-4}, "lr_scheduler.learning_rate", "-0.0001"),
    ({"learning_rate": "fast"}, "lr_scheduler.learning_rate", "'fast'"),
    ({"warmup_lr_init": -1.0}, "lr_scheduler.warmup_lr_init", "-1.0"),
])
def test_bad_values(extra, field, shown):
    sec = {"type": "ConstantWarmUpLR", "learning_rate": 1e-4, **extra}
    with pytest.raises(ConfigError) as err:
        build_lr_lambda(sec, 100)
    msg = str(err.value)
    assert field in msg and shown in msg and "\n" not in msg


def test_unknown_and_missing_type_list_supported():
    with pytest.raises(ConfigError, match=r"lr_scheduler.type: unknown schedule 'StepLR'; supported: "
                                          r"ConstantWarmUpLR, LinearWithWarmUpLR, CosineWithWarmUpLR"):
        build_lr_lambda({"type": "StepLR"}, 10)
    with pytest.raises(ConfigError, match="lr_scheduler.type: missing"):
        build_lr_lambda({"learning_rate": 1e-4}, 10)


@pytest.mark.parametrize("kind", ["PolynomialWithWarmUpLR", "WarmUpStableDecayLR"])
def test_lr_end_must_be_below_peak(kind):
    with pytest.raises(ConfigError, match=r"lr_scheduler.lr_end: must be smaller than .* got 0.01"):
        build_lr_lambda({"type": kind, "learning_rate": 0.001, "lr_end": 0.01, "decay_start_steps": 1}, 10)


def test_wsd_needs_decay_start_and_total_steps_positive():
    with pytest.raises(ConfigError, match="lr_scheduler.decay_start_steps"):
        build_lr_lambda({"type": "WarmUpStableDecayLR", "learning_rate": 0.01}, 10)
    with pytest.raises(ConfigError, match="lr_scheduler.decay_start_ratio: must be in \\[0, 1\\], got 2"):
        build_lr_lambda({"type": "WarmUpStableDecayLR", "learning_rate": 0.01, "decay_start_ratio": 2}, 10)
    with pytest.raises(ConfigError, match="training.steps"):
        build_lr_lambda({"type": "ConstantWarmUpLR"}, 0)


def test_unused_keys_are_named(caplog):
    with caplog.at_level("WARNING", logger="lit_moe.optim.schedules"):
        build_lr_lambda({"type": "ConstantWarmUpLR", "learning_rate": 1e-3, "lr_end": 1e-5, "total_steps": 7}, 10)
    text = caplog.text
    assert "ConstantWarmUpLR ignores lr_end" in text
    assert "total_steps=7 is replaced by training.steps=10" in text
