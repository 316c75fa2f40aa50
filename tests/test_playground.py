"""The playground at / in a real browser (Debian's chromium driven by Playwright), offline docs.

One server with an API key, a 40-block pool (so two chats preempt) and slowed steps (so a
stream can be watched and stopped), one with --disable-playground. Every page runs with every
non-loopback URL aborted. Screenshots of each state go to tests/artifacts/playground/.

Without chromium (or playwright) these tests skip with a loud reason on a developer's machine
and fail under CI=true: `.ci/run` must install Debian's chromium.
"""

from __future__ import annotations

import os
import threading
import time
from pathlib import Path
from urllib.parse import urlparse

import httpx
import pytest
from conftest import ServerProcess

API_KEY = "playground-test-key"
AUTH = {"Authorization": f"Bearer {API_KEY}"}
CHROMIUM = "/usr/bin/chromium"
CHROMIUM_ARGS = [
    "--headless",
    "--no-sandbox",
    "--disable-gpu",
    "--disable-background-networking",
    "--disable-component-update",
    "--disable-sync",
    "--no-first-run",
]
ARTIFACTS = Path(__file__).parent / "artifacts" / "playground"
NUM_BLOCKS = 40  # of 16 tokens: two 250-token requests fit, three preempt
WAIT_MS = 60_000
SYSTEM_PROMPT = (
    "You are the pagedserve test assistant. Answer in short sentences and never use more "
    "words than the question needs."
)


def _browser_missing() -> str | None:
    try:
        import playwright.sync_api  # noqa: F401
    except ImportError:
        return "the playwright package is not installed (pip install -e '.[dev]')"
    if not Path(CHROMIUM).exists():
        return f"{CHROMIUM} is missing (apt-get install -y chromium)"
    return None


@pytest.fixture(scope="module")
def servers(tiny_model_dir):
    common = [str(tiny_model_dir), "--dtype", "float32", "--api-key", API_KEY]
    slow = {"PAGEDSERVE_FAULT_INJECT": "step_delay_ms:15"}
    main = ServerProcess(
        *common,
        "--served-model-name",
        "tiny",
        "--num-gpu-blocks-override",
        str(NUM_BLOCKS),
        env=slow,
    )
    off = ServerProcess(*common, "--disable-playground")
    try:
        yield main.wait_ready(), off.wait_ready()
    finally:
        main.stop()
        off.stop()


@pytest.fixture(scope="module")
def server(servers):
    return servers[0]


@pytest.fixture(scope="module")
def browser():
    missing = _browser_missing()
    if missing:
        if os.environ.get("CI") == "true":
            pytest.fail(f"CI must run the browser tests, but {missing}")
        pytest.skip(f"BROWSER TESTS NOT RUN: {missing}")
    from playwright.sync_api import sync_playwright

    with sync_playwright() as p:
        browser = p.chromium.launch(executable_path=CHROMIUM, args=CHROMIUM_ARGS)
        yield browser
        browser.close()


class PageLog:
    """What a page did wrong: console errors, failed requests, HTTP errors, blocked URLs."""

    def __init__(self, page) -> None:
        self.console_errors: list[str] = []
        self.failed: list[str] = []
        self.http_errors: list[str] = []
        self.blocked: list[str] = []
        page.on("console", self._console)
        page.on("pageerror", lambda e: self.console_errors.append(f"pageerror: {e}"))
        page.on("requestfailed", lambda r: self.failed.append(f"{r.url} {r.failure}"))
        page.on("response", self._response)
        page.route("**/*", self._route)

    def _console(self, msg) -> None:
        if msg.type == "error":
            self.console_errors.append(msg.text)

    def _response(self, resp) -> None:
        if resp.status >= 400:
            self.http_errors.append(f"{resp.status} {resp.url}")

    def _route(self, route) -> None:
        host = urlparse(route.request.url).hostname
        if host in ("127.0.0.1", "localhost") or route.request.url.startswith("data:"):
            route.continue_()
        else:
            self.blocked.append(route.request.url)
            route.abort()

    def assert_clean(self, allow_failed: tuple[str, ...] = ()) -> None:
        failed = [f for f in self.failed if not any(a in f for a in allow_failed)]
        assert not self.console_errors, self.console_errors
        assert not failed, failed
        assert not self.http_errors, self.http_errors
        assert not self.blocked, f"the page reached outside loopback: {self.blocked}"


@pytest.fixture()
def context(browser):
    ctx = browser.new_context(viewport={"width": 1400, "height": 950}, extra_http_headers=AUTH)
    yield ctx
    ctx.close()


