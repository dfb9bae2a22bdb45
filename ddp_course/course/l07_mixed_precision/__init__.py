"""Lesson 07, mixed precision: autocast and GradScaler seen from inside (``amp``), AMP under DDP
(``amp_ddp``), fp32/bf16/fp16 on this hardware (``bench_amp``) and the figures.
"""
