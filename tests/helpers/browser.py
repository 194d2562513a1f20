"""A real headless Chromium driven over the Chrome DevTools protocol through a pipe
(--remote-debugging-pipe: NUL-terminated JSON on file descriptors 3 and 4), so the tests need no
WebSocket or WebDriver package. Chromium is Debian's `chromium`; without it the test is skipped,
or fails when BATCHINF_REQUIRE_SERVICES=1 (as in CI)."""

from __future__ import annotations

import base64
import fcntl
import json
import os
import shutil
import subprocess
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

from tests.helpers.services import stop_process
from tests.helpers.services import unavailable as _unavailable

FLAGS = ["--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
         "--disable-background-networking", "--disable-component-update", "--disable-sync",
         "--disable-dev-shm-usage", "--hide-scrollbars", "--mute-audio"]


def find_chromium() -> str:
    for name in ("chromium", "chromium-browser", "google-chrome", "google-chrome-stable"):
        path = shutil.which(name)
        if path:
            return path
    _unavailable("no Chromium found (apt-get install -y chromium)")
    raise AssertionError("unreachable")


class Browser:
    """One page in a fresh headless Chromium with an empty profile."""

    def __init__(self, width: int = 1280, height: int = 900) -> None:
        self.width, self.height = width, height
        self.profile = tempfile.mkdtemp(prefix="bi-chromium-")
        to_chrome_r, self._w = os.pipe()
        self._r, from_chrome_w = os.pipe()
        # the child's ends move above 9 first, so that placing them on 3 and 4 clobbers neither
        for_child = [fcntl.fcntl(fd, fcntl.F_DUPFD, 10) for fd in (to_chrome_r, from_chrome_w)]
        os.close(to_chrome_r)
        os.close(from_chrome_w)
        to_chrome_r, from_chrome_w = for_child
        script = f'exec "$0" "$@" 3<&{to_chrome_r} 4>&{from_chrome_w} {to_chrome_r}<&- {from_chrome_w}>&-'
        self.proc = subprocess.Popen(
            ["bash", "-c", script, find_chromium(), *FLAGS, f"--user-data-dir={self.profile}",
             "--remote-debugging-pipe", f"--window-size={width},{height}", "about:blank"],
            pass_fds=(to_chrome_r, from_chrome_w), stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
        os.close(to_chrome_r)
        os.close(from_chrome_w)
        self._next = 0
        self._replies: dict[int, dict[str, Any]] = {}
        self._cv = threading.Condition()
        self._reader = threading.Thread(target=self._read, daemon=True)
        self._reader.start()
        target = self.call("Target.createTarget", url="about:blank")["targetId"]
        self.session = self.call("Target.attachToTarget", targetId=target, flatten=True)["sessionId"]
        self.send("Page.enable")
        self.send("Runtime.enable")
        self.send("Emulation.setDeviceMetricsOverride", width=width, height=height, deviceScaleFactor=1,
                  mobile=False)

    def _read(self) -> None:
        buf = b""
        while chunk := os.read(self._r, 1 << 16):
            buf += chunk
            *msgs, buf = buf.split(b"\0")
            for raw in msgs:
                msg = json.loads(raw)
                if "id" in msg:
                    with self._cv:
                        self._replies[msg["id"]] = msg
                        self._cv.notify_all()
        with self._cv:
            self._cv.notify_all()

    def call(self, method: str, session: str | None = None, timeout: float = 30, **params: Any) -> dict[str, Any]:
        with self._cv:
            self._next += 1
            n = self._next
        msg: dict[str, Any] = {"id": n, "method": method, "params": params}
        if session:
            msg["sessionId"] = session
        os.write(self._w, json.dumps(msg).encode() + b"\0")
        deadline = time.monotonic() + timeout
        with self._cv:
            while n not in self._replies:
                if self.proc.poll() is not None or time.monotonic() > deadline:
                    why = self.proc.stderr.read().decode()[-2000:] if self.proc.poll() is not None else "timeout"
                    raise AssertionError(f"Chromium gave no answer to {method}: {why}")
                self._cv.wait(0.2)
            reply = self._replies.pop(n)
        if "error" in reply:
            raise AssertionError(f"{method}: {reply['error']}")
        return reply.get("result", {})

    def send(self, method: str, **params: Any) -> dict[str, Any]:
        """A command to the page."""
        return self.call(method, session=self.session, **params)

    def goto(self, url: str) -> None:
        self.send("Page.navigate", url=url)

    def js(self, expression: str) -> Any:
        r = self.send("Runtime.evaluate", expression=expression, awaitPromise=True, returnByValue=True)
        if "exceptionDetails" in r:
            raise AssertionError(f"{expression!r} raised: {r['exceptionDetails']}")
        return r["result"].get("value")

    def wait(self, expression: str, timeout: float = 30) -> Any:
        """Poll a JS expression until it is truthy; returns its value."""
        deadline = time.monotonic() + timeout
        while True:
            try:    # a DOM node comes back as {}: count it as found
                value = self.js(f"(() => {{ const v = ({expression}); return v instanceof Node ? true : v; }})()")
            except AssertionError:
                value = None
            if value:
                return value
            if time.monotonic() > deadline:
                raise AssertionError(f"timed out waiting for {expression!r}; page: "
                                     f"{self.js('document.body.innerText')[:1500]!r}")
            time.sleep(0.2)

    def screenshot(self, path: Path) -> Path:
        """The whole page (not just the viewport) as PNG; the viewport is put back afterwards."""
        height = int(self.js("document.documentElement.scrollHeight"))
        width = int(self.js("document.documentElement.scrollWidth"))
        self.send("Emulation.setDeviceMetricsOverride", width=width, height=height, deviceScaleFactor=1, mobile=False)
        data = self.send("Page.captureScreenshot", format="png")["data"]
        self.send("Emulation.setDeviceMetricsOverride", width=self.width, height=self.height, deviceScaleFactor=1,
                  mobile=False)
        path.write_bytes(base64.b64decode(data))
        return path

    def overflow(self) -> int:
        """How many CSS pixels the page is wider than the window (0: no horizontal scrolling)."""
        return int(self.js("document.documentElement.scrollWidth - window.innerWidth"))

    def close(self) -> None:
        try:
            self.call("Browser.close", timeout=5)
        except AssertionError:
            pass
        stop_process(self.proc)
        os.close(self._w)
        self._reader.join(timeout=5)
        os.close(self._r)
        shutil.rmtree(self.profile, ignore_errors=True)