def open_playground(context, server):
    page = context.new_page()
    log = PageLog(page)
    page.goto(server.url + "/")
    page.wait_for_function(
        "window.pagedserveKV && window.pagedserveKV.numUpdates > 0", timeout=WAIT_MS
    )
    return page, log


def shot(page, name: str) -> None:
    ARTIFACTS.mkdir(parents=True, exist_ok=True)
    page.screenshot(path=str(ARTIFACTS / f"{name}.png"), full_page=True)


def send_chat(page, text: str, max_tokens: int, system: str = "") -> None:
    page.fill("#system", system)
    page.fill("#max-tokens", str(max_tokens))
    page.fill("#input", text)
    page.click("#send")


def kv_eval(page, expr: str):
    return page.evaluate(f"(() => {{ const kv = window.pagedserveKV; return {expr}; }})()")


def wait_kv(page, condition: str) -> None:
    page.wait_for_function(
        f"(() => {{ const kv = window.pagedserveKV; return {condition}; }})()", timeout=WAIT_MS
    )


def wait_idle(server) -> None:
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        snap = httpx.get(server.url + "/kv/snapshot", headers=AUTH, timeout=10).json()
        if not snap["requests"] and snap["counters"]["num_waiting"] == 0:
            return
        time.sleep(0.2)
    raise AssertionError("server did not go idle")


# ---- the page ---------------------------------------------------------------------------------
def test_page_loads_with_no_failed_request_and_no_console_error(context, server):
    page, log = open_playground(context, server)
    page.wait_for_function("document.querySelector('#model-name').textContent.includes('tiny')")
    assert page.inner_text("#kv-status") == "KV stream: live"
    assert kv_eval(page, "kv.numBlocks") == NUM_BLOCKS
    c = kv_eval(page, "kv.counters")
    assert c["num_used_blocks"] + c["num_cached_blocks"] + c["num_free_blocks"] == NUM_BLOCKS
    used_cached_free = f"{c['num_used_blocks']} / {c['num_cached_blocks']} / {c['num_free_blocks']}"
    assert page.inner_text("#c-blocks") == used_cached_free
    time.sleep(0.5)  # let anything late fail
    shot(page, "01-loaded")
    log.assert_clean()


def test_chat_streams_text_into_the_page_with_ttft_and_rate(context, server):
    wait_idle(server)
    page, log = open_playground(context, server)
    send_chat(page, "Say something.", max_tokens=120)
    page.wait_for_selector(".msg.assistant[data-state=streaming]", timeout=WAIT_MS)
    first = len(page.inner_text(".msg.assistant .text"))
    page.wait_for_function(
        f"document.querySelector('.msg.assistant .text').textContent.length > {first}",
        timeout=WAIT_MS,
    )
    wait_kv(page, "kv.requests.length === 1 && kv.selected !== null")
    shot(page, "02-streaming")
    page.wait_for_selector(".msg.assistant[data-state=done]", timeout=WAIT_MS)
    stats = page.inner_text(".msg.assistant .stats")
    assert "TTFT" in stats and "tokens/s" in stats and "120 tokens" in stats, stats
    shot(page, "03-answered")
    log.assert_clean()


def test_stop_aborts_the_request_and_the_map_frees_its_blocks(context, server):
    wait_idle(server)
    page, log = open_playground(context, server)
    send_chat(page, "Count to a thousand.", max_tokens=400)
    page.wait_for_selector(".msg.assistant[data-state=streaming]", timeout=WAIT_MS)
    wait_kv(page, "kv.requests.length === 1 && kv.counters.num_used_blocks > 1")
    shot(page, "04-before-stop")
    page.click("#stop")
    page.wait_for_selector(".msg.assistant[data-state=stopped]", timeout=WAIT_MS)
    wait_kv(page, "kv.requests.length === 0 && kv.counters.num_used_blocks === 0")
    assert kv_eval(page, "Array.from(kv.codes).every((c) => (c & 127) === 0)")
    assert page.inner_text("#c-queue") == "0 / 0"
    shot(page, "05-stopped-blocks-freed")
    snap = httpx.get(server.url + "/kv/snapshot", headers=AUTH, timeout=10).json()
    assert snap["requests"] == [] and set(snap["ref_cnt"]) == {0}
    out = page.inner_text(".msg.assistant .text")
    assert 0 < len(out) and "stopped" in page.inner_text(".msg.assistant .stats")
    log.assert_clean(allow_failed=("/v1/chat/completions",))  # the aborted stream


