"""The web console (/console) in real headless Chromium, on the real stack.

The scene is made through the API as a client would: two tenants, each with batches (one
line of one batch fails, so it has an error file), chats, a fine-tuning job with a
validation file (its loss curves), limits on one tenant. Then each page is loaded as a
tenant's key and as an admin key: it shows no console error (a CSP violation or a failed
request is one), its charts have drawn points, the numbers it shows are the API's (the
same endpoints fetched here and compared with the text on the page), a tenant sees only
its own work and is not offered the fleet, every control is reached with Tab in order with
a visible focus, and the batch list renders a page of 100 with one write.

The system's Chromium is driven (`make test-deps` installs it; Playwright downloads no
browser). Screenshots of every page go to $BALLAST_TEST_ARTIFACTS/console, or to a
temporary directory, whose path is printed.
"""

from __future__ import annotations

import functools
import json
import os
import re
import shutil
import time
import uuid
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from datetime import UTC, datetime
from pathlib import Path

import httpx
import pytest

from tests.e2e.conftest import WAIT_S, Stack, make_admin_key, make_key

CHROMIUM = shutil.which("chromium") or shutil.which("chromium-browser")
pytestmark = [pytest.mark.e2e,
              pytest.mark.skipif(CHROMIUM is None, reason="Chromium is not installed: `make test-deps` installs it "
                                                          "(apt-get install chromium)")]

MODEL = "ballast-tiny"
CHATS = [[dict(role="user", content=f"Colour {i}?"), dict(role="assistant", content=["red", "green", "blue"][i % 3])]
         for i in range(10)]
HELD_OUT = [[dict(role="user", content=f"Shade {i}?"), dict(role="assistant", content=["teal", "navy"][i % 2])]
            for i in range(3)]


def wait(what: str, until: Callable[[], object], timeout: float = WAIT_S, every: float = 0.5):
    deadline = time.monotonic() + timeout
    while not (got := until()):
        assert time.monotonic() < deadline, what
        time.sleep(every)
    return got


@dataclass
class Scene:
    stack: Stack
    admin: str
    tenant: str
    key: str  # the tenant's
    other: str
    other_key: str
    batches: list[str]
    other_batch: str
    job: str

    def http(self, key: str) -> httpx.Client:
        return httpx.Client(base_url=self.stack.url, headers={"Authorization": f"Bearer {key}"}, timeout=30)


def _batch(api: httpx.Client, lines: list[dict]) -> str:
    body = "".join(json.dumps(ln) + "\n" for ln in lines)
    file_id = api.post("/v1/files", files={"file": ("in.jsonl", body)}, data={"purpose": "batch"}).json()["id"]
    r = api.post("/v1/batches", json=dict(input_file_id=file_id, endpoint="/v1/chat/completions",
                                          completion_window="24h"))
    assert r.status_code == 200, r.text
    return r.json()["id"]


def _line(i: int, model: str = MODEL) -> dict:
    return dict(custom_id=f"c{i}", method="POST", url="/v1/chat/completions",
                body=dict(model=model, messages=[dict(role="user", content=f"Count to {i}")], max_tokens=24,
                          temperature=0))


