"""A simulator that drives the real `policy/` code at fleet scale in virtual time.

Deterministic given a seed: a heap of events ordered by (time, sequence number), `now`
passed into every policy call, and no wall clock or unseeded randomness anywhere.
`sim.trace` makes the requests, `sim.engine` models an engine, `sim.loop` plays a trace
over a fleet, `sim.placement` and `sim.fleet` are the experiments, `sim.report` the tables.
"""
