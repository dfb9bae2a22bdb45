"""``make site``: the course as a static site, built from solutions/ with the saved outputs.

The build itself runs here (Sphinx with MyST-NB, a few seconds): every lesson has its page, titled by
the notebook's own title, with as many figures as the notebook has image outputs; every internal link
and anchor resolves; no page holds a path of this machine. What a reader's browser shows -- the
figures decoded, the links followed, screenshots -- is ``make site-check``
(tools/check_site.py, headless Chromium), outside ``make test`` because CI's machine has no browser.
"""

from __future__ import annotations

import html.parser
import json
import subprocess
import sys
from pathlib import Path
from urllib.parse import unquote, urlsplit

import pytest
from harness import ROOT

LESSONS = sorted(p.stem for p in (ROOT / "solutions").glob("[0-9][0-9]_*.ipynb"))


class Page(html.parser.HTMLParser):
    """The title, the images, the links and the ids of one HTML page."""

    def __init__(self, text: str) -> None:
        super().__init__()
        self.title, self.images, self.links, self.ids, self._in_title = "", [], [], set(), False
        self.feed(text)

    def handle_starttag(self, tag, attrs):
        a = dict(attrs)
        if a.get("id"):
            self.ids.add(a["id"])
        if tag == "title":
            self._in_title = True
        elif tag == "img":
            self.images.append(a.get("src", ""))
        elif tag == "a" and a.get("href"):
            self.links.append(a["href"])

    def handle_endtag(self, tag):
        if tag == "title":
            self._in_title = False

    def handle_data(self, data):
        if self._in_title:
            self.title += data


def hints(name: str) -> int:
    """The collapsed hints of a notebook (``<details>`` blocks in its markdown)."""
    nb = json.loads((ROOT / "solutions" / f"{name}.ipynb").read_text(encoding="utf-8"))
    return sum("".join(c["source"]).count("<details>") for c in nb["cells"] if c["cell_type"] == "markdown")


def notebook_title_and_images(name: str) -> tuple[str, int]:
    nb = json.loads((ROOT / "solutions" / f"{name}.ipynb").read_text(encoding="utf-8"))
    first = "".join(nb["cells"][0]["source"]).splitlines()[0].lstrip("# ").strip().replace("`", "")
    images = sum("image/png" in o.get("data", {}) for c in nb["cells"] if c["cell_type"] == "code"
                 for o in c.get("outputs", []))
    return first, images


@pytest.fixture(scope="module")
def site(tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("site") / "html"
    proc = subprocess.run([sys.executable, str(ROOT / "tools" / "make_site.py"), str(out)], capture_output=True,
                          text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    return out


def test_every_lesson_has_its_page_with_its_title_and_figures(site):
    home = Page((site / "index.html").read_text(encoding="utf-8"))
    for name in LESSONS:
        page = Page((site / f"{name}.html").read_text(encoding="utf-8"))
        title, images = notebook_title_and_images(name)
        assert title.split(" — ")[0] in page.title, (name, page.title)
        figures = [src for src in page.images if src.startswith("_images/")]
        assert len(figures) == images, (name, len(figures), images)
        assert all((site / unquote(src)).is_file() for src in figures), name
        assert f"{name}.html" in home.links, f"the home page does not link {name}"
        text = (site / f"{name}.html").read_text(encoding="utf-8")
        assert text.count("<details>") == hints(name), name  # hints stay collapsed (not <details open>)


def test_every_internal_link_and_anchor_resolves(site):
    broken = []
    pages = {p: Page(p.read_text(encoding="utf-8")) for p in site.glob("*.html")}
    for path, page in pages.items():
        for href in page.links:
            parts = urlsplit(href)
            if parts.scheme or parts.netloc or href.startswith("mailto:"):
                continue
            target = (path.parent / unquote(parts.path)).resolve() if parts.path else path
            if not target.exists():
                broken.append(f"{path.name}: {href}")
            elif parts.fragment and target.suffix == ".html":
                ids = pages[target].ids if target in pages else Page(target.read_text(encoding="utf-8")).ids
                if parts.fragment not in ids:
                    broken.append(f"{path.name}: {href} (no such anchor)")
    assert not broken, broken[:20]


def test_no_page_holds_a_path_of_this_machine(site):
    machine = {str(ROOT), str(Path.home()) + "/", "/tmp/pytest"}
    found = [(p.name, m) for p in site.rglob("*") if p.suffix in (".html", ".js", ".txt") and p.is_file()
             for m in machine if m in p.read_text(encoding="utf-8", errors="replace")]
    assert not found, found
