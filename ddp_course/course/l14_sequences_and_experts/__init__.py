"""Lesson 14, long sequences and many experts: ring attention (context parallelism) and a mixture of
experts spread over the ranks (expert parallelism), both written by hand with point-to-point sends and
``all_to_all_single``, which gloo has, and each proved equal to one process on CPU ranks.

The notebook ``solutions/14_sequences_and_experts.ipynb`` runs the programs here; each module's
docstring gives its command.
"""
