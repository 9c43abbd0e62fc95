"""The child side of the `python` tool's sandbox: the runner that sets up isolation and runs the code.

The tool starts `python -I -c <this file's text> <config json>` (under `unshare` in the namespaces mode),
so this file imports only the standard library, and only what it uses. It reads the model's code from
stdin, then sets up, by mode (tools/sandbox/isolation.py says which guarantee each layer gives):

- namespaces (already in fresh net/mount/pid namespaces made by `unshare`, as real root or as root of a
  fresh user namespace): PID 1 of the pid namespace builds a new root on a tmpfs holding read-only binds
  of /usr, /bin, /lib*, /etc and the interpreter's prefixes, a /dev with null, zero, full, random and
  urandom, its own /proc, a tmpfs /tmp and /dev/shm, and the trajectory's scratch directory (the only
  writable place on disk); `pivot_root` into it and the old root is detached. PID 1 reaps orphans; its
  exit kills every process left in the namespace.
- landlock and rlimits: the runner stays outside the sandbox as a child subreaper (every process the code
  starts stays its descendant, setsid or not) and forks the worker; when the worker ends, or the tool
  sends SIGTERM at its deadline, the runner kills every descendant before it exits.

The worker (the process that runs the code), in every mode: no_new_privs; every capability dropped from
the bounding, permitted, effective and inheritable sets; as real root, the trajectory's own uid/gid
(no supplementary groups); in the landlock mode a Landlock domain (read: the system directories and the
interpreter; write: the scratch directory; no TCP; no abstract unix sockets or signals outside the domain
where the kernel scopes them); rlimits (RLIMIT_AS, RLIMIT_CPU, RLIMIT_NPROC, RLIMIT_FSIZE, RLIMIT_NOFILE,
RLIMIT_CORE=0); the seccomp filter the tool compiled with libseccomp (tools/sandbox/seccomp.py), loaded
last; an audit hook that gives the model clear errors (not a boundary: ctypes gets around it); then the
code runs as `__main__`, with a traceback without the runner's frames on an exception.
"""

from __future__ import annotations

import json
import os
import sys

SETUP_FAILED = 121  # the runner's exit status when the sandbox could not be set up
SUPERVISORS = 2  # the runner and (namespaces) the pid namespace's init: in the call's cgroup, not the code's
_READ_ONLY_SYSTEM = ("/usr/share", "/usr/lib", "/usr/lib64", "/usr/local/lib", "/etc/localtime",
                     "/proc/self", "/proc/cpuinfo", "/proc/meminfo", "/sys/devices/system/cpu")  # fmt: skip
DEVICES = ("null", "zero", "full", "random", "urandom")
SYSTEM_DIRS = ("/usr", "/bin", "/sbin", "/lib", "/lib32", "/lib64", "/libx32", "/etc")
LANDLOCK_READ_FILES = ("/proc/cpuinfo", "/proc/meminfo", "/sys/devices/system/cpu")
_PIVOT_ROOT_NR = {"x86_64": 155, "aarch64": 41, "riscv64": 41, "ppc64le": 203, "s390x": 217}
# landlock_create_ruleset / add_rule / restrict_self: the same numbers on every architecture (asm-generic)
LANDLOCK_NR = (444, 445, 446)
MS_RDONLY, MS_NOSUID, MS_NODEV, MS_NOEXEC, MS_REMOUNT, MS_BIND, MS_REC = 1, 2, 4, 8, 32, 4096, 16384
PR_SET_PDEATHSIG, PR_SET_KEEPCAPS, PR_CAPBSET_DROP, PR_SET_SECCOMP = 1, 8, 24, 22
PR_SET_CHILD_SUBREAPER, PR_SET_NO_NEW_PRIVS = 36, 38


def _libc():
    import ctypes

    return ctypes, ctypes.CDLL(None, use_errno=True)


def _check(result: int, what: str) -> None:
    if result < 0:
        import ctypes

        errno = ctypes.get_errno()
        raise OSError(errno, f"{what}: {os.strerror(errno)}")


# --- namespaces: the new root ----------------------------------------------------------------------


def _mount(src: str | None, dst: str, fstype: str | None, flags: int, data: str | None = None) -> None:
    _, libc = _libc()

    def enc(s: str | None) -> bytes | None:
        return s.encode() if s is not None else None

    _check(libc.mount(enc(src), enc(dst), enc(fstype), flags, enc(data)), f"mount {dst}")


