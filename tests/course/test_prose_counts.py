"""Counts that a lesson's prose states are asserted by the cell that measures them.

Each case runs the measuring cell of a solution notebook on the lab result it reads, once as the lab
reports it and once with the count changed by one: the changed one must fail the cell (so a wrong
count in the prose, or a lab that stops doing what the prose says, fails the notebook run).
"""

from __future__ import annotations

import copy
import json
from unittest import mock

import pytest
from harness import ROOT


def cell_source(notebook: str, marker: str) -> str:
    """The one code cell of ``solutions/<notebook>`` that contains ``marker``."""
    cells = json.loads((ROOT / "solutions" / notebook).read_text(encoding="utf-8"))["cells"]
    found = ["".join(c["source"]) for c in cells if c["cell_type"] == "code" and marker in "".join(c["source"])]
    assert len(found) == 1, f"{len(found)} cells of {notebook} contain {marker!r}"
    return found[0]


def run_cell(source: str, **names) -> None:
    exec(compile(source, "<cell>", "exec"), {"figures": mock.MagicMock(), "plt": mock.MagicMock(), **names})


def tp_result(n_layer: int = 2) -> dict:
    rank = {"param_bytes": {"total": 10, "sharded": 6, "replicated": 4}}
    return {"full_param_bytes": 16, "ranks": [{"rank": 0, **rank}, {"rank": 1, **rank}], "options": {"n_layer": n_layer},
            "collectives": {"forward": {"all_reduce": 2 * n_layer}, "backward": {"all_reduce": 2 * n_layer}}}


def fsdp_trace(all_gathers: int = 5, reduce_scatters: int = 3) -> dict:
    return {"fsdp": [], "backend": [{"name": "gloo:all_gather"}],
            "collectives": [{"name": "c10d::_allgather_base_"}] * all_gathers
            + [{"name": "c10d::_reduce_scatter_base_"}] * reduce_scatters}


def test_lesson_11_two_all_reduces_per_block_each_way():
    source = cell_source("11_beyond_data_parallel.ipynb", 'tp["collectives"].items()')
    run_cell(source, tp=tp_result())
    run_cell(source, tp=tp_result(n_layer=3))  # the count follows the blocks, not a constant
    wrong = tp_result()
    wrong["collectives"]["forward"] = {"all_reduce": 2}  # one per block: the mistake of the old prose
    with pytest.raises(AssertionError):
        run_cell(source, tp=wrong)


@pytest.mark.parametrize("counts", [(4, 3), (5, 2), (6, 3)])
def test_lesson_09_five_all_gathers_and_three_reduce_scatters(counts):
    source = cell_source("09_fsdp.ipynb", "c10d::_allgather_base_")
    run_cell(source, lab2={"trace": fsdp_trace()})
    with pytest.raises(AssertionError):
        run_cell(source, lab2={"trace": fsdp_trace(*counts)})


def test_lesson_05_one_bucket_means_one_all_reduce():
    source = cell_source("05_inside_ddp.ipynb", 'r["allreduces_per_step"] for r in sweep["rows"]')
    rows = [{"allreduces_per_step": n, "median_ms": 1.0} for n in (9, 7, 2, 1)]
    run_cell(source, sweep={"rows": rows, "model_bytes": 1})
    wrong = copy.deepcopy(rows)
    wrong[-1]["allreduces_per_step"] = 2  # the biggest bucket no longer holds the whole model
    with pytest.raises(AssertionError):
        run_cell(source, sweep={"rows": wrong, "model_bytes": 1})
