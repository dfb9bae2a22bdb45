"""Check the built site as a reader sees it: ``make site-check`` (``python tools/check_site.py [SITE]``).

Serves ``SITE`` (default build/site) on localhost, opens the home page and every lesson page in
headless Chromium (the system's browser, driven by Playwright; nothing is downloaded) and checks, on
each page: its title, that every figure was decoded by the browser (as many as the notebook has
image outputs, each with a width), that every internal link and anchor leads somewhere, and that no
text shows a path of this machine. Screenshots of the home page and of one lesson page go to
``build/site-check/``. Exit 0 when every page passes, 1 otherwise (one line per problem).

The browser: ``$CHROMIUM``, else ``chromium``, ``chromium-browser`` or ``google-chrome`` on PATH
(Debian: ``apt-get install chromium``).
"""

from __future__ import annotations

import argparse
import functools
import http.server
import json
import os
import shutil
import sys
import threading
from pathlib import Path
from urllib.parse import urljoin, urlsplit

ROOT = Path(__file__).resolve().parents[1]
# Chromium's own calls home fail on a machine without internet, many at a time: keep it quiet.
FLAGS = ["--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run", "--disable-background-networking",
         "--disable-component-update", "--disable-sync"]
SHOTS = {"index": "home.png", "09_fsdp": "lesson_09_fsdp.png"}


def browser() -> str | None:
    """The Chromium to drive: ``$CHROMIUM`` or the first of the usual names on PATH."""
    if os.environ.get("CHROMIUM"):
        return os.environ["CHROMIUM"]
    return next((p for name in ("chromium", "chromium-browser", "google-chrome") if (p := shutil.which(name))), None)


def expected() -> dict[str, tuple[str, int]]:
    """{page: (title as the notebook writes it, image outputs)} for every lesson of solutions/."""
    out = {}
    for path in sorted((ROOT / "solutions").glob("[0-9][0-9]_*.ipynb")):
        nb = json.loads(path.read_text(encoding="utf-8"))
        title = "".join(nb["cells"][0]["source"]).splitlines()[0].lstrip("# ").strip().replace("`", "")
        images = sum("image/png" in o.get("data", {}) for c in nb["cells"] if c["cell_type"] == "code"
                     for o in c.get("outputs", []))
        out[path.stem] = (title, images)
    return out


class _Quiet(http.server.SimpleHTTPRequestHandler):
    def log_message(self, *args) -> None:  # one line per request would bury the result
        pass


def serve(site: Path) -> tuple[http.server.ThreadingHTTPServer, str]:
    handler = functools.partial(_Quiet, directory=str(site))
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), handler)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    return server, f"http://127.0.0.1:{server.server_address[1]}/"


READ_PAGE = """() => ({
  title: document.title,
  figures: [...document.querySelectorAll('img')].filter(i => i.getAttribute('src').startsWith('_images/'))
             .map(i => ({src: i.getAttribute('src'), width: i.naturalWidth, done: i.complete})),
  links: [...document.querySelectorAll('a[href]')].map(a => a.href),
  ids: [...document.querySelectorAll('[id]')].map(e => e.id),
  text: document.body.innerText,
})"""


def check_page(page, url: str, name: str, want: tuple[str, int] | None, machine: list[str]) -> tuple[list[str], dict]:
    response = page.goto(url, wait_until="load")
    problems = [] if response is not None and response.ok else [f"{name}: {url} did not load"]
    page.wait_for_function("() => [...document.images].every(i => i.complete)", timeout=10_000)
    seen = page.evaluate(READ_PAGE)
    if want is not None:
        title, images = want
        if title.split(" — ")[0] not in seen["title"]:
            problems.append(f"{name}: title {seen['title']!r} does not hold the notebook's {title!r}")
        drawn = [f for f in seen["figures"] if f["done"] and f["width"] > 0]
        if len(drawn) != images:
            problems.append(f"{name}: {len(drawn)} figures drawn of {len(seen['figures'])} on the page; "
                            f"the notebook has {images}")
    problems += [f"{name}: shows the machine path {m}" for m in machine if m in seen["text"]]
    return problems, seen


def check_links(request, base: str, pages: dict[str, dict]) -> list[str]:
    """Every internal link of every page answers 200, and its anchor exists on the page it leads to."""
    problems, ids = [], {}
    for name, seen in pages.items():
        for href in sorted(set(seen["links"])):
            if not href.startswith(base):
                continue
            parts = urlsplit(href)
            target = urljoin(base, parts.path)
            if target not in ids:
                response = request.get(target)
                ids[target] = None if not response.ok else set()
                if response.ok and parts.path.endswith(".html"):
                    ids[target] = pages.get(Path(parts.path).stem, {}).get("ids")
            if ids[target] is None:
                problems.append(f"{name}: broken link {href}")
            elif parts.fragment and ids[target] is not None and parts.fragment not in ids[target]:
                problems.append(f"{name}: link {href} names an anchor the page does not have")
    return problems


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python tools/check_site.py", description=__doc__.split("\n\n")[0])
    parser.add_argument("site", nargs="?", type=Path, default=ROOT / "build" / "site")
    parser.add_argument("--shots", type=Path, default=ROOT / "build" / "site-check", help="where screenshots go")
    args = parser.parse_args(argv)
    chromium = browser()
    if chromium is None:
        print("error: no Chromium found: install it (Debian: apt-get install chromium) or set CHROMIUM=/path/to/it.",
              file=sys.stderr)
        return 2
    if not (args.site / "index.html").is_file():
        print(f"error: {args.site}/index.html does not exist: build the site first (make site).", file=sys.stderr)
        return 2
    from playwright.sync_api import sync_playwright

    want = expected()
    machine = sorted({str(ROOT), str(Path.home()) + "/"})
    server, base = serve(args.site)
    args.shots.mkdir(parents=True, exist_ok=True)
    problems, pages = [], {}
    try:
        with sync_playwright() as pw:
            chrome = pw.chromium.launch(executable_path=chromium, args=FLAGS)
            page = chrome.new_page(viewport={"width": 1280, "height": 900})
            for name in ["index", *want]:
                found, pages[name] = check_page(page, urljoin(base, f"{name}.html"), name, want.get(name), machine)
                problems += found
                if name in SHOTS:
                    figure = page.locator("img[src^='_images/']")
                    if figure.count():  # a lesson's shot shows its first figure, as a reader scrolls to it
                        figure.first.scroll_into_view_if_needed()
                    page.screenshot(path=str(args.shots / SHOTS[name]))
            problems += check_links(page.context.request, base, pages)
            chrome.close()
    finally:
        server.shutdown()
    for line in problems:
        print(line)
    figures = sum(w[1] for w in want.values())
    print(f"{'FAIL' if problems else 'OK'}: {len(pages)} pages opened in {Path(chromium).name}, {figures} figures "
          f"expected, {sum(len(set(p['links'])) for p in pages.values())} links followed; screenshots in {args.shots}/")
    return 1 if problems else 0


if __name__ == "__main__":
    sys.exit(main())
