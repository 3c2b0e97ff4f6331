"""Runs before a sandboxed program, in its interpreter, where no namespaces isolate it (`sandbox.run`).

Passed as `python -I -S -c <this file's text> main.py` (the program's uid need not read this file).
An audit hook refuses sockets, ctypes and starting programs (`_posixsubprocess` starts them without
an audit event, so its import is refused too); reading files other than the program's directory's,
the interpreter's library and /dev; and changing files outside the program's directory. When the
server is not root, the program runs as the server's uid, and the server's files are its own.
The hook lives in the program's own interpreter: it stops ordinary programs, not a determined one
that corrupts the interpreter's memory.
"""

import os
import sys


def _install() -> None:
    real = os.path.realpath
    home = real(os.getcwd())
    library = {sys.prefix, sys.base_prefix, sys.exec_prefix, sys.base_exec_prefix}
    readable = {home, real("/proc/self"), "/dev", *map(real, library)}
    writable = {home, "/dev/null"}
    refused = (
        "socket.",
        "ctypes.",
        "os.exec",
        "os.posix_spawn",
        "os.spawn",
        "os.system",
        "subprocess.",
        "os.startfile",
    )
    changing = {
        "os.remove",
        "os.rename",
        "os.rmdir",
        "os.mkdir",
        "os.symlink",
        "os.link",
        "os.truncate",
        "os.chmod",
        "os.chown",
        "os.utime",
    }
    writing = os.O_WRONLY | os.O_RDWR | os.O_CREAT | os.O_TRUNC | os.O_APPEND

    def inside(path: object, roots: set[str]) -> bool:
        if isinstance(path, int):
            return True  # a file it already has open
        path = real(os.fsdecode(path))
        return any(path == root or path.startswith(root.rstrip("/") + "/") for root in roots)

    def hook(event: str, args: tuple) -> None:
        if event.startswith(refused):
            raise PermissionError(f"the sandbox refuses {event}")
        if event == "import" and args[0] == "_posixsubprocess":
            raise PermissionError("the sandbox refuses importing _posixsubprocess")
        if event == "open" and args[0] is not None:
            path, mode, flags = args
            writes = any(c in mode for c in "wax+") if mode is not None else bool(flags & writing)
            if not inside(path, writable if writes else readable):
                raise PermissionError(f"the sandbox refuses {'writing' if writes else 'reading'} {path!r}")
        elif event in ("os.listdir", "os.scandir") and args[0] is not None and not inside(args[0], readable):
            raise PermissionError(f"the sandbox refuses listing {args[0]!r}")
        elif event in changing and not all(
            inside(a, writable) for a in args[:2] if isinstance(a, (str, bytes, os.PathLike))
        ):
            raise PermissionError(f"the sandbox refuses {event} outside its directory")

    sys.addaudithook(hook)


if __name__ == "__main__":
    _install()
    del _install
    import runpy  # after the hook, so that the program's imports go through it

    sys.argv = sys.argv[1:]
    runpy.run_path(sys.argv[0], run_name="__main__")
