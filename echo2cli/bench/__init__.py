"""Benchmark harnesses that are not part of a run: `echo2 bench broadcast` (`broadcast.py`, one process per node in
`broadcast_node.py`) over emulated links (`netem.py`: network namespaces and `tc`)."""
