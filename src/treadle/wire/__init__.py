"""Typed messages at the process boundaries (ground floor: every layer may import these).

`engine`: front end <-> engine core (msgspec Structs over ZMQ).
`control`: front end <-> engine core without tensors (no torch): the handshake, utility calls,
the DEAD/STOPPED frames, the DP coordinator's addresses.
`worker`: engine core <-> workers (`SchedulerOutput`, `ModelRunnerOutput`).
"""
