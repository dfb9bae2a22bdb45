"""The debugging lab's programs still demonstrate their bugs, within their timeouts.

All eight programs start at once (``broken.launch_all``): the hanging ones spend most of their time
waiting for their 5 s process-group timeout, the others starting Python, so side by side they take
a fraction of the time. Lesson 12 runs the same nine jobs: under ``make test`` the tests check the
notebook's runs (``notebook_runs``) rather than launch them again. Each test then checks its program's characteristic symptom in what the
ranks recorded -- so the lab cannot silently stop showing the bug it is about.
"""

from __future__ import annotations

import re

import notebook_runs
import pytest
import torch

from ddp_course.course.l12_debugging_lab import broken

PG_TIMEOUT = broken.PG_TIMEOUT_S


DETAIL = {"TORCH_DISTRIBUTED_DEBUG": "DETAIL"}


def _notebook_lab():
    """Lesson 12's runs of the same nine jobs, when the notebook made them in this session (else None)."""
    base = notebook_runs.folder("runs/12")
    if base is None:
        return None
    done = {}
    for key, bug in broken.BUGS.items():
        if bug.nodes == 2:  # two torchrun agents: the records its four ranks wrote
            ranks = sorted(base.joinpath(key).glob("rank*.json"))
            if len(ranks) != 4 or not all(notebook_runs.fresh(p) for p in ranks):
                return None
            done[key] = (None, base / key)
            continue
        run = notebook_runs.reuse(f"runs/12/{key}", bug.module, 2, **broken.job_flags(key))
        if run is None:
            return None
        done[key] = (run, run.out_dir)
    detail = notebook_runs.reuse("runs/12/detail", broken.BUGS["collective_rank0"].module, 2, env=DETAIL,
                                 **broken.job_flags("collective_rank0"))
    if detail is None:
        return None
    done["detail"] = (detail, detail.out_dir)
    return done


@pytest.fixture(scope="module")
def lab(tmp_path_factory):
    from concurrent.futures import ThreadPoolExecutor

    shared = _notebook_lab()
    if shared is not None:
        return shared
    base = tmp_path_factory.mktemp("broken")
    with ThreadPoolExecutor(max_workers=1) as pool:  # the DETAIL run of collective_rank0 alongside the rest
        detail = pool.submit(broken.launch, "collective_rank0", base / "detail", timeout=120, env=DETAIL)
        futures = broken.launch_all(base, timeout=120)
        done = {key: (f.result(timeout=180), base / key) for key, f in futures.items()}
        done["detail"] = (detail.result(timeout=180), base / "detail")
    return done


def test_every_bug_has_a_program():
    import importlib

    for key, bug in broken.BUGS.items():
        mod = importlib.import_module(bug.module)
        assert "torchrun" in mod.__doc__ and hasattr(mod, "main"), key


def test_collective_on_rank0_hangs_until_the_timeout(lab):
    run, out = lab["collective_rank0"]
    recs = broken.records(out)
    assert run.returncode != 0
    assert all(r["fixed_completed"] for r in recs.values())  # the fixed evaluation completes first
    assert recs[0]["in_collective"] == "all_reduce" and recs[1]["in_collective"] == "barrier"
    errors = [r["error"] for r in recs.values() if "error" in r]
    # the ranks waited for the timeout (not an instant crash), and one of them says it timed out
    assert any("Timed out" in e["message"] for e in errors)
    assert all(e["seconds"] >= 0.8 * PG_TIMEOUT for e in errors if "Timed out" in e["message"])
    assert "[rank0]: RuntimeError" in broken.symptom(run) or "[rank1]: RuntimeError" in broken.symptom(run)


def test_collective_on_rank0_named_by_detail(lab):
    run, out = lab["detail"]
    recs = broken.records(out)
    assert run.returncode != 0
    msgs = {r: rec["error"]["message"] for r, rec in recs.items() if "error" in rec}
    assert any("Detected mismatch between collectives" in m for m in msgs.values()), msgs
    own = {r: re.search(rf"Rank {r} is running collective: CollectiveFingerPrint\(.*?OpType=(\w+)", m)
           for r, m in msgs.items()}  # each rank's message names its own collective
    assert {r: m.group(1) for r, m in own.items() if m} == {0: "ALLREDUCE", 1: "BARRIER"}
    assert all(rec["error"]["seconds"] < PG_TIMEOUT for rec in recs.values())  # at once, no waiting
    v = broken.check_exercise(1, {0: "ALLREDUCE", 1: "BARRIER"}, out)
    assert v.ok, v
    assert not broken.check_exercise(1, {0: "all_reduce", 1: "all_reduce"}, out).ok


