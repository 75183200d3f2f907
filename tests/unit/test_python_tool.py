"""PythonTool: output, errors and limits come back as observations; the sandbox keeps the
network and writes outside its scratch folder away, with the network namespace and with the
audit hook alone (`_NAMESPACE = False`, as on machines without user namespaces)."""

import os
import socket
import sys
import time

import pytest

from rlfusion.rl.tools import ToolError
from rlfusion.rl.tools import python_tool
from rlfusion.rl.tools.python_tool import PythonTool


@pytest.fixture(params=["namespace", "hook_only"])
def mode(request, monkeypatch):
    """Runs a test with the network namespace (where this machine has one) and without it."""
    if request.param == "namespace" and not python_tool._namespace_cmd():
        pytest.skip("no user + network namespaces on this machine")
    monkeypatch.setattr(python_tool, "_NAMESPACE", request.param == "namespace")
    return request.param


def test_prints_the_result_and_keeps_no_state():
    tool = PythonTool()
    assert tool.name == "python"
    assert tool("print(2 + 3)").strip() == "5"
    assert tool("x = 1") == ""
    assert "NameError" in tool("print(x)")  # a fresh interpreter each call


def test_an_exception_is_an_observation():
    obs = PythonTool()("def f():\n    return 1 / 0\nf()")
    assert "ZeroDivisionError: division by zero" in obs
    assert "return 1 / 0" in obs  # the user's source lines are shown
    assert "<string>" not in obs and "hook" not in obs  # the sandbox's own frames are not
    assert "SyntaxError" in PythonTool()("print(")


@pytest.mark.parametrize("code", ["while True: pass", "import time; time.sleep(30)"], ids=["busy", "sleep"])
def test_timeout_kills_the_program(code):
    start = time.monotonic()
    obs = PythonTool(timeout_s=1)(code)
    assert time.monotonic() - start < 3
    assert "timed out" in obs


def test_cpu_limit():
    start = time.monotonic()
    obs = PythonTool(timeout_s=10, cpu_s=1)("while True: pass")
    assert time.monotonic() - start < 4
    assert "CPU time limit of 1 s exceeded" in obs


def test_output_is_capped():
    start = time.monotonic()
    obs = PythonTool(max_output_bytes=1000)("print('x' * 10_000_000)")
    assert time.monotonic() - start < 3
    first, note = obs.split("\n")[:2]
    assert first == "x" * 1000 and note == "...[output truncated]"  # the head, then the note
    assert len(obs) < 1100


def test_a_long_output_keeps_the_end_of_the_traceback():
    obs = PythonTool(max_output_bytes=1000)("print('x' * 5000)\nraise KeyError('the last line')")
    assert "KeyError: 'the last line'" in obs and "[output truncated]" in obs


def test_exit_status():
    assert "exit status 3" in PythonTool()("import os\nprint('bye', flush=True)\nos._exit(3)")
    assert "exit status 4" in PythonTool()("import sys; sys.exit(4)")


def test_memory_limit():
    obs = PythonTool(memory_mb=128)("x = bytearray(1 << 30)\nprint('allocated')")
    assert "MemoryError" in obs and "memory limit of 128 MB" in obs
    assert "allocated" not in obs


def test_no_network(mode):
    with socket.create_server(("127.0.0.1", 0)) as server:
        port = server.getsockname()[1]
        obs = PythonTool()(
            "import socket\n"
            "try:\n"
            f"    socket.create_connection(('127.0.0.1', {port}), timeout=2)\n"
            "    print('connected')\n"
            "except Exception as e:\n"
            "    print('failed:', type(e).__name__, e)\n")
        assert "failed:" in obs and "connected" not in obs.replace("failed", "")
        server.setblocking(False)
        with pytest.raises(BlockingIOError):  # nothing came in
            server.accept()


def test_network_namespace(mode):
    """Beside the audit hook: with the namespace, the child is in a network namespace of its own
    whose only interface is a loopback (down), so even a socket could not reach the parent."""
    obs = PythonTool()("import os\nprint(os.readlink('/proc/self/ns/net'))\n"
                       "print(sorted(l.split(':')[0].strip() for l in open('/proc/net/dev').readlines()[2:]))")
    ns, interfaces = obs.splitlines()
    if mode == "namespace":
        assert ns != os.readlink("/proc/self/ns/net") and interfaces == "['lo']"
    else:
        assert ns == os.readlink("/proc/self/ns/net")


def test_no_writes_outside_the_scratch_folder(mode, tmp_path):
    outside = tmp_path / "outside.txt"
    obs = PythonTool()(f"open({str(outside)!r}, 'w').write('x')")
    assert "PermissionError" in obs and "outside the scratch folder" in obs
    assert not outside.exists()
    obs = PythonTool()("open('inside.txt', 'w').write('kept')\nprint(open('inside.txt').read())")
    assert obs.strip() == "kept"


