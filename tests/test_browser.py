"""``plan.to_html`` as a browser shows it: headless Chromium renders the page, and the
screenshot must hold the plan where the page's own layout puts it.

The layout (boxes of the placement grid's cells, the memory bars, the mesh's devices) comes
from the browser itself (``headless.page_layout``); the screenshot is then read pixel by
pixel at those boxes: each must be painted in its element's colour, a layer planned
differently must show a different colour than its neighbours, each bar must end where its
box ends, and the page's empty margin must be blank. A page that renders blank, unstyled, or
with its SVG dropped fails.

Marked ``browser`` (``make test-browser``, part of ``make test-all``): it needs Debian's
``chromium``, which ``make test`` does not install.
"""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest
from headless import page_layout, screenshot
from PIL import Image
from test_report import synthetic_plan

pytestmark = pytest.mark.browser


WIDTH = 1000
TOLERANCE = 6        # per channel: antialiasing never touches a box's centre


def _rgb(css: str) -> tuple[int, int, int]:
    """'#4e79a7' or 'rgb(78, 121, 167)' as a triple."""
    if css.startswith("#"):
        return int(css[1:3], 16), int(css[3:5], 16), int(css[5:7], 16)
    r, g, b = (int(v) for v in css[css.index("(") + 1:css.index(")")].split(",")[:3])
    return r, g, b


def _close(a, b) -> bool:
    return all(abs(x - y) <= TOLERANCE for x, y in zip(a, b))


@pytest.fixture(scope="module")
def rendered(tmp_path_factory):
    """The plan's page, its layout as Chromium computed it, and its screenshot (RGB)."""
    plan = synthetic_plan(6, odd_layer=2)
    plan = dataclasses.replace(plan, estimates={
        **plan.estimates.to_dict(), "model_state_bytes_per_device": 3 << 30,
        "activation_bytes_per_device": 5 << 30, "memory_per_device_bytes": 8 << 30,
        "memory_budget_per_device_bytes": 10 << 30})
    out = tmp_path_factory.mktemp("browser")
    page, png = out / "plan.html", out / "plan.png"
    plan.to_html(page)
    layout = page_layout(page, {"cell": "td.cell[title]", "rect": "svg rect"}, width=WIDTH)
    screenshot(page, png, width=WIDTH, height=layout["height"])
    image = Image.open(png).convert("RGB")
    return plan, layout, image


def _boxes(layout, kind, title_has=""):
    return [b for b in layout["boxes"] if b["kind"] == kind and title_has in b["title"]]


def _centre(image, box):
    return image.getpixel((int(box["x"] + box["w"] / 2), int(box["y"] + box["h"] / 2)))


def test_screenshot_covers_the_whole_page(rendered):
    _, layout, image = rendered
    assert image.size == (WIDTH, layout["height"])
    assert layout["height"] > 600                       # every section laid out, not one line


def test_placement_grid_is_painted_cell_by_cell(rendered):
    plan, layout, image = rendered
    cells = _boxes(layout, "cell")
    assert len(cells) == 6 * 5                          # 6 layers x 5 parameters per layer
    for cell in cells:
        assert _close(_centre(image, cell), _rgb(cell["fill"])), cell
    up = {int(c["title"].split(".")[1]): _centre(image, c)
          for c in cells if "mlp.up_proj" in c["title"]}
    # layer 2's up_proj is sharded on another dim: the picture shows it apart
    assert not _close(up[2], up[1]) and all(_close(up[i], up[0]) for i in (1, 3, 4, 5))


def test_memory_bars_are_drawn_to_their_length(rendered):
    _, layout, image = rendered
    bars = {name: _boxes(layout, "rect", f"ranks 0..7: {name}")
            for name in ("model states", "activations", "total")}
    assert all(len(b) == 1 for b in bars.values()), bars
    states, acts, total = (bars[k][0] for k in ("model states", "activations", "total"))
    assert states["w"] + acts["w"] == pytest.approx(total["w"], abs=0.5)   # 3 + 5 = 8 GiB
    for bar in (states, acts, total):
        assert _close(_centre(image, bar), _rgb(bar["fill"]))
        y = int(bar["y"] + bar["h"] / 2)
        inside, past = int(bar["x"] + bar["w"]) - 2, int(bar["x"] + bar["w"]) + 2
        assert _close(image.getpixel((inside, y)), _rgb(bar["fill"]))
        assert _close(image.getpixel((past, y)), (255, 255, 255))   # the bar stops there


def test_mesh_shows_every_device(rendered):
    plan, layout, image = rendered
    devices = _boxes(layout, "rect", "stage 0")
    assert len(devices) == plan.num_devices == 8
    for d in devices:
        assert _close(_centre(image, d), _rgb(d["fill"]))


def test_empty_margin_stays_blank(rendered):
    _, layout, image = rendered
    right = max(b["x"] + b["w"] for b in layout["boxes"])
    assert right < WIDTH - 24                           # every box inside the body's margin
    pixels = np.asarray(image)
    assert (pixels[:, WIDTH - 20:] == 255).all()       # the body's right margin
    painted = int((pixels != 255).any(axis=2).sum())
    assert painted > 0.03 * WIDTH * layout["height"]    # not a blank page
