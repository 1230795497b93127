"""Test rigs written once, for the tests, e2e, the benchmarks and the demos.

Installed only in development environments, by the dev distribution
(`dev/pyproject.toml`, `make venv`); never in the product wheel or the image
(tests/test_wheel_contents.py).
"""
