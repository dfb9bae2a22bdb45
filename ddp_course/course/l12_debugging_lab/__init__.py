"""Lesson 12, the debugging lab: one broken program per classic bug (``broken/``) and a probe of
``TORCH_DISTRIBUTED_DEBUG=DETAIL`` (``detail_probe``).
"""
