"""Lesson 09, FSDP: shards, memory and collectives measured (``fsdp_lab``), the memory calculator
(``memory``) and its benchmark (``bench_fsdp_memory``), the figures and the grader of exercise 09.
"""