@pytest.fixture(scope="module")
def scene(stack, db_url) -> Scene:
    tag = uuid.uuid4().hex[:6]
    tenant, other = f"console-a-{tag}", f"console-b-{tag}"
    key, other_key, admin = make_key(db_url, tenant), make_key(db_url, other), make_admin_key(db_url)
    with httpx.Client(base_url=stack.url, headers={"Authorization": f"Bearer {admin}"}, timeout=30) as a:
        r = a.put(f"/admin/tenants/{tenant}/limits", json=dict(model="*", requests_per_min=600,
                                                               input_tokens_per_min=200_000,
                                                               output_tokens_per_min=100_000,
                                                               tokens_per_day=50_000_000))
        assert r.status_code == 200, r.text
    with httpx.Client(base_url=stack.url, headers={"Authorization": f"Bearer {key}"}, timeout=120) as api:
        training = "".join(json.dumps(dict(messages=c)) + "\n" for c in CHATS)
        held_out = "".join(json.dumps(dict(messages=c)) + "\n" for c in HELD_OUT)
        train_id = api.post("/v1/files", files={"file": ("train.jsonl", training)},
                            data={"purpose": "fine-tune"}).json()["id"]
        valid_id = api.post("/v1/files", files={"file": ("valid.jsonl", held_out)},
                            data={"purpose": "fine-tune"}).json()["id"]
        # 20 steps (10 examples, one a step, twice): a checkpoint, with both losses, every chunk of 10.
        r = api.post("/v1/fine_tuning/jobs", json=dict(model=MODEL, training_file=train_id, validation_file=valid_id,
                                                       seed=3, hyperparameters=dict(n_epochs=2, batch_size=1)))
        assert r.status_code == 200, r.text
        job = r.json()["id"]
        batches = [_batch(api, [_line(i) for i in range(3)]),
                   _batch(api, [_line(3), _line(4), _line(5, model="no-such-model")])]
        for i in range(3):
            r = api.post("/v1/chat/completions", json=dict(model=MODEL, max_tokens=8, temperature=0,
                                                           messages=[dict(role="user", content=f"Hello {i}")]))
            assert r.status_code == 200, r.text
    with httpx.Client(base_url=stack.url, headers={"Authorization": f"Bearer {other_key}"}, timeout=60) as api:
        other_batch = _batch(api, [_line(9)])
    s = Scene(stack, admin, tenant, key, other, other_key, batches, other_batch, job)

    final = ("completed", "failed", "cancelled", "expired")
    with s.http(key) as api, s.http(other_key) as them, s.http(admin) as adm:
        def ended(batch: str) -> bool:
            return api.get(f"/v1/batches/{batch}").json()["status"] in final

        for b in batches:
            wait(f"batch {b} to end", functools.partial(ended, b))
        wait("the other tenant's batch", lambda: them.get(f"/v1/batches/{other_batch}").json()["status"] in final)
        wait(f"fine-tune {job} to end", lambda: api.get(f"/v1/fine_tuning/jobs/{job}").json()["status"]
             in ("succeeded", "failed", "cancelled"), timeout=600, every=2)
        assert api.get(f"/v1/fine_tuning/jobs/{job}").json()["status"] == "succeeded"
        # The chats' outcomes are journaled by their workflows, a moment after they ended.
        since = int(time.time()) - 900
        wait("the chats in the timeline", lambda: sum(b["chat_requests"] for b in adm.get(
            f"/admin/timeline?since={since}&step=10").json()["data"]) >= 3)
    return s


# -- the browser ------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def artifacts(tmp_path_factory) -> Path:
    root = os.environ.get("BALLAST_TEST_ARTIFACTS")
    out = Path(root) / "console" if root else tmp_path_factory.mktemp("console-screens")
    out.mkdir(parents=True, exist_ok=True)
    print(f"\nconsole screenshots: {out}")
    return out


@pytest.fixture(scope="module")
def browser():
    sync_api = pytest.importorskip("playwright.sync_api", reason="playwright is not installed (the dev extra)")
    with sync_api.sync_playwright() as p:
        b = p.chromium.launch(executable_path=CHROMIUM, args=["--no-sandbox"])
        try:
            yield b
        finally:
            b.close()


