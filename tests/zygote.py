"""Scripts and ranks forked from a warm interpreter: each one a real process of its own,
started without importing torch and forge again.

Importing what ``scripts/train.py`` imports costs about 2 s of CPU per process on this
machine; a 4-rank launch on its 2 cores pays it four times, twice per test that resumes. The
zygote is one process per test worker that imports all of that once, single-threaded, and
then forks a child per rank: the child takes its own session, environment, working folder,
argv and output files and runs the script as ``__main__``, exactly as ``python script.py``
would, then exits through the interpreter's normal shutdown (atexit handlers, buffered
output). Its exit status is reported back to the test.

A request whose environment changes what an interpreter reads while it starts (``PYTHON*``,
the OpenMP and allocator variables, torch's logging) is not forked: ``start_script`` starts a
fresh process for it (but for ``PYTHONPATH`` and ``PYTHONFAULTHANDLER``, which ``become``
applies in the child itself), as it does when the zygote finds itself unfit to fork (a thread
started while importing: forking it would copy a lock some thread holds).

What a fork cannot give a child: its own string-hash seed (``PYTHONHASHSEED``: every child
shares the zygote's, where fresh processes each draw one). A set of strings iterated in an
order that differs between ranks or between a run and its resume would not show here; the
tests that run torchrun, and the resumes in fresh processes of test_train_script, still
start fresh interpreters.

Run as ``python -m tests.zygote`` by ``Zygote``; protocol: JSON lines, requests on its
stdin, ``{"pid"}`` / ``{"exit", "code"}`` answers on its stdout.
"""

from __future__ import annotations

import contextlib
import faulthandler
import functools
import importlib
import json
import os
import pathlib
import resource
import select
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Mapping, Sequence

REPO = pathlib.Path(__file__).resolve().parents[1]
# the scripts whose imports the zygote makes once (their modules are then dropped: each child
# runs its script as __main__, its imports found already loaded)
PRELOAD = ("train", "eval", "generate")
# what every training process imports later, at its first optimizer (torch.optim's
# ``add_param_group`` is wrapped by ``torch._disable_dynamo``, which imports it): 0.5-2 s of
# each forked rank's set-up otherwise
PRELOAD_LATER = ("torch._dynamo",)
POLL_S = 0.02
# variables an interpreter, torch or OpenMP read while starting: a request that sets them
# differently from the zygote's environment gets a fresh process
START_UP_PREFIXES = (
    "PYTHON", "OMP_", "MKL_", "KMP_", "LD_", "MALLOC", "TORCH_CPP_", "TORCH_SHOW", "TORCH_LOGS",
    "TORCHDYNAMO_", "TORCHINDUCTOR_", "TORCH_COMPILE", "PYTORCH_", "LANG", "LC_", "TZ",
)  # fmt: skip
# the start-up variables ``become`` applies in the child, so a request may set them freely
IN_CHILD = frozenset({"PYTHONPATH", "PYTHONFAULTHANDLER"})
# the OpenMP runtimes that read ``KMP_*`` variables when they load (Intel's, LLVM's): torch's
# wheels link GNU's libgomp, so in a process that has loaded neither, a KMP_ variable is read
# by whatever loads one later, from the child's own environment, as in a fresh process.
# (threadpoolctl sets KMP_DUPLICATE_LIB_OK when imported, and a streamed ``load_dataset``
# imports it through scipy: counted as read at start-up, every script a worker started after
# such a test was a fresh interpreter, and test_zygote failed in that worker.)
KMP_RUNTIMES = ("libiomp", "libomp.", "libomp-")  # libomp-<hash>.so: bundled in a wheel


def kmp_runtime_loaded(pid: int) -> bool:
    """Whether process ``pid`` has loaded an OpenMP runtime that reads ``KMP_*``."""
    maps = pathlib.Path(f"/proc/{pid}/maps").read_text().splitlines()
    return any(line.rsplit("/", 1)[-1].startswith(KMP_RUNTIMES) for line in maps)


def start_up_variables(env: Mapping[str, str], kmp_runtime: bool) -> dict[str, str]:
    """The variables of ``env`` a child forked from a process (one with a KMP-reading OpenMP
    runtime loaded, or not) would not honour as a fresh process does."""
    return {
        k: v
        for k, v in env.items()
        if k.startswith(START_UP_PREFIXES)
        and k not in IN_CHILD
        and (kmp_runtime or not k.startswith("KMP_"))
    }


