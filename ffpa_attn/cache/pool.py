"""Run compile jobs in processes that never had a CUDA context, beside the calling process.

A first call that needs several compiled artifacts (a forward whose backward will run, a backward with its dQ
kernel) compiles one itself and hands the others over here; each job writes its artifact into a disk cache
(:func:`ffpa_attn.cache.artifacts.build_to_disk`) and the caller loads it from there.

Why not ``os.fork()`` of the caller: it has a CUDA context and running threads, and CUDA does not support using a
forked copy of such a process. Instead one *compile server* per pool and calling process: a fresh interpreter
(``python -c _BOOTSTRAP``) started with ``CUDA_VISIBLE_DEVICES=""`` (it never sees a GPU; compiling needs none: the
target arch is the caller's choice) and the caller's ``sys.path``. It imports the modules the pool names
(``preload``: the compiler) once, then forks one short-lived child per job: the server is single-threaded and has
never touched CUDA, so the fork is the safe kind, and each job starts from an already-imported compiler (a fresh
interpreter per worker pays the imports once per worker, about as much as one kernel's compile on a small CPU:
docs/design.md, "CuTeDSL kernels"). The server
is started ahead (:meth:`CompilePool.prestart`, called before the caller's own one-time imports), so its start-up
overlaps them instead of the compiles. The server imports no torch (nor does this package): the bootstrap
registers a bare ``ffpa_attn`` package instead of importing ``ffpa_attn/__init__.py``.

Protocol: length-prefixed pickles over the server's stdin / stdout (its Python-level stdout is sent to stderr so
compiler prints cannot corrupt the channel). To the server: ``("job", job_id, task, env)`` (``task``: the pickled
job, a module-level function or a ``functools.partial`` of one, unpickled in the job's child, so a job whose modules
do not import fails alone; ``env``: the caller's ``FFPA_ATTN_*`` variables at submission: cache root, switches) and
``("kill", job_id)``. From it: ``("ready", stats)``, ``("started", job_id, pid, time_of_the_fork)``
(``time.monotonic()``, one clock for every process) and ``("done", job_id, ok, error_text, stats)``.
A task that does not pickle is not submitted (the caller compiles it). A task returns False when it found its
artifact on disk already (nothing compiled).
"""
from __future__ import annotations

import atexit
import logging
import os
import pickle
import signal
import struct
import subprocess
import sys
import threading
import time
from typing import Any, Callable, Hashable, Sequence

logger = logging.getLogger("ffpa_attn")

