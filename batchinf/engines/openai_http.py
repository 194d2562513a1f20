"""The openai-http engine: a generate bundle's records sent to an existing OpenAI-compatible server
(llama.cpp's llama-server, vLLM's, SGLang's, a hosted API) that the bundle names.

- What is sent is the bundle's: each record's staged prompt token ids (tokenized, chat template
  applied, at planning with the bundle's own files) go to /v1/completions as a token array, with
  the record's own sampling params (its seed included, so a retry or a split asks the same).
- Credentials come from this worker's environment (BATCHINF_OPENAI_HTTP_API_KEY, or the
  BATCHINF_OPENAI_HTTP_* variable the bundle names), never from a manifest or bundle.json.
- At most `concurrency` requests are in flight; 429, 5xx, timeouts and refused connections are
  retried with full-jitter backoff, honouring Retry-After. Every record ends exactly once: a
  result, or (retries exhausted, or a 4xx) an error row naming the server's answer.
- A remote model cannot be hashed, so it is pinned by behaviour: at import the endpoint's greedy
  answers to the bundle's fixture prompts are recorded in bundle.json (`engine.fixtures`); they
  are replayed when a process first runs a job's shard and every `recheck_shards` shards after,
  and a different answer fails the job naming the fixture.
"""

from __future__ import annotations

import asyncio
import json
import queue
import random
import re
import threading
from collections.abc import Callable, Iterable, Iterator
from email.utils import parsedate_to_datetime
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

from batchinf.errors import BundleError, RecordsFailed
from batchinf.runtime.generation.runtime import GenerateRuntime
from batchinf.runtime.generation.seq import GenRequest, GenResult, GenStats

KEY_ENV = "BATCHINF_OPENAI_HTTP_API_KEY"
KEY_ENV_PATTERN = re.compile(r"BATCHINF_OPENAI_HTTP_[A-Z0-9_]{0,64}")   # a bundle names no other variable
RETRY_STATUS = frozenset({408, 409, 425, 429, 500, 502, 503, 504})
FIXTURE_TOKENS = 8
DEFAULTS = {"concurrency": 8, "timeout_seconds": 120.0, "max_tries": 8, "backoff_seconds": 0.5,
            "backoff_cap_seconds": 10.0, "recheck_shards": 16}
LIMITS = {"concurrency": (1, 256), "timeout_seconds": (0.1, 3600.0), "max_tries": (1, 100),
          "backoff_seconds": (0.0, 60.0), "backoff_cap_seconds": (0.0, 600.0), "recheck_shards": (1, 1_000_000)}


def endpoint_spec(base_url: str, model: str, *, api_key_env: str | None = None, **knobs: Any) -> dict[str, Any]:
    """bundle.json's `engine` section for a server, checked: an http(s) URL without credentials in
    it, a model name, the key's variable (BATCHINF_OPENAI_HTTP_*), and bounded knobs."""
    parts = urlsplit(base_url)
    if parts.scheme not in ("http", "https") or not parts.hostname:
        raise BundleError(f"base URL {base_url!r} must be http:// or https://HOST[:PORT]/PATH, e.g. http://127.0.0.1:8080/v1")
    if parts.username or parts.password or parts.query or parts.fragment:
        raise BundleError(f"base URL {base_url!r} may hold no credentials, query or fragment; the API key comes "
                          f"from the worker's environment ({KEY_ENV})")
    if not model or len(model) > 256:
        raise BundleError("the served model's name must be 1-256 characters (the server's `model`)")
    if api_key_env is not None and not KEY_ENV_PATTERN.fullmatch(api_key_env):
        raise BundleError(f"api_key_env {api_key_env!r}: a bundle may name only a BATCHINF_OPENAI_HTTP_* variable")
    spec: dict[str, Any] = {"name": "openai-http", "base_url": base_url.rstrip("/"), "model": model,
                            "api_key_env": api_key_env or KEY_ENV}
    for k, v in {**DEFAULTS, **{k: v for k, v in knobs.items() if v is not None}}.items():
        if k not in LIMITS:
            raise BundleError(f"unknown openai-http setting {k!r}; known: {', '.join(LIMITS)}")
        lo, hi = LIMITS[k]
        if not lo <= float(v) <= hi:
            raise BundleError(f"openai-http {k} {v} is out of range [{lo}, {hi}]")
        spec[k] = type(DEFAULTS[k])(v)
    return spec


