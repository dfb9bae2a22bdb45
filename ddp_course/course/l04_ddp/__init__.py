"""Lesson 04, DistributedDataParallel: the recipe written out (``ddp_recipe``), launching with
``mp.spawn`` (``spawn_demo``), the multi-node torchrun command run as two "nodes" of one
machine (``two_nodes``, used again in lessons 10 and 11), the equivalence figures and the grader of exercise 04.
"""
