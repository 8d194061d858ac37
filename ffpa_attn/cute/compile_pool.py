"""Compile CuTeDSL kernels in processes that never had a CUDA context, beside the calling process.

A first call that needs several kernels (a forward whose backward will run, a backward with its dQ kernel)
compiles one itself and hands the others over here; each kernel is written into the disk cache
(:func:`ffpa_attn.cute._cache._disk_get_or_compile` with ``load=False``) and the caller loads it from there.

Why not ``os.fork()`` of the caller: it has a CUDA context and running threads, and CUDA does not support using
a forked copy of such a process. Instead one *compile server* per calling process: a fresh interpreter
(``python -c _BOOTSTRAP``) started with ``CUDA_VISIBLE_DEVICES=""`` (it never sees a GPU; compiling needs none,
the target arch comes from ``CUTE_DSL_ARCH`` / ffpa-attn's own arch choice) and the caller's ``sys.path``.
It imports the compiler once, then forks one short-lived child per job: the server is single-threaded and has
never touched CUDA, so the fork is the safe kind, and each job starts from an already-imported compiler
(a fresh interpreter per worker paid the imports once per worker: 1.2-1.5 CPU-seconds without torch, 4.4 when
the kernels still imported torch, against 5-8 for one D=320-512 kernel's compile; 2-core CPU, 2026-12-02).
The server is started ahead (:meth:`CompilePool.prestart`, called before the caller's own one-time imports),
so its start-up overlaps them instead of the compiles.

Protocol: length-prefixed pickles over the server's stdin / stdout (its Python-level stdout is sent to stderr
so compiler prints cannot corrupt the channel). To the server: ``("job", job_id, key, arch, compile_fn, env)``
(``compile_fn`` must pickle: a module-level function or a ``functools.partial`` of one; ``env`` holds the
caller's ``FFPA_ATTN_*`` variables at submission: cache root, disk-cache switch) and ``("kill", job_id)``.
From it: ``("ready", stats)``, ``("started", job_id, pid, time_of_the_fork)`` (``time.monotonic()``, one
clock for every process) and ``("done", job_id, ok, error_text, stats)``.
A job whose function does not pickle is not submitted (the caller compiles it).
"""
from __future__ import annotations

import logging
import os
import pickle
import signal
import struct
import subprocess
import sys
import threading
import time
from typing import Any, Callable, Hashable

from ..common.env import env_int

logger = logging.getLogger("ffpa_attn")

_HEADER = struct.Struct("<Q")
_JOB_ENV_PREFIX = "FFPA_ATTN_"
# variables the server reads at start-up (the compiler's configuration): a change restarts the server
_STARTUP_ENV_PREFIXES = ("CUTE_DSL_", "CUTLASS_")
# exit status of a job's child whose kernel was on disk already (nothing compiled)
_EXIT_CACHED = 3


def _send(stream: Any, obj: Any) -> None:
    data = pickle.dumps(obj, protocol=pickle.HIGHEST_PROTOCOL)
    stream.write(_HEADER.pack(len(data)) + data)
    stream.flush()


def _recv_with(read: Callable[[int], bytes]) -> Any:
    """The next message from ``read`` (``read(n)``: up to ``n`` bytes, fewer only at the end), None at the end."""
    head = read(_HEADER.size)
    if len(head) < _HEADER.size:
        return None
    (size,) = _HEADER.unpack(head)
    data = read(size)
    return pickle.loads(data) if len(data) == size else None


def _recv(stream: Any) -> Any:
    """The next message on a buffered binary stream (the caller's side), None at its end."""
    return _recv_with(stream.read)


class _Job:
    def __init__(self, job_id: int, key: Hashable) -> None:
        self.id = job_id
        self.key = key
        self.pid: int | None = None  # the child compiling it, once the server has forked it
        self.done = threading.Event()
        self.ok = False
        self.error = ""
        self.stats: dict[str, Any] = {}
        self.submitted = time.monotonic()
        self.started: float | None = None

    def finish(self, ok: bool, error: str = "", stats: dict[str, Any] | None = None) -> None:
        if not self.done.is_set():
            self.ok, self.error, self.stats = ok, error, dict(stats or {})
            self.stats["queued_s"] = round((self.started or time.monotonic()) - self.submitted, 3)
            self.done.set()


