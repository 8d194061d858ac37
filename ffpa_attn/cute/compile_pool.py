"""Worker processes that compile CuTeDSL kernels beside the calling process.

A first call that needs several kernels (a forward whose backward will run, a backward with its dQ kernel)
compiles one itself and hands the others to workers; each worker writes its kernel into the disk cache
(:func:`ffpa_attn.cute._cache._disk_get_or_compile` with ``load=False``) and the caller loads it from there.

Why workers and not ``os.fork()``: the calling process has a CUDA context and running threads, and CUDA does
not support using a forked copy of such a process. A worker here is a fresh interpreter
(``python -c _BOOTSTRAP``) started with ``CUDA_VISIBLE_DEVICES=""``: it never sees a GPU, and
compiling needs none (the target arch comes from ``CUTE_DSL_ARCH`` / ffpa-attn's own arch choice). It starts
with the caller's ``sys.path`` (so it imports the same ffpa_attn, without torch: see ``_BOOTSTRAP``), imports the
compiler once at start-up and then serves jobs until the caller exits, so only the first job of a process pays
the interpreter start; callers that know they will hand over kernels start workers ahead (:meth:`prestart`).

Protocol: length-prefixed pickles over the worker's stdin / stdout (its Python-level stdout is sent to stderr so
compiler prints cannot corrupt the channel). A job is ``(job_id, key, arch, compile_fn, env)`` where
``compile_fn`` must pickle (a module-level function or a ``functools.partial`` of one) and ``env`` holds the
caller's ``FFPA_ATTN_*`` variables at submission (cache root, disk-cache switch); the reply is
``(job_id, ok, error_text)``. A job whose function does not pickle is not submitted (the caller compiles it).
"""
from __future__ import annotations

import logging
import os
import pickle
import struct
import subprocess
import sys
import threading
from typing import Any, Callable, Hashable

from ..common.env import env_int

logger = logging.getLogger("ffpa_attn")

_HEADER = struct.Struct("<Q")
_JOB_ENV_PREFIX = "FFPA_ATTN_"
# variables a worker reads at start-up (the compiler's configuration): a change restarts the workers
_STARTUP_ENV_PREFIXES = ("CUTE_DSL_", "CUTLASS_")


def _send(stream: Any, obj: Any) -> None:
    data = pickle.dumps(obj, protocol=pickle.HIGHEST_PROTOCOL)
    stream.write(_HEADER.pack(len(data)) + data)
    stream.flush()


def _recv(stream: Any) -> Any:
    """The next message, or None at end of stream."""
    head = stream.read(_HEADER.size)
    if len(head) < _HEADER.size:
        return None
    (size,) = _HEADER.unpack(head)
    data = stream.read(size)
    if len(data) < size:
        return None
    return pickle.loads(data)


class _Job:
    def __init__(self, job_id: int, worker: "_Worker") -> None:
        self.id = job_id
        self.worker = worker
        self.done = threading.Event()
        self.ok = False
        self.error = ""

    def finish(self, ok: bool, error: str = "") -> None:
        if not self.done.is_set():
            self.ok, self.error = ok, error
            self.done.set()


class _Worker:
    """One worker process and the thread that reads its replies."""

    def __init__(self, env: dict[str, str]) -> None:
        from .. import __version__

        package_dir = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
        self.proc = subprocess.Popen([sys.executable, "-c", _BOOTSTRAP, str(os.getpid()), __version__, package_dir],
                                     stdin=subprocess.PIPE, stdout=subprocess.PIPE, env=env, close_fds=True)
        self.job: _Job | None = None
        self.lock = threading.Lock()
        self.reader = threading.Thread(target=self._read, name="ffpa-compile-reader", daemon=True)
        self.reader.start()

    def _read(self) -> None:
        while True:
            try:
                msg = _recv(self.proc.stdout)
            except (OSError, ValueError, pickle.UnpicklingError):
                msg = None
            with self.lock:
                job = self.job
                if msg is None:  # the worker exited (or was killed): its job, if any, failed
                    if job is not None:
                        job.finish(False, f"compile worker exited with status {self.proc.poll()}")
                    self.job = None
                    return
                if job is not None and msg[0] == job.id:
                    self.job = None
                    job.finish(bool(msg[1]), str(msg[2]))

    @property
    def alive(self) -> bool:
        return self.proc.poll() is None

    @property
    def idle(self) -> bool:
        return self.alive and self.job is None

    def submit(self, job: _Job, message: tuple) -> bool:
        with self.lock:
            if not self.idle:
                return False
            self.job = job
        try:
            _send(self.proc.stdin, message)
        except (OSError, ValueError) as err:
            with self.lock:
                self.job = None
            logger.debug("ffpa_attn.cute: cannot reach a compile worker (%s)", err)
            self.kill()
            return False
        return True

    def kill(self) -> None:
        if self.alive:
            self.proc.kill()
        try:
            self.proc.wait(timeout=30)
        except subprocess.TimeoutExpired:  # pragma: no cover - a killed process that does not go away
            pass

    def close(self) -> None:
        """Ask the worker to exit (end of its stdin), then make sure it does."""
        try:
            self.proc.stdin.close()
            self.proc.wait(timeout=5)
        except (OSError, subprocess.TimeoutExpired):
            self.kill()