class Console:
    """A tab on the console, collecting every console error and uncaught exception."""

    def __init__(self, browser, stack: Stack, artifacts: Path):
        self.context = browser.new_context(viewport=dict(width=1280, height=900), accept_downloads=True)
        self.page = self.context.new_page()
        self.page.set_default_timeout(30_000)
        self.url, self.artifacts = stack.url + "/console", artifacts
        self.errors: list[str] = []
        self.page.on("console", lambda m: self.errors.append(f"console: {m.text}") if m.type == "error" else None)
        self.page.on("pageerror", lambda e: self.errors.append(f"pageerror: {e}"))

    def sign_in(self, key: str) -> None:
        self.page.goto(self.url)
        self.page.fill("#key", key)
        self.page.press("#key", "Enter")
        self.page.wait_for_selector("#nav:not([hidden])")

    def go(self, route: str, ready: str) -> None:
        self.page.evaluate("(r) => { location.hash = r; }", route)
        self.page.wait_for_selector(ready, state="attached")

    def shot(self, name: str) -> None:
        self.page.screenshot(path=str(self.artifacts / f"{name}.png"), full_page=True)

    def text(self, selector: str) -> str:
        return self.page.inner_text(selector).strip()

    def cells(self, rows: str) -> dict[str, list[str]]:
        """The text of each cell of the rows matching `rows`, by the row's first data-* value
        (textContent: a table under a closed disclosure is not rendered, so it has no innerText)."""
        return self.page.eval_on_selector_all(rows, """rows => Object.fromEntries(rows.map(r =>
            [Object.values(r.dataset)[0], [...r.cells].map(c => c.textContent.replace(/\\s+/g, ' ').trim())]))""")

    def no_errors(self) -> None:
        assert not self.errors, self.errors

    def close(self) -> None:
        self.context.close()


@pytest.fixture
def tab(browser, stack, artifacts) -> Iterator[Console]:
    c = Console(browser, stack, artifacts)
    try:
        yield c
    finally:
        c.close()


def path_points(page, selector: str) -> int:
    """How many points the SVG path draws (its M and L commands)."""
    d = page.get_attribute(selector, "d") or ""
    return len(re.findall(r"[ML]", d))


def tab_through(page) -> tuple[list[str], list[str], dict[str, str]]:
    """Press Tab until focus has gone round: (every visible control, in document order; the
    order Tab reached them; each reached one's outline while it had focus)."""
    controls = page.evaluate("""() => {
        const all = [...document.querySelectorAll('a[href], button, input, select, summary, [tabindex]')];
        all.forEach((el, i) => { el.dataset.probe = String(i); });
        return all.filter(el => !el.disabled && el.tabIndex >= 0 && el.getClientRects().length
                                && getComputedStyle(el).visibility !== 'hidden')
                  .map(el => el.dataset.probe);
    }""")
    page.evaluate("() => { document.activeElement && document.activeElement.blur(); window.scrollTo(0, 0); }")
    reached: list[str] = []
    outlines: dict[str, str] = {}
    for _ in range(len(controls) + 6):
        page.keyboard.press("Tab")
        probe, outline = page.evaluate("""() => { const el = document.activeElement, cs = getComputedStyle(el);
            return [el.dataset.probe || null, cs.outlineStyle + ' ' + cs.outlineWidth]; }""")
        if probe is None:
            continue
        if probe in reached:
            break
        reached.append(probe)
        outlines[probe] = outline
    return controls, reached, outlines


def assert_keyboard(c: Console, first_in_view: str, ready: str) -> None:
    """Every control reached with Tab, each with a visible focus ring, in a sensible order:
    skip link, navigation, sign-out, then the page. From a fresh load (the key is kept in
    the tab), so that Tab starts at the top of the document."""
    c.page.reload()
    c.page.wait_for_selector(ready, state="attached")
    controls, reached, outlines = tab_through(c.page)
    missing = [p for p in controls if p not in reached]
    describe = c.page.evaluate(
        """(ps) => ps.map(p => document.querySelector(`[data-probe="${p}"]`).outerHTML.slice(0, 120))""", missing)
    assert not missing, describe
    hidden = {p: o for p, o in outlines.items() if o.startswith("none") or o.endswith(" 0px")}
    assert not hidden, hidden
    probe = lambda sel: c.page.get_attribute(sel, "data-probe")  # noqa: E731
    order = [reached.index(probe(sel)) for sel in ("#skip", "#nav-links a", "#sign-out", first_in_view)]
    assert order == sorted(order), order