def test_hard_coded_world_size_times_out_at_init(lab):
    run, out = lab["world_size"]
    recs = broken.records(out)
    assert run.returncode != 0 and sorted(recs) == [0, 1]
    for rec in recs.values():
        assert rec["asked_world_size"] == 4 and rec["env"]["WORLD_SIZE"] == "2"
        assert rec["error"]["where"] == "init_process_group"
        # the store key it waited for ends in the number of a rank that was never started
        assert "wait timeout" in rec["error"]["message"]
        assert int(re.search(r"/(\d+)$", rec["error"]["message"]).group(1)) >= 2
    files = broken.error_files(run)  # @record: torchrun's error file carries each rank's traceback
    assert files and all("init_process_group" in f["traceback"] for f in files)
    assert broken.check_exercise(2, {"asked": 4, "launched": 2}, out).ok
    assert not broken.check_exercise(2, {"asked": 2, "launched": 4}, out).ok


def test_missing_set_epoch_repeats_the_order(lab):
    run, out = lab["no_set_epoch"]
    recs = broken.records(out)
    assert run.returncode == 0
    for rec in recs.values():
        assert all(e == rec["broken"][0] for e in rec["broken"])  # every epoch the same order
        assert len({tuple(e) for e in rec["fixed"]}) == len(rec["fixed"])  # set_epoch: a new order each epoch
    for variant in ("broken", "fixed"):  # the sampler still shards: the ranks never share a sample
        for e in range(len(recs[0][variant])):
            assert not set(recs[0][variant][e]) & set(recs[1][variant][e])


def test_same_seed_gives_every_rank_the_same_data(lab):
    run, out = lab["same_seed"]
    recs = broken.records(out)
    assert run.returncode == 0
    assert recs[0]["broken"]["indices"] == recs[1]["broken"]["indices"]
    assert recs[0]["broken"]["local_losses"] == recs[1]["broken"]["local_losses"]  # bit for bit
    seen0 = {i for b in recs[0]["fixed"]["indices"] for i in b}
    assert not seen0 & {i for b in recs[1]["fixed"]["indices"] for i in b}
    assert recs[0]["fixed"]["local_losses"] != recs[1]["fixed"]["local_losses"]
    assert broken.check_exercise(3, {"broken": 1.0, "fixed": 0.0}, out).ok
    assert not broken.check_exercise(3, {"broken": 0.5, "fixed": 0.0}, out).ok


def test_uneven_batches_hang_and_the_fixes_do_not(lab):
    run, out = lab["uneven_batches"]
    recs = broken.records(out)
    assert run.returncode != 0
    assert recs[0]["broken"]["batches"] == recs[1]["broken"]["batches"] + 1  # the per-rank data shows it
    assert recs[0]["fixed"]["batches"] == recs[1]["fixed"]["batches"]
    assert all(r["fixed_completed"] and r["join_completed"] for r in recs.values())
    assert recs[0]["join_batches_done"] == recs[1]["join_batches_done"] + 1  # Join covered the extra batch
    assert all("broken_completed" not in r for r in recs.values())
    assert any("Timed out" in r["error"]["message"] for r in recs.values() if "error" in r)


def test_no_sync_placement_counts(lab):
    run, out = lab["no_sync_placement"]
    rec = broken.records(out)[0]
    assert run.returncode == 0
    k = rec["right"]["k"]
    assert [s["bucket_all_reduces"] for s in rec["right"]["per_step"]] == [1, 1]
    assert [s["bucket_all_reduces"] for s in rec["backward_only"]["per_step"]] == [k, k]  # no saving at all
    assert [s["bucket_all_reduces"] for s in rec["all_inside"]["per_step"]] == [0, 0]
    assert rec["right"]["replica_max_diff"] == 0.0 and rec["backward_only"]["replica_max_diff"] == 0.0
    assert rec["all_inside"]["replica_max_diff"] > 1e-4  # never synchronised: the replicas drifted


def test_every_rank_saving_writes_the_file_twice(lab):
    run, out = lab["save_every_rank"]
    recs = broken.records(out)
    assert run.returncode == 0
    assert all(r["broken"]["wrote"] for r in recs.values())  # two writers, one path
    assert len({r["broken"]["found_saved_by"] for r in recs.values()}) == 1  # one of them won the race
    assert [r["fixed"]["wrote"] for _, r in sorted(recs.items())] == [True, False]
    assert all(r["fixed"]["found_saved_by"] == 0 for r in recs.values())


def test_device_by_global_rank_points_past_the_local_gpus(lab):
    _, out = lab["device_global_rank"]
    recs = broken.records(out)
    assert sorted(recs) == [0, 1, 2, 3]
    for r, rec in recs.items():
        assert rec["node"] == r // 2 and rec["local_rank"] == r % 2
        assert rec["by_global_rank"] == r and rec["by_local_rank"] == r % 2
        assert rec["local_rank_exists"]
    assert not recs[2]["global_rank_exists"] and not recs[3]["global_rank_exists"]
    if torch.cuda.device_count() >= 2:
        assert recs[2]["set_device_global_rank"] != "ok"  # the real error, from the real call
    else:
        assert recs[2]["set_device_global_rank"].startswith("not called")  # computed, never faked