class CompilePool:
    """Lazily started, reused compile workers (one job each at a time, at most ``max_workers``)."""

    def __init__(self) -> None:
        self._workers: list[_Worker] = []
        self._jobs: dict[int, _Job] = {}
        self._next_id = 1
        self._signature: tuple | None = None
        self._lock = threading.Lock()

    @staticmethod
    def max_workers() -> int:
        """``FFPA_ATTN_CUTE_COMPILE_WORKERS`` (registered in :mod:`ffpa_attn.common.env`), at least 1."""
        return max(1, env_int("FFPA_ATTN_CUTE_COMPILE_WORKERS"))

    @staticmethod
    def _compiler_env() -> dict[str, str]:
        """The compiler's start-up configuration a worker gets: the caller's ``CUTE_DSL_*`` / ``CUTLASS_*``, with
        ``CUTE_DSL_ARCH`` defaulted as :func:`._env.prepare_cutlass_import` does for the first import of cutlass
        (the worker's import is its process's first; the caller's may not have happened yet)."""
        from ._env import target_arch

        env = {k: v for k, v in os.environ.items() if k.startswith(_STARTUP_ENV_PREFIXES)}
        env.setdefault("CUTE_DSL_ARCH", target_arch())
        return env

    def _startup_signature(self) -> tuple:
        return tuple(sys.path), tuple(sorted(self._compiler_env().items()))

    def worker_env(self) -> dict[str, str]:
        """The environment of a new worker: the caller's, with no GPU visible and the caller's import path."""
        env = dict(os.environ)
        env.update(self._compiler_env())
        env["CUDA_VISIBLE_DEVICES"] = ""
        env["PYTHONPATH"] = os.pathsep.join(p or os.getcwd() for p in sys.path)
        env.pop("PYTHONSTARTUP", None)
        return env

    def _refresh(self) -> None:
        """Drop workers that exited; restart all when the compiler's configuration changed since they started."""
        signature = self._startup_signature()
        if signature != self._signature:
            self.shutdown()
            self._signature = signature
        self._workers = [w for w in self._workers if w.alive]

    def _start(self) -> _Worker | None:
        try:
            w = _Worker(self.worker_env())
        except OSError as err:
            logger.debug("ffpa_attn.cute: cannot start a compile worker (%s)", err)
            return None
        self._workers.append(w)
        return w

    def _worker(self) -> _Worker | None:
        """An idle worker, started if none is idle and the cap allows (None at the cap)."""
        self._refresh()
        for w in self._workers:
            if w.idle:
                return w
        return self._start() if len(self._workers) < self.max_workers() else None

    def prestart(self, n: int) -> None:
        """Have ``n`` workers (at most the cap) running: a caller about to hand over kernels starts them before
        its own one-time imports (cutlass), so their start-up overlaps those instead of the compiles."""
        with self._lock:
            self._refresh()
            while len(self._workers) < min(n, self.max_workers()) and self._start() is not None:
                pass

    def submit(self, key: Hashable, arch: str, compile_fn: Callable[[], Any]) -> int | None:
        """Hand ``compile_fn`` (the kernel of ``key`` for ``arch``) to a worker; returns a job id for
        :meth:`wait`, or None (no idle worker under the cap, or ``compile_fn`` does not pickle)."""
        env = {k: v for k, v in os.environ.items() if k.startswith(_JOB_ENV_PREFIX)}
        try:
            pickle.dumps(compile_fn)
        except Exception as err:  # noqa: BLE001 - a closure or lambda: the caller compiles it itself
            logger.debug("ffpa_attn.cute: compile function does not pickle (%s); not handed to a worker", err)
            return None
        with self._lock:
            worker = self._worker()
            if worker is None:
                return None
            job = _Job(self._next_id, worker)
            self._next_id += 1
            if not worker.submit(job, (job.id, key, arch, compile_fn, env)):
                return None
            self._jobs[job.id] = job
            return job.id

    def done(self, job_id: int) -> bool:
        """Whether job ``job_id`` has finished (an unknown id counts as finished)."""
        job = self._jobs.get(job_id)
        return job is None or job.done.is_set()

    def wait(self, job_id: int, timeout_s: float) -> bool:
        """Wait for job ``job_id``; True when its kernel is in the disk cache. One that runs past ``timeout_s``
        has its worker killed (the file lock goes with it) and counts as failed."""
        job = self._jobs.get(job_id)
        if job is None:
            return True
        if not job.done.wait(timeout_s):
            logger.warning("ffpa_attn.cute: a compile worker ran past %.0f s; compiling here instead", timeout_s)
            job.worker.kill()
            job.finish(False, f"timed out after {timeout_s:.0f} s")
        self._jobs.pop(job_id, None)
        if not job.ok:
            logger.debug("ffpa_attn.cute: compile job %d failed: %s", job_id, job.error)
        return job.ok

    def worker_pids(self) -> list[int]:
        return [w.proc.pid for w in self._workers if w.alive]

    def shutdown(self) -> None:
        """Stop every worker (their unfinished jobs fail)."""
        for w in self._workers:
            w.close()
        self._workers = []


