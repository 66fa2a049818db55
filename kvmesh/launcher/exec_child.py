"""Exec a command that gets SIGTERM when the launcher dies, however it dies (Linux PR_SET_PDEATHSIG).

Usage: ``python exec_child.py LAUNCHER_PID COMMAND [ARGS...]``. The supervisor
runs this file by path, so only the standard library is imported before the
exec. The death signal survives the exec (for a binary that is not set-uid);
checking the parent after setting it closes the race where the launcher died
first. Doing this in the child rather than in a ``preexec_fn`` keeps
``subprocess`` free to spawn safely while the launcher has threads (gRPC's).

Note: Linux sends the signal when the launcher *thread* that spawned the child
exits; spawn from a thread that lives as long as the mesh (the main thread).
"""

import ctypes
import os
import signal
import sys

PR_SET_PDEATHSIG = 1


def main() -> None:
    launcher, argv = int(sys.argv[1]), sys.argv[2:]
    if sys.platform.startswith("linux"):
        libc = ctypes.CDLL(None, use_errno=True)
        if libc.prctl(PR_SET_PDEATHSIG, int(signal.SIGTERM)) != 0:
            print(
                f"kvmesh launcher: prctl(PR_SET_PDEATHSIG) failed: {os.strerror(ctypes.get_errno())}", file=sys.stderr
            )
        if os.getppid() != launcher:
            sys.exit("kvmesh launcher: the launcher exited before this process started")
    try:
        os.execvp(argv[0], argv)
    except OSError as e:
        print(f"kvmesh launcher: cannot run {argv[0]}: {e.strerror}", file=sys.stderr)
        sys.exit(127)


if __name__ == "__main__":
    main()