PROTOCOL_FD = 3  # the zygote's answers (fd 1 becomes its stderr: a stray print cannot garble them)


def preload() -> str | None:
    """Import what the scripts import; what failed, or None (a fresh process then shows
    the error where it happens)."""
    sys.path.insert(0, str(REPO / "scripts"))
    try:
        for name in PRELOAD:
            importlib.import_module(name)
            del sys.modules[name]
        for name in PRELOAD_LATER:
            importlib.import_module(name)
    except Exception as e:
        return f"its imports failed: {e!r}"
    finally:
        sys.path.pop(0)
    return None


def thread_names() -> list[str]:
    """The names the OS gives this process's threads (native ones too): one, the main
    thread, is what a safe fork needs."""
    names = []
    for task in pathlib.Path("/proc/self/task").iterdir():
        with contextlib.suppress(FileNotFoundError):  # a thread that has ended since
            names.append((task / "comm").read_text().strip())
    return sorted(names)


def serve() -> None:
    """Answer fork requests until stdin closes."""
    os.dup2(1, PROTOCOL_FD)
    os.dup2(2, 1)
    why = preload()
    if why is None and len(threads := thread_names()) != 1:
        why = f"it had threads after its imports: {threads}"
    os.write(PROTOCOL_FD, json.dumps({"id": 0, "ready": why is None, "why": why}).encode() + b"\n")
    if why is not None:
        return
    pending = b""
    while True:
        ready, _, _ = select.select([0], [], [], POLL_S)
        if ready:
            chunk = os.read(0, 1 << 16)
            if not chunk:
                return  # the test worker has gone
            pending += chunk
            while b"\n" in pending:
                line, pending = pending.split(b"\n", 1)
                request = json.loads(line)
                sys.stdout.flush()
                sys.stderr.flush()
                pid = os.fork()
                if pid == 0:
                    become(request)  # does not return: exits through the interpreter
                answer = {"id": request["id"], "pid": pid}
                os.write(PROTOCOL_FD, json.dumps(answer).encode() + b"\n")
        reap()


def reap() -> None:
    """Report every child that has ended."""
    while True:
        try:
            pid, status = os.waitpid(-1, os.WNOHANG)
        except ChildProcessError:
            return
        if pid == 0:
            return
        code = os.waitstatus_to_exitcode(status)
        os.write(PROTOCOL_FD, json.dumps({"exit": pid, "code": code}).encode() + b"\n")


def become(request: dict) -> None:
    """In the forked child: the process ``python argv...`` would be, then run it."""
    os.setsid()  # a group of its own, as start_new_session: its children end with it
    stdin = os.open(os.devnull, os.O_RDONLY)
    out = os.open(request["stdout"], os.O_WRONLY | os.O_APPEND)
    err = os.open(request["stderr"], os.O_WRONLY | os.O_APPEND)
    for fd, target in ((stdin, 0), (out, 1), (err, 2)):
        os.dup2(fd, target)
        os.close(fd)
    os.close(PROTOCOL_FD)
    if request["file_size_limit"] is not None:  # ``ulimit -f``
        limit = int(request["file_size_limit"])
        resource.setrlimit(resource.RLIMIT_FSIZE, (limit, limit))
    os.chdir(request["cwd"])
    os.environ.clear()
    os.environ.update(request["env"])
    # as ``python -X faulthandler``: a fatal signal (SIGSEGV, SIGABRT) prints every thread's
    # Python stack to the child's stderr, now fd 2
    if request["env"].get("PYTHONFAULTHANDLER"):
        faulthandler.enable(all_threads=True)
    else:
        faulthandler.disable()
    tempfile.tempdir = None  # found again from this environment's TMPDIR
    script = os.path.abspath(request["argv"][0])
    extra = [p for p in request["env"].get("PYTHONPATH", "").split(os.pathsep) if p]
    sys.path[:] = [os.path.dirname(script), *extra, *sys.path[1:]]
    sys.argv = [request["argv"][0], *request["argv"][1:]]
    import runpy

    runpy.run_path(script, run_name="__main__")
    sys.exit(0)


