"""The expert-load heatmap as a person reads it: size, labels, title, colour bar, and the colour of
each cell (looked up in matplotlib's own viridis map for the hand-computed load ratio)."""

import io

import pytest
import torch

from lit_moe.callbacks.heatmap import MAX_LOAD_RATIO, figure_png, heatmap_figure, png_size, render_heatmap

# hand: layer1 [8, 4, 2, 2] → ratios [2, 1, .5, .5], max/mean 2; layer2 [0, 6, 6, 4] → [0, 1.5, 1.5, 1]
COUNTS = torch.tensor([[8, 4, 2, 2], [0, 6, 6, 4], [4, 4, 4, 4]])
NAMES = ["layer1", "layer2", "layer3"]
RATIOS = [[2, 1, .5, .5], [0, 1.5, 1.5, 1], [1, 1, 1, 1]]


def test_labels_title_and_colour_bar():
    fig = heatmap_figure(COUNTS, NAMES, step=200)
    ax, bar_ax = fig.axes
    assert ax.get_xlabel() == "expert" and ax.get_ylabel() == "MoE layer"
    assert [t.get_text() for t in ax.get_yticklabels()] == NAMES
    assert [t.get_text() for t in ax.get_xticklabels()] == ["0", "1", "2", "3"]
    assert ax.get_title() == "expert load, step 200  |  max imbalance 2.00 (max/mean)"
    assert bar_ax.get_ylabel() == "tokens / layer mean (1 = balanced)"
    assert bar_ax.get_ylim() == (0.0, MAX_LOAD_RATIO)
    cells = sorted(t.get_text() for t in ax.texts)
    assert cells == sorted(f"{v:.2f}" for row in RATIOS for v in row)


def test_png_size_and_cell_colours():
    from matplotlib import colormaps
    from PIL import Image

    fig = heatmap_figure(COUNTS, NAMES, step=2)
    png = figure_png(fig)
    width, height = png_size(png)
    assert width >= 400 and (width, height) == Image.open(io.BytesIO(png)).size
    image = Image.open(io.BytesIO(png)).convert("RGB")
    ax = fig.axes[0]
    viridis = colormaps["viridis"]
    for row, ratios in enumerate(RATIOS):
        for expert, ratio in enumerate(ratios):
            # a point inside the cell away from its text label: a quarter cell left of the centre, up
            x, y = ax.transData.transform((expert - 0.3, row - 0.3))
            pixel = image.getpixel((int(round(x)), int(round(height - y))))
            want = tuple(round(255 * c) for c in viridis(ratio / MAX_LOAD_RATIO)[:3])
            assert max(abs(a - b) for a, b in zip(pixel, want)) <= 3, (row, expert, pixel, want)


def test_many_experts_and_layers_stay_readable():
    counts = torch.randint(0, 50, (61, 256))
    png = render_heatmap(counts, [f"layer{i + 3}" for i in range(61)], step=1)
    width, height = png_size(png)
    assert width >= 1200 and height >= 600
    fig = heatmap_figure(counts, [f"layer{i + 3}" for i in range(61)], step=1)
    ax = fig.axes[0]
    assert len(ax.get_xticklabels()) <= 33 and len(ax.get_yticklabels()) <= 33   # thinned tick labels
    assert not ax.texts                                                          # no per-cell numbers
    assert fig.axes[1].get_ylim() == (0.0, MAX_LOAD_RATIO)


def test_no_tokens_and_bad_names():
    fig = heatmap_figure(torch.zeros(2, 4), None, step=5)
    assert fig.axes[0].get_title().endswith("no tokens routed")
    assert [t.get_text() for t in fig.axes[0].get_yticklabels()] == ["layer0", "layer1"]
    with pytest.raises(ValueError, match="2 layer names for 3 rows"):
        heatmap_figure(COUNTS, ["a", "b"])
