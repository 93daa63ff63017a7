"""The dashboard in a real browser: a coordinator with some activity (nodes live, gone and banned, accepted and
rejected groups, two published versions, trainer metrics, a ledger) is opened in headless Chromium (Debian's
`chromium` package); the screenshot must decode, not be blank and show the charts' colours, and the DOM after the
page's scripts ran must hold every section with this run's data. Skipped, saying why, without Chromium (CI installs
it in .ci/run)."""

from __future__ import annotations

import re
import shutil
import subprocess
from html.parser import HTMLParser
from pathlib import Path

import httpx
import pytest
from PIL import Image

from tests.support.coordinator import GROUP, busy_pool

CHROMIUM = shutil.which("chromium") or shutil.which("chromium-browser")
pytestmark = pytest.mark.skipif(CHROMIUM is None, reason="no chromium here: apt-get install -y chromium (.ci/run does)")
SECTIONS = ("summary", "training", "spread", "verification", "nodes", "ledger")
# Colours the page draws with: accepted / current-version bars, rejected bars, the first line of each chart.
GREEN, RED, BLUE = (0x2C, 0xA0, 0x2C), (0xD6, 0x27, 0x28), (0x1F, 0x77, 0xB4)


class Sections(HTMLParser):
    """The text inside each <section id=...> of a page, and the tags seen inside each."""

    def __init__(self) -> None:
        super().__init__()
        self.text: dict[str, list[str]] = {}
        self.tags: dict[str, list[str]] = {}
        self._open: list[str | None] = []

    def handle_starttag(self, tag: str, attrs: list[tuple[str, str | None]]) -> None:
        current = next((s for s in reversed(self._open) if s), None)
        if tag == "section":
            self._open.append(dict(attrs).get("id"))
        elif current is not None:
            self.tags.setdefault(current, []).append(tag)

    def handle_endtag(self, tag: str) -> None:
        if tag == "section" and self._open:
            self._open.pop()

    def handle_data(self, data: str) -> None:
        current = next((s for s in reversed(self._open) if s), None)
        if current is not None and data.strip():
            self.text.setdefault(current, []).append(data.strip())

    def of(self, section: str) -> str:
        return " | ".join(self.text.get(section, []))


def chromium(tmp: Path, *args: str) -> subprocess.CompletedProcess:
    # --virtual-time-budget lets the page's scripts (fetches, rendering) finish before the capture.
    cmd = [CHROMIUM, "--headless", "--no-sandbox", "--disable-gpu", "--disable-dev-shm-usage", "--hide-scrollbars",
           f"--user-data-dir={tmp / 'chromium-profile'}", "--virtual-time-budget=15000", *args]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=180)
    assert proc.returncode == 0, proc.stderr[-2000:]
    return proc


def test_dashboard_shows_every_section_with_the_runs_data(run_factory, tmp_path: Path) -> None:
    run = busy_pool(run_factory)
    ov = run.op.overview()
    assert (ov.nodes, ov.current_version) == ({"live": 2, "gone": 1, "banned": 1}, 1)

    shot = tmp_path / "dashboard.png"
    chromium(tmp_path, f"--screenshot={shot}", "--window-size=1280,1600", run.url + "/")
    image = Image.open(shot).convert("RGB")
    assert image.size == (1280, 1600)
    colours = image.getcolors(maxcolors=1 << 20)
    assert colours is not None and len(colours) > 50, "the screenshot is (nearly) blank"
    present = {c for _, c in colours}
    for name, colour in (("green bars", GREEN), ("red bars", RED), ("chart lines", BLUE)):
        assert colour in present, f"no {name} in the screenshot"

    dom = chromium(tmp_path, "--dump-dom", run.url + "/").stdout
    page = Sections()
    page.feed(dom)
    assert set(SECTIONS) <= set(page.text), (set(SECTIONS) - set(page.text), dom[:2000])
    error = re.search(r'<div id="err" class="err">(.*?)</div>', dom, re.S)
    assert error is not None and error.group(1) == "", error
    summary = page.of("summary")
    for fact in ("policy version | 1", "groups accepted | 5", "rejected | 2", "2 / 1 / 1",
                 f"ledger tokens | {5 * GROUP * 2}", "receipts signed | 5"):
        assert fact in summary, (fact, summary)
    training = page.of("training")
    assert training.count("no data yet") == 1  # accuracy and reward drawn; no node reported idle time
    assert "reward_mean" in training and "eval_accuracy" in training and "step 3" in training
    assert page.tags["training"].count("polyline") == 2
    assert "1 of 2 live nodes hold the current version v1" in page.of("spread")
    assert "v1 | 1 | v0 | 1" in page.of("spread")
    verification = page.of("verification")
    assert "rollout #: tokens after a stop token | 1 | rollout 2: tokens after a stop token" in verification
    assert "node banned" in verification  # the cheater's other pending group, rejected with the ban
    nodes = page.of("nodes")
    for name, state in (("alpha", "live"), ("bravo", "live"), ("ghost", "gone"), ("cheater", "banned")):
        assert f"{name} | {state}" in nodes, (name, nodes)
    ledger = page.of("ledger")  # one row per node: groups, tokens, versions contributed to
    for name, groups in (("alpha", 3), ("bravo", 2)):
        assert f"{name} | {groups} | {groups * GROUP * 2} | 1" in ledger, (name, ledger)
    assert "cheater" not in ledger
    assert re.search(r'<span id="poolname">test-run</span>', dom), dom[:500]
    health = re.search(r'<div id="health"[^>]*>(.*?)</div>', dom, re.S)
    assert health is not None and "last new version" in health.group(1), health
    # The watchdog's words for what blocks training now: the test's trainer never read the feed.
    assert ov.training is not None and ov.training.why and ov.training.why in health.group(1), health.group(1)


def test_the_page_is_self_contained_and_inserts_server_text_as_text(run_factory) -> None:
    run = run_factory()
    page = httpx.get(run.url + "/")
    assert page.status_code == 200 and page.headers["content-type"].startswith("text/html")
    html = page.text
    assert "src=" not in html and "href=" not in html and "cdn" not in html.lower() and "@import" not in html
    assert "innerHTML" not in html and "insertAdjacentHTML" not in html and "document.write" not in html
    for path in ("/v1/status", "/v1/overview", "/v1/ledger/nodes"):
        assert path in html
