"""The sandbox's seccomp filter, compiled by libseccomp (through pyseccomp's bindings) in the tool's process.

The runner only loads the compiled program (one prctl), so the sandbox's interpreter needs neither
libseccomp's bindings nor any package. The filter allows by default and refuses what a sandboxed program
has no use for and what would reach past the other layers:

- `socket` for every family (EACCES): no TCP, UDP, raw, netlink or unix socket to anything, loopback
  included; `socketpair` stays (multiprocessing's pipes reach nothing outside);
- io_uring (its operations open sockets and files without the syscalls above), ptrace and
  process_vm_readv/writev, the kernel keyrings, bpf, perf events, userfaultfd;
- new namespaces (`unshare`, `setns`, `clone` with a CLONE_NEW* flag; `clone3`, whose flags the filter
  cannot read, answers ENOSYS so that glibc falls back to `clone`) and mounts;
- with `allow_fork=False`, every new process (`fork`, `vfork`, `clone` without CLONE_THREAD): where no
  cgroup bounds a call's memory, one process under RLIMIT_AS is the bound.

A call from another architecture's syscall table (32-bit `int 0x80` on x86-64) kills the process
(libseccomp's default for a foreign architecture).
"""

from __future__ import annotations

import errno
import functools
import os
import tempfile

DENIED = (
    "io_uring_setup",
    "io_uring_enter",
    "io_uring_register",
    "ptrace",
    "process_vm_readv",
    "process_vm_writev",
    "keyctl",
    "add_key",
    "request_key",
    "bpf",
    "perf_event_open",
    "userfaultfd",
    "unshare",
    "setns",
    "mount",
    "umount2",
    "pivot_root",
    "move_mount",
    "open_tree",
    "fsopen",
    "fsmount",
    "fsconfig",
    "fspick",
    "mount_setattr",
    "open_by_handle_at",
    "name_to_handle_at",
    "kexec_load",
    "init_module",
    "finit_module",
    "delete_module",
    "acct",
    "swapon",
    "swapoff",
    "reboot",
)
CLONE_NEW = (0x20000, 0x02000000, 0x04000000, 0x08000000, 0x10000000, 0x20000000, 0x40000000, 0x80)
CLONE_THREAD = 0x10000


class SeccompUnavailable(RuntimeError):
    """libseccomp or its bindings are missing, or the kernel lacks seccomp filters."""


@functools.cache
def seccomp_program(allow_fork: bool) -> str:
    """The compiled BPF program, hex-encoded for the runner's JSON config; SeccompUnavailable says why not."""
    try:
        import pyseccomp as sc
    except (ImportError, OSError) as error:  # OSError: libseccomp.so.2 itself is missing
        raise SeccompUnavailable(
            f"libseccomp's bindings do not load ({error}): pip install pyseccomp, and "
            "the libseccomp2 system package"
        ) from None
    try:
        flt = sc.SyscallFilter(sc.ALLOW)
        flt.add_rule(sc.ERRNO(errno.EACCES), "socket")
        for name in DENIED:
            try:
                flt.add_rule(sc.ERRNO(errno.EPERM), name)
            except (OSError, ValueError):
                continue  # not a syscall of this architecture
        for flag in CLONE_NEW:
            flt.add_rule(sc.ERRNO(errno.EPERM), "clone", sc.Arg(0, sc.MASKED_EQ, flag, flag))
        flt.add_rule(sc.ERRNO(errno.ENOSYS), "clone3")
        if not allow_fork:
            flt.add_rule(sc.ERRNO(errno.EAGAIN), "fork")
            flt.add_rule(sc.ERRNO(errno.EAGAIN), "vfork")
            flt.add_rule(sc.ERRNO(errno.EAGAIN), "clone", sc.Arg(0, sc.MASKED_EQ, CLONE_THREAD, 0))
        with tempfile.TemporaryFile() as out:
            flt.export_bpf(out)
            out.seek(0)
            program = out.read()
    except (OSError, ValueError, RuntimeError) as error:
        raise SeccompUnavailable(f"libseccomp could not build the filter: {error!r}") from None
    if not program or len(program) % 8:
        raise SeccompUnavailable(f"libseccomp exported a {len(program)}-byte program")
    return program.hex()


def kernel_has_seccomp() -> bool:
    """Seccomp filters are compiled into this kernel (the `Seccomp:` line of /proc/self/status)."""
    try:
        with open(f"/proc/{os.getpid()}/status") as f:
            return any(line.startswith("Seccomp:") for line in f)
    except OSError:
        return False
