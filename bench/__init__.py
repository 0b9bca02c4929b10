"""Benchmarks of the Agent IM services, run as `python -m bench.<name>`."""
