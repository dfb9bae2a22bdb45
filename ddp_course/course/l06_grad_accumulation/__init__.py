"""Lesson 06, gradient accumulation with ``no_sync``: the lab (``no_sync_lab``), the step-time
benchmark (``bench_no_sync``), the figures and the grader of exercise 06.
"""
