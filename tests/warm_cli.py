"""The CLI run as a fork of a warm process: ``warm_cli.run`` is ``subprocess.run`` for a test's
``finetune`` command, less the ~4-6 s a fresh interpreter spends importing torch, transformers,
PEFT and mlx-lm.

A server (started at a worker's first such command) imports those libraries and this checkout's
modules once, with the command's environment, then waits on a Unix socket. Each run is a fork of
it with the command's own argv, environment, working directory, umask and standard streams (the
caller's descriptors, passed over the socket), its own process group, Python's default signal
handlers, and the interpreter's exit (non-daemon threads joined, atexit handlers run, streams
flushed). The test reads a ``CompletedProcess`` as from ``subprocess.run``.

A command goes to a fresh process instead, with exactly the arguments given, wherever the fork
could differ from one:
- any keyword but env, cwd, capture_output, text/universal_newlines/encoding/errors, input,
  stdin/stdout/stderr, timeout and check (``preexec_fn``, ``start_new_session``, ...);
- a command that is not the console script ``finetune``/``finetune-export``/``finetune-report``
  or ``python -m finetune...`` with no interpreter option;
- ``--debug``, which shows what the libraries say while imported;
- an environment no server was started with: servers are started with the worker's own
  environment, and with one a test gives its commands (HF_HUB_OFFLINE, PYTHONPATH, TMPDIR...)
  from the second command that has it; variables outside ``_SAFE`` are read by libraries when
  imported, so an environment differing in any of them never shares a server;
- a server whose imports wrote anything to stderr (the fresh process would show the line to the
  test), or that could not start.

So tests whose subject is the process start itself (what a refusal imports, the describe-once
profile, signals to a process group, the umask) keep ``subprocess`` and fresh interpreters.
``FINETUNE_TEST_FRESH=1`` sends every command to a fresh process, the suite as it ran before;
``FINETUNE_WARM_LOG=<file>`` appends each worker's tally of forks and fresh commands.
"""

from __future__ import annotations

import atexit
import importlib.metadata
import json
import locale
import os
import signal
import socket
import subprocess
import sys
import sysconfig
import tempfile
import time
from pathlib import Path
from typing import Any

# Variables read when a command runs, not when a library is imported, so a fork may differ in them.
_SAFE_PREFIXES = ("FINETUNE_", "WANDB_", "MLFLOW_")
# COMP_LINE, COMP_POINT: read by the completion that answers. PYTORCH_CUDA_ALLOC_CONF: torch
# reads it at the CUDA allocator's first allocation, which a CPU-only process never makes before
# the run (backends/cuda/load.py sets it before then); _TORCHINDUCTOR_PYOBJECT_TENSOR_DATA_PTR:
# read by a compiled kernel when it runs. Set in the worker by code a test runs there, and read at
# import only for what no test's command does: HF_XET_HIGH_PERFORMANCE (lm_eval's import sets it;
# huggingface_hub reads it for Xet downloads, and the suite is offline), KMP_DUPLICATE_LIB_OK
# (torch's inductor sets it; read by Intel's OpenMP runtime, where torch's Linux CPU wheel loads
# GNU's).
_SAFE = {"HF_XET_HIGH_PERFORMANCE", "KMP_DUPLICATE_LIB_OK", "TOKENIZERS_PARALLELISM",
         "HYDRA_FULL_ERROR", "COMP_LINE", "COMP_POINT", "COLUMNS", "LINES", "NO_COLOR",
         "FORCE_COLOR", "TERM", "PYTEST_CURRENT_TEST", "PYTORCH_CUDA_ALLOC_CONF",
         "PYTORCH_ALLOC_CONF", "_TORCHINDUCTOR_PYOBJECT_TENSOR_DATA_PTR"}
_KWARGS = {"env", "cwd", "capture_output", "text", "universal_newlines", "encoding", "errors",
           "input", "stdin", "stdout", "stderr", "timeout", "check"}
# the console scripts as installed (pyproject.toml's [project.scripts]): name -> "module:attr"
_SCRIPTS = {ep.name: ep.value for ep in importlib.metadata.entry_points(group="console_scripts")
            if ep.dist is not None and ep.dist.name == "finetune"}
# What a run imports that takes the time: the libraries, then this checkout's run path.
_WARM = ("torch", "transformers", "transformers.modeling_utils", "transformers.models.auto",
         "transformers.models.qwen2.modeling_qwen2", "peft", "bitsandbytes", "accelerate",
         "matplotlib.figure", "matplotlib.backends.backend_agg", "hydra", "omegaconf",
         "mlx.core", "mlx_lm", "finetune.cli", "finetune.run.loop", "finetune.export",
         "finetune.report", "finetune.backends.cuda.runtime", "finetune.backends.mlx.runtime")

