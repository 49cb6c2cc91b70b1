"""MLflow as a reviewer opens it, in a real browser: headless Chromium, driven over the DevTools protocol on a pipe
(no package needed), on `evident ui` serving a store with one hand-built evidence directory logged.

- the plots of `DETAILS-with-plots.md` (workflow/tracking.py `plot_view`) load in MLflow's own artifact view;
- `tracking.runs_url`, the link to an experiment, opens its runs table with the headline as columns.

Skips without Chromium or without the full mlflow package (flask).
"""

from __future__ import annotations

import importlib.util
import json
import os
import shutil
import subprocess
import tempfile
import time
import urllib.request
from pathlib import Path

import pytest
from test_tracking import HEADLINE_TAGS, build_headline, seal
from test_tracking_server import start_ui, stop_ui

from evident.workflow import tracking
from evident.workflow.core.evidence import write_text

CHROMIUM = next(filter(None, map(shutil.which, ("chromium", "chromium-browser", "google-chrome"))), None)
pytestmark = [
    pytest.mark.slow,  # ~20 s to start the server on 2 busy cores, a few s a page
    pytest.mark.timeout(240),
    pytest.mark.skipif(CHROMIUM is None, reason="no Chromium (chromium, chromium-browser or google-chrome) on PATH"),
    pytest.mark.skipif(importlib.util.find_spec("flask") is None, reason="`mlflow ui` needs the full mlflow package"),
]
PLOTS = {"bench": "decode tok/s and TPOT against batch", "overlap": "overlap A/B timings"}


class Browser:
    """Headless Chromium over the DevTools protocol on a pipe (`--remote-debugging-pipe`: it reads commands on fd 3
    and answers on fd 4, each message JSON ended by a NUL)."""

    def __init__(self):
        cmd_r, self._cmd_w = os.pipe()
        self._out_r, out_w = os.pipe()
        self._profile = tempfile.TemporaryDirectory()  # a fresh browser: no workflow type remembered

        def fds():
            a, b = os.dup(cmd_r), os.dup(out_w)  # above 4, so neither dup2 overwrites the other
            os.dup2(a, 3)
            os.dup2(b, 4)

        self.proc = subprocess.Popen([CHROMIUM, "--headless", "--no-sandbox", "--disable-gpu", "--remote-debugging-pipe",
                                      f"--user-data-dir={self._profile.name}", "--window-size=2400,1200"],
                                     close_fds=False, preexec_fn=fds, stdout=subprocess.DEVNULL,
                                     stderr=subprocess.DEVNULL)
        os.close(cmd_r)
        os.close(out_w)
        self._buf, self._id = b"", 0
        target = self.call("Target.createTarget", url="about:blank")["targetId"]
        self.session = self.call("Target.attachToTarget", targetId=target, flatten=True)["sessionId"]

    def call(self, method: str, session: str | None = None, **params) -> dict:
        self._id += 1
        os.write(self._cmd_w, json.dumps({"id": self._id, "method": method, "params": params,
                                          **({"sessionId": session} if session else {})}).encode() + b"\0")
        while True:
            while b"\0" not in self._buf:
                chunk = os.read(self._out_r, 1 << 16)
                assert chunk, "chromium closed its pipe"
                self._buf += chunk
            raw, self._buf = self._buf.split(b"\0", 1)
            reply = json.loads(raw)
            if reply.get("id") == self._id:
                assert "error" not in reply, reply
                return reply["result"]

    def js(self, expression: str):
        return self.call("Runtime.evaluate", self.session, expression=expression, returnByValue=True)["result"].get("value")

    def open(self, url: str, until: str, timeout: float = 60):
        """Load url, then the value of `until` once truthy (the page renders after it loads), else None."""
        self.call("Page.navigate", self.session, url=url)
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if value := self.js(until):
                return value
            time.sleep(0.25)
        return None

    def close(self):
        self.proc.terminate()
        self.proc.wait(timeout=10)
        self._profile.cleanup()


def png(path: Path, colour: str) -> None:
    from PIL import Image  # matplotlib's own dependency

    path.parent.mkdir(parents=True, exist_ok=True)
    Image.new("RGB", (60, 40), colour).save(path)


@pytest.fixture(scope="module")
def ui(tmp_path_factory):
    home = tmp_path_factory.mktemp("mlflow-browser")
    ev = build_headline(home / "evidence")
    png(ev / "plots/bench.png", "red")
    png(ev / "plots/overlap.png", "blue")
    write_text(ev / "DETAILS.md", "".join(f"### {k}\n\n![{alt}](plots/{k}.png)\n\n" for k, alt in PLOTS.items()))
    with pytest.MonkeyPatch.context() as mp:
        mp.chdir(home)  # the store's artifacts in ./mlruns, here
        mp.delenv("MLFLOW_TRACKING_URI", raising=False)
        ids = seal(ev, f"sqlite:///{home / 'store.db'}")
    url, proc = start_ui(home)
    browser = Browser()
    try:
        yield url, ids, ev, browser
    finally:
        browser.close()
        stop_ui(proc)


def test_the_plots_load_in_mlflows_artifact_view(ui):
    url, ids, ev, browser = ui
    page = f"{url}/#/experiments/{ids['experiment_id']}/runs/{ids['parent_run_id']}/artifacts/DETAILS-with-plots.md"
    # every plot of DETAILS.md decoded (the page's own images, MLflow's logo, may load first)
    alts = json.dumps(list(PLOTS.values()))
    loaded = browser.open(page, f"""(() => {{
        const shown = [...document.images].filter(i => i.complete && i.naturalWidth > 0 && i.currentSrc);
        const got = Object.fromEntries(shown.map(i => [i.alt, i.currentSrc]));
        return {alts}.every(a => a in got) && got;
    }})()""")
    assert loaded, browser.js("document.body.innerText.slice(0, 2000)")
    for name, alt in PLOTS.items():  # each decoded by the browser, from the parent's own artifact
        with urllib.request.urlopen(loaded[alt], timeout=10) as r:
            assert r.status == 200 and r.read() == (ev / f"plots/{name}.png").read_bytes()


def test_the_experiments_link_opens_the_runs_with_the_headline_as_columns(ui):
    url, ids, ev, browser = ui
    headers = browser.open(tracking.runs_url(url, ids["experiment_id"]), """(() => {
        const h = [...document.querySelectorAll('[role=columnheader]')].map(e => e.innerText.trim());
        return h.includes('parity.verdict') && h;
    })()""")
    assert headers, browser.js("location.href + ' ' + document.body.innerText.slice(0, 2000)")
    assert "/runs" in browser.js("location.href")
    assert {k for k in HEADLINE_TAGS if k.endswith((".verdict", ".noisy"))} <= set(headers)
    row = browser.js("document.querySelector('[role=row]:not(.table-isHeader)')?.innerText || document.body.innerText")
    assert ev.name in row and "all_token_text_exact" in row
