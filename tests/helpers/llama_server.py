"""A real llama.cpp `llama-server` (built by llama_quantize.llama_server) on loopback serving a GGUF,
and a tiny loopback proxy in front of it that answers 429 (with Retry-After) to the first requests:
what the openai-http engine's tests and benchmark run against."""

from __future__ import annotations

import subprocess
import threading
import time
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Iterator

from tests.helpers.llama_quantize import llama_server
from tests.helpers.services import free_port, stop_process, unavailable

MODEL = "smollm2"       # the name the server answers to (its --alias)


@dataclass
class LlamaServer:
    gguf: Path
    log: Path
    port: int = field(default_factory=free_port)
    slots: int = 1
    threads: int = 2
    context: int = 2048     # each slot's context (KV cache) in tokens
    alias: str = MODEL
    proc: subprocess.Popen | None = None

    @property
    def base_url(self) -> str:
        return f"http://127.0.0.1:{self.port}/v1"

    def start(self, timeout: float = 120) -> None:
        """Start (or restart, on the same port) and wait until it serves."""
        import httpx

        cmd = [str(llama_server()), "-m", str(self.gguf), "--host", "127.0.0.1", "--port", str(self.port),
               "--alias", self.alias, "-np", str(self.slots), "-c", str(self.context * self.slots), "-t", str(self.threads),
               "--no-webui", "--seed", "0",
               # no prompt cache: a request's answer and time then do not depend on the requests before it
               "--no-cache-prompt", "--cache-ram", "0"]
        with open(self.log, "ab") as out:
            self.proc = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT)
        deadline = time.monotonic() + timeout
        while True:
            try:
                if httpx.get(f"http://127.0.0.1:{self.port}/health", timeout=2).status_code == 200:
                    return
            except httpx.HTTPError:
                pass
            if self.proc.poll() is not None or time.monotonic() > deadline:
                self.stop()
                unavailable(f"llama-server did not start: {self.log.read_text()[-2000:]}")
            time.sleep(0.05)

    def kill(self) -> None:
        if self.proc is not None:
            self.proc.kill()
            self.proc.wait()
            self.proc = None

    def stop(self) -> None:
        if self.proc is not None:
            stop_process(self.proc)
            self.proc = None


@contextmanager
def llama_server_running(gguf: Path, log: Path, **kw: object) -> Iterator[LlamaServer]:
    server = LlamaServer(gguf, log, **kw)  # type: ignore[arg-type]
    server.start()
    try:
        yield server
    finally:
        server.stop()


@contextmanager
def throttling_proxy(upstream_port: int, retry_after: float = 1.0) -> Iterator[dict]:
    """An HTTP proxy on loopback in front of 127.0.0.1:`upstream_port` that answers 429 with
    Retry-After to the next `state["left"]` POSTs (those whose JSON body `state["match"]` accepts,
    when set) and forwards everything else. Yields the state: base_url, left, match, throttled,
    forwarded."""
    import json
    import httpx
    import uvicorn
    from starlette.applications import Starlette
    from starlette.requests import Request
    from starlette.responses import Response
    from starlette.routing import Route

    port = free_port()
    seen: dict = {"base_url": f"http://127.0.0.1:{port}/v1", "left": 0, "match": None, "throttled": 0, "forwarded": 0}

    async def forward(request: Request) -> Response:
        body = await request.body()
        seen["authorization"] = request.headers.get("authorization")
        if request.method == "POST" and seen["left"] > 0 and (seen["match"] is None or seen["match"](json.loads(body))):
            seen["left"] -= 1
            seen["throttled"] += 1
            return Response('{"error": "slow down"}', status_code=429, headers={"Retry-After": str(retry_after)})
        seen["forwarded"] += 1
        async with httpx.AsyncClient(base_url=f"http://127.0.0.1:{upstream_port}", timeout=300) as client:
            r = await client.request(request.method, request.url.path, content=body,
                                     headers={"content-type": request.headers.get("content-type", "application/json")})
        return Response(r.content, status_code=r.status_code, media_type=r.headers.get("content-type"))

    app = Starlette(routes=[Route("/{path:path}", forward, methods=["GET", "POST"])])
    server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=port, log_level="warning"))
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    while not server.started:
        time.sleep(0.05)
    try:
        yield seen
    finally:
        server.should_exit = True
        thread.join(10)