def test_two_chats_with_one_system_prompt_share_blocks_with_ref_count_2(context, server):
    wait_idle(server)
    first, log1 = open_playground(context, server)
    second, log2 = open_playground(context, server)
    send_chat(first, "What is a block table?", max_tokens=150, system=SYSTEM_PROMPT)
    first.wait_for_selector(".msg.assistant[data-state=streaming]", timeout=WAIT_MS)
    send_chat(second, "What is a prefix cache?", max_tokens=150, system=SYSTEM_PROMPT)
    second.wait_for_selector(".msg.assistant[data-state=streaming]", timeout=WAIT_MS)
    wait_kv(second, "kv.requests.length === 2 && Array.from(kv.codes).some((c) => (c & 127) === 2)")
    num_shared = kv_eval(second, "Array.from(kv.codes).filter((c) => (c & 127) === 2).length")
    assert num_shared >= len(SYSTEM_PROMPT) // 16 - 1  # the system prompt's full blocks
    assert int(second.inner_text("#c-shared")) >= 1
    # the selected request (this page's own) lists its shared blocks with their ref count
    second.wait_for_selector("#block-table .bt.shared", timeout=WAIT_MS)
    assert "(ref 2)" in second.inner_text("#block-table")
    second.wait_for_selector("#events li.prefix_hit", timeout=WAIT_MS)
    shot(second, "06-shared-prefix-blocks")
    for page in (first, second):
        page.wait_for_selector(".msg.assistant[data-state=done]", timeout=WAIT_MS)
    log1.assert_clean()
    log2.assert_clean()


def _cell_pixel(page, block: int, dx: int | None = None) -> list[int]:
    """The pixel of block's cell at dx from its left edge (None: the centre), as drawn now."""
    return page.evaluate(
        """([b, dx]) => {
          const kv = window.pagedserveKV, canvas = document.getElementById('kv-canvas');
          kv.drawNow();
          const g = kv.geometry, ctx = canvas.getContext('2d');
          const x = (b % g.cols) * g.cell + (dx === null ? Math.floor(g.cell / 2) : dx);
          const y = Math.floor(b / g.cols) * g.cell + Math.floor(g.cell / 2);
          return Array.from(ctx.getImageData(x, y, 1, 1).data.slice(0, 3));
        }""",
        [block, dx],
    )


FORKED_RGB = [194, 65, 12]
COW_RGB = [219, 39, 119]


def test_an_n2_request_shows_forked_shared_blocks_and_its_copy(context, server):
    wait_idle(server)
    page, log = open_playground(context, server)
    body = {"model": "tiny", "prompt": list(range(30, 80)), "max_tokens": 120, "n": 2,
            "temperature": 0.8, "seed": 1, "ignore_eos": True}  # fmt: skip
    errors: list[BaseException] = []

    def complete() -> None:
        try:
            r = httpx.post(server.url + "/v1/completions", json=body, headers=AUTH, timeout=300)
            r.raise_for_status()
            assert len(r.json()["choices"]) == 2
        except BaseException as e:  # noqa: BLE001 - reported by the test thread
            errors.append(e)

    thread = threading.Thread(target=complete)
    thread.start()
    try:
        wait_kv(
            page,
            "kv.requests.filter((r) => r.forked).length === 2 && kv.marks.cow.size > 0 && "
            "Array.from(kv.marks.forked).some((b) => (kv.codes[b] & 127) === 2)",
        )
        shared, cow = kv_eval(
            page,
            "[Array.from(kv.marks.forked).find((b) => (kv.codes[b] & 127) === 2), "
            "Array.from(kv.marks.cow)[0]]",
        )
        assert _cell_pixel(page, shared) == FORKED_RGB  # the fork's shared block, filled
        assert _cell_pixel(page, cow, dx=4) == COW_RGB  # the copy, outlined
        forks, copies = (int(x) for x in page.inner_text("#c-forks").split(" / "))
        assert forks >= 1 and copies >= 1
        assert page.is_visible("#legend-forked") and page.is_visible("#legend-cow")
        assert not page.is_visible("#legend-tier")  # this server has no KV tier
        assert page.locator("#requests li[data-forked]").count() == 2
        page.wait_for_selector("#events li.fork", timeout=WAIT_MS)
        assert "copy-on-write" in page.inner_text("#events li.cow")
        shot(page, "07-forked-blocks")
    finally:
        thread.join(timeout=120)
    assert not errors, errors
    log.assert_clean()