forks = 0  # runs served by a fork in this process
fork_cpu = 0.0  # their CPU seconds
fresh: list[str] = []  # why each other command went to a fresh process


def _report() -> None:
    """$FINETUNE_WARM_LOG: append this process's tally (forks, and each fresh command's reason)."""
    if (path := os.environ.get("FINETUNE_WARM_LOG")) and (forks or fresh):
        with open(path, "a") as f:
            f.write(json.dumps({"pid": os.getpid(), "forks": forks, "fork_cpu": fork_cpu,
                                "starts": starts,
                                "servers": [(s.why, s.uses) for s in started], "fresh": fresh}) + "\n")


atexit.register(_report)


def _safe(key: str) -> bool:
    return key in _SAFE or key.startswith(_SAFE_PREFIXES)


def _target(cmd: list[str]) -> tuple[str, str, str] | None:
    """(kind, what, sys.path[0]) for a command a fork can run, else None."""
    if not cmd:
        return None
    exe = cmd[0]
    name = Path(exe).name
    if name in _SCRIPTS and Path(exe).parent == Path(sysconfig.get_path("scripts")) \
            and Path(exe).is_file():
        return "script", _SCRIPTS[name], str(Path(exe).parent)
    if exe == sys.executable and len(cmd) >= 3 and cmd[1] == "-m" \
            and cmd[2].split(".")[0] == "finetune":
        return "module", cmd[2], ""
    return None


