"""Chat templates rendered in a separate process under hard memory and CPU limits.

The checks of `chat_template.BoundedEnvironment` run first, inside that process, but a single
filter or string method runs in C or in the standard library, where no check reaches
(`('{0:>999999}' * 700).format('x')` builds 700 MB before any size is looked at; `wordwrap` of a
4 MB string runs 22 s without returning). So the template compiles and renders in a child process
that cannot outgrow its limits, whatever it calls:

- address space: RLIMIT_AS at `memory_bytes` (BATCHINF_TEMPLATE_MEMORY_BYTES); a bigger
  allocation raises MemoryError in the child, which reports it and is then replaced;
- CPU: before each record RLIMIT_CPU's soft limit is set that many seconds (BATCHINF_TEMPLATE_SECONDS,
  rounded up, plus one) past the CPU the child has used, so the kernel stops a render stuck in C code
  (SIGXCPU); the in-child deadline of `seconds` ends the ordinary cases gracefully first;
- wall clock: the parent waits `seconds + WALL_GRACE` for each record's reply, then kills the child;
- output: a reply longer than MAX_OUTPUT_CHARS can encode to stops the child unread;
- no core files and no new processes (RLIMIT_CORE, RLIMIT_NPROC at 0).

A render that trips a limit, or whose child dies, is that record's TemplateLimitError; the child is
replaced and the rest of the batch goes to the new one. The child is a fresh interpreter
(`python -m batchinf.runtime.template_sandbox`), not a fork: it gets no open file or socket beyond
its pipes (close_fds), no environment but PYTHONPATH and TZ (so no store credentials), and none of
the parent's memory. It starts once per runtime (about 0.1 s) and renders a batch of records per
round trip; `submit` sends the next batch before the caller works on this one's `results`, so
staging tokenizes while the child renders. Child to parent is a status byte and UTF-8 text, never pickle: a child that escaped the
sandbox could not make the parent run anything.
"""

from __future__ import annotations

import json
import math
from collections import deque
import os
import select
import signal
import struct
import subprocess
import sys
import tempfile
import threading
import time
import weakref
from pathlib import Path
from typing import Any, Callable, Iterable, Iterator

import jinja2

from batchinf.runtime.chat_template import MAX_OUTPUT_CHARS, TemplateLimitError

WALL_GRACE = 2.0                    # seconds past the in-child deadline before the parent kills the child
START_SECONDS = 30.0                # the child's start and the template's compilation, at most
MAX_REPLY_BYTES = 4 * MAX_OUTPUT_CHARS + 1     # a status byte and the largest output, UTF-8
_HEADER = struct.Struct(">I")

# reply status bytes
OK, REJECTED, LIMIT, LIMIT_EXITING, CRASHED = b"o", b"t", b"l", b"m", b"x"


class TemplateCompileError(jinja2.exceptions.TemplateError):
    """The chat template does not compile (or its child could not start)."""


# --- parent side ---------------------------------------------------------------------------------


class _Child:
    """One sandbox process, its pipes and a reply buffer."""

    def __init__(self, env: dict[str, str]) -> None:
        self.stderr = tempfile.TemporaryFile()      # a start failure's traceback, read when it dies
        self.proc = subprocess.Popen(
            [sys.executable, "-s", "-m", "batchinf.runtime.template_sandbox"], stdin=subprocess.PIPE,
            stdout=subprocess.PIPE, stderr=self.stderr, env=env, cwd="/", close_fds=True, bufsize=0)
        self.owner = os.getpid()
        self.buf = bytearray()
        self.maxrss = 0                             # bytes, once reaped
        self.status: int | None = None              # its exit code (-signal), once reaped
        self._finalizer = weakref.finalize(self, _kill, self.proc, self.owner)

    def send(self, payload: bytes) -> None:
        fd = self.proc.stdin.fileno()
        data = memoryview(_HEADER.pack(len(payload)) + payload)
        while data:
            data = data[os.write(fd, data):]

    def receive(self, deadline: float) -> bytes | str:
        """The next reply, or why there is none: "timeout", "closed" (the child died or closed its
        pipe) or "too long" (over MAX_REPLY_BYTES, left unread)."""
        header = self._read(_HEADER.size, deadline)
        if isinstance(header, str):
            return header
        (n,) = _HEADER.unpack(header)
        return "too long" if n > MAX_REPLY_BYTES else self._read(n, deadline)

    def _read(self, n: int, deadline: float) -> bytes | str:
        fd = self.proc.stdout.fileno()
        while len(self.buf) < n:
            left = deadline - time.monotonic()
            if left <= 0 or not select.select([fd], [], [], left)[0]:
                return "timeout"
            chunk = os.read(fd, max(1 << 16, n - len(self.buf)))
            if not chunk:
                return "closed"
            self.buf += chunk
        out = bytes(self.buf[:n])
        del self.buf[:n]
        return out

    def stop(self) -> None:
        """Kill and reap the child, keeping its exit status and peak RSS."""
        self._finalizer.detach()
        if self.status is None:
            self.maxrss = max(self.maxrss, peak_rss_of(self.proc.pid))     # while it is still there to ask
            self.proc.kill()
            self.status = self.proc.wait()
        for f in (self.proc.stdin, self.proc.stdout):
            f.close()

    def death(self) -> str:
        """What happened to a stopped child, in words."""
        if self.status == -signal.SIGXCPU:
            return "it used up its CPU time (BATCHINF_TEMPLATE_SECONDS) and its process was stopped"
        if self.status is not None and self.status < 0:
            return f"its process died of {signal.Signals(-self.status).name}"
        return f"its process exited with status {self.status}"

    def stderr_tail(self) -> str:
        self.stderr.seek(max(0, self.stderr.seek(0, os.SEEK_END) - 2000))
        return self.stderr.read().decode("utf-8", "replace").strip()


