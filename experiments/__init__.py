"""Runnable experiments (`python -m experiments.NAME`), their Python config files and mesh layouts."""
