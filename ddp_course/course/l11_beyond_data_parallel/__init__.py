"""Lesson 11, beyond data parallelism: tensor and pipeline parallelism run for real on CPU ranks.

The notebook ``solutions/11_beyond_data_parallel.ipynb`` runs the programs here; each module's
docstring gives its command.
"""
