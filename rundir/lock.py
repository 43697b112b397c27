"""One training process per run directory.

The lock is an flock on WORKDIR/.lock: the kernel drops it when its process dies (SIGKILL, OOM, a crashed
host process), so a lock left behind by a dead process is simply taken over; the file keeps the holder's PID
and host so the refusal can name them. flock is per host: on a shared file system only process 0 of a
multi-host run takes it (the other hosts write nothing into the run directory).
"""

import fcntl
import os
import socket

from plumbing.errors import UserError


class RunLock:
    def __init__(self, path):
        self.path = path
        self.fd = None
        self.previous = ""  # what the file said before we took it (a dead holder's PID), for the log

    def acquire(self) -> "RunLock":
        fd = os.open(self.path, os.O_RDWR | os.O_CREAT, 0o644)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            holder = os.pread(fd, 200, 0).decode("utf-8", "replace").strip() or "unknown"
            os.close(fd)
            raise UserError(f"{self.path.parent} is in use by another training process ({holder}); wait for it "
                            "to finish or stop it, then re-run to resume") from None
        self.previous = os.pread(fd, 200, 0).decode("utf-8", "replace").strip()
        os.ftruncate(fd, 0)
        os.pwrite(fd, f"pid {os.getpid()} on {socket.gethostname()}\n".encode(), 0)
        self.fd = fd
        return self

    def release(self) -> None:
        if self.fd is not None:
            os.ftruncate(self.fd, 0)  # an empty file says nobody holds it; the file itself stays (no unlink race)
            fcntl.flock(self.fd, fcntl.LOCK_UN)
            os.close(self.fd)
            self.fd = None

    def __enter__(self):
        return self.acquire()

    def __exit__(self, *exc):
        self.release()