def test_a_tiny_pool_shows_a_preemption(context, server):
    wait_idle(server)
    page, log = open_playground(context, server)
    before = kv_eval(page, "kv.counters.num_preemptions_total")
    errors: list[BaseException] = []

    def complete(i: int) -> None:
        body = {
            "model": "tiny",
            "prompt": [3 + (i * 37 + j) % 250 for j in range(50)],  # distinct: no shared blocks
            "max_tokens": 200,
            "ignore_eos": True,
            "temperature": 0,
        }
        try:
            r = httpx.post(server.url + "/v1/completions", json=body, headers=AUTH, timeout=120)
            r.raise_for_status()
        except BaseException as e:  # noqa: BLE001 - reported by the test thread
            errors.append(e)

    threads = [threading.Thread(target=complete, args=(i,)) for i in range(3)]
    for t in threads:
        t.start()
    page.wait_for_selector("#events li.preemption", timeout=WAIT_MS)
    assert kv_eval(page, "kv.counters.num_preemptions_total") > before
    assert int(page.inner_text("#c-preemptions")) > before
    shot(page, "07-preemption")
    for t in threads:
        t.join(120)
    assert not errors and not any(t.is_alive() for t in threads)
    log.assert_clean()


def test_a_pool_of_500k_blocks_draws_aggregated(context, server):
    """More blocks than pixels: each pixel mixes a group's colours (the stream is synthetic)."""
    from engine.core.kv_view import KVSnapshot, RequestBlocks
    from server.kv_api import StreamEncoder

    n = 500_000  # held 0-300k (0-1k shared), cached 300k-400k, free 400k-500k
    tables = [list(range(200_000)), list(range(1_000)) + list(range(200_000, 300_000))]
    requests = [
        RequestBlocks(f"big{i}", t, len(t) * 16, len(t) * 16 + 1, 64, 0, 0)
        for i, t in enumerate(tables)
    ]
    tags = bytes([0] * 300_000 + [7] * 100_000 + [0] * 100_000)
    snap = KVSnapshot(1, time.time(), n, 16, tags, requests, [], 0, 200_000, 100_000, 0, 0, 0, 0)
    event = StreamEncoder().encode(snap)
    page = context.new_page()
    log = PageLog(page)
    page.route(
        "**/kv/stream",
        lambda route: route.fulfill(
            status=200, headers={"content-type": "text/event-stream"}, body=event
        ),
    )
    page.goto(server.url + "/")
    wait_kv(page, f"kv.numBlocks === {n}")
    page.wait_for_function("Number(document.querySelector('#kv-canvas').dataset.perCell) > 1")
    assert page.inner_text("#c-shared") == "1000"
    held, cached, free = page.evaluate("""(() => {
        const c = document.querySelector('#kv-canvas');
        const d = c.getContext('2d').getImageData(0, 0, c.width, c.height).data;
        const at = (i) => Array.from(d.slice(i * 4, i * 4 + 3));
        const px = c.width * c.height;
        return [at(Math.floor(px * 0.3)), at(Math.floor(px * 0.7)), at(Math.floor(px * 0.9))];
    })()""")
    # inside each region every block of a pixel's group has one state: the legend's colours
    assert (held, cached, free) == ([22, 163, 74], [147, 197, 253], [229, 231, 235])
    shot(page, "09-500k-blocks")
    log.assert_clean()


# ---- a sliding-window model: one block table per KV cache group ------------------------------
GEMMA_WINDOW = 32  # tokens; blocks of 16, so a query's window touches at most 3 blocks
GEMMA_PROMPT_LEN = 100  # 7 blocks, past the window: 4 of them slide out at the first decode


@pytest.fixture(scope="module")
def gemma_server(tmp_path_factory):
    """A tiny random Gemma 3: layer 0 sliding (window 32), layer 1 global, so two KV cache
    groups (0 full, 1 sliding). Steps slowed past the view's 10/s so every step is captured."""
    from test_gemma import build_windowed_dir

    path = build_windowed_dir(
        tmp_path_factory.mktemp("tiny-gemma3"),
        "gemma3",
        num_hidden_layers=2,
        sliding_window_pattern=2,
        sliding_window=GEMMA_WINDOW,
    )
    server = ServerProcess(
        str(path),
        "--dtype",
        "float32",
        "--api-key",
        API_KEY,
        "--served-model-name",
        "tiny-gemma",
        "--num-gpu-blocks-override",
        "64",  # cells large enough to see on the map
        env={"PAGEDSERVE_FAULT_INJECT": "step_delay_ms:150"},
    )
    try:
        yield server.wait_ready()
    finally:
        server.stop()


