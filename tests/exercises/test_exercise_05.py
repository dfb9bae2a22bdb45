"""Exercise 05's grader accepts the solution and rejects each classic mistake of a hand-built DDP,
saying which one it is.

Every wrong attempt is the answered solution with one function body replaced (two for the
all-reduce moved after backward: the hook stops launching and finish_reduction starts), run for
real on 2 ranks; so are correct answers spelled otherwise (the collectives imported by name, the
handles waited on through their futures; the functional collectives), which must pass: the grader
judges what the code does, not how it is spelled. The mistakes the grader reads from the bucket
layout alone (forward order, one bucket per parameter), the synchronous all-reduce, the handle
waited on inside backward and the all-reduces complete before backward went on are checked on the
solution's own records, changed the way those mistakes change them: no job needed.
"""

from __future__ import annotations

import copy

import pytest
from harness import answered_exercise, grade_in_pairs, graded_answer, rejected_and_named

from ddp_course.check import replace_function_body
from ddp_course.course.l05_inside_ddp import grader

NAME = "05_my_ddp.py"


def attempt(tmp_path, replacements: dict[str, str], imports: str = ""):
    """The answered exercise with each named function's body replaced (and ``imports``, top-level
    lines, added below the file's own imports, where a learner's extra imports go)."""
    source = answered_exercise(NAME)
    for function, body in replacements.items():
        source = replace_function_body(source, function, body)
    if imports:
        anchor = "\nimport torch.distributed as dist\n"
        assert anchor in source
        source = source.replace(anchor, anchor + imports, 1)
    path = tmp_path / f"05_{'_'.join(replacements)}.py"
    path.write_text(source, encoding="utf-8")
    return path


@pytest.fixture(scope="module")
def solution(tmp_path_factory):
    return graded_answer(tmp_path_factory.mktemp("answered"), "05", NAME, timeout=180)[1]


@pytest.mark.timeout(300)
def test_solution_passes_and_matches_torch_ddp(solution):
    assert solution.ok, solution.message
    assert "trains like torch's" in solution.message and "tolerance" in solution.message
    assert len(solution.records) == 2
    table = grader.comparison(solution)
    want = len(grader.expected_buckets(grader.model_parameters(), int(grader.BUCKET_CAP_MB * 2**20)))
    assert table["mine"]["all_reduces_per_step"] == want
    model_bytes = sum(b for _, b in grader.model_parameters())
    # both send every gradient once per step: the same payload, however they bucket it
    assert table["mine"]["payload_bytes_per_step"] == table["torch"]["payload_bytes_per_step"] == model_bytes
    assert all(len(v["step_ms"]) >= 3 for v in table.values())


# name -> ({function: new body}, phrases the verdict must contain)
MISTAKES = {
    # the classic "DDP by hand": all-reduce every bucket once backward has returned (no overlap)
    "all-reduce after backward": ({
        "on_grad_ready": "    pass\n",
        "finish_reduction": "    for bucket in ddp.buckets:\n"
                            "        flat = torch.cat([p.grad.reshape(-1) for p in bucket.params])\n"
                            "        dist.all_reduce(flat)\n"
                            "        flat /= ddp.world_size\n"
                            "        offset = 0\n"
                            "        for p in bucket.params:\n"
                            "            p.grad.copy_(flat[offset:offset + p.numel()].view_as(p))\n"
                            "            offset += p.numel()\n"},
        ("after loss.backward() had returned", "from the hook")),
    "sum not divided by the world size": ({
        "finish_reduction": "    for bucket in ddp.buckets:\n"
                            "        bucket.work.wait()\n"
                            "        offset = 0\n"
                            "        for p in bucket.params:\n"
                            "            p.grad.copy_(bucket.flat[offset:offset + p.numel()].view_as(p))\n"
                            "            offset += p.numel()\n"
                            "        bucket.ready, bucket.flat, bucket.work = 0, None, None\n"},
        ("2.00 times torch's", "divided by the world size")),
    "no_sync ignored": ({"no_sync": "    yield\n"}, ("during the backward under no_sync()", "stop all communication")),
    "no initial broadcast": ({"broadcast_parameters": "    pass\n"}, ("rank(s) [1]", "dist.broadcast from rank 0")),
    # Launched asynchronously from the hook, then waited on right there through the handle: judged from
    # the solution's records (test_layout_and_blocking_mistakes_are_named_from_the_records). Here, the
    # same waited on through a future the log never handed out (torch.futures.wait_all collects the
    # work's future into a new one): judged by completion, every all-reduce done before backward went on
    "waited on in the hook through torch.futures.wait_all": ({
        "on_grad_ready": "    if not ddp.require_sync:\n"
                         "        return\n"
                         "    bucket.ready += 1\n"
                         "    if bucket.ready == len(bucket.params):\n"
                         "        bucket.flat = torch.cat([p.grad.reshape(-1) for p in bucket.params])\n"
                         "        bucket.work = dist.all_reduce(bucket.flat, async_op=True)\n"
                         "        torch.futures.wait_all([bucket.work.get_future()])\n"},
        ("before backward went on from the hook", "nothing overlaps", "finish_reduction")),
}