def completion_body(model: str, prompt_ids: list[int], p: Any) -> dict[str, Any]:
    """The /v1/completions body of one record: its token ids and every sampling field it has."""
    body: dict[str, Any] = {"model": model, "prompt": list(prompt_ids), "max_tokens": p.max_tokens,
                            "temperature": p.temperature, "top_p": p.top_p, "seed": p.seed, "n": 1, "stream": False}
    if p.top_k:
        body["top_k"] = p.top_k        # not OpenAI's; llama.cpp, vLLM and SGLang read it
    if p.stop:
        body["stop"] = list(p.stop)
    if p.logprobs is not None:
        body["logprobs"] = max(1, p.logprobs)
    if p.response_format is not None:
        fmt = json.loads(p.response_format)
        body["response_format"] = fmt
        if fmt.get("type") == "json_schema":
            body["json_schema"] = fmt["json_schema"]["schema"]     # llama.cpp's name for it
    return body


def _retry_after(value: str | None) -> float | None:
    """Retry-After in seconds (a number of seconds or an HTTP date), or None."""
    if not value:
        return None
    try:
        return max(0.0, float(value))
    except ValueError:
        pass
    try:
        import time

        return max(0.0, parsedate_to_datetime(value).timestamp() - time.time())
    except (TypeError, ValueError):
        return None


def _logprobs(lp: dict[str, Any] | None, n: int) -> list[dict] | None:
    """A completions `logprobs` object as OpenAI's logprobs.content entries (batchinf's form)."""
    if not lp:
        return None
    tops = lp.get("top_logprobs") or [None] * len(lp.get("tokens") or [])
    return [{"token": t, "logprob": v, "bytes": list(t.encode()),
             "top_logprobs": [{"token": k, "logprob": x, "bytes": list(k.encode())}
                              for k, x in list((top or {}).items())[:n]]}
            for t, v, top in zip(lp.get("tokens") or [], lp.get("token_logprobs") or [], tops)]