def peak_rss_of(pid: int) -> int:
    """A live process's peak RSS in bytes (VmHWM; 0 where /proc does not say). Not ru_maxrss: a
    spawned child's counts the RSS of the parent it was forked from."""
    try:
        status = Path(f"/proc/{pid}/status").read_text()
    except OSError:
        return 0
    kib = [line.split()[1] for line in status.splitlines() if line.startswith("VmHWM:")]
    return int(kib[0]) * 1024 if kib else 0


def _kill(proc: subprocess.Popen, owner: int) -> None:
    if os.getpid() == owner:        # a forked copy of the parent leaves the parent's child alone
        proc.kill()
        proc.wait()


class TemplateSandbox:
    """A chat template compiled and rendered in a sandbox process (started at the first render).
    `render` is thread-safe (a `submit`/`results` pair belongs to one caller); a forked copy of its
    owner starts its own process."""

    def __init__(self, source: str, variables: dict[str, Any], *, memory_bytes: int, seconds: float) -> None:
        self.config = json.dumps({"source": source, "variables": variables, "memory_bytes": memory_bytes,
                                  "seconds": seconds}).encode()
        self.memory_bytes, self.seconds = memory_bytes, seconds
        self.starts = 0                 # processes started (1 + restarts after a trip)
        self.reaped_maxrss = 0          # the largest peak RSS of a stopped process, bytes
        self._child: _Child | None = None
        self._lock = threading.Lock()
        self._pid = os.getpid()
        self._pending: deque[bytes] = deque()       # the submitted conversations not answered yet
        self._out: list[str | Exception] = []       # the answers so far

    def render(self, conversations: list[list[dict]]) -> list[str | Exception]:
        """Each conversation rendered (add_generation_prompt), or its error: TemplateLimitError past a
        limit (its process is replaced), jinja2's TemplateError when the template rejects it, or
        RuntimeError for anything else the template raised. Raises TemplateCompileError when the
        template does not compile."""
        self.submit(conversations)
        return self.results()

    def submit(self, conversations: list[list[dict]]) -> None:
        """Send conversations to render; `results()` collects them (the caller works meanwhile). One
        batch is outstanding at a time: submitting another drops the unread results of the last."""
        self._after_fork()
        with self._lock:
            self._collect()
            self._out = []
            self._pending = deque(json.dumps(c, ensure_ascii=False).encode("utf-8", "surrogatepass")
                                  for c in conversations)
            self._guarded(self._send_pending)

    def results(self) -> list[str | Exception]:
        """The results of the last `submit`, in its order (see `render`)."""
        with self._lock:
            self._guarded(self._collect)
            out, self._out = self._out, []
            return out

    def _guarded(self, step: Callable[[], None]) -> None:
        """A step that fails (a compile error, or a time limit's exception in the middle of a frame)
        leaves no half-sent or half-read frame behind: the process is stopped, its batch dropped."""
        try:
            step()
        except BaseException:
            self._stop()
            self._pending.clear()
            raise

    def peak_rss(self) -> int:
        """The largest peak RSS, in bytes, of this sandbox's processes so far, the running one included
        (Linux; a process the kernel stopped for its CPU time is not counted: it is gone unasked)."""
        pid = self.pid
        return max(peak_rss_of(pid) if pid else 0, self.reaped_maxrss)

    @property
    def pid(self) -> int | None:
        """The running sandbox process's id; None before the first render, after a trip and after close."""
        child = self._child
        return child.proc.pid if child is not None and child.owner == os.getpid() else None

    def close(self) -> None:
        """Stop the process (a later render starts another)."""
        self._after_fork()
        with self._lock:
            self._stop()

    # -- internals --

    def _after_fork(self) -> None:
        if self._pid != os.getpid():        # the pipes are the parent's: leave them, start afresh
            self._pid, self._child, self._lock = os.getpid(), None, threading.Lock()
            self._pending, self._out = deque(), []

    def _send_pending(self) -> None:
        if not self._pending:
            return
        batch = b"[" + b",".join(self._pending) + b"]"
        try:
            self._running().send(batch)
        except OSError:          # it died idle (killed from outside): once more, with a fresh one
            self._stop()
            self._running().send(batch)

    def _collect(self) -> None:
        """Read the pending answers; after a trip, the rest goes to a fresh process."""
        while self._pending:
            result, alive = self._reply(self._child)
            self._out.append(result)
            self._pending.popleft()
            if not alive:
                self._stop()
                self._send_pending()

    def _running(self) -> _Child:
        if self._child is not None:
            return self._child
        from batchinf.config import sandbox_environment

        env = sandbox_environment()     # batchinf itself first on the path, wherever it was imported from
        env["PYTHONPATH"] = os.pathsep.join(filter(None, (str(Path(__file__).resolve().parents[2]),
                                                          env.get("PYTHONPATH"))))
        child = _Child(env)
        self.starts += 1
        try:
            child.send(self.config)
            reply = child.receive(time.monotonic() + START_SECONDS)
        except OSError:
            reply = "closed"
        if reply == OK:
            self._child = child
            return child
        child.stop()
        self.reaped_maxrss = max(self.reaped_maxrss, child.maxrss)
        if isinstance(reply, str):
            raise TemplateCompileError(f"the chat template's sandbox process did not start or compile it within "
                                       f"{START_SECONDS:g} s and {self.memory_bytes} bytes ({child.death()}; "
                                       f"{child.stderr_tail()[-500:] or 'no output'})")
        raise TemplateCompileError(reply[1:].decode("utf-8", "replace"))

    def _reply(self, child: _Child) -> tuple[str | Exception, bool]:
        """One record's result, and whether its process lives on."""
        reply = child.receive(time.monotonic() + self.seconds + WALL_GRACE)
        if isinstance(reply, str):
            child.stop()
            why = {"timeout": f"it ran longer than {self.seconds + WALL_GRACE:g} s and its process was stopped "
                              "(BATCHINF_TEMPLATE_SECONDS)",
                   "too long": f"its output is over {MAX_OUTPUT_CHARS} characters"}.get(reply) or child.death()
            return TemplateLimitError(f"the chat template went past a limit ({why})"), False
        status, text = reply[:1], reply[1:].decode("utf-8", "surrogatepass")
        if status == OK:
            return text, True
        if status == REJECTED:
            return jinja2.exceptions.TemplateError(text), True
        if status in (LIMIT, LIMIT_EXITING):
            return TemplateLimitError(text), status == LIMIT
        return RuntimeError(text), True

    def _stop(self) -> None:
        if self._child is not None:
            self._child.stop()
            self.reaped_maxrss = max(self.reaped_maxrss, self._child.maxrss)
            self._child = None