def _bind(src: str, dst: str, read_only: bool = True) -> None:
    if os.path.isdir(src):
        os.makedirs(dst, exist_ok=True)
    else:
        os.makedirs(os.path.dirname(dst), exist_ok=True)
        open(dst, "a").close()
    _mount(src, dst, None, MS_BIND | MS_REC)
    if read_only:  # keep the flags a user namespace may not clear (locked mounts)
        kept = os.statvfs(dst).f_flag & (MS_NOSUID | MS_NODEV | MS_NOEXEC | 1024 | 2048)
        _mount(None, dst, None, MS_REMOUNT | MS_BIND | MS_RDONLY | MS_NOSUID | kept)


def _new_root(cfg: dict) -> None:
    """Build the new root on a tmpfs mounted over the scratch path and pivot into it (see the docstring)."""
    import contextlib
    import platform

    scratch = cfg["scratch"]
    keep = os.open(scratch, os.O_PATH | os.O_DIRECTORY)  # the scratch dir, once the tmpfs covers its path
    new = scratch
    _mount("tmpfs", new, "tmpfs", MS_NOSUID | MS_NODEV, "size=1m,mode=755")
    size = f"size={cfg['tmpfs_mb']}m,mode=1777"
    for path in ("/dev/shm", "/tmp"):  # first: an interpreter or venv under /tmp is bound on top of it
        os.makedirs(new + path, exist_ok=True)
        _mount("tmpfs", new + path, "tmpfs", MS_NOSUID | MS_NODEV, size)
    bound: list[str] = []
    for path in (*SYSTEM_DIRS, *cfg["python_dirs"]):
        if any(path == b or path.startswith(b + "/") for b in bound) or not os.path.lexists(path):
            continue
        if os.path.islink(path):
            os.makedirs(os.path.dirname(new + path), exist_ok=True)
            os.symlink(os.readlink(path), new + path)
        else:
            _bind(path, new + path)
            bound.append(path)
    for name in DEVICES:
        _bind(f"/dev/{name}", f"{new}/dev/{name}", read_only=False)
    for name, target in (("fd", "/proc/self/fd"), ("stdin", "/proc/self/fd/0"),
                         ("stdout", "/proc/self/fd/1"), ("stderr", "/proc/self/fd/2")):  # fmt: skip
        os.symlink(target, f"{new}/dev/{name}")
    os.makedirs(new + scratch, exist_ok=True)
    _mount(f"/proc/self/fd/{keep}", new + scratch, None, MS_BIND)
    os.close(keep)
    os.makedirs(new + "/proc", exist_ok=True)
    with contextlib.suppress(OSError):  # e.g. a container with masked /proc paths: no /proc then
        _mount("proc", new + "/proc", "proc", MS_NOSUID | MS_NODEV | MS_NOEXEC)
    os.makedirs(new + "/.old", exist_ok=True)
    ctypes, libc = _libc()
    nr = _PIVOT_ROOT_NR[platform.machine()]
    _check(libc.syscall(nr, new.encode(), (new + "/.old").encode()), "pivot_root")
    os.chdir("/")
    _check(libc.umount2(b"/.old", 2), "umount old root")  # MNT_DETACH
    os.rmdir("/.old")
    _mount(None, "/", None, MS_REMOUNT | MS_RDONLY | MS_NOSUID | MS_NODEV)


# --- the worker: privileges, Landlock, limits, seccomp, the courtesy hook ------------------------------


def _clear_caps() -> None:
    ctypes, libc = _libc()

    class Header(ctypes.Structure):
        _fields_ = [("version", ctypes.c_uint32), ("pid", ctypes.c_int)]

    class Data(ctypes.Structure):
        _fields_ = [("effective", ctypes.c_uint32), ("permitted", ctypes.c_uint32),
                    ("inheritable", ctypes.c_uint32)]  # fmt: skip

    _check(libc.capset(ctypes.byref(Header(0x20080522, 0)), (Data * 2)()), "capset")


