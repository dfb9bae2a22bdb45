"""Lesson 09, FSDP: shards, memory and collectives measured (``fsdp_lab``), the memory calculator
(``memory``) and its benchmark (``bench_fsdp_memory``), ``ZeroRedundancyOptimizer`` beside DDP (``zero_lab``), the figures, and the graders of
exercise 09: ``grader`` (``fully_shard``) and ``grader_zero1`` (ZeRO-1 built by hand).
"""
