"""Benchmarks, one module each (``main(argv) -> int``); run with ``python -m ddp_course.bench NAME``."""