def hms(t: int) -> str:
    return datetime.fromtimestamp(t, UTC).strftime("%H:%M:%S")


def num(s: str) -> float | None:
    return None if s == "—" else float(s.replace(",", ""))


# -- a tenant's key ---------------------------------------------------------------------------


def test_a_tenant_sees_its_batches_with_the_apis_numbers(scene, tab):
    tab.sign_in(scene.key)
    nav = tab.page.eval_on_selector_all("#nav-links a", "as => as.map(a => a.textContent)")
    assert nav == ["Usage", "Batches", "Fine-tunes"]  # no fleet offered
    tab.go("#/batches", "#batches-rows tr[data-id]")
    with scene.http(scene.key) as api:
        listed = api.get("/v1/batches?limit=100").json()["data"]
    shown = tab.cells("#batches-rows tr[data-id]")
    assert set(shown) == {b["id"] for b in listed} and set(scene.batches) <= set(shown)
    assert scene.other_batch not in tab.text("#batches-table")
    for b in listed:
        c = b["request_counts"]
        done = c["completed"] + c["failed"]
        status, progress, preemptions = shown[b["id"]][1:4]
        assert status == b["status"]
        assert progress == f"{done} / {c['total']}" + (f" ({c['failed']} failed)" if c["failed"] else "")
        bar = tab.page.eval_on_selector(f'tr[data-id="{b["id"]}"] progress', "p => [p.value, p.max]")
        assert bar == [done, max(1, c["total"])]
        assert num(preemptions.split(" ")[0]) == b["ballast"]["preemptions"]
        for field, what in (("input_file_id", "input"), ("output_file_id", "output"), ("error_file_id", "errors")):
            button = tab.page.query_selector(f'tr[data-id="{b["id"]}"] button[data-file]:text-is("{what}")')
            assert (button is not None) == bool(b[field]), (b["id"], what)
    failing = next(b for b in listed if b["id"] == scene.batches[1])
    assert failing["request_counts"]["failed"] == 1 and failing["error_file_id"]

    # A download is the file's content, fetched with the key.
    with tab.page.expect_download() as got:
        tab.page.click(f'tr[data-id="{failing["id"]}"] button:text-is("errors")')
    with scene.http(scene.key) as api:
        expected = api.get(f"/v1/files/{failing['error_file_id']}/content").content
    assert Path(got.value.path()).read_bytes() == expected
    tab.shot("batches")
    tab.no_errors()


def test_a_tenant_sees_its_fine_tune_losses_and_checkpoints(scene, tab):
    tab.sign_in(scene.key)
    tab.go("#/fine-tunes", f'#jobs-rows tr[data-id="{scene.job}"]')
    tab.shot("fine-tunes")
    tab.page.click(f'#jobs-rows a:text-is("{scene.job}")')
    tab.page.wait_for_selector("#loss-chart path[data-series=valid]", state="attached")
    base = f"/v1/fine_tuning/jobs/{scene.job}"
    with scene.http(scene.key) as api:
        job = api.get(base).json()
        events = api.get(f"{base}/events?limit=100").json()["data"]
        checkpoints = api.get(f"{base}/checkpoints?limit=100").json()["data"]
        csv = api.get(f"/v1/files/{job['result_files'][0]}/content").text.splitlines()
    # The finished job's metrics file: every step's train loss, the validation loss at checkpoints.
    head = csv[0].split(",")
    steps = [dict(zip(head, line.split(","), strict=True)) for line in csv[1:]]
    assert len(steps) == 20
    valid = [r for r in steps if r["valid_loss"]]
    assert valid and path_points(tab.page, "#loss-chart path[data-series=valid]") == len(valid)
    assert path_points(tab.page, "#loss-chart path[data-series=train]") == len(steps)
    shown = tab.cells("#loss-data tbody tr")
    assert list(shown) == [r["step"] for r in steps]
    for r in steps:
        step, train, val = shown[r["step"]]
        assert step == r["step"] and abs(float(train) - float(r["train_loss"])) <= 6e-5
        assert (val == "—") == (not r["valid_loss"])
        assert val == "—" or abs(float(val) - float(r["valid_loss"])) <= 6e-5
    # …which agree with what the job's events said at each checkpoint.
    said = {e["data"]["step"]: e["data"] for e in events if "step" in (e.get("data") or {})}
    assert said and all(abs(d["valid_loss"] - float(steps[s - 1]["valid_loss"])) < 1e-5 for s, d in said.items())
    readout = tab.text("#job-loss .readout")
    assert f"at step {valid[-1]['step']}" in readout and f"at step {steps[-1]['step']}" in readout
    rows = tab.cells("#checkpoints-table tbody tr")
    assert [r[0] for r in rows.values()] == [str(c["step_number"]) for c in checkpoints]
    assert all(abs(float(r[1]) - c["metrics"]["train_loss"]) <= 6e-5 for r, c in zip(rows.values(), checkpoints,
                                                                                     strict=True))
    label = tab.page.get_attribute("#loss-chart", "aria-labelledby")
    assert label and tab.page.text_content(f"#{label.split()[0]}")  # an accessible name
    tab.shot("fine-tune")
    tab.no_errors()