class _Server:
    """The compile server process and the thread that reads its messages."""

    def __init__(self, env: dict[str, str]) -> None:
        from .._version import __version__

        package_dir = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
        self.proc = subprocess.Popen([sys.executable, "-c", _BOOTSTRAP, str(os.getpid()), __version__, package_dir],
                                     stdin=subprocess.PIPE, stdout=subprocess.PIPE, env=env, close_fds=True)
        self.ready = threading.Event()
        self.startup: dict[str, Any] = {}
        self.jobs: dict[int, _Job] = {}  # submitted, not finished
        self.lock = threading.Lock()
        self.reader = threading.Thread(target=self._read, name="ffpa-compile-reader", daemon=True)
        self.reader.start()

    def _read(self) -> None:
        while True:
            try:
                msg = _recv(self.proc.stdout)
            except (OSError, ValueError, EOFError, pickle.UnpicklingError):
                msg = None
            if msg is None:  # the server exited (or was killed): its unfinished jobs failed
                with self.lock:
                    jobs, self.jobs = list(self.jobs.values()), {}
                for job in jobs:
                    job.finish(False, f"compile server exited with status {self.proc.poll()}")
                self.ready.set()
                return
            if msg[0] == "ready":
                self.startup = msg[1]
                self.ready.set()
            elif msg[0] == "started":
                job = self.jobs.get(msg[1])
                if job is not None:  # msg[3]: time.monotonic() of the fork (one clock for all processes)
                    job.pid, job.started = msg[2], msg[3]
            elif msg[0] == "done":
                with self.lock:
                    job = self.jobs.pop(msg[1], None)
                if job is not None:
                    job.finish(bool(msg[2]), str(msg[3]), msg[4])

    @property
    def alive(self) -> bool:
        return self.proc.poll() is None

    def send(self, message: tuple, job: _Job | None = None) -> bool:
        """Send ``message``; ``job``: the job it submits (registered first, so its replies find it)."""
        with self.lock:
            if job is not None:
                self.jobs[job.id] = job
            try:
                _send(self.proc.stdin, message)
                return True
            except (OSError, ValueError) as err:
                if job is not None:
                    self.jobs.pop(job.id, None)
                logger.debug("ffpa_attn.cute: cannot reach the compile server (%s)", err)
        self.kill()
        return False

    def kill(self) -> None:
        if self.alive:
            self.proc.kill()
        try:
            self.proc.wait(timeout=30)
        except subprocess.TimeoutExpired:  # pragma: no cover - a killed process that does not go away
            pass

    def close(self) -> None:
        """Ask the server to exit (end of its stdin: it kills its unfinished children), then make sure it does.
        One still importing the compiler has no children and reads no message yet: killed at once, so that the
        caller's exit never waits for those imports."""
        if not self.ready.is_set():
            self.kill()
            return
        try:
            self.proc.stdin.close()
            self.proc.wait(timeout=5)
        except (OSError, subprocess.TimeoutExpired):
            self.kill()


