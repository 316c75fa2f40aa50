"""The playground's image input in a real browser (Debian's chromium driven by Playwright): a
tiny random-weight LLaVA served with an API key; an image picked through the file input, pasted
or dropped shows as a thumbnail with a remove button and goes out as an OpenAI `image_url` part
with a `data:` URL; the answer equals the API's for the same image, the server's encoder ran
and the KV map marked the request's image blocks. A refused image leaves the conversation; a
text-only model (its /v1/models card lists only "text") shows no image control.

Screenshots go to tests/artifacts/playground/ (image-*.png)."""

from __future__ import annotations

import base64
import io

import httpx
import pytest
import test_playground
from conftest import ServerProcess, metric_value
from test_multimodal import build_tiny_llava_dir, random_image
from test_playground import (
    API_KEY,
    AUTH,
    WAIT_MS,
    kv_eval,
    open_playground,
    shot,
    wait_idle,
    wait_kv,
)

browser = test_playground.browser  # the fixtures: chromium, and a context with the API key
context = test_playground.context
MAX_MEDIA_BYTES = 100_000
ENCODED = "pagedserve:mm_encoder_images_total"


def png(image) -> bytes:
    buf = io.BytesIO()
    image.save(buf, format="PNG")
    return buf.getvalue()


def noise_png(size: int) -> bytes:
    """An incompressible PNG of size x size pixels (past MAX_MEDIA_BYTES for 256)."""
    from PIL import Image

    rng = __import__("numpy").random.default_rng(size)
    return png(Image.fromarray(rng.integers(0, 256, (size, size, 3), dtype="uint8")))


@pytest.fixture(scope="module")
def llava_server(tmp_path_factory):
    path = build_tiny_llava_dir(tmp_path_factory.mktemp("pg-llava"))
    server = ServerProcess(
        str(path), "--dtype", "float32", "--served-model-name", "tiny-llava",
        "--api-key", API_KEY, "--max-media-bytes", str(MAX_MEDIA_BYTES),
        env={"PAGEDSERVE_FAULT_INJECT": "step_delay_ms:15"},
    )  # fmt: skip
    try:
        yield server.wait_ready()
    finally:
        server.stop()


@pytest.fixture(scope="module")
def text_server(tiny_model_dir):
    server = ServerProcess(str(tiny_model_dir), "--dtype", "float32", "--api-key", API_KEY)
    try:
        yield server.wait_ready()
    finally:
        server.stop()


def encoded(server) -> float:
    text = httpx.get(server.url + "/metrics", headers=AUTH, timeout=10).text
    return metric_value(text, ENCODED, {"model_name": "tiny-llava"})


def chat_bodies(page) -> list[dict]:
    bodies: list[dict] = []
    page.on(
        "request",
        lambda r: bodies.append(r.post_data_json) if r.url.endswith("/chat/completions") else None,
    )
    return bodies


def attach_files(page, tmp_path, *images: bytes) -> None:
    paths = []
    for i, data in enumerate(images):
        paths.append(tmp_path / f"image{i}.png")
        paths[-1].write_bytes(data)
    page.set_input_files("#image-input", [str(p) for p in paths])
    page.wait_for_function(
        f"document.querySelectorAll('#attachments .thumb img').length === {len(images)}",
        timeout=WAIT_MS,
    )


TRANSFER_JS = """async ([kind, b64]) => {
  const bytes = Uint8Array.from(atob(b64), (c) => c.charCodeAt(0));
  const dt = new DataTransfer();
  if (b64) dt.items.add(new File([bytes], "pasted.png", { type: "image/png" }));
  else dt.setData("text/plain", "just text");
  const target = document.getElementById(kind === "paste" ? "input" : "composer");
  const event = kind === "paste"
    ? new ClipboardEvent("paste", { clipboardData: dt, bubbles: true, cancelable: true })
    : new DragEvent("drop", { dataTransfer: dt, bubbles: true, cancelable: true });
  target.dispatchEvent(event);
  return event.defaultPrevented;
}"""


def transfer(page, kind: str, data: bytes | None) -> bool:
    """A paste (on the text box) or a drop (on the composer) of one PNG file (None: text), as
    a user's; True when the page took it (the event's default prevented)."""
    return page.evaluate(TRANSFER_JS, [kind, base64.b64encode(data).decode() if data else ""])


