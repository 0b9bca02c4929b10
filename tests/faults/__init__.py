"""Fault tests: real processes killed, frozen, cut off and stopped under load.

Each case asserts counters (lost, duplicated, stuck: all zero) rather than
just "no exception", is bounded in time, and stays on loopback. Their figures
are recorded in docs/reliability.md; `make faults` runs them longer.
"""
