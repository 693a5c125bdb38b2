"""Headless Chromium for tests: a page's layout as the browser computes it, and a screenshot.

Both come from the command line (``chromium --headless``), no driver library:

- ``page_layout(html, ...)`` loads a copy of the page with a small script appended that
  writes the bounding box and colour of chosen elements into the DOM as JSON;
  ``--dump-dom`` prints the DOM after the script ran. The page under test stays as it is
  (it has no scripts of its own); only the copy carries the probe.
- ``screenshot(html, png, ...)`` renders the page itself at the same width, tall enough for
  the whole page, at one device pixel per CSS pixel, so layout boxes are pixel boxes.

``make test-browser`` installs Debian's ``chromium`` when it is missing; elsewhere tests
that need it are skipped with that advice (``conftest.py``).
"""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import tempfile
from pathlib import Path

__all__ = ["chromium", "page_layout", "screenshot"]

_PROBE = """<script>
(() => {
  const boxes = [];
  for (const [kind, selector] of Object.entries(%s)) {
    for (const el of document.querySelectorAll(selector)) {
      const r = el.getBoundingClientRect();
      const style = getComputedStyle(el);
      const title = el.getAttribute("title") ||
                    (el.querySelector("title") ? el.querySelector("title").textContent : "");
      boxes.push({kind, title, x: r.x + scrollX, y: r.y + scrollY, w: r.width, h: r.height,
                  fill: el.getAttribute("fill") || style.backgroundColor});
    }
  }
  const out = document.createElement("pre");
  out.id = "torchalpa-layout";
  out.textContent = JSON.stringify({boxes, width: document.documentElement.scrollWidth,
                                    height: document.documentElement.scrollHeight});
  document.body.appendChild(out);
})();
</script>"""


def chromium() -> str | None:
    """The Chromium binary on PATH (Debian names it ``chromium``), or None."""
    for name in ("chromium", "chromium-browser", "google-chrome"):
        path = shutil.which(name)
        if path:
            return path
    return None


def _run(args: list[str], timeout: float) -> str:
    binary = chromium()
    if binary is None:
        raise FileNotFoundError("no chromium on PATH: `apt-get install -y chromium` "
                                "(make test-browser does it)")
    with tempfile.TemporaryDirectory(prefix="torchalpa-chromium-") as profile:
        # root in a container needs --no-sandbox; a private profile lets tests run side by side
        cmd = [binary, "--headless", "--no-sandbox", "--disable-gpu", "--hide-scrollbars",
               "--force-device-scale-factor=1", "--no-first-run", f"--user-data-dir={profile}",
               *args]
        done = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout,
                              env={**os.environ, "HOME": profile})
    if done.returncode != 0:
        raise RuntimeError(f"chromium failed ({done.returncode}): {done.stderr[-2000:]}")
    return done.stdout


def page_layout(html: Path, selectors: dict[str, str], *, width: int,
                timeout: float = 120) -> dict:
    """``{"boxes": [{kind, title, x, y, w, h, fill}], "width", "height"}`` of the page at
    ``width`` CSS pixels, for every element matching each ``selectors`` value."""
    probe = html.with_name(html.stem + ".probe.html")
    page = html.read_text()
    probe.write_text(page.replace("</body>", _PROBE % json.dumps(selectors) + "</body>"))
    dom = _run([f"--window-size={width},800", "--dump-dom", probe.as_uri()], timeout)
    found = re.search(r'<pre id="torchalpa-layout">(.*?)</pre>', dom, re.S)
    if found is None:
        raise RuntimeError("the layout probe did not run; chromium printed:\n" + dom[:2000])
    import html as html_escapes
    return json.loads(html_escapes.unescape(found.group(1)))


def screenshot(html: Path, png: Path, *, width: int, height: int, timeout: float = 120) -> None:
    """Render ``html`` at ``width`` x ``height`` CSS (= device) pixels into ``png``."""
    _run([f"--window-size={width},{height}", f"--screenshot={png}", html.as_uri()], timeout)
    if not png.exists():
        raise RuntimeError(f"chromium wrote no screenshot at {png}")
