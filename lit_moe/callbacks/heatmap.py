"""The expert-load heatmap: a layers × experts image of each expert's token share, and a tiny PNG
encoder (zlib + the PNG chunk layout) so no imaging library is needed."""

from __future__ import annotations

import struct
import zlib

import torch

# Colour ramp from low to high load: dark blue → teal → green → yellow (a viridis-like ramp, easy to
# read and colour-blind friendly). Anchors are evenly spaced on [0, 1].
_RAMP = torch.tensor([
    [68, 1, 84], [59, 82, 139], [33, 145, 140], [94, 201, 98], [253, 231, 37],
], dtype=torch.float32)

MAX_LOAD_RATIO = 2.0
"""Load ratios (count / layer mean) at or above this get the top colour; a balanced layer is mid-ramp."""


def colourise(t: torch.Tensor) -> torch.Tensor:
    """Values in [0, 1] → uint8 RGB by linear interpolation along the ramp. Shape [..., 3]."""
    t = t.clamp(0, 1) * (len(_RAMP) - 1)
    lo = t.floor().long().clamp(max=len(_RAMP) - 2)
    frac = (t - lo).unsqueeze(-1)
    rgb = _RAMP[lo] * (1 - frac) + _RAMP[lo + 1] * frac
    return rgb.round().to(torch.uint8)


def load_ratios(tokens_per_expert: torch.Tensor) -> torch.Tensor:
    """Each expert's tokens divided by its layer's mean (1.0 = perfectly balanced). [L, E] float."""
    counts = tokens_per_expert.detach().double().cpu()
    mean = counts.mean(dim=1, keepdim=True)
    return torch.where(mean > 0, counts / mean.clamp(min=1e-12), torch.zeros_like(counts))


def heatmap_image(tokens_per_expert: torch.Tensor, cell_w: int | None = None,
                  cell_h: int | None = None) -> torch.Tensor:
    """uint8 RGB image [H, W, 3]: row = MoE layer, column = expert, colour = load ratio scaled so that
    0 is the bottom and ``MAX_LOAD_RATIO`` the top of the ramp."""
    n_layers, n_experts = tokens_per_expert.shape
    cell_w = cell_w or max(1, min(16, 1024 // n_experts))
    cell_h = cell_h or max(4, min(16, 512 // n_layers))
    rgb = colourise((load_ratios(tokens_per_expert) / MAX_LOAD_RATIO).float())   # [L, E, 3]
    return rgb.repeat_interleave(cell_h, dim=0).repeat_interleave(cell_w, dim=1).contiguous()


def encode_png(rgb: torch.Tensor) -> bytes:
    """PNG bytes of a uint8 [H, W, 3] image (8-bit truecolour, no interlace, filter 0 per row)."""
    if rgb.dtype != torch.uint8 or rgb.dim() != 3 or rgb.shape[2] != 3:
        raise ValueError(f"encode_png: expected uint8 [H, W, 3], got {rgb.dtype} {tuple(rgb.shape)}")
    height, width, _ = rgb.shape
    rows = rgb.cpu().numpy()
    raw = b"".join(b"\x00" + rows[y].tobytes() for y in range(height))

    def chunk(kind: bytes, data: bytes) -> bytes:
        return (struct.pack(">I", len(data)) + kind + data
                + struct.pack(">I", zlib.crc32(kind + data) & 0xFFFFFFFF))

    header = struct.pack(">IIBBBBB", width, height, 8, 2, 0, 0, 0)
    return (b"\x89PNG\r\n\x1a\n" + chunk(b"IHDR", header) + chunk(b"IDAT", zlib.compress(raw, 6))
            + chunk(b"IEND", b""))
