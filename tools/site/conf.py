"""Sphinx configuration of the course's site (``make site``; sources written by tools/make_site.py).

The pages are the notebooks of ``solutions/`` with the outputs they were saved with: nothing is
executed (``nb_execution_mode = "off"``). MyST-NB reads the notebooks; the book theme gives the
lesson list beside each page, previous/next links, a search box and collapsed ``<details>`` hints.
"""

project = "ddp-course"
author = "the ddp-course authors"
copyright = "the ddp-course authors"  # noqa: A001 -- Sphinx's name for it

extensions = ["myst_nb"]
nb_execution_mode = "off"  # the saved outputs are the course's measurements: show them, never re-run
nb_output_stderr = "show"
nb_merge_streams = True
myst_enable_extensions = ["dollarmath", "colon_fence"]
myst_heading_anchors = 3

exclude_patterns = ["_build", "**/.ipynb_checkpoints", "runs", "**/runs"]
suppress_warnings = ["mystnb.unknown_mime_type"]  # widget state (progress bars) has no static form

html_theme = "sphinx_book_theme"
html_title = "ddp-course: PyTorch distributed training, by doing it"
html_theme_options = {"show_toc_level": 2, "use_download_button": True, "home_page_in_toc": True}
html_show_sourcelink = False
html_last_updated_fmt = None