JOB_TIMEOUT_S = 600.0  # a compile job running longer is killed; the caller compiles the artifact itself
_HEADER = struct.Struct("<Q")
_JOB_ENV_PREFIX = "FFPA_ATTN_"
# exit status of a job's child whose artifact was on disk already (nothing compiled)
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
        self.pid: int | None = None  # the child running it, once the server has forked it
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

    def __init__(self, name: str, env: dict[str, str], preload: Sequence[str]) -> None:
        from .._version import __version__

        package_dir = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
        self.proc = subprocess.Popen([sys.executable, "-c", _BOOTSTRAP, str(os.getpid()), __version__, package_dir,
                                      ",".join(preload)],
                                     stdin=subprocess.PIPE, stdout=subprocess.PIPE, env=env, close_fds=True)
        self.ready = threading.Event()
        self.startup: dict[str, Any] = {}
        self.jobs: dict[int, _Job] = {}  # submitted, not finished
        self.lock = threading.Lock()
        self.reader = threading.Thread(target=self._read, name=f"ffpa-compile-{name}", daemon=True)
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
                logger.debug("ffpa_attn.cache: cannot reach the compile server (%s)", err)
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
    """A compile server of this process (started by :meth:`prestart` or the first job) and its jobs.

    Args:
        name: names the server's reader thread and the pool in :func:`get_pool`.
        preload: modules the server imports once at start-up (the compiler; each job's child inherits them).
        startup_env: ``() -> {variable: value}``: the server's start-up configuration (the compiler reads it at
            import) on top of the caller's environment; a change restarts the server.
        max_workers: ``() -> int``: the most jobs compiling at once (read at each submission).
    """

    def __init__(self, name: str = "compile", preload: Sequence[str] = (),
                 startup_env: Callable[[], dict[str, str]] | None = None,
                 max_workers: Callable[[], int] = lambda: 1) -> None:
        self.name = name
        self.preload = tuple(preload)
        self._startup_env = startup_env or dict
        self.max_workers = max_workers
        self._server: _Server | None = None
        self._jobs: dict[int, _Job] = {}
        self._history: list[_Job] = []  # every job submitted (for job_records)
        self._next_id = 1
        self._signature: tuple | None = None
        self._lock = threading.Lock()

    def _startup_signature(self) -> tuple:
        return tuple(sys.path), tuple(sorted(self._startup_env().items()))

    def worker_env(self) -> dict[str, str]:
        """The environment of the server: the caller's plus ``startup_env``, with no GPU visible, one OpenMP
        thread and the caller's import path."""
        env = dict(os.environ)
        env.update(self._startup_env())
        env["CUDA_VISIBLE_DEVICES"] = ""
        # the server forks, so it must stay single-threaded: should torch ever be imported there, its import would
        # start an OpenMP thread pool unless told one thread (the server does no tensor math)
        env["OMP_NUM_THREADS"] = "1"
        env["PYTHONPATH"] = os.pathsep.join(p or os.getcwd() for p in sys.path)
        env.pop("PYTHONSTARTUP", None)
        return env

    def _ensure_server(self) -> _Server | None:
        """The running server (restarted when it exited or its start-up configuration changed); None when it
        cannot start."""
        signature = self._startup_signature()
        if signature != self._signature:
            self.shutdown()
            self._signature = signature
        if self._server is not None and not self._server.alive:
            self._server = None
        if self._server is None:
            try:
                self._server = _Server(self.name, self.worker_env(), self.preload)
            except OSError as err:
                logger.debug("ffpa_attn.cache: cannot start the compile server (%s)", err)
        return self._server

    def prestart(self, n: int = 1) -> None:
        """Start the server now when ``n`` (the jobs about to be handed over) > 0: a caller calls this before its
        own one-time imports (the compiler), so the server's start-up overlaps those instead of the compiles. Its
        children are forked per job (milliseconds), so ``n`` needs no processes of its own."""
        if n > 0:
            with self._lock:
                self._ensure_server()

    def submit(self, key: Hashable, task: Callable[[], Any]) -> int | None:
        """Hand ``task`` (the job compiling ``key``; ``key`` only labels it) to the server; returns a job id for
        :meth:`wait`, or None (``max_workers`` jobs running already, no server, or ``task`` does not pickle)."""
        env = {k: v for k, v in os.environ.items() if k.startswith(_JOB_ENV_PREFIX)}
        try:
            payload = pickle.dumps(task, protocol=pickle.HIGHEST_PROTOCOL)
        except Exception as err:  # noqa: BLE001 - a closure or lambda: the caller compiles it itself
            logger.debug("ffpa_attn.cache: compile task does not pickle (%s); not handed over", err)
            return None
        with self._lock:
            if sum(not j.done.is_set() for j in self._jobs.values()) >= max(1, self.max_workers()):
                return None
            server = self._ensure_server()
            if server is None:
                return None
            job = _Job(self._next_id, key)
            self._next_id += 1
            if not server.send(("job", job.id, payload, env), job):
                return None
            self._jobs[job.id] = job
            self._history.append(job)
            return job.id

    def done(self, job_id: int) -> bool:
        """Whether job ``job_id`` has finished (an unknown id counts as finished)."""
        job = self._jobs.get(job_id)
        return job is None or job.done.is_set()

    def wait(self, job_id: int, timeout_s: float = JOB_TIMEOUT_S) -> bool:
        """Wait for job ``job_id``; True when it succeeded (its artifact is on disk). One that runs past
        ``timeout_s`` has its child killed (its file locks go with it) and counts as failed."""
        job = self._jobs.get(job_id)
        if job is None:
            return True
        if not job.done.wait(timeout_s):
            logger.warning("ffpa_attn.cache: a compile worker ran past %.0f s; compiling here instead", timeout_s)
            self._kill(job)
            job.finish(False, f"timed out after {timeout_s:.0f} s")
        self._jobs.pop(job_id, None)
        if not job.ok:
            logger.debug("ffpa_attn.cache: compile job %d failed: %s", job_id, job.error)
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
        """The server's start-up (``cpu_s`` / ``wall_s`` of its imports, ``os_threads``, ``torch_imported``;
        empty until it is ready)."""
        return dict(self._server.startup) if self._server is not None else {}

    def job_records(self) -> list[dict[str, Any]]:
        """What each finished job did, in submission order: ``key``, ``ok``, ``error``, ``compiled`` (False: the
        artifact was on disk already), ``cpu_s`` (the child's user + system time), ``wall_s`` (fork to exit),
        ``queued_s`` (submission to fork: time spent waiting for the server's start-up or a free slot), ``pid``."""
        return [{"key": repr(j.key), "ok": j.ok, "error": j.error, **j.stats} for j in self._history
                if j.done.is_set()]

    def shutdown(self) -> None:
        """Stop the server (its unfinished jobs fail)."""
        if self._server is not None:
            self._server.close()
        self._server = None


