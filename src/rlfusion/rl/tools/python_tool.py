"""`PythonTool`: runs the policy's Python code in a fresh, limited subprocess and returns what it
printed (stdout, then stderr), within `max_output_bytes`.

Each call gets a new `python -I` in a new scratch folder (its cwd, HOME and TMPDIR, deleted
afterwards), rlimits on CPU time, address space, file size, open files and (in the namespace)
processes, a wall-clock timeout that SIGKILLs the whole process group, and a cap on the output
the parent reads. What the code does wrong (raises, loops, allocates too much, exits non-zero)
comes back as text for the policy; `ToolError` only when the sandbox itself could not run.

Isolation, in two layers:
- a new user + network namespace (`unshare -rn`: only a loopback, down) where this machine
  allows one, tried once; `_NAMESPACE = False` turns it off, as on machines without user
  namespaces, where the audit hook alone keeps the network out.
- an audit hook (`sys.addaudithook`), in both cases, installed before the user's code runs: it
  refuses sockets and name lookups, starting processes, signals to other processes, ctypes calls
  and loads, links, and any write, create, rename, remove or metadata change outside the scratch
  folder (reads stay open: imports, the stdlib, data files).
An audit hook guards against ordinary code, not against a program bent on escaping (PEP 578):
one that rebuilds C modules through importlib's internals can get past it. The namespace is the
hard fence for the network; writes outside the scratch folder have only the hook.
"""

from __future__ import annotations

import functools
import json
import math
import os
import selectors
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field

from rlfusion.rl.tools import ToolError

_NAMESPACE = True  # run the child in a new network namespace where this machine allows it
_READY = b"\x00"  # the child's first byte on stdout: limits and hook in place, user code next
_START_GRACE_S = 10.0  # interpreter start-up and bootstrap, not counted in timeout_s
_NPROC = 16  # processes + threads: set only in the namespace, where the kernel counts only ours
_HARD_CAP = 1 << 20  # output read past max(this, 8 * max_output_bytes): the child is killed
_TRUNCATED = "...[output truncated]"

