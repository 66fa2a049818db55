"""``python -m kvmesh.engine.tp_rank FD SIDE_FD``: one follower rank of a tensor-parallel engine, which
started it with one end of a socket pair as FD and of another as SIDE_FD (``kvmesh.engine.tensor_parallel``)."""

from __future__ import annotations

import sys

from kvmesh.engine.tensor_parallel import follower_main

if __name__ == "__main__":
    follower_main(int(sys.argv[1]), int(sys.argv[2]))
