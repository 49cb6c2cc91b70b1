"""Check the HTML archive's pages: statically (every link and image resolves) and in headless
Chromium over the DevTools protocol (standard library only).

`--remote-debugging-pipe` speaks the protocol over file descriptors 3 (to the browser) and 4 (from
it), NUL-separated JSON, so no websocket client is needed. What a test needs back: every console
error, exception and failed load while the page loaded, each <img> with whether it decoded, every
link's resolved URL, and a full-page screenshot.
"""

from __future__ import annotations

import base64
import fcntl
import json
import os
import select
import shutil
import subprocess
import tempfile
import time
from html.parser import HTMLParser
from pathlib import Path
from urllib.parse import unquote, urlsplit

TIMEOUT = 60.0


def binary() -> str | None:
    return shutil.which("chromium") or shutil.which("chromium-browser")


class Browser:
    def __init__(self, exe: str, width: int = 1280, height: int = 900):
        to_r, self._to = os.pipe()
        self._from, from_w = os.pipe()

        def fds():  # runs in the child before exec: the protocol's two descriptors, inheritable
            high = [fcntl.fcntl(fd, fcntl.F_DUPFD, 10) for fd in (to_r, from_w)]  # never clobber one with the other
            os.dup2(high[0], 3)
            os.dup2(high[1], 4)

        self._profile = tempfile.mkdtemp(prefix="evident-chromium-")
        self.proc = subprocess.Popen(
            [exe, "--headless=new", "--no-sandbox", "--disable-gpu", "--remote-debugging-pipe",
             "--hide-scrollbars", "--no-first-run", "--allow-file-access-from-files",
             f"--user-data-dir={self._profile}", f"--window-size={width},{height}", "about:blank"],
            preexec_fn=fds, close_fds=False, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        os.close(to_r)
        os.close(from_w)
        self._buf, self._next, self.events = b"", 0, []
        targets = self.call("Target.getTargets")["targetInfos"]
        page = next(t for t in targets if t["type"] == "page")
        self.session = self.call("Target.attachToTarget", targetId=page["targetId"], flatten=True)["sessionId"]
        for domain in ("Page", "Runtime", "Log", "Network"):
            self.call(f"{domain}.enable", session=True)

    def _read(self, deadline: float) -> dict:
        while b"\0" not in self._buf:
            ready, _, _ = select.select([self._from], [], [], max(0.0, deadline - time.monotonic()))
            if not ready:
                raise TimeoutError("Chromium did not answer in time")
            chunk = os.read(self._from, 1 << 20)
            if not chunk:
                raise RuntimeError("Chromium closed the DevTools pipe")
            self._buf += chunk
        raw, _, self._buf = self._buf.partition(b"\0")
        return json.loads(raw)

    def call(self, method: str, session: bool = False, **params) -> dict:
        self._next += 1
        msg = {"id": self._next, "method": method, "params": params}
        if session:
            msg["sessionId"] = self.session
        os.write(self._to, json.dumps(msg).encode() + b"\0")
        deadline = time.monotonic() + TIMEOUT
        while True:
            reply = self._read(deadline)
            if reply.get("id") == self._next:
                if "error" in reply:
                    raise RuntimeError(f"{method}: {reply['error']}")
                return reply.get("result", {})
            self.events.append(reply)

    def wait_for(self, method: str) -> dict:
        deadline = time.monotonic() + TIMEOUT
        for i, e in enumerate(self.events):
            if e.get("method") == method:
                return self.events.pop(i)
        while True:
            e = self._read(deadline)
            if e.get("method") == method:
                return e
            self.events.append(e)

    def evaluate(self, expression: str):
        out = self.call("Runtime.evaluate", session=True, expression=expression, returnByValue=True)
        return out["result"].get("value")

    def close(self) -> None:
        try:
            self.call("Browser.close")
        except (RuntimeError, TimeoutError, OSError):
            pass
        try:
            self.proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            self.proc.kill()
        os.close(self._to)
        os.close(self._from)
        shutil.rmtree(self._profile, ignore_errors=True)


def errors(events: list[dict]) -> list[str]:
    """Console errors, uncaught exceptions, error log entries (a missing image is one) and failed loads."""
    out = []
    for e in events:
        m, p = e.get("method"), e.get("params", {})
        if m == "Runtime.consoleAPICalled" and p.get("type") in ("error", "assert"):
            out.append("console: " + " ".join(str(a.get("value", a.get("description"))) for a in p.get("args", [])))
        elif m == "Runtime.exceptionThrown":
            out.append("exception: " + p["exceptionDetails"].get("text", ""))
        elif m == "Log.entryAdded" and p["entry"].get("level") == "error":
            out.append(f"log: {p['entry'].get('text')} {p['entry'].get('url', '')}")
        elif m == "Network.loadingFailed" and not p.get("canceled"):
            out.append(f"load failed: {p.get('errorText')}")
    return out


def load(page: Path, screenshot: Path, width: int = 1280) -> dict:
    """Open `page` (a file), wait for its load event, and report what a reader would have seen."""
    browser = Browser(binary(), width=width)
    try:
        browser.call("Page.navigate", session=True, url=page.resolve().as_uri())
        browser.wait_for("Page.loadEventFired")
        images = browser.evaluate(
            "Array.from(document.images).map(i => ({src: i.currentSrc || i.src, ok: i.complete && i.naturalWidth > 0}))")
        links = browser.evaluate("Array.from(document.links).map(a => a.href)")
        title = browser.evaluate("document.title")
        size = browser.call("Page.getLayoutMetrics", session=True)["cssContentSize"]
        shot = browser.call("Page.captureScreenshot", session=True, format="png", captureBeyondViewport=True,
                            clip={"x": 0, "y": 0, "width": width, "height": min(size["height"], 8000), "scale": 1})
        screenshot.write_bytes(base64.b64decode(shot["data"]))
        return {"title": title, "images": images, "links": links, "errors": errors(browser.events)}
    finally:
        browser.close()


def links_and_images(page: Path) -> list[str]:
    """Every <a href> and <img src> of a page, as written."""
    found = []

    class Collect(HTMLParser):
        def handle_starttag(self, tag, attrs):
            a = dict(attrs)
            if tag == "a" and "href" in a:
                found.append(a["href"])
            if tag == "img":
                found.append(a["src"])

    Collect().feed(page.read_text())
    return found


def assert_archive_resolves(root: Path) -> int:
    """Every link and image of every page is relative and names a file that exists."""
    pages = [root / "index.html", *root.glob("_pages/*/*.html")]
    count = 0
    for page in pages:
        for ref in links_and_images(page):
            parts = urlsplit(ref)
            assert not parts.scheme and not ref.startswith("/"), f"{page.name}: {ref} is not relative"
            if parts.path:
                assert (page.parent / unquote(parts.path)).is_file(), f"{page.name}: {ref} does not resolve"
            count += 1
    return count
