"""Lesson 00, setup: what a launcher hands each process (``env_report``, also used by lesson 04).
"""