class CompilePool:
    """The compile server of this process (started by :meth:`prestart` or the first job) and its jobs: at most
    ``max_workers`` compile at once."""

    def __init__(self) -> None:
        self._server: _Server | None = None
        self._jobs: dict[int, _Job] = {}
        self._history: list[_Job] = []  # every job submitted (for job_records)
        self._next_id = 1
        self._signature: tuple | None = None
        self._lock = threading.Lock()

    @staticmethod
    def max_workers() -> int:
        """``FFPA_ATTN_CUTE_COMPILE_WORKERS`` (registered in :mod:`ffpa_attn.common.env`), at least 1."""
        return max(1, env_int("FFPA_ATTN_CUTE_COMPILE_WORKERS"))

    @staticmethod
    def _compiler_env() -> dict[str, str]:
        """The compiler's start-up configuration the server gets: the caller's ``CUTE_DSL_*`` / ``CUTLASS_*``, with
        ``CUTE_DSL_ARCH`` defaulted as :func:`._env.prepare_cutlass_import` does for the first import of cutlass
        (the server's import is its process's first; the caller's may not have happened yet)."""
        from ._env import target_arch

        env = {k: v for k, v in os.environ.items() if k.startswith(_STARTUP_ENV_PREFIXES)}
        env.setdefault("CUTE_DSL_ARCH", target_arch())
        return env

    def _startup_signature(self) -> tuple:
        return tuple(sys.path), tuple(sorted(self._compiler_env().items()))

    def worker_env(self) -> dict[str, str]:
        """The environment of the server: the caller's, with no GPU visible, one OpenMP thread and the caller's
        import path."""
        env = dict(os.environ)
        env.update(self._compiler_env())
        env["CUDA_VISIBLE_DEVICES"] = ""
        # the server forks, so it must stay single-threaded: should torch ever be imported there, its import would
        # start an OpenMP thread pool unless told one thread (the server does no tensor math)
        env["OMP_NUM_THREADS"] = "1"
        env["PYTHONPATH"] = os.pathsep.join(p or os.getcwd() for p in sys.path)
        env.pop("PYTHONSTARTUP", None)
        return env

    def _ensure_server(self) -> _Server | None:
        """The running server (restarted when it exited or the compiler's configuration changed); None when it
        cannot start."""
        signature = self._startup_signature()
        if signature != self._signature:
            self.shutdown()
            self._signature = signature
        if self._server is not None and not self._server.alive:
            self._server = None
        if self._server is None:
            try:
                self._server = _Server(self.worker_env())
            except OSError as err:
                logger.debug("ffpa_attn.cute: cannot start the compile server (%s)", err)
        return self._server

    def prestart(self, n: int = 1) -> None:
        """Start the server now when ``n`` (the kernels about to be handed over) > 0: a caller calls this before
        its own one-time imports (cutlass), so the server's start-up overlaps those instead of the compiles. Its
        children are forked per job (milliseconds), so ``n`` needs no processes of its own."""
        if n > 0:
            with self._lock:
                self._ensure_server()

    def submit(self, key: Hashable, arch: str, compile_fn: Callable[[], Any]) -> int | None:
        """Hand ``compile_fn`` (the kernel of ``key`` for ``arch``) to the server; returns a job id for
        :meth:`wait`, or None (``max_workers`` jobs compiling already, no server, or ``compile_fn`` does not
        pickle)."""
        env = {k: v for k, v in os.environ.items() if k.startswith(_JOB_ENV_PREFIX)}
        try:
            pickle.dumps(compile_fn)
        except Exception as err:  # noqa: BLE001 - a closure or lambda: the caller compiles it itself
            logger.debug("ffpa_attn.cute: compile function does not pickle (%s); not handed over", err)
            return None
        with self._lock:
            if sum(not j.done.is_set() for j in self._jobs.values()) >= self.max_workers():
                return None
            server = self._ensure_server()
            if server is None:
                return None
            job = _Job(self._next_id, key)
            self._next_id += 1
            if not server.send(("job", job.id, key, arch, compile_fn, env), job):
                return None
            self._jobs[job.id] = job
            self._history.append(job)
            return job.id

    def done(self, job_id: int) -> bool:
        """Whether job ``job_id`` has finished (an unknown id counts as finished)."""
        job = self._jobs.get(job_id)
        return job is None or job.done.is_set()

    def wait(self, job_id: int, timeout_s: float) -> bool:
        """Wait for job ``job_id``; True when its kernel is in the disk cache. One that runs past ``timeout_s``
        has its child killed (the file lock goes with it) and counts as failed."""
        job = self._jobs.get(job_id)
        if job is None:
            return True
        if not job.done.wait(timeout_s):
            logger.warning("ffpa_attn.cute: a compile worker ran past %.0f s; compiling here instead", timeout_s)
            self._kill(job)
            job.finish(False, f"timed out after {timeout_s:.0f} s")
        self._jobs.pop(job_id, None)
        if not job.ok:
            logger.debug("ffpa_attn.cute: compile job %d failed: %s", job_id, job.error)
        return job.ok

    def _kill(self, job: _Job) -> None:
        server = self._server
        if server is not None and server.alive:
            server.send(("kill", job.id))
        if job.pid is not None:  # directly as well: the caller must not wait for the server to get to it
            try:
                os.kill(job.pid, signal.SIGKILL)
            except OSError:
                pass

    def server_pid(self) -> int | None:
        """The server's pid while it runs."""
        return self._server.proc.pid if self._server is not None and self._server.alive else None

    def startup_stats(self) -> dict[str, Any]:
        """The server's start-up (``cpu_s`` / ``wall_s`` of its imports; empty until it is ready)."""
        return dict(self._server.startup) if self._server is not None else {}

    def job_records(self) -> list[dict[str, Any]]:
        """What each finished job did, in submission order: ``key``, ``ok``, ``error``, ``compiled`` (False: the
        kernel was on disk already), ``cpu_s`` (the child's user + system time), ``wall_s`` (fork to exit),
        ``queued_s`` (submission to fork: time spent waiting for the server's start-up or a free slot), ``pid``."""
        return [{"key": repr(j.key), "ok": j.ok, "error": j.error, **j.stats} for j in self._history
                if j.done.is_set()]

    def shutdown(self) -> None:
        """Stop the server (its unfinished jobs fail)."""
        if self._server is not None:
            self._server.close()
        self._server = None


