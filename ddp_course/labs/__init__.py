"""Small torchrun-launchable programs that lessons run (each has a docstring with its command)."""