def _drop_privileges(cfg: dict) -> None:
    _, libc = _libc()
    _check(libc.prctl(PR_SET_NO_NEW_PRIVS, 1, 0, 0, 0), "no_new_privs")
    for cap in range(64):
        libc.prctl(PR_CAPBSET_DROP, cap, 0, 0, 0)  # fails harmlessly without CAP_SETPCAP (nothing to drop)
    if cfg["uid"] is not None:
        os.setgroups([])
        os.setresgid(cfg["gid"], cfg["gid"], cfg["gid"])
        os.setresuid(cfg["uid"], cfg["uid"], cfg["uid"])  # clears the permitted and effective sets
    _clear_caps()
    try:
        with open("/proc/self/status") as f:
            status = f.read().splitlines()
    except OSError:
        return  # no /proc (a masked one in a container): capset's success is the check
    for line in status:  # the bounding set only matters without no_new_privs, which is set
        if line.startswith(("CapEff:", "CapPrm:", "CapInh:", "CapAmb:")) and int(line.split()[1], 16):
            raise OSError(f"capabilities left after dropping them: {line.strip()}")


# Landlock access rights (include/uapi/linux/landlock.h), by the ABI version that introduced them
_FS_V1 = (1 << 13) - 1  # EXECUTE .. MAKE_SYM; REFER (ABI 2), TRUNCATE (3) and IOCTL_DEV (5) follow
_FS_READ = 1 | 1 << 2 | 1 << 3  # EXECUTE, READ_FILE, READ_DIR
_FS_FILE = 1 | 1 << 1 | 1 << 2 | 1 << 14 | 1 << 15  # what a rule on a file (not a directory) may hold
_NET_TCP = 3  # BIND_TCP, CONNECT_TCP (ABI 4)
_SCOPES = 3  # ABSTRACT_UNIX_SOCKET, SIGNAL (ABI 6)


def _landlock(cfg: dict) -> None:
    """A Landlock domain: read and execute under the system and interpreter directories, everything under
    the scratch directory, /dev/null writable; no TCP (ABI >= 4), no abstract unix sockets or signals out of
    the domain (ABI >= 6). Landlock also forbids ptrace of, and /proc access to, processes outside it."""
    ctypes, libc = _libc()
    abi = cfg["landlock_abi"]
    fs = _FS_V1 | (abi >= 2) << 13 | (abi >= 3) << 14 | (abi >= 5) << 15
    u64 = ctypes.c_uint64

    class Ruleset(ctypes.Structure):
        _fields_ = [("fs", u64), ("net", u64), ("scoped", u64)]

    class PathBeneath(ctypes.Structure):
        _pack_ = 1
        _fields_ = [("allowed", u64), ("parent_fd", ctypes.c_int32)]

    attr = Ruleset(fs, _NET_TCP if abi >= 4 else 0, _SCOPES if abi >= 6 else 0)
    size = 8 if abi < 4 else 16 if abi < 6 else 24
    create, add_rule, restrict = LANDLOCK_NR
    ruleset = libc.syscall(create, ctypes.byref(attr), ctypes.c_size_t(size), 0)
    _check(ruleset, "landlock_create_ruleset")
    rules = [(p, _FS_READ) for p in (*SYSTEM_DIRS, *cfg["python_dirs"], *LANDLOCK_READ_FILES)]
    rules += [(cfg["scratch"], fs)] + [(f"/dev/{d}", _FS_READ | 1 << 1) for d in DEVICES]
    for path, access in rules:
        try:
            fd = os.open(path, os.O_PATH | os.O_CLOEXEC)
        except OSError:
            continue  # e.g. no /lib32 here
        try:
            if not os.path.isdir(path):
                access &= _FS_FILE
            rule = PathBeneath(access & fs, fd)
            _check(libc.syscall(add_rule, ruleset, 1, ctypes.byref(rule), 0), f"landlock rule {path}")
        finally:
            os.close(fd)
    _check(libc.syscall(restrict, ruleset, 0), "landlock_restrict_self")
    os.close(ruleset)


