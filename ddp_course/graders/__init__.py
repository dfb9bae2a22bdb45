"""Graders of the exercise scripts: module gNN grades exercise NN (``grade(path) -> Verdict``)."""
