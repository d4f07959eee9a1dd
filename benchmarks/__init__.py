"""Standalone benchmarks (run as scripts; not part of the test suite); ``harness.py`` holds what they share."""
