"""The course's lesson material, one folder per notebook: ``lNN_<topic>/`` goes with ``NN_<topic>.ipynb``.

A lesson folder holds everything its notebook runs beyond the core (``ddp_course.config``, ``data``,
``model``, ``dist``, ``parallel``, ``train``, ``checkpoint``, ``metrics``, ``launch``):

- its torchrun-launchable lab programs (each module's docstring gives its command);
- ``figures.py``: the figures the notebook draws;
- ``bench_<name>.py``: benchmarks, run as ``python -m ddp_course.bench <name>``;
- ``grader.py`` (``grader_<name>.py`` for a second one): the grader of the exercise script it declares
  (``EXERCISE``), run as ``python -m ddp_course check NN PATH``.

``plots.py`` here holds the figures several lessons share (loss curves, bar charts). The core never
imports from this package (``tests/core/test_architecture.py`` checks it); see ``docs/ARCHITECTURE.md``.
"""

import re
from pathlib import Path

LESSON_DIR = re.compile(r"l(\d\d)_[a-z0-9_]+")


def lesson_folders() -> dict[str, str]:
    """{"NN": "ddp_course.course.lNN_topic"} for every lesson folder, in lesson order."""
    here = Path(__file__).parent
    found = {}
    for d in sorted(here.iterdir()):
        m = LESSON_DIR.fullmatch(d.name)
        if m and (d / "__init__.py").exists():
            found[m.group(1)] = f"{__name__}.{d.name}"
    return found