class _Server:
    def __init__(self, env: dict[str, str]) -> None:
        self.dir = tempfile.mkdtemp(prefix="warm-cli-")
        self.path = os.path.join(self.dir, "s")
        self.err = os.path.join(self.dir, "imports.err")
        with open(self.err, "wb") as err:
            self.proc = subprocess.Popen([sys.executable, __file__, self.path], env=env,
                                         stdin=subprocess.DEVNULL, stdout=err, stderr=err,
                                         start_new_session=True)
        atexit.register(self.close)
        self.ready: bool | None = None
        self.uses = 0
        self.why = ""

    def wait_ready(self) -> bool:
        if self.ready is None:
            deadline = time.monotonic() + 120
            while not os.path.exists(self.path + ".ready") and self.proc.poll() is None \
                    and time.monotonic() < deadline:
                time.sleep(0.05)
            self.ready = os.path.exists(self.path + ".ready") and os.path.getsize(self.err) == 0
        return self.ready

    def close(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait()


_servers: dict[tuple[tuple[str, str], ...], _Server] = {}  # by environment, the latest used last
_seen: set[tuple[tuple[str, str], ...]] = set()
_MAX_SERVERS = 2  # alive at once in a worker (~0.5 GB each)
_MAX_STARTS = 12  # started over a worker's life
starts = 0
started: list[_Server] = []


def _key(env: dict[str, str]) -> tuple[tuple[str, str], ...]:
    return tuple(sorted((k, v) for k, v in env.items() if not _safe(k)))


def _server_for(env: dict[str, str]) -> tuple[_Server | None, str]:
    """The warm server a command with this environment forks from, else (None, why).

    A server is started with the command's own environment, outside _SAFE, exactly as a fresh
    interpreter would get it, so its imports read what the fresh process's would: the worker's
    own environment (which drifts as tests run code in the worker: lm_eval's import sets
    HF_XET_HIGH_PERFORMANCE, torch's inductor KMP_DUPLICATE_LIB_OK), or an environment a test
    gives its commands (HF_HUB_OFFLINE, PYTHONPATH, TMPDIR) once it is seen a second time."""
    global starts
    if os.environ.get("FINETUNE_TEST_FRESH") == "1":
        return None, "FINETUNE_TEST_FRESH=1"
    key, own = _key(env), _key(dict(os.environ))
    server = _servers.pop(key, None)
    if server is None:
        # what sets this environment apart from the worker's own
        why = ",".join(sorted(k for k in set(env) | set(os.environ)
                              if env.get(k) != os.environ.get(k) and not _safe(k)))
        if key != own and key not in _seen:
            _seen.add(key)
            return None, "an environment of its own, first seen: " + why
        if starts >= _MAX_STARTS:
            return None, f"{_MAX_STARTS} servers started already"
        starts += 1
        server = _Server(env)
        server.why = why or "the worker's own"
        started.append(server)
    _servers[key] = server
    while len(_servers) > _MAX_SERVERS:  # the least recently used, keeping the worker's own
        _servers.pop(next(k for k in _servers if k != own)).close()
    if not server.wait_ready():
        return None, "the warm server did not start quietly: " + Path(server.err).read_text()[-300:]
    return server, ""


def _fd(spec: Any, default: int, opened: list[Any]) -> int:
    if spec is None:
        return default
    if spec == subprocess.DEVNULL:
        f = open(os.devnull, "r+b")
        opened.append(f)
        return f.fileno()
    if spec == subprocess.PIPE:
        f = tempfile.TemporaryFile()
        opened.append(f)
        return f.fileno()
    return spec if isinstance(spec, int) else spec.fileno()


def run(cmd: list[str], **kw: Any) -> subprocess.CompletedProcess:
    """``subprocess.run(cmd, **kw)``, as a fork of the warm server where it would not differ."""
    global forks
    cmd = [str(c) for c in cmd]
    target = _target(cmd)
    extra = set(kw) - _KWARGS
    env = {k: str(v) for k, v in (kw.get("env") if kw.get("env") is not None else os.environ).items()}
    why = ("keywords " + ",".join(sorted(extra))) if extra else "" if target else "not a CLI command"
    if not why and "--debug" in cmd:
        why = "--debug shows what the server's imports said"
    server = None
    if not why:
        server, why = _server_for(env)
    if server is None:
        fresh.append(f"{' '.join(cmd[:3])[:80]}: {why}")
        return subprocess.run(cmd, **kw)
    forks += 1
    server.uses += 1
    text = bool(kw.get("text") or kw.get("universal_newlines") or kw.get("encoding") or kw.get("errors"))
    stdout = subprocess.PIPE if kw.get("capture_output") else kw.get("stdout")
    stderr = subprocess.PIPE if kw.get("capture_output") else kw.get("stderr")
    opened: list[Any] = []
    try:
        if kw.get("input") is not None:
            f = tempfile.TemporaryFile()
            opened.append(f)
            data = kw["input"]
            f.write(data.encode(kw.get("encoding") or locale.getpreferredencoding(False)) if isinstance(data, str) else data)
            f.seek(0)
            fd_in = f.fileno()
        else:
            fd_in = _fd(kw.get("stdin"), 0, opened)
        fd_out = _fd(stdout, 1, opened)
        out_file = opened[-1] if stdout == subprocess.PIPE else None
        fd_err = fd_out if stderr == subprocess.STDOUT else _fd(stderr, 2, opened)
        err_file = opened[-1] if stderr == subprocess.PIPE else None
        umask = os.umask(0o022)
        os.umask(umask)
        msg = {"argv": cmd, "target": target, "env": env, "umask": umask,
               "cwd": os.path.abspath(str(kw.get("cwd") or os.getcwd()))}
        code, timed_out = _ask(server, msg, [fd_in, fd_out, fd_err], kw.get("timeout"))

        def read(f: Any) -> Any:
            if f is None:
                return None
            f.seek(0)
            data = f.read()
            if not text:
                return data
            s = data.decode(kw.get("encoding") or locale.getpreferredencoding(False), kw.get("errors") or "strict")
            return s.replace("\r\n", "\n").replace("\r", "\n")
        out, err = read(out_file), read(err_file)
    finally:
        for f in opened:
            f.close()
    if timed_out:
        raise subprocess.TimeoutExpired(cmd, kw["timeout"], out, err)
    done = subprocess.CompletedProcess(cmd, code, out, err)
    if kw.get("check"):
        done.check_returncode()
    return done


def _ask(server: _Server, msg: dict[str, Any], fds: list[int], timeout: float | None) -> tuple[int, bool]:
    global fork_cpu
    with socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET) as s:
        s.connect(server.path)
        socket.send_fds(s, [json.dumps(msg).encode()], fds)
        pid = json.loads(s.recv(4096))["pid"]
        s.settimeout(timeout)
        try:
            reply = json.loads(s.recv(4096))
            fork_cpu += reply["cpu"]
            return reply["code"], False
        except socket.timeout:
            try:
                os.killpg(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
            s.settimeout(None)
            return json.loads(s.recv(4096))["code"], True


# ---- the server ----------------------------------------------------------------------------

def _serve(path: str) -> None:
    import logging
    import warnings

    from finetune import quiet

    # The CLI silences known third-party lines before it imports their libraries (quiet.install);
    # a line one of them logs while imported (bitsandbytes' 'kernels-community' on a CPU) is
    # dropped here the same way, and the filters removed again, so that the fork starts as bare
    # as a fresh interpreter (commands with --debug, which shows those lines, run fresh).
    before = dict(os.environ)
    names = [n for n, *_ in quiet.LOG_FILTERS + quiet.INFO_ONLY]
    saved = [(logging.getLogger(n), list(logging.getLogger(n).filters), logging.getLogger(n).level)
             for n in names]
    saved_warnings = list(warnings.filters)
    quiet.install()
    import gc

    gc.disable()  # the imports make long-lived objects: the collections they set off rescanned them all
    for name in _WARM:
        try:
            importlib.import_module(name)
        except ImportError:
            pass
    gc.enable()
    for logger, filters, level in saved:
        logger.filters[:] = filters
        logger.setLevel(level)
    warnings.filters[:] = saved_warnings
    warnings._filters_mutated()  # type: ignore[attr-defined]
    sys.stderr.flush()
    parent = os.getppid()
    lsock = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
    lsock.bind(path)
    lsock.listen(4)
    lsock.settimeout(2.0)
    added = {k: v for k, v in os.environ.items() if before.get(k) != v}  # what the imports set
    # The imported modules' objects out of the collector's reach: a fork's collections would
    # otherwise walk them all, copying every page of the server's heap into the fork
    gc.collect()
    gc.freeze()
    Path(path + ".ready").touch()
    while True:
        try:
            conn, _ = lsock.accept()
        except socket.timeout:
            if os.getppid() != parent:  # the pytest worker is gone
                return
            continue
        with conn:
            data, fds, _, _ = socket.recv_fds(conn, 1 << 20, 3)
            msg = json.loads(data)
            msg["env"] = {**{k: v for k, v in added.items() if k not in msg["env"]}, **msg["env"]}
            pid = os.fork()
            if pid == 0:
                lsock.close()
                conn.close()
                _child(msg, fds)  # never returns
            for fd in fds:
                os.close(fd)
            conn.sendall(json.dumps({"pid": pid}).encode())
            _, status, usage = os.wait4(pid, 0)
            try:
                conn.sendall(json.dumps({"code": os.waitstatus_to_exitcode(status),
                                         "cpu": usage.ru_utime + usage.ru_stime}).encode())
            except OSError:
                pass


def _child(msg: dict[str, Any], fds: list[int]) -> None:
    code = 1
    try:
        os.setpgid(0, 0)
        for i, fd in enumerate(fds):
            os.dup2(fd, i)
        for fd in set(fds):
            if fd > 2:
                os.close(fd)
        signal.signal(signal.SIGINT, signal.default_int_handler)
        signal.signal(signal.SIGTERM, signal.SIG_DFL)
        os.umask(msg["umask"])
        os.chdir(msg["cwd"])
        os.environ.clear()
        os.environ.update(msg["env"])
        kind, what, path0 = msg["target"]
        sys.path[0] = path0 or msg["cwd"]
        try:
            import numpy

            numpy.random.seed()
        except ImportError:
            pass
        try:
            if kind == "script":  # as the console script's wrapper: sys.exit(main())
                sys.argv = msg["argv"]
                mod, _, attr = what.partition(":")
                sys.exit(getattr(importlib.import_module(mod), attr)())
            else:
                import runpy

                sys.argv = [msg["argv"][0]] + msg["argv"][3:]
                # a fresh `python -m finetune.cli` has not imported the module it runs (the
                # package's __init__ imports none of its modules); the server has, and runpy
                # would warn that it found it in sys.modules
                sys.modules.pop(what, None)
                runpy.run_module(what, run_name="__main__", alter_sys=True)
                code = 0
        except SystemExit as e:
            if e.code is None:
                code = 0
            elif isinstance(e.code, int):
                code = e.code
            else:
                print(e.code, file=sys.stderr)
                code = 1
        except KeyboardInterrupt:
            sys.excepthook(*sys.exc_info())
            code = -signal.SIGINT
        except BaseException:
            sys.excepthook(*sys.exc_info())
            code = 1
        import threading

        threading._shutdown()  # type: ignore[attr-defined]  # as the interpreter's exit does
        atexit._run_exitfuncs()
        for stream in (sys.stdout, sys.stderr):
            try:
                stream.flush()
            except (OSError, ValueError):
                pass
    finally:
        if code == -signal.SIGINT:
            signal.signal(signal.SIGINT, signal.SIG_DFL)
            os.kill(os.getpid(), signal.SIGINT)
        os._exit(code & 0xFF)


if __name__ == "__main__":
    _serve(sys.argv[1])