# name -> ({function: new body}, top-level imports): correct answers spelled otherwise, which must pass
RESPELLED = {
    # the collectives imported by name before the harness starts (no `dist.` in the answer), and each
    # bucket waited on through its work's future
    "names imported from torch.distributed": ({
        "broadcast_parameters": "    with torch.no_grad():\n"
                                "        for p in module.parameters():\n"
                                "            broadcast(p, 0)\n",
        "on_grad_ready": "    if ddp.require_sync:\n"
                         "        bucket.ready += 1\n"
                         "        if bucket.ready == len(bucket.params):\n"
                         "            bucket.flat = torch.cat([p.grad.flatten() for p in bucket.params])\n"
                         "            bucket.work = all_reduce(bucket.flat, async_op=True)\n",
        "finish_reduction": "    for bucket in ddp.buckets:\n"
                            "        bucket.work.get_future().wait()\n"
                            "        grads = bucket.flat.div_(ddp.world_size).split([p.numel() for p in bucket.params])\n"
                            "        for p, g in zip(bucket.params, grads):\n"
                            "            p.grad.copy_(g.view_as(p))\n"
                            "        bucket.ready, bucket.flat, bucket.work = 0, None, None\n"},
        "from torch.distributed import all_reduce, broadcast\n"),
    # torch.distributed._functional_collectives: the all-reduce returns an AsyncCollectiveTensor (no
    # handle), which waits at its first use, in finish_reduction
    "functional collectives": ({
        "on_grad_ready": "    if ddp.require_sync:\n"
                         "        bucket.ready += 1\n"
                         "        if bucket.ready == len(bucket.params):\n"
                         "            flat = torch.cat([p.grad.reshape(-1) for p in bucket.params])\n"
                         "            bucket.flat = funcol.all_reduce(flat, \"sum\", dist.group.WORLD)\n",
        "finish_reduction": "    for bucket in ddp.buckets:\n"
                            "        grads = (bucket.flat / ddp.world_size).split([p.numel() for p in bucket.params])\n"
                            "        for p, g in zip(bucket.params, grads):\n"
                            "            p.grad.copy_(g.view_as(p))\n"
                            "        bucket.ready, bucket.flat = 0, None\n"},
        "import torch.distributed._functional_collectives as funcol\n"),
}


@pytest.fixture(scope="module")
def verdicts(tmp_path_factory) -> dict:
    """{mistake or respelled answer: the grader's verdict on that attempt}, graded two at a time."""
    attempts = {m: attempt(tmp_path_factory.mktemp("attempt"), replacements)
                for m, (replacements, _) in MISTAKES.items()}
    attempts |= {m: attempt(tmp_path_factory.mktemp("respelled"), replacements, imports)
                 for m, (replacements, imports) in RESPELLED.items()}
    return grade_in_pairs(lambda path: grader.grade(path, timeout=180), attempts)


@pytest.mark.timeout(300)
@pytest.mark.parametrize("mistake", list(MISTAKES))
def test_classic_mistake_is_rejected_and_named(mistake, verdicts):
    rejected_and_named(verdicts[mistake], MISTAKES[mistake][-1])


@pytest.mark.timeout(300)
@pytest.mark.parametrize("answer", list(RESPELLED))
def test_correct_answer_spelled_otherwise_passes(answer, verdicts):
    verdict = verdicts[answer]
    assert verdict.ok, verdict.message
    calls = [c for r in verdict.records for s in r["steps"] for c in s["calls"]]
    assert calls and all(c["phase"] == "backward" and c["async"] for c in calls)
    # each all-reduce waited on (through its work's future, or its result's first use) in
    # finish_reduction, once backward had returned
    assert all(c["waited"] == {"phase": "after backward", "ready": r["n_grads"]}
               for r in verdict.records for s in r["steps"] for c in s["calls"])


def _changed(records: list[dict], change) -> list[dict]:
    out = copy.deepcopy(records)
    for r in out:
        change(r)
    return out


