"""Images in (engine/multimodal/, engine/models/llava.py): a tiny random-weight LLaVA (CLIP tower,
MLP projector, Llama text side) against transformers' generate on the same weights and pixels,
the encoder cache, and image-aware prefix caching."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from conftest import build_byte_tokenizer, tiny_config

from engine.config import EngineConfig
from engine.core.request import RequestRejectedError
from engine.llm_engine import LLMEngine
from engine.multimodal.encoder_cache import EncoderCache
from engine.sampling_params import SamplingParams

IMAGE_TOKEN = "<image>"
MAX_NEW = 8


def build_tiny_llava_dir(path, seed: int = 0, tower: str = "clip"):
    """A random-weight LlavaForConditionalGeneration (float32) with a byte tokenizer that has an
    <image> special token, and a CLIP (or SigLIP) image processor of 28x28 pixels in 7x7
    patches: 16 image tokens per image."""
    from transformers import (
        CLIPImageProcessor,
        CLIPVisionConfig,
        LlamaConfig,
        LlavaConfig,
        LlavaForConditionalGeneration,
        SiglipVisionConfig,
    )

    tok = build_byte_tokenizer()
    tok.add_special_tokens({"additional_special_tokens": [IMAGE_TOKEN]})
    image_id = tok.convert_tokens_to_ids(IMAGE_TOKEN)
    vision = dict(hidden_size=32, intermediate_size=64, num_hidden_layers=3, num_attention_heads=4)
    vision |= dict(image_size=28, patch_size=7)
    if tower == "clip":
        vcfg, strategy = CLIPVisionConfig(**vision, projection_dim=32), "default"
    else:
        vcfg, strategy = SiglipVisionConfig(**vision), "full"
    cfg = LlavaConfig(
        vision_config=vcfg,
        text_config=LlamaConfig(**tiny_config(tok)),
        image_token_id=image_id,
        projector_hidden_act="gelu",
        vision_feature_layer=-2,
        vision_feature_select_strategy=strategy,
    )
    torch.manual_seed(seed)
    model = LlavaForConditionalGeneration(cfg).float().eval()
    with torch.no_grad():  # a visible image signal: larger random tower and projector weights
        for name, p in model.named_parameters():
            if "vision_tower" in name or "projector" in name:
                if p.dim() > 1:
                    p.normal_(0, 0.3)
    model.save_pretrained(path)
    processor = CLIPImageProcessor(
        size={"shortest_edge": 28}, crop_size={"height": 28, "width": 28}
    )
    processor.save_pretrained(path)
    tok.save_pretrained(path)
    return path


@pytest.fixture(scope="module")
def llava_dir(tmp_path_factory):
    return build_tiny_llava_dir(tmp_path_factory.mktemp("tiny-llava"))


def random_image(seed: int, size=(40, 52)):
    from PIL import Image

    rng = np.random.default_rng(seed)
    return Image.fromarray(rng.integers(0, 256, (*size, 3), dtype=np.uint8))


def hf_llava_greedy(model_dir, ids: list[int], pixels: list[torch.Tensor]) -> list[int]:
    from transformers import LlavaForConditionalGeneration

    model = LlavaForConditionalGeneration.from_pretrained(model_dir, dtype=torch.float32).eval()
    kw = {"pixel_values": torch.stack(pixels)} if pixels else {}
    with torch.inference_mode():
        out = model.generate(
            torch.tensor([ids]),
            attention_mask=torch.ones(1, len(ids), dtype=torch.long),
            max_new_tokens=MAX_NEW,
            do_sample=False,
            eos_token_id=None,
            **kw,
        )
    return out[0, len(ids) :].tolist()


def make_engine(model_dir, **kw) -> LLMEngine:
    cfg = dict(model=str(model_dir), dtype="float32", device="cpu", max_model_len=512)
    return LLMEngine(EngineConfig(**(cfg | kw)))


def image_prompt(engine: LLMEngine, text: str, images) -> tuple[list[int], list]:
    """text with one <image> per image in front, tokenized, expanded: (ids, ImageInputs)."""
    mm = engine.mm_processor
    ids = engine.tokenizer.encode(IMAGE_TOKEN * len(images) + text)
    pixels = [mm.pixels(image, "image") for image in images]
    return mm.expand(ids, pixels)


def generate(engine: LLMEngine, prompts: dict[str, tuple[list[int], list]]) -> dict[str, list]:
    params = SamplingParams(max_tokens=MAX_NEW, temperature=0.0, ignore_eos=True)
    for rid, (ids, inputs) in prompts.items():
        engine.add(engine.make_request(rid, ids, params, inputs))
    tokens: dict[str, list] = {rid: [] for rid in prompts}
    cached: dict[str, int] = {}
    while engine.has_unfinished_requests():
        for out in engine.step()[0]:
            tokens[out.request_id] += out.outputs[0].token_ids
            cached[out.request_id] = out.num_cached_tokens
    engine.last_cached = cached
    return tokens


def test_one_and_two_images_match_transformers(llava_dir):
    engine = make_engine(llava_dir)
    one = image_prompt(engine, "what is this?", [random_image(1)])
    two = image_prompt(engine, "compare them", [random_image(2), random_image(3)])
    text = (engine.tokenizer.encode("plain text, no image"), [])
    got = generate(engine, {"one": one, "two": two, "text": text})
    assert len(one[0]) == 16 + len("what is this?")
    for rid, (ids, inputs) in {"one": one, "two": two, "text": text}.items():
        want = hf_llava_greedy(llava_dir, ids, [i.pixel_values for i in inputs])
        assert got[rid] == want, rid
    assert engine.runner.mm.num_images_encoded == 3


def test_same_image_hits_prefix_and_encoder_cache(llava_dir):
    engine = make_engine(llava_dir, block_size=4)
    first = image_prompt(engine, "describe", [random_image(5)])
    got1 = generate(engine, {"a": first})
    encoded = engine.runner.mm.num_images_encoded
    again = image_prompt(engine, "describe", [random_image(5)])
    got2 = generate(engine, {"b": again})
    assert got1["a"] == got2["b"]
    assert engine.last_cached["b"] >= 16  # the image's blocks came from the prefix cache
    assert engine.runner.mm.num_images_encoded == encoded  # and no second encoder run


def test_different_images_same_text_never_share_blocks(llava_dir):
    engine = make_engine(llava_dir, block_size=4)
    a = image_prompt(engine, "what colour?", [random_image(7)])
    b = image_prompt(engine, "what colour?", [random_image(8)])
    assert a[0] == b[0]  # identical token ids: only the image differs
    got_a = generate(engine, {"a": a})
    got_b = generate(engine, {"b": b})
    assert engine.last_cached["b"] == 0  # the first block holds placeholders of another image
    assert got_a["a"] == hf_llava_greedy(llava_dir, a[0], [a[1][0].pixel_values])
    assert got_b["b"] == hf_llava_greedy(llava_dir, b[0], [b[1][0].pixel_values])
    assert got_a["a"] != got_b["b"]


def test_chunked_prefill_splits_an_image_and_matches(llava_dir):
    engine = make_engine(llava_dir, max_num_batched_tokens=8, block_size=4)
    prompt = image_prompt(engine, "chunks", [random_image(9)])
    got = generate(engine, {"c": prompt})
    assert got["c"] == hf_llava_greedy(llava_dir, prompt[0], [prompt[1][0].pixel_values])
    assert engine.runner.mm.num_images_encoded == 1  # encoded once, sliced per chunk


def test_preemption_recompute_reads_the_encoder_cache(llava_dir):
    """Two image requests in a pool too small for both: one is preempted, recomputed, and
    both still equal transformers; each image was encoded once."""
    engine = make_engine(llava_dir, block_size=4, num_gpu_blocks_override=13)
    prompts = {
        "p": image_prompt(engine, "first", [random_image(21)]),
        "q": image_prompt(engine, "second", [random_image(22)]),
    }
    params = SamplingParams(max_tokens=MAX_NEW, temperature=0.0, ignore_eos=True)
    for rid, (ids, inputs) in prompts.items():
        engine.add(engine.make_request(rid, ids, params, inputs))
    tokens: dict[str, list] = {rid: [] for rid in prompts}
    preemptions = 0
    while engine.has_unfinished_requests():
        outs, stats = engine.step()
        preemptions += stats.num_preemptions
        for out in outs:
            tokens[out.request_id] += out.outputs[0].token_ids
    assert preemptions >= 1
    for rid, (ids, inputs) in prompts.items():
        assert tokens[rid] == hf_llava_greedy(llava_dir, ids, [inputs[0].pixel_values]), rid
    assert engine.runner.mm.num_images_encoded == 2


def test_placeholder_count_and_limits_are_refused(llava_dir):
    engine = make_engine(llava_dir, limit_mm_per_prompt={"image": 1})
    mm = engine.mm_processor
    ids = engine.tokenizer.encode(IMAGE_TOKEN + "x")
    pixels = mm.pixels(random_image(1), "image")
    with pytest.raises(RequestRejectedError, match="2 images"):
        mm.expand(ids, [pixels, pixels])
    engine2 = make_engine(llava_dir)
    with pytest.raises(RequestRejectedError, match="placeholders"):
        engine2.mm_processor.expand(ids + ids, [pixels])


def test_siglip_tower_matches_transformers(tmp_path):
    model_dir = build_tiny_llava_dir(tmp_path / "siglip", seed=3, tower="siglip")
    engine = make_engine(model_dir)
    prompt = image_prompt(engine, "hello", [random_image(4)])
    assert len(prompt[0]) == 16 + len("hello")  # "full": no class token to drop
    got = generate(engine, {"s": prompt})
    assert got["s"] == hf_llava_greedy(model_dir, prompt[0], [prompt[1][0].pixel_values])


def test_bfloat16_packed_linears_run_the_tower(llava_dir):
    """bf16 on CPU packs every Linear (2-D GEMMs): the tower and projector run through them and
    the first tokens still agree with float32 transformers."""
    engine = make_engine(llava_dir, dtype="bfloat16")
    prompt = image_prompt(engine, "what is this?", [random_image(1)])
    got = generate(engine, {"b": prompt})["b"]
    assert got[:4] == hf_llava_greedy(llava_dir, prompt[0], [prompt[1][0].pixel_values])[:4]


def test_text_only_model_refuses_images(tiny_model_dir, llava_dir):
    engine = make_engine(tiny_model_dir)
    assert engine.mm_processor is None
    donor = make_engine(llava_dir)
    ids, inputs = image_prompt(donor, "x", [random_image(1)])
    with pytest.raises(RequestRejectedError, match="does not take images"):
        engine.make_request("r", [5, 6], SamplingParams(max_tokens=2), inputs)


def test_encoder_cache_is_lru_bounded_in_bytes():
    cache = EncoderCache(max_bytes=3 * 64)
    for i in range(3):
        cache.put(bytes([i]), torch.zeros(16))  # 64 bytes each
    assert cache.get(b"\x00") is not None  # 0 becomes most recent
    cache.put(b"\x03", torch.zeros(16))  # evicts 1, the least recently used
    assert cache.get(b"\x01") is None and cache.get(b"\x00") is not None
    assert cache.num_bytes == 3 * 64
    cache.put(b"big", torch.zeros(100))  # over the bound alone: not kept
    assert cache.get(b"big") is None and len(cache) == 3


# ---- through the server: the official openai client, data: and http URLs -----------------------
def png_bytes(image) -> bytes:
    import io

    buf = io.BytesIO()
    image.save(buf, format="PNG")
    return buf.getvalue()


@pytest.fixture(scope="module")
def media_host():
    """A loopback HTTP server: /a.png, /b.png, /same (redirect to /a.png on the same host),
    /other (redirect to another host name), /text (not an image)."""
    import http.server
    import threading

    files = {"/a.png": png_bytes(random_image(11)), "/b.png": png_bytes(random_image(12))}

    class Handler(http.server.BaseHTTPRequestHandler):
        def do_GET(self):  # noqa: N802 - http.server's name
            port = self.server.server_address[1]
            redirects = {"/same": "/a.png", "/other": f"http://localhost:{port}/a.png"}
            if self.path in redirects:
                self.send_response(302)
                self.send_header("Location", redirects[self.path])
                self.end_headers()
                return
            body = files.get(self.path, b"plain text, not an image")
            self.send_response(200)
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, *args):
            pass

    httpd = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    threading.Thread(target=httpd.serve_forever, daemon=True).start()
    yield f"http://127.0.0.1:{httpd.server_address[1]}", files
    httpd.shutdown()


@pytest.fixture(scope="module")
def llava_server(llava_dir):
    from conftest import serve_float32

    args = ("--allowed-media-domains", "127.0.0.1", "--limit-mm-per-prompt", '{"image": 2}')
    yield from serve_float32(llava_dir, "tiny-llava", *args, "--max-media-bytes", "100000")


def ask(client, *parts, text: str = "what is this?", **kw):
    content = [*parts, {"type": "text", "text": text}]
    return client.chat.completions.create(
        model="tiny-llava",
        messages=[{"role": "user", "content": content}],
        max_tokens=MAX_NEW,
        temperature=0.0,
        **kw,
    )


def url_part(url: str, detail: str | None = None) -> dict:
    return {"type": "image_url", "image_url": {"url": url} | ({"detail": detail} if detail else {})}


def data_url(data: bytes) -> str:
    import base64

    return "data:image/png;base64," + base64.b64encode(data).decode()


def test_openai_client_data_and_http_urls(llava_server, media_host, llava_dir):
    from openai import OpenAI
    from transformers import AutoTokenizer

    base, files = media_host
    client = OpenAI(base_url=llava_server.url + "/v1", api_key="x")
    by_data = ask(client, url_part(data_url(files["/a.png"]), "low"))
    by_http = ask(client, url_part(base + "/a.png", "high"))
    by_same_host_redirect = ask(client, url_part(base + "/same"))
    other = ask(client, url_part(base + "/b.png"))
    text = by_data.choices[0].message.content
    assert by_http.choices[0].message.content == text
    assert by_same_host_redirect.choices[0].message.content == text
    assert other.choices[0].message.content != text  # another image, the same text
    chat_prompt = "<|im_start|>user\n<image>\nwhat is this?<|im_end|>\n<|im_start|>assistant\n"
    num_text = len(AutoTokenizer.from_pretrained(llava_dir).encode(chat_prompt)) - 1
    assert by_data.usage.prompt_tokens == num_text + 16  # one <image> became 16
    two = ask(client, url_part(base + "/a.png"), url_part(base + "/b.png"))
    assert two.usage.prompt_tokens == by_data.usage.prompt_tokens + 16 + 1


def test_image_refusals_name_the_part(llava_server, media_host):
    import openai

    base, files = media_host
    client = openai.OpenAI(base_url=llava_server.url + "/v1", api_key="x", max_retries=0)
    cases = {
        "data:image/png;base64,@@not-base64@@": "not valid base64",
        data_url(b"GIF89a but not really an image"): "not a readable image",
        data_url(b"\0" * 200_000): "larger than",
        base + "/text": "not a readable image",
        base + "/other": "redirects to another host",
        "http://example.com/cat.png": "not allowed",
        "file:///etc/passwd": "not allowed",
        "ftp://127.0.0.1/a.png": "unsupported image URL scheme",
    }
    for url, words in cases.items():
        with pytest.raises(openai.BadRequestError) as err:
            ask(client, {"type": "text", "text": "look"}, url_part(url))
        assert words in err.value.message, url
        assert err.value.body["param"] == "messages[0].content[1].image_url", url
    with pytest.raises(openai.BadRequestError) as err:
        ask(client, *[url_part(base + "/a.png")] * 3)
    assert "at most 2" in err.value.message
    with pytest.raises(openai.BadRequestError) as err:
        ask(client, url_part(base + "/a.png", "huge"))
    assert err.value.body["param"] == "messages[0].content[0].detail"
    assert ask(client, url_part(base + "/a.png")).choices[0].finish_reason == "length"


def test_tokenize_counts_image_tokens(llava_server, media_host):
    import httpx

    base, _ = media_host
    msg = {"role": "user", "content": [url_part(base + "/a.png"), {"type": "text", "text": "hi"}]}
    body = {"messages": [msg], "return_token_strs": True}
    got = httpx.post(llava_server.url + "/tokenize", json=body, timeout=30).json()
    assert got["token_strs"].count("<image>") == 16
    text_only = {"messages": [{"role": "user", "content": "hi"}]}
    plain = httpx.post(llava_server.url + "/tokenize", json=text_only, timeout=30).json()
    assert got["count"] == plain["count"] + 16 + 1  # 16 placeholders and the "\n" after them


def test_models_card_says_images(llava_server, tiny_server):
    import httpx

    card = httpx.get(llava_server.url + "/v1/models").json()["data"][0]
    assert card["input_modalities"] == ["text", "image"]
    text_card = httpx.get(tiny_server.url + "/v1/models").json()["data"][0]
    assert text_card["input_modalities"] == ["text"]


def test_responses_input_image(llava_server, media_host):
    from openai import OpenAI

    base, files = media_host
    client = OpenAI(base_url=llava_server.url + "/v1", api_key="x")
    resp = client.responses.create(
        model="tiny-llava",
        input=[
            {
                "role": "user",
                "content": [
                    {"type": "input_image", "image_url": data_url(files["/a.png"])},
                    {"type": "input_text", "text": "what is this?"},
                ],
            }
        ],
        max_output_tokens=MAX_NEW,
        temperature=0.0,
    )
    assert resp.output_text == ask(client, url_part(base + "/a.png")).choices[0].message.content


def test_text_only_server_refuses_image_parts(tiny_server):
    import openai

    client = openai.OpenAI(base_url=tiny_server.url + "/v1", api_key="x", max_retries=0)
    with pytest.raises(openai.BadRequestError) as err:
        client.chat.completions.create(
            model="tiny",
            messages=[{"role": "user", "content": [url_part(data_url(b"x"))]}],
            max_tokens=2,
        )
    assert "does not take images" in err.value.message
    assert err.value.body["param"] == "messages[0].content[0].image_url"


def test_encoder_metrics(llava_server, media_host):
    """After the tests above: two distinct images (a.png, b.png) were encoded, once each; the
    two-image request found b in the encoder cache (a's blocks came from the prefix cache)."""
    import httpx
    from conftest import metric_value

    text = httpx.get(llava_server.url + "/metrics").text
    labels = {"model_name": "tiny-llava"}
    assert metric_value(text, "pagedserve:mm_encoder_images_total", labels) == 2
    assert metric_value(text, "vllm:mm_cache_hits_total", labels) >= 1
    assert metric_value(text, "vllm:mm_cache_queries_total", labels) >= 3


def test_local_files_only_under_the_allowed_path(tmp_path):
    from engine.multimodal.media import fetch_image_bytes
    from engine.multimodal.processor import ImageError

    allowed = tmp_path / "media"
    allowed.mkdir()
    (allowed / "a.png").write_bytes(png_bytes(random_image(1)))
    (tmp_path / "secret.png").write_bytes(b"outside")
    cfg = EngineConfig(device="cpu", allowed_local_media_path=str(allowed), max_media_bytes=10_000)
    assert fetch_image_bytes(f"file://{allowed}/a.png", cfg, "p").startswith(b"\x89PNG")
    for url in (f"file://{allowed}/../secret.png", f"file://{tmp_path}/secret.png"):
        with pytest.raises(ImageError, match="no such file under the allowed media path"):
            fetch_image_bytes(url, cfg, "p")
    with pytest.raises(ImageError, match="file URLs are not allowed"):
        fetch_image_bytes(f"file://{allowed}/a.png", EngineConfig(device="cpu"), "p")
    (allowed / "big.png").write_bytes(b"\0" * 20_000)
    with pytest.raises(ImageError, match="larger than 10000 bytes"):
        fetch_image_bytes(f"file://{allowed}/big.png", cfg, "p")


def test_images_in_several_messages_of_one_conversation(llava_server, media_host):
    """Issue 46 item 1: images per conversation, not only per message; after the metrics test
    (a.png and b.png again: encoder-cache hits, no new encoder run)."""
    import httpx
    import openai

    base, _ = media_host
    client = openai.OpenAI(base_url=llava_server.url + "/v1", api_key="x", max_retries=0)

    def conversation(second_url: str) -> list[dict]:
        def user(url: str, text: str) -> dict:
            return {"role": "user", "content": [url_part(url), {"type": "text", "text": text}]}

        return [user(base + "/a.png", "a?"), {"role": "assistant", "content": "a cat"},
                user(second_url, "and b?")]  # fmt: skip

    messages = conversation(base + "/b.png")
    got = client.chat.completions.create(
        model="tiny-llava", messages=messages, max_tokens=MAX_NEW, temperature=0.0
    )
    body = {"messages": messages, "return_token_strs": True}
    counted = httpx.post(llava_server.url + "/tokenize", json=body, timeout=30).json()
    assert counted["token_strs"].count("<image>") == 32  # 16 per image, both messages
    assert got.usage.prompt_tokens == counted["count"]
    with pytest.raises(openai.BadRequestError) as err:
        client.chat.completions.create(
            model="tiny-llava", messages=conversation(base + "/text"), max_tokens=MAX_NEW
        )
    assert err.value.body["param"] == "messages[2].content[0].image_url"