_POOLS: dict[str, CompilePool] = {}
_POOLS_LOCK = threading.Lock()


def get_pool(name: str, **options: Any) -> CompilePool:
    """This process's pool ``name``, created on first use with ``options`` (:class:`CompilePool`'s arguments;
    later calls get the same pool) and shut down at exit. Its server starts at :meth:`CompilePool.prestart` or
    the first job."""
    with _POOLS_LOCK:
        pool = _POOLS.get(name)
        if pool is None:
            pool = _POOLS[name] = CompilePool(name, **options)
            atexit.register(pool.shutdown)
        return pool


# ------------------------------------------------------------------------------------------- the server side

# The server's entry point. ffpa_attn/__init__.py imports torch and the whole package (the op registration, the
# planner): the server registers a bare ``ffpa_attn`` package (this package's directory and version) instead and
# imports only this module and the pool's preload modules, which import no torch (3.5 of the 4.4 CPU-seconds the
# CuTeDSL server's start-up took while its kernels did). argv: parent pid, ffpa_attn version, package dir,
# comma-separated preload modules.
_BOOTSTRAP = """
import sys, types
pkg = types.ModuleType("ffpa_attn")
pkg.__path__, pkg.__version__, pkg.__package__ = [sys.argv[3]], sys.argv[2], "ffpa_attn"
sys.modules["ffpa_attn"] = pkg
from ffpa_attn.cache.pool import _serve
raise SystemExit(_serve(int(sys.argv[1]), [m for m in sys.argv[4].split(",") if m]))
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


def _run_job(payload: bytes, env: dict[str, str], report_fd: int) -> None:  # pragma: no cover - a forked child
    """A job's child: run the task and exit (0: compiled, :data:`_EXIT_CACHED`: the task found its artifact on
    disk, 1: failed, with the error written to ``report_fd``); never returns."""
    code = 1
    try:
        for k in [k for k in os.environ if k.startswith(_JOB_ENV_PREFIX)]:  # the caller's, as of the submission
            del os.environ[k]
        os.environ.update(env)
        task = pickle.loads(payload)
        code = _EXIT_CACHED if task() is False else 0
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


def _serve(parent: int, preload: Sequence[str]) -> int:  # pragma: no cover - the server process (tested via the pool)
    """Server main loop: import the ``preload`` modules once, then fork a child per job until stdin closes or the
    parent exits. Single-threaded on purpose (a select loop, no watchdog thread), so forking it is safe."""
    import importlib
    import select

    t_wall, t_cpu = time.monotonic(), time.process_time()
    # no os.closerange(3, ...) here: Popen(close_fds=True) already left only stdin / stdout / stderr across the
    # exec, and descriptors opened since belong to libraries injected into this process (compute-sanitizer's,
    # for one: closing them broke every import that followed with EBADF)
    channel_out = os.fdopen(os.dup(sys.stdout.fileno()), "wb")
    channel_in = os.dup(sys.stdin.fileno())
    os.dup2(sys.stderr.fileno(), sys.stdout.fileno())  # prints of the compiler go to stderr, not the channel
    for module in preload:  # what every job needs: imported once, here
        try:
            importlib.import_module(module)
        except Exception as err:  # noqa: BLE001 - a job that needs it then reports the real error
            logger.debug("ffpa_attn.cache: compile server cannot import %s (%s)", module, err)
    _send(channel_out, ("ready", {"cpu_s": round(time.process_time() - t_cpu, 3),
                                  "wall_s": round(time.monotonic() - t_wall, 3),
                                  "os_threads": _os_threads(), "torch_imported": sys.modules.get("torch") is not None}))
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
                _, job_id, payload, env = msg
                report_r, report_w = os.pipe()
                sys.stdout.flush()
                sys.stderr.flush()
                pid = os.fork()
                if pid == 0:
                    for other in (channel_in, channel_out.fileno(), report_r, *children):
                        os.close(other)
                    _run_job(payload, env, report_w)
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


__all__ = ["CompilePool", "get_pool", "JOB_TIMEOUT_S"]
