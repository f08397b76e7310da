"""Launch `python -m <module> ...` or `python <script> ...` as a fork of a warm interpreter.

A test that runs the command line (`python -m titan_rl.train ...`) pays ~7 s of imports
(torch, TorchTitan, vLLM) before the run's first line of work, and the suite makes more
than a hundred such runs. Each pytest worker keeps one interpreter that imported those once
(the zygote, `python tests/_zygote.py SOCKET`, single-threaded, no torch op run); a launch
forks it, and the child runs the module or script as `__main__` with the request's argv,
working folder, environment and stdio, and ends through the interpreter's exit, as a fresh
process would.
What differs from a fresh process: modules imported already (their import-time messages
went to the zygote's stderr, so a test of what the console shows launches with
`fork=False`), and variables read at import (the request falls back to a real process when
its environment differs from the zygote's in anything but OMP_NUM_THREADS, which
titan_rl.train applies itself through torch.set_num_threads, PYTHONUNBUFFERED (the children
write unbuffered) and PYTEST_CURRENT_TEST, which pytest changes with every test: a request
that copies os.environ carries it, and keyed on it a worker's zygote served only the test
that started it while every later launch paid a fresh interpreter's imports).

`run` is subprocess.run and `popen` subprocess.Popen for the arguments the tests use;
`torchrun(n, cmd)` is `torchrun --nproc_per_node=n` for a command the zygote can fork: n
children with torchrun's rank variables (rank 0 hosts the rendezvous store, as a plain
env:// launch does), their output joined in rank order, the others killed when one fails.
"""

from __future__ import annotations

import atexit
import json
import os
import select
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time

PRELOAD = ("titan_rl.train", "titan_rl.config", "titan_rl.validation", "titan_rl.rl.trainer", "titan_rl.titan.build",
           "titan_rl.checkpoint", "titan_rl.summary", "titan_rl.vllm.engine", "titan_rl.vllm.model",
           "titan_rl.vllm.sampling", "titan_rl.vllm.weight_transfer", "titan_rl.eval", "titan_rl.parity",
           "vllm.entrypoints.llm", "vllm.sampling_params", "vllm.v1.worker.cpu_worker",
           "vllm.v1.worker.cpu_model_runner")
# torchrun's variables for one rank (`torchrun` below sets them per child; nothing preloaded reads them)
_RANK_KEYS = ("RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE", "GROUP_RANK", "MASTER_ADDR", "MASTER_PORT")
_FREE_KEYS = {"OMP_NUM_THREADS", "PYTHONUNBUFFERED", "PYTEST_CURRENT_TEST", *_RANK_KEYS}
_ZYGOTES: dict[tuple, "_Zygote"] = {}  # one per worker: its environment is the first request's


def _key(env: dict) -> tuple:
    return tuple(sorted((k, v) for k, v in env.items() if k not in _FREE_KEYS))


def _target(cmd) -> list[str] | None:
    """The argv a child runs (module form: ['-m', name, ...]), or None if not forkable."""
    cmd = [str(c) for c in cmd]
    if len(cmd) < 2 or os.path.realpath(cmd[0]) != os.path.realpath(sys.executable):
        return None
    if cmd[1] == "-m" and len(cmd) > 2:
        return cmd[1:]
    if cmd[1].endswith(".py") and os.path.isfile(cmd[1]):
        return cmd[1:]
    return None


class _Zygote:
    def __init__(self, env: dict):
        self.dir = tempfile.mkdtemp(prefix="titan_rl_zygote_")
        self.path = os.path.join(self.dir, "sock")
        self.log = open(os.path.join(self.dir, "stderr"), "wb")
        self.proc = subprocess.Popen([sys.executable, __file__, self.path], env=env, stdin=subprocess.DEVNULL,
                                     stdout=self.log, stderr=self.log)
        deadline = time.time() + 240
        while not os.path.exists(self.path):
            if self.proc.poll() is not None or time.time() > deadline:
                raise RuntimeError(f"the zygote did not start: {open(self.log.name).read()[-3000:]}")
            time.sleep(0.05)

    def close(self):
        if self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait()
        self.log.close()
        shutil.rmtree(self.dir, ignore_errors=True)