class Forked:
    """A child of the zygote, with the part of ``subprocess.Popen`` that ``run_ranks`` uses."""

    def __init__(self, zygote: Zygote, pid: int) -> None:
        self.zygote, self.pid = zygote, pid
        self.returncode: int | None = None

    def poll(self) -> int | None:
        if self.returncode is None:
            self.returncode = self.zygote.exit_code(self.pid)
        return self.returncode

    def wait(self, timeout: float | None = 60) -> int:
        deadline = time.monotonic() + (timeout or 0)
        while self.poll() is None:
            if timeout is not None and time.monotonic() > deadline:
                raise subprocess.TimeoutExpired(str(self.pid), timeout)
            time.sleep(POLL_S)
        assert self.returncode is not None
        return self.returncode


class Zygote:
    """The warm interpreter of this test worker (``zygote()``)."""

    def __init__(self) -> None:
        self.env = {**os.environ, "OMP_NUM_THREADS": "1"}
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "tests.zygote"],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            cwd=REPO,
            env=self.env,
        )
        self.pending = b""
        self.exits: dict[int, int] = {}
        self.requests = 0
        self.alive = True
        first = self.answer_to(0)
        self.fit = bool(first["ready"])
        self.why_unfit: str = first.get("why") or ""
        self.kmp_runtime = self.fit and kmp_runtime_loaded(self.proc.pid)

    def fits(self, env: Mapping[str, str]) -> bool:
        """Whether a child with ``env`` starts as a fresh process would (``become`` honours
        PYTHONPATH, as sys.path, and PYTHONFAULTHANDLER)."""
        return self.unfit_reason(env) is None

    def unfit_reason(self, env: Mapping[str, str]) -> str | None:
        """Why a child with ``env`` would not start as a fresh process would; None if it would
        (what a test that expects a fork says when it gets none)."""
        if not self.fit:
            return f"the zygote was unfit from its start: {self.why_unfit}"
        if not self.alive or self.proc.poll() is not None:
            return f"the zygote ended (exit code {self.proc.poll()})"
        mine = start_up_variables(self.env, self.kmp_runtime)
        theirs = start_up_variables(env, self.kmp_runtime)
        differ = sorted(k for k in mine.keys() | theirs.keys() if mine.get(k) != theirs.get(k))
        if differ:
            return "; ".join(
                f"{k}: {env.get(k)!r}, the zygote's {self.env.get(k)!r}" for k in differ
            )
        return None

    def start(
        self,
        argv: Sequence[str],
        env: Mapping[str, str],
        stdout: str,
        stderr: str,
        file_size_limit: int | None = None,
    ) -> Forked:
        self.requests += 1
        request = {"id": self.requests, "argv": list(argv), "env": dict(env)}
        request |= {"cwd": os.getcwd(), "stdout": stdout, "stderr": stderr}
        request |= {"file_size_limit": file_size_limit}
        assert self.proc.stdin is not None
        self.proc.stdin.write(json.dumps(request).encode() + b"\n")
        self.proc.stdin.flush()
        return Forked(self, int(self.answer_to(self.requests)["pid"]))

    def answer_to(self, request: int) -> dict:
        """The zygote's answer to ``request`` (0: its start); a child forked for an earlier
        request nobody waited for (its test was interrupted) is ended."""
        while True:
            for answer in self.read_answers(block=True):
                if answer["id"] == request:
                    return answer
                with contextlib.suppress(ProcessLookupError, KeyError):
                    os.killpg(int(answer["pid"]), signal.SIGKILL)

    def exit_code(self, pid: int) -> int | None:
        """``pid``'s exit code once the zygote reported it. A zygote that ended reaps no
        more: a child it left is then watched here, and reads as killed once it is gone."""
        if self.alive:
            try:
                self.read_answers(block=False)
            except RuntimeError:
                self.alive = False
        if pid in self.exits or self.alive:
            return self.exits.get(pid)
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            return -signal.SIGKILL
        return None

    def read_answers(self, block: bool) -> list[dict]:
        """The answers read so far that are not exit reports; ``block``: wait for one."""
        assert self.proc.stdout is not None
        fd, answers = self.proc.stdout.fileno(), []
        while True:
            *lines, self.pending = self.pending.split(b"\n")
            for message in map(json.loads, lines):
                if "exit" in message:
                    self.exits[int(message["exit"])] = int(message["code"])
                else:
                    answers.append(message)
            if answers or not select.select([fd], [], [], None if block else 0)[0]:
                return answers
            chunk = os.read(fd, 1 << 16)
            if not chunk:
                raise RuntimeError("the zygote ended")
            self.pending += chunk

    def close(self) -> None:
        with contextlib.suppress(OSError):
            assert self.proc.stdin is not None
            self.proc.stdin.close()
        self.proc.wait()