def _seccomp(bpf_hex: str) -> None:
    """Load the filter the tool compiled with libseccomp (needs no_new_privs, set before)."""
    ctypes, libc = _libc()
    program = bytes.fromhex(bpf_hex)

    class Fprog(ctypes.Structure):
        _fields_ = [("len", ctypes.c_ushort), ("filter", ctypes.c_char_p)]

    _check(libc.prctl(PR_SET_SECCOMP, 2, ctypes.byref(Fprog(len(program) // 8, program)), 0, 0), "seccomp")


def _set_limits(cfg: dict) -> None:
    import resource

    cpu = max(1, int(-(-cfg["cpu_s"] // 1)))
    limits = {resource.RLIMIT_AS: cfg["memory_mb"] << 20, resource.RLIMIT_CPU: (cpu, cpu + 1),
              resource.RLIMIT_FSIZE: cfg["fsize_mb"] << 20,
              resource.RLIMIT_NOFILE: 256, resource.RLIMIT_CORE: 0}  # fmt: skip
    if cfg["uid"] is not None:  # counted per real uid: a limit for the call only when the uid is its own
        limits[resource.RLIMIT_NPROC] = cfg["max_processes"]
    for which, value in limits.items():
        soft, hard = value if isinstance(value, tuple) else (value, value)
        resource.setrlimit(which, (soft, hard))


def _install_guard(cfg: dict) -> None:
    writable = tuple(cfg["write_paths"])
    readable = (*writable, *cfg["read_paths"], os.path.realpath("/proc/self"))
    block_exec, guard_listing = cfg["block_exec"], cfg["mode"] != "namespaces"  # namespaces: little to list
    realpath, fsdecode = os.path.realpath, os.fsdecode
    write_flags = os.O_WRONLY | os.O_RDWR | os.O_CREAT | os.O_TRUNC | os.O_APPEND
    spawn_events = {"os.system", "os.exec", "os.posix_spawn", "os.spawn", "subprocess.Popen", "pty.spawn"}

    def inside(path: str, roots: tuple) -> bool:
        return any(path == r or path.startswith(r.rstrip("/") + "/") for r in roots)

    def hook(event: str, args: tuple) -> None:
        if event == "open":
            path, mode, flags = args
            if path is None or isinstance(path, int):
                return
            full = realpath(fsdecode(path))
            write = any(c in (mode or "") for c in "wax+") or bool((flags or 0) & write_flags)
            if not inside(full, writable if write else readable):
                raise PermissionError(f"python tool: access to {fsdecode(path)!r} is not allowed here "
                                      "(only the current directory is)")  # fmt: skip
        elif guard_listing and event in ("os.listdir", "os.scandir") and isinstance(args[0], (str, bytes)):
            if not inside(realpath(fsdecode(args[0])), readable):
                raise PermissionError(f"python tool: listing {fsdecode(args[0])!r} is not allowed here")
        elif event == "socket.__new__" and args[1] != 1:  # AF_UNIX: socketpair (multiprocessing.Pipe)
            raise PermissionError("python tool: network access is disabled")
        elif block_exec and event in spawn_events:
            raise PermissionError("python tool: starting programs is disabled")

    sys.addaudithook(hook)


def _run_code(code: str) -> None:
    import linecache
    import traceback
    import types

    linecache.cache["<code>"] = (len(code), None, code.splitlines(True), "<code>")
    main = types.ModuleType("__main__")
    main.__builtins__ = __builtins__
    sys.modules["__main__"] = main
    sys.argv = ["<code>"]
    sys.stdout.reconfigure(line_buffering=True)  # keeps prints and a subprocess's output in order
    try:
        exec(compile(code, "<code>", "exec"), main.__dict__)
    except SystemExit:
        raise
    except BaseException as exc:
        sys.stdout.flush()
        tb = None if isinstance(exc, SyntaxError) else exc.__traceback__.tb_next  # drop the runner's frame
        traceback.print_exception(type(exc), exc, tb)
        sys.stderr.flush()
        raise SystemExit(1) from None
    finally:
        sys.stdout.flush()


def _setup_failed(exc: BaseException) -> None:
    print(f"sandbox setup failed: {exc!r}", file=sys.stderr, flush=True)
    os._exit(SETUP_FAILED)


def _worker(cfg: dict, code: str) -> None:
    try:
        _drop_privileges(cfg)
        os.chdir(cfg["scratch"])
        if cfg["mode"] == "landlock":
            _landlock(cfg)
        _set_limits(cfg)
        if cfg["seccomp_bpf"]:
            _seccomp(cfg["seccomp_bpf"])
        _install_guard(cfg)
    except Exception as exc:
        _setup_failed(exc)
    _run_code(code)


# --- the process tree: PID 1 of the namespaces, or the subreaper -------------------------------------


def _init(cfg: dict, code: str, report: int) -> None:
    """PID 1 of the call's pid namespace: builds the new root, forks the worker (the user's code), reaps
    every orphan, and reports the worker's wait status; its exit kills whatever is left in the namespace."""
    import signal

    _, libc = _libc()
    libc.prctl(PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0)  # die with the runner
    try:
        _new_root(cfg)
    except Exception as exc:
        _setup_failed(exc)
    worker = os.fork()
    if worker == 0:
        os.close(report)
        _worker(cfg, code)
        return
    while True:
        pid, status = os.wait()
        if pid == worker:
            break
    os.write(report, str(status).encode())
    os._exit(0)


def descendants(root: int) -> list[int]:
    """Live descendants of `root`, parents before children (a scan of /proc). dsv4rl.faults.proc_tree does
    the same for the trainer; this file runs where dsv4rl may not be importable, so it has its own."""
    children: dict[int, list[int]] = {}
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/stat", "rb") as f:
                fields = f.read().rsplit(b")", 1)[1].split()
        except (OSError, IndexError):
            continue
        if fields[0] not in (b"Z", b"X"):
            children.setdefault(int(fields[1]), []).append(int(entry))
    found, todo = [], list(children.get(root, ()))
    while todo:
        pid = todo.pop()
        found.append(pid)
        todo.extend(children.get(pid, ()))
    return found


def kill_descendants() -> None:
    """SIGKILL every descendant of this process and reap them, until none is left: as a child subreaper,
    the orphans of killed processes come back to it and are found by the next scan."""
    import contextlib
    import signal
    import time

    me = os.getpid()
    for _ in range(1000):
        found = descendants(me)
        for pid in found:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
        while True:
            try:
                if os.waitpid(-1, os.WNOHANG)[0] == 0:
                    break
            except ChildProcessError:
                break
        if not found:
            return
        time.sleep(0.002)


class _Deadline(BaseException):
    pass


def _supervise(cfg: dict, code: str) -> int:
    """Without namespaces: fork the worker as a child subreaper, wait for it (or the tool's SIGTERM at the
    deadline), kill every descendant; the worker's wait status."""
    import signal

    _, libc = _libc()
    _check(libc.prctl(PR_SET_CHILD_SUBREAPER, 1, 0, 0, 0), "child subreaper")

    def deadline(_sig, _frame):
        raise _Deadline

    signal.signal(signal.SIGTERM, deadline)
    try:
        worker = os.fork()
        if worker == 0:
            signal.signal(signal.SIGTERM, signal.SIG_DFL)
            libc.prctl(PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0)
            _worker(cfg, code)
            sys.exit(0)
        status = os.waitpid(worker, 0)[1]
    except _Deadline:
        status = signal.SIGKILL  # as if killed: the tool reports its timeout
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    kill_descendants()
    return status


def runner_main(cfg: dict) -> None:
    """The runner: ends as the worker ended (the same exit status or the same signal)."""
    import signal

    code = sys.stdin.buffer.read().decode("utf-8", "replace")
    null = os.open(os.devnull, os.O_RDONLY)
    os.dup2(null, 0)
    os.close(null)
    if cfg["mode"] == "namespaces":
        read_end, write_end = os.pipe()
        init = os.fork()
        if init == 0:
            os.close(read_end)
            _init(cfg, code, write_end)
            return
        os.close(write_end)
        status = os.waitpid(init, 0)[1]
        reported = os.read(read_end, 64)
        status = int(reported) if reported else status
    else:
        status = _supervise(cfg, code)
    if os.WIFSIGNALED(status):
        sig = os.WTERMSIG(status)
        if sig not in (signal.SIGKILL, signal.SIGSTOP):  # these two have no handler to reset (EINVAL)
            signal.signal(sig, signal.SIG_DFL)
        os.kill(os.getpid(), sig)
    os._exit(os.WEXITSTATUS(status) if os.WIFEXITED(status) else 1)


if __name__ == "__main__" and len(sys.argv) > 1 and sys.argv[0] == "-c":
    runner_main(json.loads(sys.argv[1]))