def _zygote_for(env: dict) -> _Zygote | None:
    if os.environ.get("TITAN_RL_TESTS_NO_FORK"):
        return None
    key = _key(env)
    if not _ZYGOTES:
        _ZYGOTES[key] = _Zygote({**env, "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1"})
    zygote = _ZYGOTES.get(key)  # None for another environment (a masked CPU, torchrun's variables)
    if zygote is not None and zygote.proc.poll() is not None:
        raise RuntimeError(f"the zygote exited ({zygote.proc.returncode}): {open(zygote.log.name).read()[-3000:]}")
    return zygote


@atexit.register
def _close_all():
    for z in _ZYGOTES.values():
        z.close()


class Forked:
    """The Popen attributes the tests use, for a child of the zygote."""

    def __init__(self, zygote: _Zygote, argv: list[str], env: dict, cwd, stdin, stdout, stderr, text: bool):
        self.args, self.returncode = [sys.executable, *argv], None
        self.stdout = self.stderr = None
        fds, close_after = [], []

        def target(spec, what):
            if spec == subprocess.PIPE:
                r, w = os.pipe()
                setattr(self, what, os.fdopen(r, "r" if text else "rb"))
                close_after.append(w)
                return w
            if spec == subprocess.DEVNULL or spec is None:  # None: like DEVNULL (the tests never inherit)
                fd = os.open(os.devnull, os.O_RDWR)
                close_after.append(fd)
                return fd
            return spec.fileno() if hasattr(spec, "fileno") else spec

        fds.append(target(stdin if stdin is not None else subprocess.DEVNULL, "_stdin"))
        fds.append(target(stdout, "stdout"))
        fds.append(fds[1] if stderr == subprocess.STDOUT else target(stderr, "stderr"))
        self._sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        self._sock.connect(zygote.path)
        msg = json.dumps({"argv": argv, "env": env, "cwd": str(cwd or os.getcwd())}).encode() + b"\n"
        socket.send_fds(self._sock, [msg], fds)
        for fd in close_after:
            os.close(fd)
        self._buf = b""
        self.pid = self._read_line()["pid"]

    def _read_line(self, timeout=None) -> dict | None:
        while b"\n" not in self._buf:
            if timeout is not None and not select.select([self._sock], [], [], timeout)[0]:
                return None
            chunk = self._sock.recv(4096)
            if not chunk:
                raise RuntimeError("the zygote went away")
            self._buf += chunk
        line, self._buf = self._buf.split(b"\n", 1)
        return json.loads(line)

    def poll(self):
        if self.returncode is None:
            msg = self._read_line(timeout=0)
            if msg is not None:
                self.returncode = msg["status"]
                self._sock.close()
        return self.returncode

    def wait(self, timeout=None):
        if self.returncode is None:
            msg = self._read_line(timeout=timeout)
            if msg is None:
                raise subprocess.TimeoutExpired(self.args, timeout)
            self.returncode = msg["status"]
            self._sock.close()
        return self.returncode

    def communicate(self, timeout=None):
        """(stdout, stderr) read to the end, then the exit status."""
        got = {}
        readers = [threading.Thread(target=lambda n=n, f=f: got.__setitem__(n, f.read()), daemon=True)
                   for n, f in (("stdout", self.stdout), ("stderr", self.stderr)) if f is not None]
        for t in readers:
            t.start()
        self.wait(timeout=timeout)
        for t in readers:
            t.join()
        for f in (self.stdout, self.stderr):
            if f is not None:
                f.close()
        return got.get("stdout"), got.get("stderr")

    def send_signal(self, sig):
        if self.returncode is None:
            try:
                os.kill(self.pid, sig)
            except ProcessLookupError:
                pass

    def kill(self):
        self.send_signal(signal.SIGKILL)

    def terminate(self):
        self.send_signal(signal.SIGTERM)


def _forkable(cmd, env: dict, fork: bool) -> tuple[_Zygote, list[str]] | None:
    argv = _target(cmd) if fork else None
    zygote = _zygote_for(env) if argv else None
    return None if zygote is None else (zygote, argv)