def test_layout_and_blocking_mistakes_are_named_from_the_records(solution):
    params = grader.model_parameters()
    names = [n for n, _ in params]
    cap = int(grader.BUCKET_CAP_MB * 2**20)

    def layout(buckets):
        def change(r):
            r["buckets"] = buckets
        return change

    forward = grader.expected_buckets(params[::-1], cap)  # the same rule, walking first to last
    verdict = grader.diagnose(_changed(solution.records, layout(forward)))
    assert not verdict.ok and "forward order" in verdict.message, verdict.message
    verdict = grader.diagnose(_changed(solution.records, layout([[n] for n in reversed(names)])))
    assert not verdict.ok and "one bucket per parameter" in verdict.message, verdict.message
    ok_layout = grader.expected_buckets(params, cap)
    merged = [ok_layout[0] + ok_layout[1], *ok_layout[2:]]  # a cap read as "at least", or a doubled cap
    verdict = grader.diagnose(_changed(solution.records, layout(merged)))
    assert not verdict.ok and f"fill {len(ok_layout)} buckets" in verdict.message, verdict.message

    def blocking(r):
        for s in r["steps"]:
            for c in s["calls"]:
                c["async"] = False
    verdict = grader.diagnose(_changed(solution.records, blocking))
    assert not verdict.ok and "async_op=True" in verdict.message, verdict.message

    def at_the_end(r):  # every bucket launched from the last gradient's hook
        for s in r["steps"]:
            for c in s["calls"]:
                c["ready"] = r["n_grads"]
    verdict = grader.diagnose(_changed(solution.records, at_the_end))
    assert not verdict.ok and "ITS last gradient" in verdict.message, verdict.message

    def waited(when):  # every bucket's handle first waited on at when(record, call)
        def change(r):
            for s in r["steps"]:
                for c in s["calls"]:
                    c["waited"] = when(r, c)
        return change
    # in its own hook, right after the launch: backward stops for the network at every bucket
    verdict = grader.diagnose(_changed(solution.records, waited(lambda r, c: {"phase": "backward", "ready": c["ready"]})))
    assert not verdict.ok and "waited on inside backward" in verdict.message, verdict.message
    # at the very end of backward, every gradient final (where torch's DDP waits), or never seen: no overlap lost
    for when in (lambda r, c: {"phase": "backward", "ready": r["n_grads"]}, lambda r, c: None):
        verdict = grader.diagnose(_changed(solution.records, waited(when)))
        assert verdict.ok, verdict.message
    assert "async_op=True" in grader._hint("AttributeError: 'NoneType' object has no attribute 'wait'")


def test_all_reduces_complete_before_backward_went_on_are_named_from_the_records(solution):
    """Waited for in the hook by a wait the log does not see: every all-reduce launched before the
    last gradient was complete at the log's first check after its launch (in_flight 0)."""
    def in_flight(when):
        def change(r):
            for s in r["steps"]:
                for c in s["calls"]:
                    c["in_flight"] = when(c)
        return change

    n_grads = solution.records[0]["n_grads"]
    early = [c for r in solution.records for s in r["steps"] for c in s["calls"] if c["ready"] < n_grads]
    # The solution's: still running once backward went on from its hook -- on the rank that reached the
    # all-reduce first, always (it waits for the other); the rank that came second may find it already
    # done on a quiet machine. So some are in flight, never all finished: the grader asks no more.
    assert early and any(c["in_flight"] > 0 for c in early)
    verdict = grader.diagnose(_changed(solution.records, in_flight(lambda c: 0)))
    assert not verdict.ok and "before backward went on from the hook" in verdict.message, verdict.message
    assert f"all {len(early)} all-reduces" in verdict.message and "finish_reduction" in verdict.message
    # the last bucket (launched once every gradient is final) may be waited on at once: nothing to overlap
    verdict = grader.diagnose(_changed(solution.records, in_flight(lambda c: 0 if c["ready"] == n_grads else 3)))
    assert verdict.ok, verdict.message
    # some done before the next check (a fast network, a busy machine) prove nothing: only all of them do
    verdict = grader.diagnose(_changed(solution.records, in_flight(lambda c: 0 if c["ready"] < 15 else 3)))
    assert verdict.ok, verdict.message


def test_comparison_of_a_run_that_did_not_happen_says_what_to_do():
    from ddp_course.check import not_complete

    with pytest.raises(ValueError, match="re-run the grading cell"):
        grader.comparison(not_complete("on_grad_ready()", "exercises/05_my_ddp.py"))


def test_expected_buckets_follow_the_stated_rule():
    sizes = [("a", 40), ("b", 30), ("c", 50), ("d", 10), ("e", 100)]
    # from the last: e (100 > 60) alone; d + c = 60 fits; b + a = 70 does not
    assert grader.expected_buckets(sizes, 60) == [["e"], ["d", "c"], ["b"], ["a"]]
    assert grader.expected_buckets(sizes, 1000) == [["e", "d", "c", "b", "a"]]