_POOL: CompilePool | None = None
_POOL_LOCK = threading.Lock()


def pool() -> CompilePool:
    """This process's pool (created on first use; its workers start with their first job)."""
    global _POOL
    with _POOL_LOCK:
        if _POOL is None:
            _POOL = CompilePool()
            import atexit

            atexit.register(_POOL.shutdown)
        return _POOL


# ------------------------------------------------------------------------------------------- the worker side

# The worker's entry point. ffpa_attn/__init__.py imports torch (seconds of start-up a compile never uses): the
# worker registers a bare ``ffpa_attn`` package (this package's directory and version) instead, so importing
# ``ffpa_attn.cute`` and the compiler runs no torch import. argv: parent pid, ffpa_attn version, package dir.
_BOOTSTRAP = """
import sys, types
pkg = types.ModuleType("ffpa_attn")
pkg.__path__, pkg.__version__, pkg.__package__ = [sys.argv[3]], sys.argv[2], "ffpa_attn"
sys.modules["ffpa_attn"] = pkg
from ffpa_attn.cute.compile_pool import _serve
raise SystemExit(_serve(int(sys.argv[1])))
"""


def _exit_with_parent(parent: int) -> None:  # pragma: no cover - a thread of the worker process
    """End the worker when the process it compiles for is gone (killed without closing the channel)."""
    import time

    while os.getppid() == parent:
        time.sleep(1.0)
    os._exit(0)


def _serve(parent: int) -> int:  # pragma: no cover - runs in the worker process (tested through the pool)
    """Worker main loop: import the compiler once, then compile jobs until stdin closes or the parent exits."""
    # a descriptor inherited by accident (e.g. the caller's end of this worker's own stdin) would keep the
    # channel from ever reaching end-of-file: keep only stdin, stdout and stderr
    os.closerange(3, 65536)
    channel_out = os.fdopen(os.dup(sys.stdout.fileno()), "wb")
    channel_in = os.fdopen(os.dup(sys.stdin.fileno()), "rb")
    os.dup2(sys.stderr.fileno(), sys.stdout.fileno())  # prints of the compiler go to stderr, not the channel
    threading.Thread(target=_exit_with_parent, args=(parent,), name="ffpa-compile-watchdog", daemon=True).start()
    from ffpa_attn.cute import _cache

    try:  # warm up: the compile module (cutlass) is what every job needs
        from ffpa_attn.cute import _compile  # noqa: F401
    except Exception as err:  # noqa: BLE001 - a job then reports the real error
        logger.debug("ffpa_attn.cute: compile worker cannot import the compiler (%s)", err)
    while True:
        msg = _recv(channel_in)
        if msg is None:
            return 0
        job_id, key, arch, compile_fn, env = msg
        for k in [k for k in os.environ if k.startswith(_JOB_ENV_PREFIX)]:  # the caller's, as of the submission
            del os.environ[k]
        os.environ.update(env)
        ok, error = False, ""
        try:
            _cache._disk_get_or_compile(key, arch, compile_fn, load=False)
            ok = True
        except BaseException as err:  # noqa: BLE001 - reported to the caller, which compiles it itself
            error = f"{type(err).__name__}: {err}"
        _send(channel_out, (job_id, ok, error))


