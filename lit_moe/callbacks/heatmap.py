"""The expert-load heatmap, drawn with matplotlib: rows = MoE layers, columns = experts, colour =
each expert's tokens divided by its layer's mean (1 = perfectly balanced), with labelled axes, a
colour bar, and the step and worst imbalance in the title.

Rendered off-screen (Agg, an explicit ``Figure``: no pyplot global state, safe in any thread) to PNG
bytes that go both to TensorBoard and to a file, so the two are the same picture.
"""

from __future__ import annotations

import io
import math
import struct
from typing import Optional, Sequence

import torch

MAX_LOAD_RATIO = 2.0
"""Top of the colour scale (load ratio = count / layer mean); higher ratios get the top colour (the
bar is drawn with an arrow there). A fixed scale keeps the colours of different steps comparable."""

MIN_WIDTH_PX = 640
DPI = 100
ANNOTATE_MAX_CELLS = 256   # write the ratio in each cell when there are at most this many


def load_ratios(tokens_per_expert: torch.Tensor) -> torch.Tensor:
    """Each expert's tokens divided by its layer's mean (1.0 = perfectly balanced). [L, E] float."""
    counts = tokens_per_expert.detach().double().cpu()
    mean = counts.mean(dim=1, keepdim=True)
    return torch.where(mean > 0, counts / mean.clamp(min=1e-12), torch.zeros_like(counts))


def max_imbalance(tokens_per_expert: torch.Tensor) -> Optional[float]:
    """max/mean tokens per expert of the worst layer (None when no layer routed a token)."""
    ratios = load_ratios(tokens_per_expert)
    routed = tokens_per_expert.detach().double().cpu().sum(dim=1) > 0
    return float(ratios[routed].max()) if bool(routed.any()) else None


def _ticks(n: int, most: int = 32) -> list[int]:
    stride = max(1, math.ceil(n / most))
    return list(range(0, n, stride))


def heatmap_figure(tokens_per_expert: torch.Tensor, layer_names: Optional[Sequence[str]] = None,
                   step: Optional[int] = None):
    """The matplotlib ``Figure`` of the heatmap of ``tokens_per_expert [L, E]`` (token counts of one
    step). ``layer_names`` label the rows (default ``layer0..``); ``step`` goes into the title with
    the worst layer's imbalance (max/mean)."""
    from matplotlib.figure import Figure

    counts = tokens_per_expert.detach().double().cpu()
    n_layers, n_experts = counts.shape
    names = list(layer_names) if layer_names is not None else [f"layer{i}" for i in range(n_layers)]
    if len(names) != n_layers:
        raise ValueError(f"render_heatmap: {len(names)} layer names for {n_layers} rows")
    ratios = load_ratios(counts).numpy()

    width_in = max(MIN_WIDTH_PX / DPI, min(16.0, 2.5 + 0.3 * n_experts))
    height_in = max(3.2, min(12.0, 1.6 + 0.35 * n_layers))
    fig = Figure(figsize=(width_in, height_in), dpi=DPI, layout="constrained")
    ax = fig.add_subplot()
    image = ax.imshow(ratios, aspect="auto", interpolation="nearest", cmap="viridis",
                      vmin=0.0, vmax=MAX_LOAD_RATIO, origin="upper")
    bar = fig.colorbar(image, ax=ax, extend="max" if ratios.size and ratios.max() > MAX_LOAD_RATIO else "neither")
    bar.set_label("tokens / layer mean (1 = balanced)")
    ax.set_xlabel("expert")
    ax.set_ylabel("MoE layer")
    xt, yt = _ticks(n_experts), _ticks(n_layers)
    ax.set_xticks(xt, [str(e) for e in xt])
    ax.set_yticks(yt, [names[i] for i in yt])
    if n_layers * n_experts <= ANNOTATE_MAX_CELLS:
        for i in range(n_layers):
            for e in range(n_experts):
                value = ratios[i, e]
                ax.text(e, i, f"{value:.2f}", ha="center", va="center", fontsize=7,
                        color="black" if value > 0.6 * MAX_LOAD_RATIO else "white")
    worst = max_imbalance(counts)
    title = "expert load"
    if step is not None:
        title += f", step {step}"
    title += f"  |  max imbalance {worst:.2f} (max/mean)" if worst is not None else "  |  no tokens routed"
    ax.set_title(title)
    return fig


def figure_png(fig) -> bytes:
    """8-bit RGB PNG bytes of a figure."""
    rgba = io.BytesIO()
    fig.savefig(rgba, format="png", dpi=DPI, facecolor="white")
    # 8-bit RGB (what TensorBoard's image summary declares), via Pillow, which matplotlib depends on
    from PIL import Image

    rgb = io.BytesIO()
    Image.open(io.BytesIO(rgba.getvalue())).convert("RGB").save(rgb, format="PNG", optimize=True)
    return rgb.getvalue()


def render_heatmap(tokens_per_expert: torch.Tensor, layer_names: Optional[Sequence[str]] = None,
                   step: Optional[int] = None) -> bytes:
    """PNG bytes of :func:`heatmap_figure`."""
    return figure_png(heatmap_figure(tokens_per_expert, layer_names, step))


def png_size(png: bytes) -> tuple[int, int]:
    """(width, height) from a PNG's IHDR chunk."""
    if png[:8] != b"\x89PNG\r\n\x1a\n" or png[12:16] != b"IHDR":
        raise ValueError("png_size: not a PNG")
    width, height = struct.unpack(">II", png[16:24])
    return int(width), int(height)
