"""The child side of the `python` tool's sandbox, and the probe of which isolation layers work here.

This file is also the sandbox's runner: the tool starts `python -I -c <this file's text> <config json>`
(optionally under `unshare`), so it imports only the standard library at the top, and cheaply. The runner
reads the user's code from stdin, then, in this order:

1. namespaces (when the config says so; the process already runs in fresh net/mount/pid namespaces made
   by `unshare`, as real root or as root of a fresh user namespace): builds a new root on a tmpfs holding
   read-only binds of /usr, /bin, /lib*, /etc and the interpreter's prefixes, a /dev with null, zero,
   full, random and urandom, a fresh /proc of the pid namespace, a tmpfs /tmp and /dev/shm, and the
   trajectory's scratch directory at its own path (the only place on disk it can write); then
   `pivot_root` into it and detaches the old root, so nothing else of the host's files is reachable.
2. privileges: sets no_new_privs (setuid binaries grant nothing); as real root it switches to the
   trajectory's own unprivileged uid/gid (which makes RLIMIT_NPROC apply: the kernel never enforces it
   for uid 0), keeping CAP_DAC_READ_SEARCH only without namespaces, where the interpreter may live in a
   directory that uid cannot read (e.g. /root/.pyenv); in a user namespace it drops every capability.
3. rlimits: RLIMIT_AS, RLIMIT_CPU (SIGXCPU, then SIGKILL a second later), RLIMIT_NPROC, RLIMIT_FSIZE,
   RLIMIT_NOFILE and RLIMIT_CORE=0.
4. an audit hook (`sys.addaudithook`): `open` and listing of paths outside the scratch directory, the
   interpreter's directories and a few read-only system paths, non-AF_UNIX sockets, and (without
   namespaces) starting programs raise PermissionError. It is a courtesy layer that gives the model a
   clear error, not a security boundary: ctypes or a C extension bypasses it. The boundaries are the
   namespaces, the uid and the rlimits.
5. runs the code as `__main__`, printing a traceback without the runner's frames on an exception.
"""

from __future__ import annotations

import json
import os
import sys

SETUP_FAILED = 121  # the runner's exit status when the sandbox could not be set up
_READ_ONLY_SYSTEM = ("/usr/share", "/usr/lib", "/usr/lib64", "/usr/local/lib", "/etc/localtime",
                     "/proc/self", "/proc/cpuinfo", "/proc/meminfo", "/sys/devices/system/cpu")  # fmt: skip
_DEVICES = ("null", "zero", "full", "random", "urandom")
_SYSTEM_DIRS = ("/usr", "/bin", "/sbin", "/lib", "/lib32", "/lib64", "/libx32", "/etc")
_PIVOT_ROOT_NR = {"x86_64": 155, "aarch64": 41, "riscv64": 41, "ppc64le": 203, "s390x": 217}
MS_RDONLY, MS_NOSUID, MS_NODEV, MS_NOEXEC, MS_REMOUNT, MS_BIND, MS_REC = 1, 2, 4, 8, 32, 4096, 16384


def _libc():
    import ctypes

    return ctypes, ctypes.CDLL(None, use_errno=True)


def _check(result: int, what: str) -> None:
    if result != 0:
        import ctypes

        errno = ctypes.get_errno()
        raise OSError(errno, f"{what}: {os.strerror(errno)}")


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
    bound: list[str] = []
    for path in (*_SYSTEM_DIRS, *cfg["python_dirs"]):
        if any(path == b or path.startswith(b + "/") for b in bound) or not os.path.lexists(path):
            continue
        if os.path.islink(path):
            os.symlink(os.readlink(path), new + path)
        else:
            _bind(path, new + path)
            bound.append(path)
    os.makedirs(new + "/dev", exist_ok=True)
    for name in _DEVICES:
        _bind(f"/dev/{name}", f"{new}/dev/{name}", read_only=False)
    for name, target in (("fd", "/proc/self/fd"), ("stdin", "/proc/self/fd/0"),
                         ("stdout", "/proc/self/fd/1"), ("stderr", "/proc/self/fd/2")):  # fmt: skip
        os.symlink(target, f"{new}/dev/{name}")
    size = f"size={cfg['tmpfs_mb']}m,mode=1777"
    for path in ("/dev/shm", "/tmp"):
        os.makedirs(new + path, exist_ok=True)
        _mount("tmpfs", new + path, "tmpfs", MS_NOSUID | MS_NODEV, size)
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


def _set_caps(mask: int) -> None:
    ctypes, libc = _libc()

    class Header(ctypes.Structure):
        _fields_ = [("version", ctypes.c_uint32), ("pid", ctypes.c_int)]

    class Data(ctypes.Structure):
        _fields_ = [("effective", ctypes.c_uint32), ("permitted", ctypes.c_uint32),
                    ("inheritable", ctypes.c_uint32)]  # fmt: skip

    data = (Data * 2)()
    data[0].effective = data[0].permitted = mask
    _check(libc.capset(ctypes.byref(Header(0x20080522, 0)), data), "capset")