def popen(cmd, *, env=None, cwd=None, stdin=None, stdout=None, stderr=None, text=False, fork=True):
    env = dict(os.environ if env is None else env)
    target = _forkable(cmd, env, fork)
    if target is None:
        return subprocess.Popen(cmd, env=env, cwd=cwd, stdin=stdin, stdout=stdout, stderr=stderr, text=text)
    return Forked(*target, env, cwd, stdin, stdout, stderr, text)


def run(cmd, *, env=None, cwd=None, timeout=None, capture_output=False, text=False, stdout=None, stderr=None,
        fork=True):
    env = dict(os.environ if env is None else env)
    if capture_output:
        stdout = stderr = subprocess.PIPE
    target = _forkable(cmd, env, fork)
    if target is None:
        return subprocess.run(cmd, env=env, cwd=cwd, timeout=timeout, stdout=stdout, stderr=stderr, text=text)
    p = Forked(*target, env, cwd, None, stdout, stderr, text)
    try:
        out, err = p.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        p.kill()
        p.wait()
        raise
    return subprocess.CompletedProcess(p.args, p.returncode, out, err)


def torchrun(nproc: int, cmd, *, env=None, cwd=None, timeout=None) -> subprocess.CompletedProcess:
    """`torchrun --nproc_per_node=nproc <cmd without the interpreter>` with captured text
    output; `cmd` is [sys.executable, "-m", module, ...] or [sys.executable, script, ...]."""
    from titan_rl.launch import free_port

    env = dict(os.environ if env is None else env)
    port = free_port()
    target = _forkable(cmd, env, True)
    if target is None:
        tr = os.path.join(os.path.dirname(sys.executable), "torchrun")
        return subprocess.run([tr, f"--nproc_per_node={nproc}", f"--master_port={port}", *[str(c) for c in cmd[1:]]],
                              env=env, cwd=cwd, timeout=timeout, capture_output=True, text=True)
    ranks = [Forked(*target, {**env, "RANK": str(r), "LOCAL_RANK": str(r), "WORLD_SIZE": str(nproc),
                              "LOCAL_WORLD_SIZE": str(nproc), "GROUP_RANK": "0", "MASTER_ADDR": "127.0.0.1",
                              "MASTER_PORT": str(port), "OMP_NUM_THREADS": env.get("OMP_NUM_THREADS", "1")},
                    cwd, None, subprocess.PIPE, subprocess.PIPE, True) for r in range(nproc)]
    got: dict = {}
    readers = [threading.Thread(target=lambda k=(r, n), f=f: got.__setitem__(k, f.read()), daemon=True)
               for r, p in enumerate(ranks) for n, f in (("out", p.stdout), ("err", p.stderr))]
    for t in readers:
        t.start()
    deadline = None if timeout is None else time.time() + timeout
    failed_at = None
    while any(p.poll() is None for p in ranks):
        if failed_at is None and any(p.returncode not in (None, 0) for p in ranks):
            failed_at = time.time()  # torchrun stops the other ranks once one fails
        if (failed_at is not None and time.time() > failed_at + 5) or (deadline and time.time() > deadline):
            for p in ranks:
                p.kill()
            for p in ranks:
                p.wait()
            if failed_at is None:
                raise subprocess.TimeoutExpired(cmd, timeout)
            break
        time.sleep(0.05)
    for t in readers:
        t.join()
    codes = [p.returncode for p in ranks]
    code = next((c for c in codes if c not in (0, None)), 0)
    join = lambda n: "".join(got[(r, n)] or "" for r in range(nproc))  # noqa: E731
    done = subprocess.CompletedProcess(cmd, code, join("out"), join("err"))
    done.rank_codes = codes  # each rank's own: a rank that aborted hides behind rank 0's echo of it
    done.rank_stderr = [got[(r, "err")] or "" for r in range(nproc)]  # and what each printed itself
    return done


# ---------------------------------------------------------------- the zygote process