_POOL: CompilePool | None = None
_POOL_LOCK = threading.Lock()


def pool() -> CompilePool:
    """This process's pool (created on first use; its server starts at :meth:`CompilePool.prestart` or the
    first job)."""
    global _POOL
    with _POOL_LOCK:
        if _POOL is None:
            _POOL = CompilePool()
            import atexit

            atexit.register(_POOL.shutdown)
        return _POOL


# ------------------------------------------------------------------------------------------- the server side

# The server's entry point. ffpa_attn/__init__.py imports torch and the whole package (the op registration, the
# planner): the server registers a bare ``ffpa_attn`` package (this package's directory and version) instead and
# imports only ``ffpa_attn.cute`` and the compiler, which import no torch (3.5 of the 4.4 CPU-seconds the server's
# start-up took while they did). argv: parent pid, ffpa_attn version, package dir.
_BOOTSTRAP = """
import sys, types
pkg = types.ModuleType("ffpa_attn")
pkg.__path__, pkg.__version__, pkg.__package__ = [sys.argv[3]], sys.argv[2], "ffpa_attn"
sys.modules["ffpa_attn"] = pkg
from ffpa_attn.cute.compile_pool import _serve
raise SystemExit(_serve(int(sys.argv[1])))
"""


def _read_exact(fd: int, n: int) -> bytes:
    chunks, got = [], 0
    while got < n:
        chunk = os.read(fd, n - got)
        if not chunk:
            break
        chunks.append(chunk)
        got += len(chunk)
    return b"".join(chunks)


def _recv_fd(fd: int) -> Any:
    """The next message on raw descriptor ``fd`` (no buffering: the server select()s on it), None at its end."""
    return _recv_with(lambda n: _read_exact(fd, n))


def _run_job(key: Hashable, arch: str, compile_fn: Callable[[], Any], env: dict[str, str],
             report_fd: int) -> None:  # pragma: no cover - runs in a forked child of the server
    """A job's child: compile into the disk cache and exit (0: compiled, :data:`_EXIT_CACHED`: it was on disk,
    1: failed, with the error written to ``report_fd``); never returns."""
    code = 1
    try:
        from ffpa_attn.cute import _cache

        for k in [k for k in os.environ if k.startswith(_JOB_ENV_PREFIX)]:  # the caller's, as of the submission
            del os.environ[k]
        os.environ.update(env)
        code = _EXIT_CACHED if _cache._disk_get_or_compile(key, arch, compile_fn, load=False) is None else 0
    except BaseException as err:  # noqa: BLE001 - reported to the caller, which compiles it itself
        try:
            os.write(report_fd, f"{type(err).__name__}: {err}".encode(errors="replace")[:8000])
        except OSError:
            pass
    finally:
        try:
            sys.stdout.flush()
            sys.stderr.flush()
        finally:
            os._exit(code)