def start_script(
    argv: Sequence[str],
    stdout: str,
    stderr: str,
    *,
    env: Mapping[str, str] | None = None,
    file_size_limit: int | None = None,
) -> subprocess.Popen | Forked:
    """``python argv...`` started in a session of its own, its output appended to the files
    ``stdout`` and ``stderr``: forked from the zygote where that starts as a fresh process
    would, else a fresh process. ``env``: the whole environment (default: this one's);
    ``file_size_limit``: ``ulimit -f``."""
    full_env = dict(env if env is not None else os.environ)
    warm = zygote()
    if warm is not None and warm.fits(full_env):
        return warm.start(argv, full_env, stdout, stderr, file_size_limit)

    def limit() -> None:
        if file_size_limit is not None:
            resource.setrlimit(resource.RLIMIT_FSIZE, (file_size_limit, file_size_limit))

    with open(stdout, "ab") as out, open(stderr, "ab") as err:
        return subprocess.Popen(
            [sys.executable, *argv],
            env=full_env,
            stdout=out,
            stderr=err,
            start_new_session=True,  # a group of its own: its children end with it
            preexec_fn=limit if file_size_limit is not None else None,
        )


def run_script(
    argv: Sequence[str | bytes],
    *,
    env: Mapping[str, str] | None = None,
    timeout: float = 240,
    file_size_limit: int | None = None,
) -> subprocess.CompletedProcess[bytes]:
    """``python argv...`` as ``subprocess.run(..., capture_output=True)`` gives it (bytes
    out), started by ``start_script``. ``argv`` may hold bytes, as it arrives on Linux
    (decoded as Python decodes argv); ``env`` is added to this environment. At ``timeout``
    its group is killed and ``TimeoutExpired`` raised; so is what it leaves running."""
    args = [os.fsdecode(a) for a in argv]
    with tempfile.TemporaryDirectory() as tmp:
        out, err = os.path.join(tmp, "stdout"), os.path.join(tmp, "stderr")
        for path in (out, err):
            open(path, "wb").close()
        child = start_script(args, out, err, env={**os.environ, **(env or {})},
                             file_size_limit=file_size_limit)  # fmt: skip
        try:
            code = child.wait(timeout)
        except subprocess.TimeoutExpired:
            raise subprocess.TimeoutExpired(args, timeout, read(out), read(err)) from None
        finally:  # however the wait ended (a timeout, an interrupted test): nothing left running
            end_group(child)
        return subprocess.CompletedProcess(args, code, read(out), read(err))


def end_group(proc: subprocess.Popen | Forked) -> None:
    """Kill what is left of ``proc``'s group: the script, and what it started and left
    behind (loader workers, a checkpoint process)."""
    with contextlib.suppress(ProcessLookupError):  # none left: all of it has ended
        os.killpg(proc.pid, signal.SIGKILL)
    if proc.poll() is None:  # a forked script not yet in its own group
        with contextlib.suppress(ProcessLookupError):
            os.kill(proc.pid, signal.SIGKILL)
    proc.wait()


def read(path: str) -> bytes:
    with open(path, "rb") as file:
        return file.read()


@functools.cache
def zygote() -> Zygote | None:
    """This test worker's zygote, started on first use and ended with the worker (None
    with ``FORGE_TEST_FRESH_PROCESSES=1``: every script a fresh process)."""
    import atexit

    if os.environ.get("FORGE_TEST_FRESH_PROCESSES") == "1":
        return None
    started = Zygote()
    atexit.register(started.close)
    return started


if __name__ == "__main__":
    serve()