# Runs in the child before the user's code, settings in argv[1]. The hook reads nothing the
# user's code could replace later (globals, builtins, os.path): what it uses is in its closure.
_BOOTSTRAP = r'''
import json, linecache, os, posix, resource, sys, traceback, types
cfg = json.loads(sys.argv[1])
for name, (soft, hard) in cfg["limits"].items():
    rlimit = getattr(resource, name)
    cap = resource.getrlimit(rlimit)[1]
    cap = hard if cap == resource.RLIM_INFINITY else cap
    resource.setrlimit(rlimit, (min(soft, cap), min(hard, cap)))
with open(cfg["code"], encoding="utf-8") as f:
    code = f.read()
linecache.cache["<code>"] = (len(code), None, code.splitlines(True), "<code>")  # for tracebacks

def make_hook(scratch):
    str_, bytes_, int_, isinstance_, frozenset_ = str, bytes, int, isinstance, frozenset
    PermissionError_, ImportError_, OSError_ = PermissionError, ImportError, OSError
    getcwd, stat = posix.getcwd, posix.stat
    write_flags = os.O_WRONLY | os.O_RDWR | os.O_APPEND | os.O_CREAT | os.O_TRUNC
    write_modes = frozenset("wax+")
    refused = frozenset((
        "socket.__new__", "socket.bind", "socket.connect", "socket.sendto", "socket.sendmsg",
        "socket.getaddrinfo", "socket.gethostbyname", "socket.gethostbyaddr", "socket.getnameinfo",
        "os.system", "os.exec", "os.fork", "os.forkpty", "os.posix_spawn", "os.spawn",
        "subprocess.Popen", "pty.spawn", "os.kill", "os.killpg", "resource.setrlimit",
        "resource.prlimit", "os.link", "os.symlink", "gc.get_objects", "gc.get_referrers",
        "gc.get_referents"))
    refused_modules = frozenset(("_sqlite3", "_dbm", "_gdbm", "readline"))  # C writes, no event
    path_args = {"os.chmod": (0,), "os.chown": (0,), "os.chflags": (0,), "os.mkdir": (0,),
                 "os.remove": (0,), "os.rmdir": (0,), "os.rename": (0, 1), "os.truncate": (0,),
                 "os.utime": (0,), "os.setxattr": (0,), "os.removexattr": (0,), "shutil.rmtree": (0,)}

    def resolve(path):
        """(the absolute path, normalised, or None; whether a relative path climbs above its base)"""
        if isinstance_(path, bytes_):
            path = bytes_.decode(path, "utf-8", "surrogateescape")
        if not isinstance_(path, str_):
            return None, False
        path, depth, climbs = str_.__str__(path), 0, False  # an exact str, whatever subclass came
        if not path.startswith("/"):
            # The `open` event does not say whether a dir_fd is the base: a path that never
            # climbs above its base stays inside any base inside the scratch folder.
            for part in path.split("/"):
                depth += -1 if part == ".." else part not in ("", ".")
                climbs = climbs or depth < 0
            path = getcwd() + "/" + path
        parts = []
        for part in path.split("/"):
            if part == "..":
                parts = parts[:-1]
            elif part not in ("", "."):
                parts.append(part)
        return "/" + "/".join(parts), climbs

    def inside(full):
        return full is not None and (full == scratch or full.startswith(scratch + "/"))

    def check_write(path):  # an fd (an int) is refused too: fchmod works on a read-only fd
        full, climbs = resolve(path)
        if climbs or not (inside(full) or full == "/dev/null"):
            raise PermissionError_(f"writing outside the scratch folder is not allowed: {full or f'fd {path}'}")

    def is_dir(full):
        try:
            return stat(full).st_mode & 0o170000 == 0o040000
        except OSError_:
            return False

    def hook(event, args):
        if event == "import" and str_.__str__(args[0]) in refused_modules:
            raise ImportError_(f"{args[0]} is not available in this sandbox")
        if event in refused or event.startswith("ctypes."):
            raise PermissionError_(f"{event} is not allowed in this sandbox")
        if event == "open" and not isinstance_(args[0], int_):  # reopening an fd cannot widen it
            path, mode, flags = args
            # builtins.open and os.open report their O_* flags; C code opening with fopen(), a mode
            if flags & write_flags or mode is not None and frozenset_(mode) & write_modes:
                check_write(path)
            elif mode is None:  # os.open: a directory fd from outside would let dir_fd= escape
                full, climbs = resolve(path)
                if climbs or not inside(full) and is_dir(full):
                    raise PermissionError_(f"opening a directory outside the scratch folder is not allowed: {full}")
        for i in path_args.get(event, ()):
            check_write(args[i])

    return hook

def no_spawn(*args):
    raise PermissionError("starting processes is not allowed in this sandbox")

# Imported before the hook, so that ctypes' types stay usable (sympy imports them); calls,
# loads and reads at an address raise `ctypes.*` events, which the hook refuses.
import ctypes
# No audit event for these: spawning through _posixsubprocess itself, FIFOs, device nodes,
# and signals through a pidfd (to the parent, say).
import _posixsubprocess, _signal, signal
_posixsubprocess.fork_exec = no_spawn
for module in (os, posix, signal, _signal):
    for name in ("mkfifo", "mknod", "pidfd_open", "pidfd_send_signal"):
        if hasattr(module, name):
            delattr(module, name)
sys.addaudithook(make_hook(cfg["scratch"]))
main = types.ModuleType("__main__")  # the user's globals; the bootstrap's are not in sys.modules
sys.modules["__main__"] = main
os.write(1, b"\x00")
try:
    exec(compile(code, "<code>", "exec"), main.__dict__)
except SystemExit:
    raise
except BaseException as e:
    report = traceback.TracebackException(type(e), e, e.__traceback__)
    todo = [report]
    while todo:  # without the bootstrap's own frames (its exec, the hook)
        part = todo.pop()
        part.stack = traceback.StackSummary.from_list([f for f in part.stack if f.filename != "<string>"])
        todo += [x for x in (part.__cause__, part.__context__) if x is not None]
    print("".join(report.format()), end="", file=sys.stderr)
    if isinstance(e, MemoryError):
        print(f"[memory limit of {cfg['memory_mb']} MB reached]", file=sys.stderr)
    sys.exit(1)
'''


@functools.cache
def _namespace_cmd() -> tuple[str, ...]:
    """`unshare -rn --` where it works on this machine (tried once), else ()."""
    exe = shutil.which("unshare")
    if exe is None or not sys.platform.startswith("linux"):
        return ()
    try:
        ok = subprocess.run([exe, "-rn", "true"], capture_output=True, timeout=10).returncode == 0
    except (OSError, subprocess.SubprocessError):
        return ()
    return (exe, "-rn", "--") if ok else ()