def _child(conn, listener, msg: dict, fds: list[int]) -> None:
    import random
    import runpy
    import traceback

    listener.close()
    conn.close()
    for i, fd in enumerate(fds):
        os.dup2(fd, i)
        os.close(fd)
    # the zygote's environment is the request's (_key) plus what the preload set at import
    # (as a fresh process's would be by the time those imports ran)
    for k in _FREE_KEYS:
        if k in msg["env"]:
            os.environ[k] = msg["env"][k]
        else:
            os.environ.pop(k, None)
    os.chdir(msg["cwd"])
    random.seed()
    signal.signal(signal.SIGTERM, signal.SIG_DFL)
    argv = msg["argv"]
    code = 0
    try:
        if argv[0] == "-m":
            sys.argv = [argv[1], *argv[2:]]
            sys.modules.pop(argv[1], None)  # `python -m X` has X as __main__ only
            sys.path[0] = msg["cwd"]
            runpy.run_module(argv[1], run_name="__main__", alter_sys=True)
        else:
            sys.argv = list(argv)
            sys.path[0] = os.path.dirname(os.path.abspath(argv[0]))
            runpy.run_path(argv[0], run_name="__main__")
    except SystemExit as e:
        code = e.code
    except BaseException:
        traceback.print_exc()
        code = 1
    # Out of _serve and through the interpreter's own exit, as a fresh process ends: the exit
    # handlers, then the teardown (C++ destructors among it: vLLM's CPU TP shared memory is
    # unlinked there, and a name left behind makes the next run's engine fail to start). The
    # preload stays frozen: collecting it again in every child took ~1.9 s per run (2.3 s vs
    # 0.4 s for an exit), but frozen objects are never freed and nanobind reports Triton's as
    # leaks on stderr at the teardown, so stderr is closed once the exit handlers have run
    # (what a run prints is out by then; a test of the console launches with fork=False).
    # A run that built an in-process engine unfreezes at exit anyway (make_llm's exit handler,
    # there for fresh processes' consoles) and pays the collection: the gain is the others'.
    import atexit

    atexit._run_exitfuncs()
    sys.stdout.flush()
    sys.stderr.flush()
    os.dup2(os.open(os.devnull, os.O_WRONLY), 2)
    raise SystemExit(code)


def _warm_contract() -> None:
    """The installed versions every run's execution contract records (importlib.metadata,
    ~0.5 s, cached per process): computed here, every child inherits them. Not the platform
    self-check, though it is cached the same way: it runs torch ops at 2 threads, and a child
    forked after the parent has started OpenMP's thread pool hangs in its first parallel op
    (seen here: a 3000x3000 matmul never returned)."""
    from titan_rl.contract import versions

    versions()


def _serve(path: str) -> None:
    import importlib

    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # the repository, as `cd ROOT`
    from titan_rl import quiet

    quiet.install()
    for name in PRELOAD:
        importlib.import_module(name)
    from titan_rl.registry import get_architecture, list_architectures

    for name in list_architectures():  # every model folder
        get_architecture(name)
    _warm_contract()
    # The preloaded objects never die; out of the collector's sight, the gc.collect() calls a
    # run makes (vLLM's engine start makes 7) do not walk them in every child.
    import gc

    gc.freeze()
    parent = os.getppid()
    listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    listener.bind(path + ".tmp")
    listener.listen(16)
    os.rename(path + ".tmp", path)
    children: dict[int, socket.socket] = {}
    while os.getppid() == parent:
        ready = select.select([listener], [], [], 0.05)[0]
        if ready:
            conn, _ = listener.accept()
            data, fds, _, _ = socket.recv_fds(conn, 1 << 20, 3)
            while not data.endswith(b"\n"):
                data += conn.recv(1 << 20)
            msg = json.loads(data)
            sys.stdout.flush()
            sys.stderr.flush()
            pid = os.fork()
            if pid == 0:
                _child(conn, listener, msg, fds)
            for fd in fds:
                os.close(fd)
            conn.sendall(json.dumps({"pid": pid}).encode() + b"\n")
            children[pid] = conn
        while children:
            pid, status = os.waitpid(-1, os.WNOHANG)
            if pid == 0:
                break
            conn = children.pop(pid, None)
            if conn is not None:
                code = -os.WTERMSIG(status) if os.WIFSIGNALED(status) else os.WEXITSTATUS(status)
                try:
                    conn.sendall(json.dumps({"status": code}).encode() + b"\n")
                except OSError:
                    pass
                conn.close()
    for pid in children:
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass


if __name__ == "__main__":
    _serve(sys.argv[1])
