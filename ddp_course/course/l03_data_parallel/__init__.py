"""Lesson 03, DataParallel: its mechanism by hand (``dp_mechanism``), DP against DDP on GPUs
(``bench_dp_vs_ddp`` with ``train_gpu_memory``) and the figures.
"""
