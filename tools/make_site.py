"""Build the course as a static site: ``make site`` (``python tools/make_site.py [OUT]``).

The pages are ``solutions/NN_*.ipynb`` with their saved outputs (no notebook is executed) and the
home page is the README's lesson table, each lesson linked to its page. Sphinx with MyST-NB and the
book theme (the ``site`` extra of pyproject.toml) turns them into HTML: ``build/site/index.html``.

    python tools/make_site.py              # writes build/site-src/ (the sources) and build/site/
    python tools/make_site.py --check      # the same, then fails on a broken page (see check_site)

Sphinx's warnings are errors (``-W``): a broken cross-reference or a notebook it cannot read fails
the build instead of leaving a page out.
"""

from __future__ import annotations

import argparse
import re
import shutil
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
CONF = Path(__file__).resolve().with_name("site") / "conf.py"
LESSON_ROW = re.compile(r"^\| (\d\d) \| `(\d\d_[a-z_]+)` \| (.*) \|$")


def lesson_rows(readme: str) -> list[tuple[str, str, str]]:
    """(number, notebook name, what you run and measure) of each row of the README's lesson table."""
    return [m.groups() for line in readme.splitlines() if (m := LESSON_ROW.match(line))]


def home_page(readme: str) -> str:
    """The site's home page: the README's title paragraph and its lesson table, each lesson a link."""
    title, _, rest = readme.partition("\n")
    intro = rest.strip().split("\n\n")[0]
    rows = lesson_rows(readme)
    table = ["| # | lesson | what you run and measure |", "|---|---|---|"]
    table += [f"| {nn} | [{name}]({name}.ipynb) | {what} |" for nn, name, what in rows]
    toc = ["```{toctree}", ":hidden:", ":maxdepth: 1", "", *(f"{name}.ipynb" for _, name, _ in rows), "```"]
    return "\n".join([title, "", intro, "", "## The lessons", "", *table, "",
                      "The pages are the notebooks of `solutions/` with the outputs saved when they last ran on "
                      "the machine named in the README's \"What has been run on what\". To run them yourself, "
                      "clone the repository and `make lab`; `python -m ddp_course progress` shows where you stand.",
                      "", *toc, ""])


def write_sources(src: Path) -> list[str]:
    """Fill ``src`` with conf.py, index.md and the solution notebooks; returns the lessons' names."""
    readme = (ROOT / "README.md").read_text(encoding="utf-8")
    rows = lesson_rows(readme)
    missing = [name for _, name, _ in rows if not (ROOT / "solutions" / f"{name}.ipynb").is_file()]
    unlisted = sorted({p.stem for p in (ROOT / "solutions").glob("[0-9][0-9]_*.ipynb")} - {n for _, n, _ in rows})
    if missing or unlisted:
        raise SystemExit(f"error: the README's lesson table and solutions/ disagree: missing notebooks {missing}, "
                         f"notebooks not in the table {unlisted}. Fix the table in README.md.")
    if src.exists():
        shutil.rmtree(src)
    src.mkdir(parents=True)
    shutil.copy(CONF, src / "conf.py")
    (src / "index.md").write_text(home_page(readme), encoding="utf-8")
    for _, name, _ in rows:
        shutil.copy(ROOT / "solutions" / f"{name}.ipynb", src / f"{name}.ipynb")
    return [name for _, name, _ in rows]


def build(src: Path, out: Path) -> None:
    """sphinx-build -W (warnings are errors), quietly; its own output only when it fails."""
    cmd = [sys.executable, "-m", "sphinx", "-b", "html", "-W", "--keep-going", "-q", "-j", "2", str(src), str(out)]
    proc = subprocess.run(cmd, capture_output=True, text=True)
    if proc.returncode != 0:
        sys.stderr.write(proc.stdout + proc.stderr)
        raise SystemExit(f"error: the site did not build (sphinx-build exit code {proc.returncode}); see above.")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python tools/make_site.py", description=__doc__.split("\n\n")[0])
    parser.add_argument("out", nargs="?", type=Path, default=ROOT / "build" / "site", help="where the HTML goes")
    args = parser.parse_args(argv)
    try:
        import myst_nb  # noqa: F401
        import sphinx_book_theme  # noqa: F401
    except ImportError as exc:
        print(f"error: the site needs the `site` extra ({exc.name} is missing): run `make site`, or "
              "`pip install -e '.[site]'` first.", file=sys.stderr)
        return 2
    src = args.out.with_name(args.out.name + "-src")
    lessons = write_sources(src)
    build(src, args.out)
    print(f"site: {len(lessons)} lessons and the home page in {args.out}/ (open index.html)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
