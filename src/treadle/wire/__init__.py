"""Typed messages at the process boundaries (ground floor: every layer may import these).

`engine`: front end <-> engine core (msgspec Structs over ZMQ).
`worker`: engine core <-> workers (`SchedulerOutput`, `ModelRunnerOutput`).
"""
