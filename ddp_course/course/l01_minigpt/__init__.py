"""Lesson 01, MiniGPT on one device: the grader of exercise 01 (the model and loop are the core's).
"""
