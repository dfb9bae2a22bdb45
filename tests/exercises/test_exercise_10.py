"""Exercise 10's grader accepts the tuned loader and rejects each classic mistake of a distributed
input pipeline, naming it.

Real 2-rank jobs (about 8 s each) for the answer (under ``make test``, the verdict lesson 10's
notebook gave it, records included, read back) and for the mistakes that only a run shows: no workers and workers that are
not persistent (the measured speedup), no DistributedSampler (every rank reads everything),
``shuffle=True`` beside the sampler (DataLoader raises). Each wrong attempt is the answered solution
with a function body replaced (``tests/harness.py``). The mistakes that change which samples a rank
reads, but not how fast (no ``set_epoch``, overlapping shards, the default seed, ...), go through
the same diagnosis on the answer's own records, altered the way the mistake leaves them.

Measured on the course's 2-core machine, with other jobs running (speedup of the epochs after the
first, per rank; the grader's target, ``SPEEDUP_TARGET``, is 2.0x, justified beside it): the answer
3.03x-3.66x over 16 runs, no workers 0.98x-1.03x over 5, workers that are not persistent
0.54x-0.72x over 4.
"""

from __future__ import annotations

import copy

import notebook_runs
import pytest
from harness import ROOT, answered_exercise, exercise_attempt, grade_in_pairs, rejected_and_named

from ddp_course.check import NOT_COMPLETE, replace_function_body
from ddp_course.course.l10_scaling import grader
from ddp_course.course.l10_scaling.slow_storage import fingerprint, sample

NAME = "10_dataloader.py"
SAMPLER = "    sampler = DistributedSampler(dataset, num_replicas=world_size, rank=rank, shuffle=True, seed=SEED)\n"


@pytest.fixture(scope="module")
def graded(tmp_path_factory):
    """The answered exercise graded once: its verdict, whose records are the job's RESULT rows.

    Under ``make test`` lesson 10's notebook has just graded the same answered script (its
    ``build/learner`` copy) with the same grader: that verdict is read back instead of a new job.
    """
    path = tmp_path_factory.mktemp("g10") / "10_answered.py"
    path.write_text(answered_exercise(NAME))
    return notebook_runs.grade("10", path, timeout=120)


@pytest.mark.timeout(180)
def test_solution_passes_with_its_timings_kept(graded):
    assert graded.ok, graded.message
    assert f"target {grader.SPEEDUP_TARGET:.1f}x" in graded.message  # the verdict states what it compared against
    kept = grader.summary(graded)
    assert kept["ok"] and kept["target"] == grader.SPEEDUP_TARGET and len(kept["ranks"]) == grader.NPROC
    assert all(r["speedup"] >= grader.SPEEDUP_TARGET and not r["restarted"] for r in kept["ranks"])


def test_summary_of_a_run_that_did_not_happen_says_what_to_do():
    from ddp_course.check import not_complete

    with pytest.raises(ValueError, match="re-run the grading cell"):
        grader.summary(not_complete("make_loader()", "exercises/10_dataloader.py"))


def _answered_with(tmp_path, bodies: dict[str, str]):
    path = exercise_attempt(tmp_path, NAME, *next(iter(bodies.items())))
    for function, body in list(bodies.items())[1:]:
        path.write_text(replace_function_body(path.read_text(), function, body))
    return path


MISTAKES = {
    "no workers": ({"make_loader": SAMPLER + "    return DataLoader(dataset, batch_size=batch_size, sampler=sampler)\n"},
                   ("too slow", "num_workers=0", f"target {grader.SPEEDUP_TARGET:.1f}x")),
    "workers, not persistent": ({"make_loader": SAMPLER + "    return DataLoader(dataset, batch_size=batch_size, "
                                                          "sampler=sampler, num_workers=4)\n"},
                                ("too slow", "new worker processes in every epoch", "persistent_workers=True")),
    # without a sampler there is no set_epoch to call either: the learner leaves start_epoch empty
    "no DistributedSampler": ({"make_loader": "    return DataLoader(dataset, batch_size=batch_size, shuffle=True, "
                                              "num_workers=4, persistent_workers=True)\n",
                               "start_epoch": "    pass\n"},
                              ("read the whole dataset", "every rank reads everything", "DistributedSampler")),
    "shuffle=True beside the sampler": ({"make_loader": SAMPLER + "    return DataLoader(dataset, batch_size=batch_size, "
                                                                 "sampler=sampler, shuffle=True, num_workers=4, "
                                                                 "persistent_workers=True)\n"},
                                        ("mutually exclusive with shuffle", "no shuffle argument")),
}


@pytest.fixture(scope="module")
def verdicts(tmp_path_factory) -> dict:
    """{mistake: the grader's verdict on the attempt with that mistake}, graded two at a time. A second
    job beside one changes none of these verdicts: each is named from what the job did (which
    processes read, which samples, DataLoader's error), and the slow ones miss the target by far
    (1.0x and 0.5-0.7x against 2.0x)."""
    attempts = {m: _answered_with(tmp_path_factory.mktemp("attempt"), bodies) for m, (bodies, _) in MISTAKES.items()}
    return grade_in_pairs(lambda path: grader.grade(path, timeout=120), attempts)


