"""Lesson 08, checkpoints and fault tolerance: a kill during a save (``ckpt_kill``), resuming with
a part forgotten (``ckpt_forget``), resharding to another world size (``ckpt_reshard``), the figures
and the grader of exercise 08.
"""
