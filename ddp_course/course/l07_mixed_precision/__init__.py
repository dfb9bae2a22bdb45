"""Lesson 07, mixed precision: autocast and GradScaler seen from inside (``amp``), the same training in
each precision in one process (``precisions``), AMP under DDP (``amp_ddp``), fp32/bf16/fp16 on this
hardware (``bench_amp``) and the figures.
"""