def _complete_in_thread(
    server, model: str, prompt: list[int], max_tokens: int, request_id: str | None = None
):
    errors: list[BaseException] = []
    headers = {**AUTH, "X-Request-Id": request_id} if request_id else AUTH

    def complete() -> None:
        body = {
            "model": model,
            "prompt": prompt,
            "max_tokens": max_tokens,
            "ignore_eos": True,
            "temperature": 0,
        }
        try:
            r = httpx.post(server.url + "/v1/completions", json=body, headers=headers, timeout=300)
            r.raise_for_status()
        except BaseException as e:  # noqa: BLE001 - reported by the test thread
            errors.append(e)

    thread = threading.Thread(target=complete)
    thread.start()
    return thread, errors


# Runs in the page every animation frame: records (full held, sliding held, sliding freed) of
# the selected request at each new KV update, true once the sliding group's table has shrunk
# between two updates while the full group's grew.
SAMPLE_GROUP_TABLES = """(() => {
    const kv = window.pagedserveKV;
    const s = window.groupSamples || (window.groupSamples = []);
    const full = document.querySelector('#block-table .group-table[data-group="0"]');
    const sliding = document.querySelector('#block-table .group-table[data-group="1"]');
    if (full && sliding && (!s.length || s[s.length - 1][3] !== kv.seq)) {
        s.push([Number(full.dataset.held), Number(sliding.dataset.held),
                Number(sliding.dataset.skipped), kv.seq]);
    }
    for (let i = 0; i < s.length; i++)
        for (let j = i + 1; j < s.length; j++)
            if (s[j][1] < s[i][1] && s[j][0] > s[i][0]) return true;
    return false;
})()"""


