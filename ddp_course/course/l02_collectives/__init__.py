"""Lesson 02, collectives: every collective shown rank by rank (``collectives``), ranks that disagree
(``mismatch``), all-reduce timing (``bench_allreduce``), the figures and the ring all-reduce grader.
"""
