"""Benchmarks: standalone scripts that measure the project against a stated target."""