def _drop_privileges(cfg: dict) -> None:
    _, libc = _libc()
    _check(libc.prctl(38, 1, 0, 0, 0), "no_new_privs")  # PR_SET_NO_NEW_PRIVS
    keep = 1 << 2 if cfg["keep_dac_read"] else 0  # CAP_DAC_READ_SEARCH
    for cap in range(64):
        if not keep >> cap & 1:
            libc.prctl(24, cap, 0, 0, 0)  # PR_CAPBSET_DROP; fails harmlessly without CAP_SETPCAP
    if cfg["uid"] is not None:
        if keep:
            _check(libc.prctl(8, 1, 0, 0, 0), "keepcaps")  # PR_SET_KEEPCAPS
        os.setgroups([])
        os.setresgid(cfg["gid"], cfg["gid"], cfg["gid"])
        os.setresuid(cfg["uid"], cfg["uid"], cfg["uid"])
    if os.geteuid() == 0 or keep:
        _set_caps(keep)


def _set_limits(cfg: dict) -> None:
    import resource

    cpu = max(1, int(-(-cfg["cpu_s"] // 1)))
    limits = {resource.RLIMIT_AS: cfg["memory_mb"] << 20, resource.RLIMIT_CPU: (cpu, cpu + 1),
              resource.RLIMIT_NPROC: cfg["max_processes"], resource.RLIMIT_FSIZE: cfg["fsize_mb"] << 20,
              resource.RLIMIT_NOFILE: 256, resource.RLIMIT_CORE: 0}  # fmt: skip
    for which, value in limits.items():
        soft, hard = value if isinstance(value, tuple) else (value, value)
        resource.setrlimit(which, (soft, hard))


def _install_guard(cfg: dict) -> None:
    writable = tuple(cfg["write_paths"])
    readable = (*writable, *cfg["read_paths"], os.path.realpath("/proc/self"))
    block_exec, guard_listing = cfg["block_exec"], not cfg["namespaces"]  # namespaces: little to list
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
        elif event == "socket.__new__" and args[1] != 1:  # AF_UNIX stays usable (multiprocessing)
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
        _set_limits(cfg)
        _install_guard(cfg)
    except Exception as exc:
        _setup_failed(exc)
    _run_code(code)


def _init(cfg: dict, code: str, report: int) -> None:
    """PID 1 of the call's pid namespace: builds the new root, forks the worker (the user's code), reaps
    every orphan, and reports the worker's wait status; its exit kills whatever is left in the namespace."""
    import signal

    _, libc = _libc()
    libc.prctl(1, signal.SIGKILL, 0, 0, 0)  # PR_SET_PDEATHSIG: die with the runner
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


def runner_main(cfg: dict) -> None:
    """The runner: with namespaces, forks PID 1 of the new pid namespace and ends as its worker ended
    (the same exit status or the same signal), else runs the code itself."""
    import signal

    code = sys.stdin.buffer.read().decode("utf-8", "replace")
    null = os.open(os.devnull, os.O_RDONLY)
    os.dup2(null, 0)
    os.close(null)
    if not cfg["namespaces"]:
        _worker(cfg, code)
        return
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
    if os.WIFSIGNALED(status):
        sig = os.WTERMSIG(status)
        signal.signal(sig, signal.SIG_DFL)
        os.kill(os.getpid(), sig)
    os._exit(os.WEXITSTATUS(status) if os.WIFEXITED(status) else 1)


# --- the parent's side: the command line, the probe, stray processes ---------------------------------


def python_dirs(python: str) -> list[str]:
    """The directories an interpreter needs (its prefixes and the real location of its executable)."""
    if python in _DIRS:
        return _DIRS[python]
    import subprocess

    query = ("import json, os, sys; print(json.dumps([sys.prefix, sys.base_prefix, sys.exec_prefix, "
             "sys.base_exec_prefix, os.path.dirname(os.path.realpath(sys.executable))]))")  # fmt: skip
    out = subprocess.run([python, "-I", "-c", query], capture_output=True, text=True, timeout=30, check=True)
    dirs = sorted({os.path.realpath(d) for d in json.loads(out.stdout)} | set(json.loads(out.stdout)))
    _DIRS[python] = [d for d in dirs if not any(d.startswith(o + "/") for o in dirs)]
    return _DIRS[python]


def command(python: str, cfg: dict, unshare: str | None) -> list[str]:
    """The argv that runs the runner with `cfg`, under `unshare` when `cfg["namespaces"]`."""
    global _SOURCE
    if _SOURCE is None:
        with open(__file__) as f:
            _SOURCE = f.read()
    argv = [python, "-I", "-c", _SOURCE, json.dumps(cfg)]
    if not cfg["namespaces"]:
        return argv
    user = [] if os.geteuid() == 0 else ["--user", "--map-root-user"]
    return [unshare, *user, "--net", "--mount", "--pid", *argv]


def kill_uid(uid: int) -> int:
    """SIGKILL every live process whose real uid is `uid` (the sandbox's own uid), until none is left
    (zombies are dead already: their parent or init reaps them)."""
    import signal

    killed = 0
    for _ in range(50):
        found = 0
        for entry in os.listdir("/proc"):
            if not entry.isdigit():
                continue
            try:
                with open(f"/proc/{entry}/status") as f:
                    fields = dict(line.split(":", 1) for line in f if ":" in line)
                if int(fields["Uid"].split()[0]) == uid and fields["State"].split()[0] not in "ZX":
                    os.kill(int(entry), signal.SIGKILL)
                    found += 1
            except (OSError, KeyError, ValueError):
                continue
        killed += found
        if not found:
            break
    return killed


def base_config(scratch: str, python: str, namespaces: bool, uid: int | None, **limits) -> dict:
    dirs = python_dirs(python)
    readable = [*dirs, *(f"/dev/{d}" for d in _DEVICES), *_READ_ONLY_SYSTEM]
    return {"scratch": scratch, "namespaces": namespaces, "python_dirs": dirs, "uid": uid, "gid": uid,
            "keep_dac_read": uid is not None and not namespaces, "block_exec": not namespaces,
            "write_paths": [scratch, "/dev/null"], "read_paths": readable, "tmpfs_mb": 64, "fsize_mb": 64,
            **limits}  # fmt: skip


_PROBES: dict[str, dict] = {}
_DIRS: dict[str, list[str]] = {}


def probe(python: str) -> dict:
    """Which isolation layers work here for `python` (run once per interpreter, then cached)."""
    if python in _PROBES:
        return _PROBES[python]
    import shutil
    import subprocess
    import tempfile

    root = os.geteuid() == 0
    unshare = shutil.which("unshare")
    info: dict = {"root": root, "unshare": unshare}

    def works(argv: list[str]) -> bool:
        try:
            return subprocess.run(argv, capture_output=True, timeout=30).returncode == 0
        except (OSError, subprocess.SubprocessError):
            return False

    user = [] if root else ["--user", "--map-root-user"]
    kinds = {"user_namespace": ["--user", "--map-root-user"], "net_namespace": [*user, "--net"],
             "mount_namespace": [*user, "--mount"], "pid_namespace": [*user, "--pid", "--fork"]}  # fmt: skip
    for name, flags in kinds.items():
        info[name] = bool(unshare) and works([unshare, *flags, "true"])
    scratch = tempfile.mkdtemp(prefix="dsv4rl-py-probe-")
    try:
        uid = PROBE_UID if root else None
        if root:
            os.chown(scratch, uid, uid)
        cfg = base_config(scratch, python, True, uid, memory_mb=1024, cpu_s=10, max_processes=64)
        code = "import os, socket\nassert os.getpid() == 2 and not os.path.exists('/home/.')\nprint('ok')"
        try:
            argv = command(python, cfg, unshare or "unshare")
            env = {"PATH": "/usr/bin:/bin"}
            out = subprocess.run(
                argv, input=code.encode(), capture_output=True, timeout=30, cwd=scratch, env=env
            )
            ok, detail = out.returncode == 0 and out.stdout.strip() == b"ok", out.stdout + out.stderr
        except (OSError, subprocess.SubprocessError) as exc:
            ok, detail = False, repr(exc).encode()
    finally:
        if root:
            kill_uid(PROBE_UID)
        shutil.rmtree(scratch, ignore_errors=True)
    info["namespaces"] = ok
    if not ok:
        info["namespaces_error"] = detail.decode("utf-8", "replace")[-500:]
    info["isolation"] = "namespaces" if ok else "rlimits"
    info["layers"] = {
        "network": "net namespace (no interfaces up)" if ok else "audit hook only",
        "filesystem": "pivot_root into a minimal read-only root" if ok else
        ("separate uid (file permissions) + audit hook" if root else "audit hook only"),
        "processes": "pid namespace + RLIMIT_NPROC" if ok else "RLIMIT_NPROC + process group kill",
        "memory_cpu": "RLIMIT_AS, RLIMIT_CPU, RLIMIT_FSIZE, wall timeout",
    }  # fmt: skip
    _PROBES[python] = info
    return info


PROBE_UID = 0x7FFE0000  # the probe's uid; trajectories get their own (see PythonTool.open)
_SOURCE: str | None = None

if __name__ == "__main__" and len(sys.argv) > 1 and sys.argv[0] == "-c":
    runner_main(json.loads(sys.argv[1]))
