"""RoPE / YaRN against the values worked out in deepseek_math.md §2 (DeepSeek-V3: d_r=64, s=40, L0=4096)."""

import math

import pytest
import torch

from lit_moe.model import DeepseekV3Config
from lit_moe.model.presets import DEEPSEEK_V3_671B
from lit_moe.model.rope import rope_inv_freq, rotary_cos_sin, softmax_scale, yarn_correction_range
from lit_moe.ops import apply_rotary


def dsv3(**overrides):
    return DeepseekV3Config(**{**DEEPSEEK_V3_671B, **overrides})


def test_yarn_correction_range_and_ramp_table():
    assert yarn_correction_range(32, 1, 64, 10000, 4096) == (10, 23)
    inv, factor = rope_inv_freq(dsv3())
    base = 1.0 / (10000 ** (torch.arange(0, 64, 2, dtype=torch.float64) / 64))
    ratio = inv.double() / base
    expected = {0: 1.0, 10: 1.0, 11: 1 - (1 / 13) * (1 - 1 / 40), 16: 1 - (6 / 13) * (1 - 1 / 40),
                22: 1 - (12 / 13) * (1 - 1 / 40), 23: 1 / 40, 31: 1 / 40}
    for i, r in expected.items():
        assert ratio[i].item() == pytest.approx(r, rel=1e-6), i
    assert [round(ratio[i].item(), 3) for i in (11, 16, 22, 23)] == [0.925, 0.55, 0.1, 0.025]
    assert inv[10].item() == pytest.approx(0.0562341, rel=1e-6)
    assert inv.sum().item() == pytest.approx(3.948936, abs=2e-6)
    assert factor == 1.0   # mscale == mscale_all_dim


def test_softmax_scale_with_and_without_yarn():
    assert softmax_scale(dsv3()) == pytest.approx(0.1352338, abs=1e-7)
    assert softmax_scale(dsv3(rope_scaling=None, position_embedding_type="rope")) == pytest.approx(0.0721688, abs=1e-7)


def test_mscale_split_between_cos_sin_and_softmax():
    c = dsv3(rope_scaling={"type": "yarn", "factor": 40, "original_max_position_embeddings": 4096,
                           "mscale": 1.0, "mscale_all_dim": 0.5})
    m = lambda mu: 0.1 * mu * math.log(40) + 1  # noqa: E731
    assert rope_inv_freq(c)[1] == pytest.approx(m(1.0) / m(0.5))
    assert softmax_scale(c) == pytest.approx(192 ** -0.5 * m(0.5) ** 2)
    c0 = dsv3(rope_scaling={"type": "yarn", "factor": 40, "original_max_position_embeddings": 4096,
                            "mscale": 1.0, "mscale_all_dim": 0})
    assert rope_inv_freq(c0)[1] == pytest.approx(m(1.0)) and softmax_scale(c0) == pytest.approx(192 ** -0.5)


def test_plain_rope_frequencies():
    c = dsv3(rope_scaling=None, position_embedding_type="rope", rope_theta=500.0)
    inv, factor = rope_inv_freq(c)
    torch.testing.assert_close(inv, 500.0 ** (-torch.arange(0, 64, 2, dtype=torch.float32) / 64))
    assert factor == 1.0


def test_rotary_position_zero_is_identity_and_scores_depend_on_offset_only():
    c = dsv3()
    pos = torch.tensor([[0, 3, 7, 100, 104, 1000, 1004]])
    cos, sin = rotary_cos_sin(c, pos)
    assert cos.dtype == torch.float32 and cos.shape == (1, 7, 32)
    torch.manual_seed(0)
    q, k = torch.randn(64, dtype=torch.float64), torch.randn(64, dtype=torch.float64)
    rot = lambda x, i: apply_rotary(x, cos[0, i].double(), sin[0, i].double())  # noqa: E731
    perm = torch.cat([torch.arange(0, 64, 2), torch.arange(1, 64, 2)])
    torch.testing.assert_close(rot(q, 0), q[perm])   # position 0: identity (in de-interleaved order)
    s1 = rot(q, 2) @ rot(k, 1)       # positions 7, 3
    s2 = rot(q, 4) @ rot(k, 3)       # positions 104, 100
    s3 = rot(q, 6) @ rot(k, 5)       # positions 1004, 1000
    torch.testing.assert_close(s1, s2, rtol=0, atol=1e-5)
    torch.testing.assert_close(s1, s3, rtol=0, atol=1e-4)


def test_rotary_dtype_field():
    c = dsv3(rotary_dtype="bfloat16")
    cos, sin = rotary_cos_sin(c, torch.arange(5)[None])
    assert cos.dtype == sin.dtype == torch.bfloat16