class ThreadSandboxes:
    """A bundle's chat template (tokenizer_config.json's, the "default" one of a list), rendered in a
    sandbox process of each thread that renders with it, at Settings' limits when this was made:
    a submit/results pair is one caller's, and a controller plans several tenants' jobs at once on
    threads that share one runtime, so one thread's answers never reach another's records."""

    def __init__(self, cfg: dict[str, Any]) -> None:
        from batchinf.config import settings
        from batchinf.runtime.chat_template import token_text

        source = cfg.get("chat_template")
        if isinstance(source, list):    # [{"name": "default", "template": ...}, ...]
            source = next((t["template"] for t in source if t.get("name") == "default"), None)
        self.source = source or None
        self.variables = {k: token_text(cfg.get(k)) for k in ("bos_token", "eos_token", "pad_token", "unk_token")}
        self.limits = {"memory_bytes": settings().template_memory_bytes, "seconds": settings().template_seconds}
        self._local = threading.local()
        self._made: list[TemplateSandbox] = []       # every thread's, for `close`

    def get(self) -> TemplateSandbox | None:
        """This thread's sandbox; None when the bundle has no chat template."""
        if self.source is None:
            return None
        if not hasattr(self._local, "box"):
            self._local.box = TemplateSandbox(self.source, self.variables, **self.limits)
            self._made.append(self._local.box)
        return self._local.box

    def close(self) -> None:
        """Stop every thread's sandbox process (each starts again at its thread's next render)."""
        for box in self._made:
            box.close()