@pytest.mark.timeout(300)
@pytest.mark.parametrize("mistake", list(MISTAKES))
def test_classic_mistake_is_rejected_and_named(mistake, verdicts):
    rejected_and_named(verdicts[mistake], MISTAKES[mistake][-1])


def test_an_unfinished_exercise_is_told_to_complete_it():
    from ddp_course.check import grade

    verdict = grade("10", ROOT / "lessons" / "exercises" / NAME)  # the stub is found before any job starts
    assert not verdict.ok and NOT_COMPLETE in verdict.message
    assert "make_loader()" in verdict.message and "start_epoch()" in verdict.message


# --------------------------------------------------------------------------------------------------
# the diagnosis on the answer's records, altered as each mistake leaves them


def _with_indices(row: dict, epoch: int, flat: list[int], batch_size: int = 8) -> None:
    """Make ``row``'s learner loader have read ``flat`` in ``epoch`` (indices and their true contents)."""
    import torch

    batches = [flat[i:i + batch_size] for i in range(0, len(flat), batch_size)]
    row["tuned"][epoch]["indices"] = batches
    row["tuned"][epoch]["fingerprints"] = [fingerprint(torch.stack([sample(i) for i in b])) for b in batches]


def _no_set_epoch(found):
    for r in found:
        for e in range(1, len(r["tuned"])):
            _with_indices(r, e, [i for b in r["tuned"][0]["indices"] for i in b])


def _same_shard_on_every_rank(found):  # e.g. rank=0 given to every rank's sampler
    for e in range(len(found[0]["tuned"])):
        _with_indices(found[1], e, [i for b in found[0]["tuned"][e]["indices"] for i in b])


def _default_seed(found):
    cfg = found[0]["config"]
    for r in found:
        for e in range(len(r["tuned"])):
            _with_indices(r, e, grader.expected_indices(cfg["n_samples"], len(found), r["rank"], 0, e))


def _one_batch_less(found):
    for ep in found[1]["tuned"]:
        del ep["indices"][-1], ep["fingerprints"][-1]


def _other_contents(found):
    found[0]["tuned"][1]["fingerprints"][2][3] += 0.5


def _two_workers(found):
    for r in found:
        r["tuned"] = [{**ep, "seconds": s, "readers": [r["pid"] + 1, r["pid"] + 2]}
                      for ep, s in zip(r["tuned"], (0.60, 0.21, 0.21))]
        for ep, s in zip(r["untuned"], (0.71, 0.40, 0.40)):
            ep["seconds"] = s


CRAFTED = {
    "no set_epoch": (_no_set_epoch, ("exactly the order of epoch 0", "set_epoch(epoch)")),
    "the same shard on every rank": (_same_shard_on_every_rank, ("overlap", "rank=rank")),
    "the default seed": (_default_seed, ("default seed (0)", "seed=SEED")),
    "unequal batch counts": (_one_batch_less, ("same number of batches",)),
    "other contents": (_other_contents, ("not the samples stored under them",)),
    "two workers": (_two_workers, ("too slow", "2 workers at best")),
}


@pytest.mark.parametrize("mistake", list(CRAFTED))
def test_diagnosis_names_each_mistake_on_crafted_records(mistake, graded):
    found = graded.records
    assert found and grader.diagnose(found).ok
    alter, phrases = CRAFTED[mistake]
    found = copy.deepcopy(found)
    alter(found)
    verdict = grader.diagnose(found)
    assert not verdict.ok
    assert all(p in verdict.message for p in phrases), verdict.message


def test_dataloader_argument_errors_are_named_from_its_own_messages():
    from torch.utils.data import DataLoader, DistributedSampler

    data = list(range(8))
    for kwargs, phrase in ((dict(sampler=DistributedSampler(data, num_replicas=2, rank=0), shuffle=True), "shuffle"),
                           (dict(persistent_workers=True), "persistent"), (dict(prefetch_factor=4), "prefetch_factor")):
        with pytest.raises(ValueError) as err:
            DataLoader(data, **kwargs)
        assert phrase in grader._crash_hint(str(err.value)), (kwargs, str(err.value))
    with pytest.raises(AttributeError) as err:
        DataLoader(data, shuffle=True).sampler.set_epoch(1)
    assert "no DistributedSampler" in grader._crash_hint(str(err.value))


def test_the_untuned_loader_is_built_for_its_epoch():
    """The harness once called ``untuned.sampler.set_epoch(epoch)`` beside ``start_epoch(tuned, epoch)``: the
    line start_epoch asks for, in plain sight. The untuned loader is now built for each epoch (no workers, so
    at no cost), and gives that epoch's order of this rank's shard, a new one each epoch."""
    from torch.utils.data import DistributedSampler

    from ddp_course.course.l10_scaling.slow_storage import SlowStorage, untuned_loader

    data = SlowStorage(12, 0.0, 0.0)
    orders = []
    for epoch in range(3):
        want = DistributedSampler(data, num_replicas=2, rank=1, shuffle=True, seed=7)
        want.set_epoch(epoch)
        got = [b["index"].tolist() for b in untuned_loader(data, 3, 1, 2, 7, epoch)]
        assert sum(got, []) == list(want)
        orders.append(got)
    assert orders[0] != orders[1] != orders[2]
    assert "set_epoch" not in (ROOT / "lessons" / "exercises" / "10_dataloader.py").read_text(encoding="utf-8")
