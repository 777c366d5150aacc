"""bloomery-broker: the host broker that queues starts until their memory need can be granted.

book.py      pure bookkeeping: capacity, need records, the FIFO queue, fit checks, the lease table
protocol.py  pure: the wire messages (one JSON frame each), size bound, request checks
capacity.py  I/O: the host's capacity (cards through CuPy in a child process, RAM + cgroup, TOML config)
procs.py     I/O: process identity (pid + start time) and liveness through psutil
state.py     I/O: the state file (leases + queue), written atomically
daemon.py    I/O: the ZeroMQ ROUTER loop
cli.py       `bloomery-broker [serve]` and `bloomery-broker status`
"""
