"""Rotary position encoding: RoPE and YaRN frequencies, the YaRN mscale, and the softmax scale.

Conventions follow DeepSeek-V3 as Hugging Face implements it (``_compute_yarn_parameters``):

- base frequencies theta_i = base^(-2i/d) for the d = ``rotary_dim`` rotary dims (``qk_rope_head_dim`` with MLA);
- YaRN: correction dims D(r) = d ln(L0 / (2 pi r)) / (2 ln base), low = floor(D(beta_fast)),
  high = ceil(D(beta_slow)) clamped to [0, d-1]; ramp rho_i = clamp((i - low)/(high - low), 0, 1);
  theta'_i = theta_i (1 - rho_i) + theta_i / s * rho_i  (L0 = ``original_max_position_embeddings``);
- cos/sin are multiplied by m(s, mscale) / m(s, mscale_all_dim) (by m(s, 1) when either is 0), with
  m(s, mu) = 0.1 mu ln s + 1 for s > 1, else 1;
- softmax scale = d_qk^-1/2 * m(s, mscale_all_dim)^2 with YaRN (when mscale_all_dim != 0).

Angles are ``position_ids * theta'`` in fp32, so ``position_ids`` that restart at each document give
each document the rotary phases it would have alone.
"""

from __future__ import annotations

import math

import torch

from lit_moe.model.config import DeepseekV3Config


def yarn_get_mscale(scale: float, mscale: float = 1.0) -> float:
    if scale <= 1:
        return 1.0
    return 0.1 * mscale * math.log(scale) + 1.0


def yarn_correction_range(beta_fast: float, beta_slow: float, dim: int, base: float,
                          original_length: int) -> tuple[int, int]:
    """(low, high) pair indices of the YaRN ramp, floored/ceiled and clamped to [0, dim-1]."""
    def correction_dim(rotations: float) -> float:
        return dim * math.log(original_length / (rotations * 2 * math.pi)) / (2 * math.log(base))

    low = math.floor(correction_dim(beta_fast))
    high = math.ceil(correction_dim(beta_slow))
    return max(low, 0), min(high, dim - 1)


def rope_inv_freq(config: DeepseekV3Config, device: torch.device | str | None = None
                  ) -> tuple[torch.Tensor, float]:
    """Inverse frequencies ``[d/2]`` (fp32) and the cos/sin magnitude factor."""
    dim, base = config.rotary_dim, config.rope_theta
    exponents = torch.arange(0, dim, 2, dtype=torch.int64, device=device).to(torch.float32) / dim
    pos_freqs = base ** exponents
    if config.position_embedding_type != "yarn":
        return 1.0 / pos_freqs, 1.0
    s = config.scaling_factor
    low, high = yarn_correction_range(config.beta_fast, config.beta_slow, dim, base,
                                      config.yarn_original_length)
    if low == high:
        high += 0.001  # avoid a zero-width ramp
    ramp = ((torch.arange(dim // 2, dtype=torch.float32, device=device) - low) / (high - low)).clamp(0, 1)
    extrapolation = 1.0 / pos_freqs          # kept for fast-rotating (high-frequency) dims
    interpolation = 1.0 / (s * pos_freqs)    # slow dims are stretched by s
    keep = 1 - ramp
    inv_freq = interpolation * (1 - keep) + extrapolation * keep
    if config.mscale and config.mscale_all_dim:
        factor = yarn_get_mscale(s, config.mscale) / yarn_get_mscale(s, config.mscale_all_dim)
    else:
        factor = yarn_get_mscale(s)
    return inv_freq, float(factor)


def softmax_scale(config: DeepseekV3Config) -> float:
    """Attention logit scale: d_qk^-1/2, times m(s, mscale_all_dim)^2 under YaRN."""
    scale = config.qk_head_dim ** -0.5
    if config.position_embedding_type == "yarn" and config.mscale_all_dim:
        m = yarn_get_mscale(config.scaling_factor, config.mscale_all_dim)
        scale = scale * m * m
    return scale


def rotary_cos_sin(config: DeepseekV3Config, position_ids: torch.Tensor
                   ) -> tuple[torch.Tensor, torch.Tensor]:
    """cos and sin ``[B, S, d/2]`` in ``rotary_dtype`` for integer ``position_ids [B, S]``.

    Angles are formed in fp32 whatever ``rotary_dtype`` is (positions up to 10^5 need it)."""
    inv_freq, factor = rope_inv_freq(config, device=position_ids.device)
    angles = position_ids.to(torch.float32)[..., None] * inv_freq
    dtype = config.torch_dtype("rotary_dtype")
    return (angles.cos() * factor).to(dtype), (angles.sin() * factor).to(dtype)