def test_sliding_group_table_shrinks_while_the_full_one_grows(context, gemma_server):
    page, log = open_playground(context, gemma_server)
    wait_kv(page, "kv.groups.length === 2")
    assert page.is_visible("#groups")
    kinds = page.eval_on_selector_all("#groups-rows tr", "rows => rows.map(r => r.dataset.kind)")
    assert kinds == ["full", "sliding"]
    assert f"window {GEMMA_WINDOW}" in page.inner_text("#groups")
    prompt = [3 + (j * 37) % 250 for j in range(GEMMA_PROMPT_LEN)]
    # selected from its first update on, as the page does with its own chats
    page.evaluate("window.pagedserveKV.follow = 'gemma-shrink'")
    thread, errors = _complete_in_thread(
        gemma_server, "tiny-gemma", prompt, max_tokens=50, request_id="gemma-shrink"
    )
    page.wait_for_function(SAMPLE_GROUP_TABLES, timeout=WAIT_MS, polling="raf")
    samples = page.evaluate("window.groupSamples")
    full, sliding, skipped = ([x[i] for x in samples] for i in range(3))
    assert full == sorted(full), "a full-attention table never gives blocks back"
    assert max(sliding) == -(-GEMMA_PROMPT_LEN // 16)  # the prefill step held every block
    assert sliding[-1] <= -(-(GEMMA_WINDOW - 1) // 16) + 1 and skipped[-1] > 0
    page.wait_for_selector("#block-table .group-table[data-group='1'] .bt.skipped")
    assert "slid out of the window" in page.inner_text("#block-table")
    page.wait_for_selector("#events li.window_free", timeout=WAIT_MS)
    assert int(page.inner_text("#c-window-freed")) >= 4
    shot(page, "10-sliding-window-groups")
    thread.join(300)
    assert not errors and not thread.is_alive()
    log.assert_clean()


def test_kv_snapshot_lists_every_group_and_filters_by_group(gemma_server):
    prompt = [3 + (j * 11) % 250 for j in range(GEMMA_PROMPT_LEN)]
    thread, errors = _complete_in_thread(gemma_server, "tiny-gemma", prompt, max_tokens=30)
    deadline = time.monotonic() + 120
    snap = None
    while time.monotonic() < deadline:  # until the request runs with blocks behind the window
        snap = httpx.get(gemma_server.url + "/kv/snapshot", headers=AUTH, timeout=10).json()
        if snap["requests"] and snap["requests"][0]["groups"][1]["num_skipped_blocks"]:
            break
        time.sleep(0.1)
    assert [(g["kind"], g["window"]) for g in snap["kv_cache_groups"]] == [
        ("full", 0),
        ("sliding", GEMMA_WINDOW),
    ]
    (r,) = snap["requests"]
    tables = [g["block_table"] for g in r["groups"]]
    assert r["block_table"] == tables[0] and -1 not in tables[0] and tables[1][0] == -1
    held = [b for t in tables for b in t if b >= 0]
    assert sorted(b for b, n in enumerate(snap["ref_cnt"]) if n) == sorted(held)
    assert snap["counters"]["num_used_blocks"] == len(held)
    one = httpx.get(
        gemma_server.url + "/kv/snapshot", params={"group": 1}, headers=AUTH, timeout=10
    ).json()
    assert [g["group"] for req in one["requests"] for g in req["groups"]] in ([1], [])
    thread.join(300)
    assert not errors and not thread.is_alive()


@pytest.mark.parametrize("path", ["/kv/snapshot", "/kv/stream"])
@pytest.mark.parametrize("value", ["2", "-1", "x", "1.5", ""])
def test_a_bad_group_gets_an_openai_error_and_the_server_keeps_serving(gemma_server, path, value):
    r = httpx.get(gemma_server.url + path, params={"group": value}, headers=AUTH, timeout=10)
    assert r.status_code == 400
    error = r.json()["error"]
    assert error["type"] == "BadRequestError" and error["param"] == "group"
    assert "2 KV cache groups" in error["message"] and set(error) >= {"message", "code"}
    ok = httpx.get(gemma_server.url + "/kv/snapshot", headers=AUTH, timeout=10)
    assert ok.status_code == 200 and len(ok.json()["kv_cache_groups"]) == 2


def test_a_full_attention_model_has_one_group_and_refuses_group_1(server):
    wait_idle(server)
    snap = httpx.get(server.url + "/kv/snapshot", headers=AUTH, timeout=10).json()
    (group,) = snap["kv_cache_groups"]
    assert (group["group"], group["kind"], group["window"]) == (0, "full", 0)
    assert group["num_skipped_blocks"] == group["num_window_freed_blocks_total"] == 0
    num_hashed = sum(g >= 0 for g in snap["hash_group"])
    assert group["num_hashed_blocks"] == sum(snap["hashed"]) == num_hashed
    assert group["num_cached_blocks"] == snap["counters"]["num_cached_blocks"]
    r = httpx.get(server.url + "/kv/snapshot", params={"group": 1}, headers=AUTH, timeout=10)
    assert r.status_code == 400 and r.json()["error"]["param"] == "group"
    assert "1 KV cache group)" in r.json()["error"]["message"]


# ---- offline docs ------------------------------------------------------------------------------
@pytest.mark.parametrize(
    "path, selector",
    [
        ("/docs", ".swagger-ui .info .title"),
        ("/redoc", "h1"),
    ],
)
def test_docs_render_with_the_network_blocked(context, server, path, selector):
    page = context.new_page()
    log = PageLog(page)
    page.goto(server.url + path)
    page.wait_for_selector(selector, timeout=WAIT_MS)
    assert "pagedserve" in page.inner_text(selector)
    # the KV snapshot route's summary: the schema reached the UI and was rendered
    page.get_by_text("The paged KV cache now").first.wait_for(state="attached", timeout=WAIT_MS)
    shot(page, f"08-docs{path.replace('/', '-')}")
    log.assert_clean()


# ---- HTTP only: auth, the OpenAPI schema, --disable-playground -------------------------------
PLAYGROUND_PATHS = [
    "/",
    "/playground/app.js",
    "/playground/style.css",
    "/kv/snapshot",
    "/kv/stream",
]


@pytest.mark.parametrize("path", [*PLAYGROUND_PATHS, "/docs", "/redoc", "/tokenizer_info"])
def test_page_and_kv_endpoints_need_the_api_key(server, path):
    r = httpx.get(server.url + path, timeout=10)
    assert r.status_code == 401 and r.json()["error"]["type"] == "AuthenticationError"
    with httpx.stream("GET", server.url + path, headers=AUTH, timeout=10) as r:
        assert r.status_code == 200


def test_kv_endpoints_are_in_the_openapi_schema(server):
    schema = httpx.get(server.url + "/openapi.json", headers=AUTH, timeout=10).json()
    for path in ("/kv/snapshot", "/kv/stream", "/tokenizer_info"):
        assert "get" in schema["paths"][path], path
    assert "block_table" in schema["paths"]["/kv/snapshot"]["get"]["description"]


def test_kv_stream_starts_with_a_full_snapshot_event(server):
    events = []
    start = time.monotonic()
    with httpx.stream("GET", server.url + "/kv/stream", headers=AUTH, timeout=10) as r:
        assert r.headers["content-type"].startswith("text/event-stream")
        for line in r.iter_lines():
            if line.startswith("event: "):
                events.append(line[7:])
            if len(events) >= 1:
                break
    assert events == ["snapshot"] and time.monotonic() - start < 10


@pytest.mark.parametrize("path", PLAYGROUND_PATHS)
def test_disable_playground_turns_the_page_and_kv_endpoints_off(servers, path):
    off = servers[1]
    assert httpx.get(off.url + path, headers=AUTH, timeout=10).status_code == 404
    assert httpx.get(off.url + "/v1/models", headers=AUTH, timeout=10).status_code == 200
    assert httpx.get(off.url + "/docs", headers=AUTH, timeout=10).status_code == 200


# ---- the first-ten-minutes edges -----------------------------------------------------------------
HUES = {"held": (22, 163, 74), "shared": (245, 158, 11)}


def _selected_cell_colours(page) -> list[list[int]]:
    """The centre pixel of every block the selected request holds, as drawn."""
    return page.evaluate(
        """() => {
          const kv = window.pagedserveKV, canvas = document.getElementById('kv-canvas');
          kv.drawNow();  // the pixels and the block tables from one state (no frame between)
          const g = kv.geometry, ctx = canvas.getContext('2d');
          const r = kv.requests.find((x) => x.request_id === kv.selected);
          if (!r) return [];
          return kv.heldIds(r).map((b) => {
            const x = (b % g.cols) * g.cell + Math.floor(g.cell / 2);
            const y = Math.floor(b / g.cols) * g.cell + Math.floor(g.cell / 2);
            return Array.from(ctx.getImageData(x, y, 1, 1).data.slice(0, 3));
          });
        }"""
    )


def _state_hue(rgb: list[int]) -> str:
    r, g, b = rgb
    if g > r and g > b:
        return "held"  # green, or its darker shade
    if r > b and g > b:
        return "shared"  # amber
    return f"other {rgb}"


@pytest.fixture(scope="module")
def big_pool_server(tiny_model_dir):
    """12,000 blocks: the map draws small cells (or one pixel a block) at ordinary widths."""
    server = ServerProcess(
        str(tiny_model_dir), "--dtype", "float32", "--api-key", API_KEY,
        "--num-gpu-blocks-override", "12000", env={"PAGEDSERVE_FAULT_INJECT": "step_delay_ms:15"},
    )  # fmt: skip
    try:
        yield server.wait_ready()
    finally:
        server.stop()


@pytest.mark.parametrize(
    ("pool", "width"), [("small", 1400), ("big", 2400), ("big", 1400), ("big", 700)]
)
def test_the_selected_requests_cells_keep_their_state_colour(context, request, pool, width):
    """The page selects its own request; its blocks stay green (held) or amber (shared) with
    an outline, or a darker shade where cells are too small for one, never solid red: at
    large cells (40 blocks), small cells and one pixel per block (12,000 blocks)."""
    server = request.getfixturevalue("server" if pool == "small" else "big_pool_server")
    wait_idle(server)
    page, log = open_playground(context, server)
    page.set_viewport_size({"width": width, "height": 950})
    kv_eval(page, "(kv.zoom = false)")  # the whole pool: small cells for the big one
    send_chat(page, "Say something long.", max_tokens=200)
    wait_kv(page, "kv.selected !== null && kv.requests.some((r) => r.request_id === kv.selected)")
    # read at once: the tiny model may end its answer within a few frames (drawNow draws first)
    colours = _selected_cell_colours(page)
    cell = kv_eval(page, "kv.geometry.cell")
    assert (cell < 10) == (pool == "big"), cell
    assert colours, "the selected request holds no blocks (or had finished when read)"
    assert {_state_hue(c) for c in colours} <= {"held", "shared"}, (cell, colours)
    shot(page, f"10-selected-cells-{pool}-{width}px-cell{cell}")
    if page.is_enabled("#stop"):  # the tiny model may already have ended its answer
        page.click("#stop")
    log.assert_clean(allow_failed=("/v1/chat/completions",))  # the stop aborts the stream


def test_a_big_pool_is_drawn_up_to_its_highest_used_block(context, big_pool_server):
    """12,000 blocks would draw as 4-pixel cells with a thin line in use: the map's scale
    follows the highest block in use instead, and says so."""
    wait_idle(big_pool_server)
    page, log = open_playground(context, big_pool_server)
    send_chat(page, "Say something long.", max_tokens=200)
    wait_kv(page, "kv.selected !== null && kv.requests.some((r) => r.request_id === kv.selected)")
    page.wait_for_timeout(300)
    shown, cell = kv_eval(page, "[kv.geometry.shown, kv.geometry.cell]")
    top = kv_eval(page, "kv.codes.findLastIndex((c) => c !== 0)")
    assert top < shown < 12_000 and cell >= 8, (top, shown, cell)
    assert "the rest are free" in page.inner_text("#map-scale")
    assert {_state_hue(c) for c in _selected_cell_colours(page)} <= {"held", "shared"}
    shot(page, "12-big-pool-zoomed")
    page.click("#stop")
    log.assert_clean(allow_failed=("/v1/chat/completions",))


def test_the_window_legend_shows_only_for_windowed_models(context, server, gemma_server):
    page, _ = open_playground(context, server)
    page.wait_for_function("window.pagedserveKV.groups.length > 0", timeout=WAIT_MS)
    assert page.is_hidden("#legend-window")
    page, _ = open_playground(context, gemma_server)
    page.wait_for_selector("#legend-window", state="visible", timeout=WAIT_MS)


@pytest.fixture(scope="module")
def templateless_server(tiny_model_dir, tmp_path_factory):
    """The tiny model without a chat template (as Gemma 3 270M's GGUF has none)."""
    import json
    import shutil

    path = tmp_path_factory.mktemp("tiny-no-template") / "model"
    shutil.copytree(tiny_model_dir, path)
    (path / "chat_template.jinja").unlink(missing_ok=True)
    config_path = path / "tokenizer_config.json"
    config = json.loads(config_path.read_text())
    config.pop("chat_template", None)
    config_path.write_text(json.dumps(config))
    server = ServerProcess(str(path), "--dtype", "float32", "--api-key", API_KEY)
    try:
        yield server.wait_ready()
    finally:
        server.stop()


def test_a_model_without_a_chat_template_opens_in_raw_completion(context, templateless_server):
    page, log = open_playground(context, templateless_server)
    page.wait_for_function("document.querySelector('#mode').value === 'completion'")
    assert "no chat template" in page.inner_text("#mode-note")
    assert page.is_hidden("#system-label")
    page.fill("#max-tokens", "8")
    page.fill("#input", "Once upon a time")
    page.click("#send")
    page.wait_for_selector(".msg.completion[data-state=done]", timeout=WAIT_MS)
    shot(page, "11-no-chat-template-raw-completion")
    log.assert_clean()


@pytest.fixture(scope="module")
def lora_server(tiny_model_dir, tmp_path_factory):
    from test_lora import ATTN, build_adapter

    root = tmp_path_factory.mktemp("playground-loras")
    attn = build_adapter(tiny_model_dir, root / "attn", 21, 8, ATTN, lora_alpha=16)
    server = ServerProcess(
        str(tiny_model_dir), "--dtype", "float32", "--served-model-name", "tiny",
        "--api-key", API_KEY, "--enable-lora", "--lora-modules", f"attn={attn}",
    )  # fmt: skip
    yield server.wait_ready()
    server.stop()


def test_the_model_picker_lists_adapters_and_a_chat_goes_with_the_pick(
    context, lora_server, server
):
    page, log = open_playground(context, lora_server)
    page.wait_for_selector("#model-label:not([hidden])", timeout=WAIT_MS)
    options = page.eval_on_selector_all("#model option", "os => os.map(o => [o.value, o.text])")
    assert options == [["tiny", "tiny"], ["attn", "attn (LoRA adapter of tiny)"]]
    assert page.input_value("#model") == "tiny"
    models = []

    def on_request(req) -> None:
        if req.url.endswith("/v1/chat/completions"):
            models.append(req.post_data_json["model"])

    page.on("request", on_request)
    page.select_option("#model", "attn")
    send_chat(page, "Hello.", max_tokens=4)
    page.wait_for_selector(".msg.assistant[data-state=done]", timeout=WAIT_MS)
    assert models == ["attn"]
    assert "4 tokens" in page.inner_text(".msg.assistant .stats")
    shot(page, "lora-picker")
    log.assert_clean()
    plain, _ = open_playground(context, server)  # one model: no picker
    plain.wait_for_function("document.querySelector('#model-name').textContent.includes('tiny')")
    assert plain.is_hidden("#model-label")
