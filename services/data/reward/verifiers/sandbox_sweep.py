"""Runs as a sandbox run's uid after the run where no pid namespace ended its processes (`sandbox.run`).

Passed as `python -I -S -c <this file's text> DIR...`: kills every live process of its uid (even
those that left the run's session), then removes the uid's files and directories in each DIR (the
host's world-writable directories). Exits with 1 if processes of the uid are still alive after 2 s.
"""

import os
import shutil
import signal
import sys
import time


def live_processes(uid: int) -> list[str]:
    """Pids of the processes of `uid`, other than this one, that are not zombies."""
    found = []
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            with open(f"/proc/{pid}/status") as f:
                fields = dict(line.split(":", 1) for line in f.read().splitlines() if ":" in line)
        except OSError:
            continue  # it has just ended
        if int(pid) != os.getpid() and int(fields["Uid"].split()[0]) == uid and fields["State"].split()[0] != "Z":
            found.append(pid)
    return found


def main(dirs: list[str]) -> int:
    uid = os.getuid()
    deadline = time.monotonic() + 2.0
    while True:
        try:
            os.kill(-1, signal.SIGKILL)  # every process this uid may signal: its own
        except ProcessLookupError:
            break
        if not live_processes(uid):
            break
        if time.monotonic() > deadline:
            return 1
        time.sleep(0.005)
    for parent in filter(os.path.isdir, dirs):
        for entry in os.scandir(parent):
            if entry.stat(follow_symlinks=False).st_uid == uid:
                if entry.is_dir(follow_symlinks=False):
                    shutil.rmtree(entry.path, ignore_errors=True)
                else:
                    os.unlink(entry.path)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