ESCAPES = {  # each must end in a PermissionError from the sandbox, with nothing written
    "subprocess": "import subprocess; subprocess.run(['touch', '{out}/x'])",
    "os.system": "import os; os.system('touch {out}/x')",
    "fork_exec": "import _posixsubprocess; _posixsubprocess.fork_exec([b'/bin/touch', b'{out}/x'], "
                 "[b'/bin/touch'], True, (), None, None, -1, -1, -1, -1, -1, -1, -1, -1, False, False, "
                 "-1, None, None, None, -1, None, False)",
    "fork": "import os; os.fork()",
    "symlink": "import os; os.symlink('{out}/x', 'link')",
    "dir_fd": "import os; d = os.open('{out}', os.O_RDONLY); os.open('x', os.O_WRONLY | os.O_CREAT, dir_fd=d)",
    "dir_fd_climb": "import os; os.makedirs('a/b'); d = os.open('a/b', os.O_RDONLY)\n"
                    "os.open('../../../x', os.O_WRONLY | os.O_CREAT, dir_fd=d)",
    "chdir": "import os; os.chdir('{out}'); open('x', 'w')",
    "pathlib": "import pathlib; pathlib.Path('{out}/x').write_text('x')",
    "mkdir": "import os; os.mkdir('{out}/x')",
    "rename": "import os; os.rename('{out}/keep', 'stolen')",
    "rmtree": "import shutil; shutil.rmtree('{out}')",
    "ssl_keylog": "import ssl; ssl.create_default_context().keylog_filename = '{out}/x'",  # fopen() in C
    "kill_parent": "import os; os.kill(os.getppid(), 0)",
}


@pytest.mark.parametrize("code", ESCAPES.values(), ids=ESCAPES.keys())
def test_escape_attempts_are_refused(code, tmp_path):
    (tmp_path / "keep").write_text("keep")
    obs = PythonTool()(code.format(out=tmp_path))
    assert "PermissionError" in obs and "not allowed" in obs
    assert sorted(os.listdir(tmp_path)) == ["keep"]


def test_ctypes_cannot_be_used():
    obs = PythonTool()("import ctypes\nctypes.CDLL(None)\nprint('loaded')")
    assert "PermissionError: ctypes.dlopen is not allowed" in obs and "loaded" not in obs


@pytest.mark.parametrize("module", ["sqlite3", "readline"])
def test_modules_that_write_files_from_c_are_unavailable(module):
    obs = PythonTool()(f"import {module}")
    assert f"ImportError: _{module} is not available" in obs or f"ImportError: {module} is not available" in obs


def test_libraries_still_import():
    """numpy and sympy import ctypes for its types; that and the stdlib's reads keep working."""
    pytest.importorskip("numpy")
    pytest.importorskip("sympy")
    obs = PythonTool(timeout_s=20)("import json, math, numpy, sympy, tempfile\n"
                                   "print(numpy.arange(4).sum(), sympy.sqrt(8), math.pi > 3)\n"
                                   "with tempfile.TemporaryFile() as f: f.write(b'x')")
    assert obs.strip() == "6 2*sqrt(2) True"


def test_the_scratch_folder_is_removed(tmp_path):
    obs = PythonTool(scratch_root=str(tmp_path))("import os\nprint(os.getcwd(), os.environ['HOME'])\nopen('f', 'w')")
    cwd, home = obs.split()
    assert cwd == home and cwd.startswith(str(tmp_path.resolve()))
    assert os.listdir(tmp_path) == []


def test_a_sandbox_that_cannot_start_raises_tool_error(mode, monkeypatch):
    monkeypatch.setattr(sys, "executable", "/nonexistent/python3")
    with pytest.raises(ToolError, match="python: "):
        PythonTool()("print(1)")


@pytest.mark.parametrize("kwargs, message", [
    ({"timeout_s": 0}, "timeout_s must be a positive number"),
    ({"timeout_s": float("inf")}, "timeout_s must be a positive number"),
    ({"cpu_s": -1}, "cpu_s must be None"),
    ({"memory_mb": 16}, "memory_mb must be an integer >= 64"),
    ({"memory_mb": 256.0}, "memory_mb must be an integer"),
    ({"max_output_bytes": 0}, "max_output_bytes must be a positive integer"),
    ({"max_output_bytes": True}, "max_output_bytes must be a positive integer"),
    ({"scratch_root": "/nonexistent/folder"}, "scratch_root must be None"),
])
def test_bad_arguments(kwargs, message):
    with pytest.raises(ValueError, match=message) as info:
        PythonTool(**kwargs)
    assert "\n" not in str(info.value)