def test_a_tenant_sees_its_usage_against_its_limits(scene, tab):
    tab.sign_in(scene.key)
    tab.go("#/tenants", "#limits-table, #limits .error")
    tab.page.wait_for_selector("#usage-minute .chart, #usage-minute .error")
    with scene.http(scene.key) as api:
        limits = api.get("/v1/limits").json()["data"]
        source = tab.page.get_attribute("#usage-minute .chart", "data-source")
        minute = api.get(source).json()["data"]
    shown = tab.page.eval_on_selector_all("#limits-table tbody tr", """rows => rows.map(r =>
        [r.dataset.model, r.dataset.limit, r.cells[2].textContent, r.cells[3].textContent])""")
    assert sorted(shown) == sorted([lim["model"], lim["limit"], f"{round(lim['used']):,}", f"{lim['allowed']:,}"]
                                   for lim in limits)
    assert {r[1] for r in shown} >= {"requests_per_min", "tokens_per_day"}
    # Per minute: what the page drew is what the endpoint answers for the same window.
    rows = tab.cells("#usage-tokens-minute-data tbody tr")
    expected = {str(b["start_time"]): [hms(b["start_time"]), f"{sum(r['input_tokens'] for r in b['results']):,}",
                                       f"{sum(r['output_tokens'] for r in b['results']):,}"]
                for b in minute if b["results"]}
    assert rows == expected and rows  # the chats and batches of a few minutes ago
    assert path_points(tab.page, "#usage-tokens-minute path[data-series=input]") == len(minute)
    # requests_per_min: a line, or (far above what was used) named at the chart's top.
    assert tab.page.query_selector('#usage-requests-minute [data-limit="Requests per minute limit: 600"]')
    assert "Requests per minute limit: 600" in tab.text("#usage-minute")
    tab.shot("usage")
    # The fleet is not this key's: not offered, and refused without asking the API.
    tab.go("#/fleet", "#refused")
    assert "admin" in tab.text("#refused")
    tab.no_errors()


def test_every_control_is_reached_with_tab_and_enter_follows_a_link(scene, tab):
    tab.sign_in(scene.key)
    tab.go("#/batches", "#batches-rows tr[data-id]")
    assert_keyboard(tab, "#batches-refresh", "#batches-rows tr[data-id]")
    # Enter on a focused navigation link follows it.
    tab.page.focus("#nav-fine-tunes")
    tab.page.keyboard.press("Enter")
    tab.page.wait_for_selector(f'#jobs-rows tr[data-id="{scene.job}"]')
    assert tab.page.evaluate("location.hash") == "#/fine-tunes"
    assert tab.page.get_attribute("#nav-fine-tunes", "aria-current") == "page"
    tab.page.focus(f'#jobs-rows a:text-is("{scene.job}")')
    tab.page.keyboard.press("Enter")
    tab.page.wait_for_selector("#loss-data")
    assert_keyboard(tab, "#jobs-back", "#loss-data")
    tab.go("#/tenants", "#usage-minute .chart")
    assert_keyboard(tab, "#usage-minute summary", "#usage-minute .chart")
    tab.no_errors()


