"""Lesson 10, scaling: speedup over processes (``bench_scaling``), DataLoader tuning
(``bench_dataloader``), torch.compile with DDP (``compile_ddp``, ``bench_compile_ddp``), GPU throughput
(``bench_gpu``), two nodes on one machine (``two_nodes``), multi-node commands (``multinode``) and the figures.
"""
