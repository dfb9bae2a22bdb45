"""Lesson 10, scaling: speedup over processes (``bench_scaling``), DataLoader tuning
(``bench_dataloader``), torch.compile with DDP (``compile_ddp``, ``bench_compile_ddp``), GPU throughput
(``bench_gpu``), multi-node commands (``multinode``), the figures, and exercise 10's slow storage
(``slow_storage``) and grader. Training on two "nodes" of
one machine uses lesson 04's ``two_nodes``.
"""
