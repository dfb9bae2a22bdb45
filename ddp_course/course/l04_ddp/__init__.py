"""Lesson 04, DistributedDataParallel: the recipe written out (``ddp_recipe``), launching with
``mp.spawn`` (``spawn_demo``), the equivalence figures and the grader of exercise 04.
"""
