"""Lesson 13, two dimensions at once: FSDP over data-parallel ranks and tensor (and sequence)
parallelism inside each block, on a 2 x 2 mesh of CPU ranks, proved equal to one process; then a third
dimension, pipeline stages over that plan (``three_d_lab``: 8 ranks as 2 x 2 x 2, 1F1B by hand).

The notebook ``solutions/13_two_dimensions.ipynb`` runs the programs here; each module's docstring
gives its command. The strategy itself is ``ddp_course/parallel/fsdp_tp.py``.
"""
