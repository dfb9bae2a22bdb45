"""Lesson 13, two dimensions at once: FSDP over data-parallel ranks and tensor (and sequence)
parallelism inside each block, on a 2 x 2 mesh of CPU ranks, proved equal to one process.

The notebook ``solutions/13_two_dimensions.ipynb`` runs the programs here; each module's docstring
gives its command. The strategy itself is ``ddp_course/parallel/fsdp_tp.py``.
"""