@dataclass
class _Output:
    deadline: float  # time.monotonic() by which the program must have ended
    out: bytearray = field(default_factory=bytearray)  # the head of stdout, after the ready byte
    err: bytearray = field(default_factory=bytearray)  # the tail of stderr: a traceback's end
    truncated: bool = False
    started: bool = False  # the ready byte came
    timed_out: bool = False
    flooded: bool = False  # killed for printing past the hard cap


class PythonTool:
    """Runs Python code in a sandbox and returns what it printed (see the module docstring)."""

    name = "python"

    def __init__(self, timeout_s: float = 5.0, cpu_s: float | None = None, memory_mb: int = 256,
                 max_output_bytes: int = 8192, scratch_root: str | None = None) -> None:
        if not _positive(timeout_s):
            raise ValueError(f"timeout_s must be a positive number of seconds, got {timeout_s!r}")
        if cpu_s is not None and not _positive(cpu_s):
            raise ValueError(f"cpu_s must be None (= timeout_s) or a positive number of seconds, got {cpu_s!r}")
        if not _positive(memory_mb, int) or memory_mb < 64:
            raise ValueError(f"memory_mb must be an integer >= 64 (Python itself needs ~20 MB), got {memory_mb!r}")
        if not _positive(max_output_bytes, int):
            raise ValueError(f"max_output_bytes must be a positive integer, got {max_output_bytes!r}")
        if scratch_root is not None and not os.path.isdir(scratch_root):
            raise ValueError(f"scratch_root must be None (the system temp folder) or an existing folder, got {scratch_root!r}")
        self.timeout_s = float(timeout_s)
        self.cpu_s = float(cpu_s if cpu_s is not None else timeout_s)
        self.memory_mb = memory_mb
        self.max_output_bytes = max_output_bytes
        self.scratch_root = scratch_root

    def __call__(self, code: str) -> str:
        try:
            root = tempfile.mkdtemp(prefix="rlfusion-python-", dir=self.scratch_root)
        except OSError as e:
            raise ToolError(f"python: cannot make a scratch folder: {e}") from e
        try:
            scratch = os.path.join(os.path.realpath(root), "scratch")
            os.mkdir(scratch)
            code_path = os.path.join(root, "code.py")  # beside the scratch folder: not writable
            with open(code_path, "w", encoding="utf-8", errors="replace") as f:
                f.write(code)
            return self._run(scratch, code_path)
        finally:
            _remove_tree(root)

    def _run(self, scratch: str, code_path: str) -> str:
        namespace = _namespace_cmd() if _NAMESPACE else ()
        cpu = math.ceil(self.cpu_s)
        limits = {"RLIMIT_CPU": (cpu, cpu + 1), "RLIMIT_AS": (self.memory_mb << 20,) * 2,
                  "RLIMIT_FSIZE": (16 << 20,) * 2, "RLIMIT_NOFILE": (64, 64), "RLIMIT_CORE": (0, 0)}
        if namespace:
            limits["RLIMIT_NPROC"] = (_NPROC, _NPROC)
        settings = {"limits": limits, "code": code_path, "scratch": scratch, "memory_mb": self.memory_mb}
        # -I: no PYTHON* variables, user site or script folder on sys.path; -B: no .pyc writes
        # (refused outside scratch anyway); -u: what was printed before a kill still arrives.
        cmd = [*namespace, sys.executable, "-I", "-B", "-u", "-c", _BOOTSTRAP, json.dumps(settings)]
        env = {"PATH": "/usr/bin:/bin", "HOME": scratch, "TMPDIR": scratch, "LANG": "C.UTF-8",
               # one malloc arena, one BLAS thread: the address space they reserve counts to RLIMIT_AS
               "MALLOC_ARENA_MAX": "1", "OMP_NUM_THREADS": "1", "OPENBLAS_NUM_THREADS": "1"}
        try:
            proc = subprocess.Popen(cmd, stdin=subprocess.DEVNULL, stdout=subprocess.PIPE,
                                    stderr=subprocess.PIPE, cwd=scratch, env=env, start_new_session=True)
        except OSError as e:
            raise ToolError(f"python: cannot start the sandbox ({cmd[0]}): {e}") from e
        try:
            result = self._collect(proc)
            if not (result.timed_out or result.flooded) and not _ended(proc.pid, result.deadline):
                result.timed_out = True  # it closed its output but kept running
        finally:
            _kill_group(proc)  # a program past its time, or anything it left behind
        if not result.started:
            tail = result.err[-500:].decode("utf-8", "replace").strip()
            why = "did not start in time" if result.timed_out else f"exited with status {proc.returncode}"
            raise ToolError(f"python: the sandbox {why} before running the code: {tail}")
        return self._observation(result, proc.returncode)

    def _collect(self, proc: subprocess.Popen) -> _Output:
        """Reads stdout and stderr as they come until both close, the deadline passes or the
        output passes the hard cap, keeping at most max_output_bytes of each."""
        keep, hard_cap = self.max_output_bytes, max(_HARD_CAP, 8 * self.max_output_bytes)
        result, total = _Output(deadline=time.monotonic() + self.timeout_s + _START_GRACE_S), 0
        with selectors.DefaultSelector() as sel:
            sel.register(proc.stdout, selectors.EVENT_READ, result.out)
            sel.register(proc.stderr, selectors.EVENT_READ, result.err)
            while sel.get_map() and total <= hard_cap:
                left = result.deadline - time.monotonic()
                if left <= 0:
                    result.timed_out = True
                    break
                for key, _ in sel.select(left):
                    chunk = os.read(key.fd, 1 << 16)
                    if not chunk:
                        sel.unregister(key.fileobj)
                        continue
                    total += len(chunk)
                    if key.data is result.err:
                        result.err += chunk
                        result.truncated |= len(result.err) > keep
                        del result.err[:-keep]
                        continue
                    if not result.started and chunk[:1] == _READY:  # nothing prints before it
                        result.started, chunk = True, chunk[1:]
                        result.deadline = time.monotonic() + self.timeout_s  # the user's time
                    if result.started:
                        room = keep - len(result.out)
                        result.out += chunk[:room]
                        result.truncated |= len(chunk) > room
        result.flooded = total > hard_cap
        return result

    def _observation(self, result: _Output, returncode: int) -> str:
        """stdout, then the end of stderr, within max_output_bytes; then how the program ended."""
        out, err, limit = bytes(result.out), bytes(result.err), self.max_output_bytes
        if out and err and not out.endswith(b"\n"):
            out += b"\n"
        if len(out) + len(err) > limit:
            err = err[-max(limit // 2, limit - len(out)):]
            out, result.truncated = out[:limit - len(err)], True
        notes = [_TRUNCATED] if result.truncated or result.flooded else []
        if result.timed_out:
            notes.append(f"[timed out after {self.timeout_s:g} s; process killed]")
        elif result.flooded:
            notes.append("[process killed: it printed too much]")
        elif returncode == -signal.SIGXCPU:
            notes.append(f"[timed out: CPU time limit of {math.ceil(self.cpu_s)} s exceeded; process killed]")
        elif returncode == -signal.SIGKILL:
            notes.append("[killed by SIGKILL: CPU time or memory limit]")
        elif returncode < 0:
            notes.append(f"[killed by signal {signal.Signals(-returncode).name}]")
        elif returncode > 0:
            notes.append(f"[exit status {returncode}]")
        text = (out + err).decode("utf-8", "replace")
        if notes and text and not text.endswith("\n"):
            text += "\n"
        return text + "\n".join(notes)


def _ended(pid: int, deadline: float) -> bool:
    """Whether the process ends by `deadline`. It is left unreaped, so that its pid, the id of
    its process group, cannot pass to a stranger before `_kill_group`."""
    while os.waitid(os.P_PID, pid, os.WEXITED | os.WNOHANG | os.WNOWAIT) is None:
        if time.monotonic() >= deadline:
            return False
        time.sleep(0.002)
    return True


def _kill_group(proc: subprocess.Popen) -> None:
    try:
        os.killpg(proc.pid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):  # the group is gone already
        pass
    proc.wait()
    proc.stdout.close()
    proc.stderr.close()


def _remove_tree(root: str) -> None:
    """Deletes a scratch folder, also where the program took away its own permissions."""
    for folder, subfolders, _ in os.walk(root):
        for name in subfolders:
            try:
                os.chmod(os.path.join(folder, name), 0o700)
            except OSError:
                pass
    shutil.rmtree(root, ignore_errors=True)


def _positive(x: object, kind: type | tuple[type, ...] = (int, float)) -> bool:
    """A positive finite number of `kind` (never a bool)."""
    return isinstance(x, kind) and not isinstance(x, bool) and math.isfinite(x) and x > 0