def test_a_page_of_a_hundred_batches_is_one_write(scene, tab):
    """Thousands of batches: the list pages on the server, 100 at a time, and each page is
    written to the table at once (one mutation of its body), quickly."""
    pages = 30

    def fake(route):
        after = re.search(r"after=batch_fake_(\d+)", route.request.url)
        start = int(after.group(1)) + 1 if after else 0
        data = [dict(id=f"batch_fake_{i}", object="batch", status="in_progress", created_at=1_700_000_000 + i,
                     input_file_id=f"file-in{i}", output_file_id=None, error_file_id=None, estimated_completion=None,
                     request_counts=dict(total=100, completed=i % 100, failed=0),
                     ballast=dict(preemptions=i % 7, items_preempted=i % 3)) for i in range(start, start + 100)]
        route.fulfill(json=dict(object="list", data=data, first_id=data[0]["id"], last_id=data[-1]["id"],
                                has_more=start + 100 < pages * 100))

    tab.page.route(re.compile(r".*/v1/batches\?.*"), fake)
    tab.sign_in(scene.key)
    tab.go("#/batches", "#batches-rows tr[data-id=batch_fake_0]")
    tab.page.evaluate("""() => { window.writes = 0; new MutationObserver(ms => { window.writes += ms.length; })
        .observe(document.getElementById('batches-rows'), { childList: true }); }""")
    spent = []
    for n in range(1, 6):
        t0 = time.perf_counter()
        tab.page.click("#batches-next")
        tab.page.wait_for_selector(f"#batches-rows tr[data-id=batch_fake_{n * 100}]")
        spent.append(time.perf_counter() - t0)
        assert tab.page.eval_on_selector_all("#batches-rows tr", "rs => rs.length") == 100
    assert tab.page.evaluate("window.writes") == 5  # one per page
    assert tab.text("#batches-page").startswith("Page 6: 100 batches")
    tab.page.click("#batches-prev")
    tab.page.wait_for_selector("#batches-rows tr[data-id=batch_fake_400]")
    assert max(spent) < 2.0, spent
    tab.no_errors()


def test_a_bad_key_is_refused_at_sign_in(scene, tab):
    tab.page.goto(tab.url)
    tab.page.fill("#key", "sk-ballast-" + "n" * 43)
    tab.page.click("#sign-in-button")
    tab.page.wait_for_selector("#sign-in-error:has-text('refused')")
    assert tab.page.is_hidden("#nav")
    # The one error: the browser's note of the refused request.
    assert all("401" in e for e in tab.errors) and len(tab.errors) <= 1, tab.errors


# -- an admin key ---------------------------------------------------------------------------


