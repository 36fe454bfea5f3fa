"""The transport every treadle process uses; it knows nothing about models or HTTP.

- `serial`: the msgpack wire format, arrays out of band (channels 1 and 2).
- `zmq_utils`: socket helpers, addresses, request type bytes.
- `engine_auth`: which peer of a request ROUTER is which engine core (keys, tokens).
- `shm_broadcast` (with `shm_wait`, `shm_ring`, `shm_message`): the shared-memory
  `MessageQueue` (channel 3).
- `process`: start method, process titles, ready and death pipes (`process_watch`: wait for
  READY, monitor, shutdown).

Import the submodules directly; this package imports nothing on its own.
"""