class HttpGenerateRuntime(GenerateRuntime):
    """A generate bundle whose model is the server its bundle.json names: the tokenizer, chat
    template and fixtures are the bundle's, the forward passes the server's."""

    engine = "openai-http"

    def __init__(self, root: Path, meta: dict[str, Any], *, device: str = "cpu") -> None:
        super().__init__(root, meta, device=device)
        spec = meta.get("engine") or {}
        self.spec = endpoint_spec(spec.get("base_url", ""), spec.get("model", ""), api_key_env=spec.get("api_key_env"),
                                  **{k: spec.get(k) for k in DEFAULTS})
        self._checked_jobs: set[str] = set()
        self._since_check = 0

    def load_model(self) -> None:
        """Nothing to load here: the model runs on the server."""

    # --- pinning by behaviour -------------------------------------------------------------------
    def fixture_answers(self) -> list[dict[str, Any]]:
        """The endpoint's greedy answers to the bundle's fixture prompts, one request at a time
        (a server's batching then cannot change them): what `engine.fixtures` pins at import."""
        from batchinf.runtime.generation.sampling import SamplingParams

        out = []
        for fx in self.meta.get("fixtures", []):
            if "continuation" not in fx:
                continue
            req = GenRequest(0, fx["token_ids"], SamplingParams(max_tokens=FIXTURE_TOKENS))
            try:
                (res,) = list(self.generate([req], concurrency=1))
            except RecordsFailed as exc:
                raise BundleError(f"the openai-http endpoint {self.spec['base_url']} (model {self.spec['model']}) "
                                  f"did not answer fixture {fx['text']!r}: {exc.failures[0]}") from None
            out.append({"token_ids": fx["token_ids"], "text": res.text, "finish_reason": res.finish_reason})
        return out

    def verify_fixtures(self) -> None:
        """Replay the pinned fixtures; a different answer is drift, refused naming the fixture."""
        pinned = self.spec_fixtures()
        got = self.fixture_answers()
        for i, (want, have) in enumerate(zip(pinned, got, strict=True)):
            if (want["text"], want["finish_reason"]) != (have["text"], have["finish_reason"]):
                raise BundleError(
                    f"openai-http fixture {i} drifted: the endpoint {self.spec['base_url']} (model "
                    f"{self.spec['model']}) now answers {have['text']!r} ({have['finish_reason']}) to prompt ids "
                    f"{want['token_ids'][:12]}..., pinned at import as {want['text']!r} ({want['finish_reason']}): "
                    "the server runs another model or build; restore it, or re-import the bundle against it")

    def spec_fixtures(self) -> list[dict[str, Any]]:
        fixtures = (self.meta.get("engine") or {}).get("fixtures")
        if not fixtures:
            raise BundleError(f"bundle {self.root} names an openai-http endpoint but pins no fixtures of it; "
                              "re-import it with `batchinf bundle import ... --engine openai-http`")
        return fixtures

    def begin_shard(self, job_id: str) -> None:
        """Before a shard: replay the fixtures at each job's first shard in this process and every
        `recheck_shards` shards after (the load replayed them once already)."""
        if job_id in self._checked_jobs and self._since_check < self.spec["recheck_shards"]:
            self._since_check += 1
            return
        if self._checked_jobs:
            self.verify_fixtures()
        self._checked_jobs.add(job_id)
        self._since_check = 1

    # --- generation -----------------------------------------------------------------------------
    def generate(self, requests: Iterable[GenRequest], *, max_batch_tokens: int = 16384, max_slots: int = 64,
                 stats: GenStats | None = None, stop_admitting: Callable[[], bool] | None = None,
                 concurrency: int | None = None, **_: Any) -> Iterator[GenResult]:
        """Results as the server answers, at most `concurrency` requests in flight. Requests that
        end without an answer are raised together at the end (RecordsFailed), after every answer
        was yielded. Once `stop_admitting` says True, no more requests are sent (a split hands
        those on). Closing the iterator (a lost lease) cancels the requests in flight."""
        reqs = list(requests)
        self.check(reqs, max_batch_tokens)
        if not reqs:
            return
        results: queue.Queue = queue.Queue()
        stop = threading.Event()
        def send() -> None:
            try:
                asyncio.run(self._send_all(reqs, results, stop, stop_admitting, concurrency or self.spec["concurrency"]))
            except BaseException as exc:  # noqa: BLE001 -- handed to the caller, whose records are not done
                results.put(("crashed", None, exc))

        worker = threading.Thread(target=send, name="batchinf-openai-http", daemon=True)
        worker.start()
        failures: dict[int, str] = {}
        try:
            for _ in reqs:
                kind, key, value = results.get()
                if kind == "answer":
                    if stats is not None:
                        stats.prompt_tokens += value.input_tokens
                        stats.prefill_positions += value.input_tokens
                        stats.decode_tokens += value.output_tokens
                        stats.decode_slot_steps += value.output_tokens
                    yield value
                elif kind == "no_answer":
                    failures[key] = value
                elif kind == "crashed":
                    raise value
        finally:
            stop.set()
            worker.join(30)
        if failures:
            raise RecordsFailed(failures)

    def _headers(self) -> dict[str, str]:
        from batchinf.config import engine_secret

        key = engine_secret(self.spec["api_key_env"])
        return {"Authorization": f"Bearer {key}"} if key else {}

    async def _send_all(self, reqs: list[GenRequest], results: queue.Queue, stop: threading.Event,
                        stop_admitting: Callable[[], bool] | None, concurrency: int) -> None:
        import httpx

        gate = asyncio.Semaphore(concurrency)
        limits = httpx.Limits(max_connections=concurrency, max_keepalive_connections=concurrency)
        async with httpx.AsyncClient(base_url=self.spec["base_url"], timeout=self.spec["timeout_seconds"],
                                     limits=limits, headers=self._headers()) as client:
            async def one(r: GenRequest) -> None:
                async with gate:
                    if stop_admitting is not None and stop_admitting():
                        results.put(("deferred", r.key, None))
                        return
                    try:
                        results.put(("answer", r.key, await self._complete(client, r)))
                    except _NoAnswer as exc:
                        results.put(("no_answer", r.key, str(exc)))

            tasks = [asyncio.create_task(one(r)) for r in reqs]
            # one future for them all: each wait below is O(1), not a callback on every task of the shard
            everything = asyncio.gather(*tasks, return_exceptions=True)
            while not everything.done():
                if stop.is_set():           # the consumer went away: cancel what is in flight
                    for t in tasks:
                        t.cancel()
                    break
                await asyncio.wait([everything], timeout=0.1)
            await asyncio.gather(*tasks, return_exceptions=True)

    async def _complete(self, client: Any, r: GenRequest) -> GenResult:
        import httpx

        body = completion_body(self.spec["model"], r.prompt_ids, r.params)
        last = ""
        for attempt in range(self.spec["max_tries"]):
            wait = None
            try:
                resp = await client.post("/completions", json=body)
            except (httpx.TimeoutException, httpx.TransportError) as exc:
                last = f"{type(exc).__name__}: {exc}"
            else:
                if resp.status_code == 200:
                    return self._result(r, resp)
                last = f"HTTP {resp.status_code}: {resp.text[:300]}"
                if resp.status_code not in RETRY_STATUS:
                    raise _NoAnswer(f"the server refused the request: {last}")
                wait = _retry_after(resp.headers.get("retry-after"))
            if attempt + 1 < self.spec["max_tries"]:
                backoff = random.uniform(0, min(self.spec["backoff_cap_seconds"],
                                                self.spec["backoff_seconds"] * 2 ** attempt))
                await asyncio.sleep(min(wait, 60.0) if wait is not None else backoff)
        raise _NoAnswer(f"no answer after {self.spec['max_tries']} tries (429, 5xx, timeouts); last: {last}")

    def _result(self, r: GenRequest, resp: Any) -> GenResult:
        try:
            data = resp.json()
            choice = data["choices"][0]
            text = choice["text"]
        except (ValueError, KeyError, IndexError, TypeError) as exc:
            raise _NoAnswer(f"the server's answer is not a completion ({exc}): {resp.text[:300]}") from None
        ids = self.encode_rendered(text)
        usage = data.get("usage") or {}
        finish = "length" if choice.get("finish_reason") == "length" else "stop"
        return GenResult(key=r.key, token_ids=ids, text=text, finish_reason=finish, input_tokens=len(r.prompt_ids),
                         output_tokens=int(usage.get("completion_tokens") or len(ids)),
                         logprobs=_logprobs(choice.get("logprobs"), r.params.logprobs or 0)
                         if r.params.logprobs is not None else None)


class _NoAnswer(Exception):
    """A request ended without an answer; the message says why (an error row's)."""


def pin_endpoint(src: Path, meta: dict[str, Any], spec: dict[str, Any]) -> dict[str, Any]:
    """bundle.json for the same files executed by the server `spec` names: the endpoint's greedy
    answers to the fixture prompts recorded (`engine.fixtures`), so later drift is seen."""
    with_engine = {**meta, "engine": spec}
    return {**meta, "engine": {**spec, "fixtures": HttpGenerateRuntime(src, with_engine).fixture_answers()}}