def test_an_admin_sees_the_fleet_and_its_live_timeline(scene, tab):
    tab.sign_in(scene.admin)
    nav = tab.page.eval_on_selector_all("#nav-links a", "as => as.map(a => a.textContent)")
    assert nav == ["Fleet", "Tenants"]
    tab.go("#/fleet", "#engines-table tbody tr")
    tab.page.wait_for_selector("#timeline-chart path[data-series=p99]", state="attached")
    tab.page.wait_for_selector("#timeline-rows tr[data-t]", state="attached")
    with scene.http(scene.admin) as api:
        engines = api.get("/admin/engines").json()["data"]
        shown = tab.cells("#engines-table tbody tr")
        assert set(shown) == {e["id"] for e in engines} and engines
        for e in engines:
            assert shown[e["id"]][1:4] == [e["model"], e["region"] or "—", e["state"]]
        pools = tab.cells("#pools-table tbody tr")
        assert set(pools) == {e["model"] for e in engines}
        # The timeline shown is the endpoint's answer for the window the page asked about
        # (read at once with the rows it drew: the page polls).
        for _ in range(3):
            source, rows = tab.page.evaluate("""() => [document.getElementById('timeline-box').dataset.source,
                Object.fromEntries([...document.querySelectorAll('#timeline-rows tr[data-t]')].map(r =>
                    [r.dataset.t, [...r.cells].map(c => c.textContent.trim())]))]""")
            buckets = api.get(source).json()["data"]
            busy = [b for b in buckets if b["chat_requests"] or b["batch_tokens"] or b["surging"]]
            if set(rows) == {str(b["t"]) for b in busy}:
                break
            time.sleep(1)  # something was journaled in between: look again
        assert set(rows) == {str(b["t"]) for b in busy}
    for b in busy:
        when, requests, p50, p99, tokens, surging = rows[str(b["t"])]
        assert when == hms(b["t"]) and num(requests) == b["chat_requests"]
        for got, want in ((p50, b["chat_ttft_p50_ms"]), (p99, b["chat_ttft_p99_ms"]),
                          (tokens, b["batch_tokens_per_s"])):
            assert (num(got) is None) == (want is None) and (want is None or abs(num(got) - want) <= 0.051), (b, rows)
        assert surging == (", ".join(b["surging"]) or "—")
    assert sum(b["chat_requests"] for b in buckets) >= 3 and sum(b["batch_tokens"] for b in buckets) > 0
    assert path_points(tab.page, "#timeline-chart path[data-series=p99]") == sum(
        b["chat_ttft_p99_ms"] is not None for b in buckets)
    assert path_points(tab.page, "#timeline-chart path[data-series=tokens]") == len(buckets)
    peak = max((b for b in buckets if b["chat_ttft_p99_ms"] is not None), key=lambda b: b["chat_ttft_p99_ms"])
    said = tab.page.evaluate("""() => Object.fromEntries([...document.querySelectorAll('#timeline-readout dt')]
        .map(dt => [dt.textContent, dt.nextElementSibling.textContent]))""")
    shown_peak = re.fullmatch(r"([\d.]+) ms at (\d\d:\d\d:\d\d) UTC", said["Peak p99 TTFT"])
    assert shown_peak, said
    assert abs(float(shown_peak[1]) - peak["chat_ttft_p99_ms"]) <= 0.051 and shown_peak[2] == hms(peak["t"])
    assert said["In the window"] == (f"{sum(b['chat_requests'] for b in buckets):,} requests, "
                                     f"{sum(b['batch_tokens'] for b in buckets):,} batch tokens")
    # It polls: the chart is fetched again within a few seconds, for a later window.
    tab.page.wait_for_function("(s) => document.getElementById('timeline-box').dataset.source !== s",
                               arg=source, timeout=15_000)
    tab.shot("fleet")
    assert_keyboard(tab, "#fleet-window", "#timeline-rows tr[data-t]")
    tab.no_errors()


