"""Run a command under the system-call sandbox of deploy/*.service, without systemd.

For the GPU machine (tests/deploy/device_sandbox.sh), which has no systemd: checks that
CUDA, MPS and sparsekvd work under ``NoNewPrivileges=yes``, the units'
``SystemCallFilter=`` (``SystemCallErrorNumber=EPERM``), ``SystemCallArchitectures=native``
and ``RestrictAddressFamilies=AF_UNIX``.

    python3 sandbox_exec.py ALLOWED_SYSCALLS.txt -- COMMAND [ARG...]

ALLOWED_SYSCALLS.txt: one name a line ('#' comments): ``syscalls-sparsekvd.txt``
(``@system-service ~@privileged``, sparsekvd.service) or ``syscalls-mps.txt``
(``@system-service``, nvidia-mps.service), made where systemd is installed by
``python3 tests/deploy/sandbox_exec.py --write-allowed DIR`` (expands the groups with
``systemd-analyze syscall-filter``). Uses libseccomp through ctypes; the filter (and
no_new_privs) is inherited by every child, as under systemd.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import os
import socket
import subprocess
import sys

SCMP_ACT_ALLOW = 0x7FFF0000
EPERM = 1
SCMP_CMP_EQ = 4


def SCMP_ACT_ERRNO(e: int) -> int:  # noqa: N802 - libseccomp's name
    return 0x00050000 | (e & 0xFFFF)


class ScmpArgCmp(ctypes.Structure):
    _fields_ = [("arg", ctypes.c_uint), ("op", ctypes.c_int),
                ("datum_a", ctypes.c_uint64), ("datum_b", ctypes.c_uint64)]


def _expand(group: str, seen: set[str]) -> set[str]:
    out = subprocess.run(["systemd-analyze", "syscall-filter", group], capture_output=True,
                         text=True, check=True).stdout
    names: set[str] = set()
    for line in out.splitlines()[1:]:
        word = line.strip()
        if not word or word.startswith("#"):
            continue
        if word.startswith("@"):
            if word not in seen:
                seen.add(word)
                names |= _expand(word, seen)
        else:
            names.add(word)
    return names


def write_allowed(folder: str) -> None:
    service = _expand("@system-service", set())
    privileged = _expand("@privileged", set())
    version = subprocess.run(["systemd-analyze", "--version"], capture_output=True,
                             text=True).stdout.splitlines()[0]
    for name, what, allowed in (("syscalls-sparsekvd.txt", "@system-service ~@privileged", service - privileged),
                                ("syscalls-mps.txt", "@system-service", service)):
        with open(os.path.join(folder, name), "w") as fh:
            fh.write(f"# SystemCallFilter={what}, expanded by {version}\n")
            fh.write("\n".join(sorted(allowed)) + "\n")


def _libseccomp():
    here = os.path.dirname(os.path.abspath(__file__))
    for name in (ctypes.util.find_library("seccomp"), "libseccomp.so.2",
                 os.environ.get("LIBSECCOMP", ""), os.path.join(here, "libseccomp.so.2")):
        if name:
            try:
                return ctypes.CDLL(name)
            except OSError:
                continue
    sys.exit("sandbox_exec: libseccomp not found (set LIBSECCOMP=/path/libseccomp.so.2)")


def apply(allowed_file: str) -> int:
    lib = _libseccomp()
    lib.seccomp_init.restype = ctypes.c_void_p
    lib.seccomp_init.argtypes = [ctypes.c_uint32]
    lib.seccomp_syscall_resolve_name.argtypes = [ctypes.c_char_p]
    lib.seccomp_rule_add_array.argtypes = [ctypes.c_void_p, ctypes.c_uint32, ctypes.c_int,
                                           ctypes.c_uint, ctypes.POINTER(ScmpArgCmp)]
    lib.seccomp_load.argtypes = [ctypes.c_void_p]
    names = [w.strip() for w in open(allowed_file) if w.strip() and not w.startswith("#")]
    ctx = lib.seccomp_init(SCMP_ACT_ERRNO(EPERM))
    if not ctx:
        sys.exit("sandbox_exec: seccomp_init failed")
    n = 0
    for name in names:
        nr = lib.seccomp_syscall_resolve_name(name.encode())
        if nr < 0 or name == "socket":
            continue
        if lib.seccomp_rule_add_array(ctx, SCMP_ACT_ALLOW, nr, 0, None) == 0:
            n += 1
    # RestrictAddressFamilies=AF_UNIX: socket() only for AF_UNIX.
    nr = lib.seccomp_syscall_resolve_name(b"socket")
    cmp = (ScmpArgCmp * 1)(ScmpArgCmp(0, SCMP_CMP_EQ, socket.AF_UNIX, 0))
    if lib.seccomp_rule_add_array(ctx, SCMP_ACT_ALLOW, nr, 1, cmp) != 0:
        sys.exit("sandbox_exec: cannot add the socket rule")
    rc = lib.seccomp_load(ctx)  # sets no_new_privs first (libseccomp's default)
    if rc != 0:
        sys.exit(f"sandbox_exec: seccomp_load failed: {rc}")
    return n


def main(argv: list[str]) -> None:
    if len(argv) == 2 and argv[0] == "--write-allowed":
        write_allowed(argv[1])
        return
    if len(argv) < 3 or argv[1] != "--":
        sys.exit(__doc__)
    n = apply(argv[0])
    print(f"sandbox_exec: {n} system calls allowed, socket() AF_UNIX only, no_new_privs; "
          f"exec {' '.join(argv[2:])}", file=sys.stderr, flush=True)
    os.execvp(argv[2], argv[2:])


if __name__ == "__main__":
    main(sys.argv[1:])
