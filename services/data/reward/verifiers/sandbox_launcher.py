"""The first process of a sandbox run (`sandbox.run`): isolates itself, then becomes the program.

Run as a script, `python -I -S sandbox_launcher.py CONFIG`, by the server's uid in the run's new
session and working directory; CONFIG is the JSON that `sandbox.run` writes. It imports nothing
but the standard library.

With namespaces (CAP_SYS_ADMIN) it unshares network, mount and pid namespaces, mounts private
tmpfs over the host's world-writable directories, moves the program's directory onto the private
/tmp, and forks init of the new pid namespace. Init mounts a /proc of that namespace, forks the
program and reaps orphans; when init ends, the kernel kills every process left in the namespace.
(The program is not init itself: the kernel shields init from the signals of RLIMIT_CPU.)
Then, in the program's process: rlimits, the run's uid, `execve` with an empty environment.
"""

import json
import os
import resource
import signal
import sys

CLONE_NEWNS, CLONE_NEWPID, CLONE_NEWNET = 0x00020000, 0x20000000, 0x40000000
MS_NOSUID, MS_NODEV, MS_NOEXEC, MS_REC, MS_PRIVATE = 2, 4, 8, 0x4000, 0x40000
# The host's world-writable directories: each gets a private tmpfs, so what the program writes
# there is capped and vanishes with it (and /dev/shm cannot fill the host's RAM).
PRIVATE_DIRS = ("/tmp", "/var/tmp", "/dev/shm", "/run/lock")
# Credentials a container may hold readable by any uid (Docker secrets, the Kubernetes service
# account's token): each is covered by an empty, read-only tmpfs.
HIDDEN_DIRS = ("/run/secrets", "/var/run/secrets")
MS_RDONLY = 1


def main(cfg: dict) -> None:
    try:
        if not cfg["namespaces"]:
            become_program(cfg)
        with open("main.py", "rb") as f:
            source = f.read()
        import ctypes

        libc = ctypes.CDLL(None, use_errno=True)

        def mount(
            source: bytes | None, target: str, fstype: bytes | None, flags: int, data: bytes | None = None
        ) -> None:
            if libc.mount(source, target.encode(), fstype, flags, data) != 0:
                raise OSError(ctypes.get_errno(), f"mount {target}")

        if libc.unshare(CLONE_NEWNET | CLONE_NEWNS | CLONE_NEWPID) != 0:
            raise OSError(ctypes.get_errno(), "unshare")
        mount(b"none", "/", None, MS_REC | MS_PRIVATE)  # no mount below reaches the host
        size = f"size={cfg['tmpfs_bytes']},mode=1777".encode()
        for target in PRIVATE_DIRS:
            if os.path.isdir(target):
                mount(b"tmpfs", target, b"tmpfs", MS_NOSUID | MS_NODEV, size)
        for target in HIDDEN_DIRS:
            if os.path.isdir(target) and not os.path.islink(target):
                mount(b"tmpfs", target, b"tmpfs", MS_RDONLY | MS_NOSUID | MS_NODEV, b"size=4k,mode=755")
        # The program's directory, at the same path, now on the private /tmp.
        os.makedirs(cfg["workdir"], exist_ok=True)
        with open(os.path.join(cfg["workdir"], "main.py"), "wb") as f:
            f.write(source)
        if cfg["uid"] is not None:
            os.chown(cfg["workdir"], cfg["uid"], cfg["uid"])
        os.chdir(cfg["workdir"])
        status_r, status_w = os.pipe()
        init = os.fork()
        if init == 0:
            mount(b"proc", "/proc", b"proc", MS_NOSUID | MS_NODEV | MS_NOEXEC)  # this namespace's processes only
            program = os.fork()
            if program == 0:
                os.close(status_r)
                os.close(status_w)
                become_program(cfg)
            # Init cannot die of the program's signal (the kernel shields it): it passes the status up.
            os.write(status_w, str(reap_until(program)).encode())
            os._exit(0)
    except OSError as e:
        os.write(2, (cfg["mark"] + repr(e) + "\n").encode())
        os._exit(cfg["failed"])
    os.close(status_w)
    init_status = reap_until(init)
    end_as(int(os.read(status_r, 32) or init_status))


def become_program(cfg: dict) -> None:
    for name, (soft, hard) in cfg["rlimits"].items():
        resource.setrlimit(getattr(resource, name), (soft, hard))
    if cfg["uid"] is not None:
        os.setgroups([])
        os.setgid(cfg["uid"])
        os.setuid(cfg["uid"])
    os.execve(cfg["argv"][0], cfg["argv"], {})


def reap_until(pid: int) -> int:
    """Reap children (and orphans, as init) until `pid` ends; its wait status."""
    while True:
        done, status = os.wait()
        if done == pid:
            return status


def end_as(status: int) -> None:
    """Exit, or die of the signal, as the wait status `status` says, so the server reads the program's end."""
    code = os.waitstatus_to_exitcode(status)
    if code < 0:
        resource.setrlimit(resource.RLIMIT_CORE, (0, 0))
        signal.signal(-code, signal.SIG_DFL)
        os.kill(os.getpid(), -code)
    os._exit(code)


if __name__ == "__main__":
    main(json.loads(sys.argv[1]))