def test_surges_are_shaded_on_the_timeline_and_named_beside_it(scene, tab):
    """The journal of this stack has no surge: the page is given a timeline that has one."""
    t0 = (int(time.time()) // 10) * 10 - 900

    def timeline(route):
        data = [dict(t=t0 + 10 * i, chat_requests=2, chat_ttft_p50_ms=20.0 + i, chat_ttft_p99_ms=40.0 + 2 * i,
                     batch_tokens=1000 - 10 * i, batch_tokens_per_s=100.0 - i,
                     surging=["ballast-tiny"] if 30 <= i < 45 or i >= 80 else []) for i in range(91)]
        route.fulfill(json=dict(object="list", step=10, since=t0, until=t0 + 910, data=data))

    tab.page.route(re.compile(r".*/admin/timeline\?.*"), timeline)
    tab.sign_in(scene.admin)
    tab.go("#/fleet", "#timeline-chart rect.shade")
    shades = tab.page.eval_on_selector_all("#timeline-chart rect.shade", "rs => rs.map(r => +r.getAttribute('width'))")
    assert len(shades) == 2 and shades[0] > 50
    said = tab.text("#timeline-readout")
    assert f"ballast-tiny {hms(t0 + 300)}–{hms(t0 + 450)} UTC; ballast-tiny {hms(t0 + 800)}–{hms(t0 + 910)} UTC" in said
    assert f"Peak p99 TTFT\n220.0 ms at {hms(t0 + 900)} UTC" in said
    assert path_points(tab.page, "#timeline-chart path[data-series=p50]") == 91
    # Surging still, in the last bucket: so the pool says.
    assert tab.text('#pools-table tr[data-pool="ballast-tiny"] td:last-child').startswith("surging")
    assert tab.text('#fleet-summary [data-card="Surging pools"] .v') == "ballast-tiny"
    tab.shot("fleet-surge")
    tab.no_errors()


def test_an_admin_sees_every_tenant_and_each_ones_usage(scene, tab):
    tab.sign_in(scene.admin)
    tab.go("#/tenants", f'#tenant-list a[data-tenant="{scene.tenant}"]')
    listed = tab.page.eval_on_selector_all("#tenant-list a", "as => as.map(a => a.dataset.tenant)")
    with scene.http(scene.admin) as api:
        assert listed == [t["id"] for t in api.get("/admin/tenants").json()["data"]]
        assert {scene.tenant, scene.other} <= set(listed)
        tab.page.click(f'#tenant-list a[data-tenant="{scene.tenant}"]')
        tab.page.wait_for_selector("#limits-table")
        tab.page.wait_for_selector("#usage-minute .chart")
        limits = api.get(f"/v1/limits?tenant={scene.tenant}").json()["data"]
        source = tab.page.get_attribute("#usage-day .chart", "data-source")
        assert f"tenant={scene.tenant}" in source
        days = api.get(source).json()["data"]
    shown = tab.page.eval_on_selector_all("#limits-table tbody tr", """rows => rows.map(r =>
        [r.dataset.model, r.dataset.limit, r.cells[2].textContent, r.cells[3].textContent])""")
    assert sorted(shown) == sorted([lim["model"], lim["limit"], f"{round(lim['used']):,}", f"{lim['allowed']:,}"]
                                   for lim in limits) and len(shown) == 4
    rows = tab.cells("#usage-tokens-day-data tbody tr")
    assert rows == {str(b["start_time"]): [datetime.fromtimestamp(b["start_time"], UTC).strftime("%Y-%m-%d"),
                                           f"{sum(r['input_tokens'] + r['output_tokens'] for r in b['results']):,}"]
                    for b in days if b["results"]}
    assert path_points(tab.page, "#usage-tokens-day path[data-series=input]") == len(days)
    tab.shot("tenants")
    # An admin key has no batches of its own: the page says so and asks nothing.
    tab.go("#/batches", "#refused")
    tab.no_errors()


def test_sign_out_forgets_the_key(scene, tab):
    tab.sign_in(scene.key)
    tab.page.click("#sign-out")
    tab.page.wait_for_selector("#sign-in:not([hidden])")
    assert tab.page.evaluate("sessionStorage.length") == 0 and tab.page.is_hidden("#nav")
    tab.page.reload()
    tab.page.wait_for_selector("#sign-in:not([hidden])")
    tab.shot("sign-in")
    # Signed out, the form is all there is: reached with Tab, and Enter in the field signs in.
    controls, reached, _ = tab_through(tab.page)
    assert sorted(reached) == sorted(controls) and len(controls) == 3  # the skip link, the key, the button
    # (Tab went round from the key, which has the focus when the form shows.)
    tab.page.focus("#key")
    tab.page.keyboard.type(scene.other_key)
    tab.page.keyboard.press("Enter")
    tab.page.wait_for_selector("#nav:not([hidden])")
    assert tab.text("#who-text") == f"Tenant {scene.other}"
    tab.no_errors()