def test_an_attached_image_goes_out_as_an_image_url_part_and_is_answered(
    context, llava_server, tmp_path
):
    wait_idle(llava_server)
    page, log = open_playground(context, llava_server)
    page.wait_for_selector("#attach", state="visible", timeout=WAIT_MS)
    image = png(random_image(21))
    attach_files(page, tmp_path, png(random_image(22)))
    page.click("#attachments .thumb .remove")  # the preview's remove button
    assert page.is_hidden("#attachments")
    attach_files(page, tmp_path, image)
    assert page.get_attribute("#attachments img", "src").startswith("data:image/png;base64,")
    shot(page, "image-01-attached")
    bodies = chat_bodies(page)
    before = encoded(llava_server)
    page.fill("#temperature", "0")
    page.fill("#max-tokens", "40")
    page.fill("#input", "what is this?")
    page.click("#send")
    assert page.is_hidden("#attachments")  # sent: the next message starts without images
    # the KV map marks the running request's image blocks (16 placeholder tokens)
    wait_kv(page, "kv.requests.some((r) => r.num_image_tokens === 16) && kv.marks.image.size > 0")
    page.wait_for_selector(".msg.assistant[data-state=done]", timeout=WAIT_MS)
    shot(page, "image-02-answered")
    (body,) = bodies
    sent = body["messages"][-1]["content"]
    url = "data:image/png;base64," + base64.b64encode(image).decode()
    assert sent == [
        {"type": "image_url", "image_url": {"url": url}},
        {"type": "text", "text": "what is this?"},
    ]
    assert encoded(llava_server) == before + 1  # the server's vision encoder ran once
    assert page.is_visible(".msg.user .images img")
    api = httpx.post(
        llava_server.url + "/v1/chat/completions", headers=AUTH, timeout=120,
        json={"model": "tiny-llava", "messages": body["messages"], "max_tokens": 40,
              "temperature": 0},
    ).json()  # fmt: skip
    answer = api["choices"][0]["message"]["content"]
    assert answer and page.inner_text(".msg.assistant .text") == answer
    log.assert_clean()


def test_paste_and_drop_attach_images_and_a_refused_one_leaves_the_conversation(
    context, llava_server
):
    wait_idle(llava_server)
    page, log = open_playground(context, llava_server)
    page.wait_for_selector("#attach", state="visible", timeout=WAIT_MS)
    assert transfer(page, "paste", png(random_image(31)))
    assert transfer(page, "drop", noise_png(256))  # larger than --max-media-bytes
    page.wait_for_function("document.querySelectorAll('#attachments .thumb').length === 2")
    page.click("#attachments .thumb .remove")  # the pasted one
    bodies = chat_bodies(page)
    page.fill("#input", "and this?")
    page.fill("#max-tokens", "4")
    page.click("#send")
    page.wait_for_selector(".msg.assistant[data-state=error]", timeout=WAIT_MS)
    error = page.inner_text(".msg.assistant.error .text")
    assert "larger than" in error, error
    assert "left out of the conversation" in error
    shot(page, "image-03-refused")
    page.fill("#input", "hello")
    page.click("#send")
    page.wait_for_selector(".msg.assistant[data-state=done]", timeout=WAIT_MS)
    assert bodies[-1]["messages"] == [{"role": "user", "content": "hello"}]
    # the one HTTP error is the refusal (and the browser's console line about it)
    assert [e.split()[0] for e in log.http_errors] == ["400"], log.http_errors
    assert all("400" in e for e in log.console_errors), log.console_errors
    assert not log.failed and not log.blocked


def test_raw_completion_mode_offers_no_image(context, llava_server):
    page, _ = open_playground(context, llava_server)
    page.wait_for_selector("#attach", state="visible", timeout=WAIT_MS)
    page.select_option("#mode", "completion")
    assert page.is_hidden("#attach")
    transfer(page, "paste", png(random_image(41)))
    assert page.query_selector_all("#attachments .thumb") == []
    assert "no images" in page.inner_text("#attach-note")


def test_a_text_only_model_hides_the_image_control(context, text_server):
    card = httpx.get(text_server.url + "/v1/models", headers=AUTH, timeout=10).json()["data"][0]
    assert card["input_modalities"] == ["text"]
    page, log = open_playground(context, text_server)
    page.wait_for_function("document.querySelector('#model-name').textContent.includes('max')")
    assert page.is_hidden("#attach") and page.is_hidden("#attachments")
    assert transfer(page, "paste", png(random_image(51)))  # swallowed, with a note
    assert page.query_selector_all("#attachments .thumb") == []
    assert "no images" in page.inner_text("#attach-note")
    assert not transfer(page, "paste", None)  # text on the clipboard: an ordinary paste
    kv_eval(page, "kv.numUpdates")
    shot(page, "image-04-text-only")
    log.assert_clean()