def chat_results(sandbox: TemplateSandbox | None, batches: Iterable[list[list[dict]]], config: Path
                 ) -> Iterator[list[str | Exception]]:
    """Each batch's conversations rendered, or the errors their records get: ValueError when the
    template rejects the messages or goes past a limit (RuntimeError for anything else it raised);
    raises BundleError, naming `config`, when the template does not compile. The next batch goes
    to the sandbox before this one's results are yielded: its process renders while the caller
    tokenizes these."""
    from batchinf.errors import BundleError

    it = iter(batches)
    if sandbox is None:
        for batch in it:
            yield [ValueError(f"bundle {config.parent.name} has no chat template; send a plain prompt instead")] * len(batch)
        return
    try:
        if (batch := next(it, None)) is not None:
            sandbox.submit(batch)
        while batch is not None:
            results = sandbox.results()
            if (batch := next(it, None)) is not None:
                sandbox.submit(batch)
            yield [_chat_error(r) if isinstance(r, jinja2.exceptions.TemplateError) else r for r in results]
    except TemplateCompileError as e:
        raise BundleError(f"{config}: the chat template does not compile ({e}); fix or remove chat_template") from e


def _chat_error(e: jinja2.exceptions.TemplateError) -> ValueError:
    if isinstance(e, TemplateLimitError):
        err = ValueError(f"the bundle's chat template went past a limit rendering these messages: {e}")
    else:
        err = ValueError(f"the bundle's chat template rejected the messages: {e}")
    err.__cause__ = e
    return err


# --- child side ----------------------------------------------------------------------------------


def _limit(resource: Any, what: int, value: int) -> None:
    try:
        resource.setrlimit(what, (value, value))
    except (ValueError, OSError):       # e.g. RLIMIT_AS on macOS: the data segment, then
        if what == resource.RLIMIT_AS:
            resource.setrlimit(resource.RLIMIT_DATA, (value, value))


def _serve() -> None:
    import resource

    from batchinf.runtime import chat_template

    stdin, stdout = sys.stdin.buffer, sys.stdout.buffer
    sys.stdout = sys.stderr             # nothing but frames on the reply pipe

    def read() -> bytes | None:
        header = stdin.read(_HEADER.size)
        if len(header) < _HEADER.size:
            return None
        return stdin.read(_HEADER.unpack(header)[0])

    def write(status: bytes, text: str = "") -> None:
        payload = status + text.encode("utf-8", "surrogatepass")
        stdout.write(_HEADER.pack(len(payload)) + payload)
        stdout.flush()

    config = json.loads(read() or b"{}")
    seconds = float(config["seconds"])
    # after a MemoryError the heap may be fragmented: this process is replaced
    out_of_memory = (f"the chat template went past the sandbox's memory limit of {config['memory_bytes']} bytes "
                      "(BATCHINF_TEMPLATE_MEMORY_BYTES)")
    _limit(resource, resource.RLIMIT_AS, int(config["memory_bytes"]))
    _limit(resource, resource.RLIMIT_CORE, 0)
    _limit(resource, resource.RLIMIT_NPROC, 0)
    chat_template.RENDER_SECONDS = seconds
    cpu_budget = math.ceil(seconds) + 1

    def arm_cpu() -> None:
        used = resource.getrusage(resource.RUSAGE_SELF)
        resource.setrlimit(resource.RLIMIT_CPU, (int(used.ru_utime + used.ru_stime) + cpu_budget,
                                                 resource.RLIM_INFINITY))

    arm_cpu()
    try:
        template = chat_template.compile_template(config["source"])
    except jinja2.exceptions.TemplateError as exc:
        write(REJECTED, str(exc))
        return
    except MemoryError:
        write(REJECTED, f"compiling it: {out_of_memory}")
        return
    write(OK)
    variables = config["variables"]
    while (frame := read()) is not None:
        for messages in json.loads(frame):
            arm_cpu()
            status, text = _render_one(chat_template, template, messages, variables, out_of_memory)
            write(status, text)
            if status == LIMIT_EXITING:     # the parent reads its peak RSS, then ends it
                stdin.read()
                return


def _render_one(chat_template: Any, template: Any, messages: Any, variables: dict[str, Any],
                out_of_memory: str) -> tuple[bytes, str]:
    try:
        return OK, chat_template.render(template, messages=messages, add_generation_prompt=True, **variables)
    except chat_template.TemplateLimitError as exc:
        if isinstance(exc.__cause__, MemoryError):
            return LIMIT_EXITING, out_of_memory
        return LIMIT, str(exc)
    except jinja2.exceptions.TemplateError as exc:
        return REJECTED, str(exc)
    except MemoryError:
        return LIMIT_EXITING, out_of_memory
    except Exception as exc:  # noqa: BLE001 -- whatever else a template raises is that record's error
        return CRASHED, f"{type(exc).__name__}: {exc}"


if __name__ == "__main__":
    _serve()
