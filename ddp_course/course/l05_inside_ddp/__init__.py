"""Lesson 05, inside DDP: buckets, hooks and unused parameters (``ddp_internals``), overlap of
communication with backward (``ddp_profile``), their shared instruments (``ddp_common``), the
bucket-size benchmark (``bench_buckets``), the figures, and the grader of exercise 05 (your own DDP).
"""