def _os_threads() -> int:
    """Threads of this process as the OS counts them (the server must have one when it forks), -1 if unknown."""
    try:
        with open("/proc/self/status") as f:
            return next(int(line.split()[1]) for line in f if line.startswith("Threads:"))
    except (OSError, StopIteration, ValueError):
        return -1


def _serve(parent: int) -> int:  # pragma: no cover - runs in the server process (tested through the pool)
    """Server main loop: import the compiler once, then fork a child per job until stdin closes or the parent
    exits. Single-threaded on purpose (a select loop, no watchdog thread), so forking it is safe."""
    import select

    t_wall, t_cpu = time.monotonic(), time.process_time()
    # no os.closerange(3, ...) here: Popen(close_fds=True) already left only stdin / stdout / stderr across the
    # exec, and descriptors opened since belong to libraries injected into this process (compute-sanitizer's,
    # for one: closing them broke every import that followed with EBADF)
    channel_out = os.fdopen(os.dup(sys.stdout.fileno()), "wb")
    channel_in = os.dup(sys.stdin.fileno())
    os.dup2(sys.stderr.fileno(), sys.stdout.fileno())  # prints of the compiler go to stderr, not the channel
    from ffpa_attn.cute import _cache  # noqa: F401 - what every job runs

    try:  # the compile module (cutlass and the kernels) is what every job needs: imported once, here
        from ffpa_attn.cute import _compile  # noqa: F401
    except Exception as err:  # noqa: BLE001 - a job then reports the real error
        logger.debug("ffpa_attn.cute: compile server cannot import the compiler (%s)", err)
    _send(channel_out, ("ready", {"cpu_s": round(time.process_time() - t_cpu, 3),
                                  "wall_s": round(time.monotonic() - t_wall, 3),
                                  "os_threads": _os_threads(), "torch_imported": "torch" in sys.modules}))
    children: dict[int, tuple[int, int, float, bytearray]] = {}  # report fd -> (job id, pid, start, error text)

    def stop() -> int:
        for _, pid, _, _ in children.values():
            try:
                os.kill(pid, signal.SIGKILL)
            except OSError:
                pass
        os._exit(0)  # no interpreter teardown of the compiler: the caller's exit does not wait for it

    while True:
        if os.getppid() != parent:  # the caller is gone (killed without closing the channel)
            stop()
        readable, _, _ = select.select([channel_in, *children], [], [], 1.0)
        for fd in readable:
            if fd == channel_in:
                msg = _recv_fd(channel_in)
                if msg is None:
                    stop()
                if msg[0] == "kill":
                    for job_id, pid, _, _ in children.values():
                        if job_id == msg[1]:
                            os.kill(pid, signal.SIGKILL)
                    continue
                _, job_id, key, arch, compile_fn, env = msg
                report_r, report_w = os.pipe()
                sys.stdout.flush()
                sys.stderr.flush()
                pid = os.fork()
                if pid == 0:
                    for other in (channel_in, channel_out.fileno(), report_r, *children):
                        os.close(other)
                    _run_job(key, arch, compile_fn, env, report_w)
                os.close(report_w)
                children[report_r] = (job_id, pid, time.monotonic(), bytearray())
                _send(channel_out, ("started", job_id, pid, time.monotonic()))
                continue
            data = os.read(fd, 65536)
            job_id, pid, start, error = children[fd]
            if data:
                error.extend(data)
                continue
            os.close(fd)  # end of the report pipe: the child exited
            del children[fd]
            _, status, usage = os.wait4(pid, 0)
            code = os.waitstatus_to_exitcode(status)
            text = error.decode(errors="replace") or (f"compile child exited with status {code}" if code not in
                                                     (0, _EXIT_CACHED) else "")
            _send(channel_out, ("done", job_id, code in (0, _EXIT_CACHED), text,
                                {"compiled": code == 0, "cpu_s": round(usage.ru_utime + usage.ru_stime, 3),
                                 "wall_s": round(time.monotonic() - start, 3), "pid": pid}))
