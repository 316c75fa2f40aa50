"""Shared builders: tiny random-weight Llama folders, a byte-level tokenizer, engines, requests."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

CHAT_TEMPLATE = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n"
    "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
SPECIAL_TOKENS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]


def pytest_sessionstart(session) -> None:
    """Build the CPU kernels once, before any test's server starts: a first build takes minutes
    on two cores, longer than a server's start-up deadline (each server would race to build)."""
    import time

    from pagedserve_kernels.cpu_ops import load_cpu_ops

    start = time.monotonic()
    ops = load_cpu_ops()
    took = time.monotonic() - start
    print(f"CPU kernels: {'built or loaded' if ops is not None else 'unavailable'} in {took:.0f}s")


@pytest.fixture(scope="session")
def ops():
    """The CPU kernels (built once in pytest_sessionstart); a failed build fails their tests."""
    from pagedserve_kernels.cpu_ops import load_cpu_ops

    ops = load_cpu_ops()
    if ops is None:
        pytest.fail("the CPU kernels did not build")
    return ops


def cpu_has_vnni() -> bool:
    """Whether this CPU has AVX-512 VNNI (and BW), which the kernels' fast integer paths need."""
    flags = set(Path("/proc/cpuinfo").read_text().split()) if Path("/proc/cpuinfo").exists() else ()
    return {"avx512_vnni", "avx512bw"} <= set(flags)


def require_vnni(ops, family: str) -> None:
    """With `family`'s portable switch off ("int8", "gguf"): skips on a CPU without AVX-512 VNNI
    (there is no fast path to test), fails where the CPU has VNNI but the kernel does not run it."""
    if getattr(ops, f"{family}_kernel")() == "portable":
        if not cpu_has_vnni():
            pytest.skip(f"{family}: this CPU has no AVX-512 VNNI (its portable path is tested)")
        pytest.fail(f"{family}: the CPU has AVX-512 VNNI but the kernel runs the portable path")


def kernel_path_fixture(family: str):
    """A fixture running a test on the VNNI path (see require_vnni) and on the portable loop of
    the kernel family whose ops are `set_{family}_portable` and `{family}_kernel`."""

    @pytest.fixture(params=["fast", "portable"])
    def kernel_path(request, ops):
        set_portable = getattr(ops, f"set_{family}_portable")
        old = set_portable(request.param == "portable")
        try:
            if request.param == "fast":
                require_vnni(ops, family)
            yield getattr(ops, f"{family}_kernel")()
        finally:
            set_portable(old)

    return kernel_path


def build_byte_tokenizer():
    """A byte-level BPE tokenizer with no merges: every UTF-8 byte is one token (ids 3..258)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    alphabet = sorted(pre_tokenizers.ByteLevel.alphabet())
    vocab = {tok: i for i, tok in enumerate(SPECIAL_TOKENS)}
    vocab.update({ch: len(SPECIAL_TOKENS) + i for i, ch in enumerate(alphabet)})
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    tok.decoder = decoders.ByteLevel()
    tok.add_special_tokens(SPECIAL_TOKENS)
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok,
        eos_token="<|im_end|>",
        bos_token="<|im_start|>",
        pad_token="<|endoftext|>",
    )
    fast.chat_template = CHAT_TEMPLATE
    return fast


def tiny_config(tokenizer, **overrides) -> dict:
    """The tiny models' config keys (any family): 2 layers of 64, GQA 4:2, the byte tokenizer's
    special ids. The init std is large so greedy argmax gaps dwarf float32 rounding noise."""
    cfg = dict(
        vocab_size=len(tokenizer),
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=1024,
        rms_norm_eps=1e-5,
        tie_word_embeddings=False,
        initializer_range=0.3,
        eos_token_id=tokenizer.eos_token_id,
        bos_token_id=tokenizer.bos_token_id,
        pad_token_id=tokenizer.pad_token_id,
    )
    return cfg | overrides


def build_tiny_model_dir(path: Path, seed: int = 0, **overrides) -> Path:
    """Saves a random-weight LlamaForCausalLM (float32, tiny_config) with the byte tokenizer."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    tokenizer = build_byte_tokenizer()
    torch.manual_seed(seed)
    model = LlamaForCausalLM(LlamaConfig(**tiny_config(tokenizer, **overrides))).float().eval()
    model.save_pretrained(path, safe_serialization=True)
    tokenizer.save_pretrained(path)
    return path


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory) -> Path:
    return build_tiny_model_dir(tmp_path_factory.mktemp("tiny-llama"))


@pytest.fixture(scope="session")
def tiny_tied_model_dir(tmp_path_factory) -> Path:
    return build_tiny_model_dir(
        tmp_path_factory.mktemp("tiny-llama-tied"),
        seed=1,
        tie_word_embeddings=True,
        num_attention_heads=4,
        num_key_value_heads=1,
        hidden_size=128,
        num_hidden_layers=3,
    )


_HF_GREEDY: dict[tuple, list[list[int]]] = {}


def hf_greedy(
    model_dir: Path, prompts: list[list[int]], max_new_tokens: int, stop_at_eos: bool = False
) -> list[list[int]]:
    """transformers' greedy generate, one prompt at a time (no padding), float32. Remembered for
    the session by folder, its config and weights files (size and mtime), prompts and length."""
    import torch
    from transformers import AutoModelForCausalLM

    files = [p for p in Path(model_dir).iterdir() if p.suffix in (".json", ".safetensors")]
    files = sorted((p.name, p.stat().st_size, p.stat().st_mtime_ns) for p in files)
    key = (str(Path(model_dir).resolve()), tuple(files), tuple(map(tuple, prompts)),
           max_new_tokens, stop_at_eos)  # fmt: skip
    if key in _HF_GREEDY:
        return [list(r) for r in _HF_GREEDY[key]]
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    if not stop_at_eos:  # like ignore_eos: EOS is an ordinary token (min_new_tokens would mask it)
        model.generation_config.eos_token_id = None
    num_threads = torch.get_num_threads()
    if sum(p.numel() for p in model.parameters()) < 20_000_000:
        torch.set_num_threads(1)  # tiny matmuls: a second thread's barriers cost more than it adds
    try:
        results = [hf_generate(model, ids, max_new_tokens) for ids in prompts]
    finally:
        torch.set_num_threads(num_threads)
    assert all(len(r) == max_new_tokens for r in results) or stop_at_eos
    _HF_GREEDY[key] = [list(r) for r in results]
    return results


def hf_generate(model, ids: list[int], max_new_tokens: int) -> list[int]:
    """transformers' greedy `generate` on one prompt: the new token ids."""
    import torch

    with torch.inference_mode():
        out = model.generate(
            torch.tensor([ids]),
            attention_mask=torch.ones(1, len(ids), dtype=torch.long),
            max_new_tokens=max_new_tokens,
            do_sample=False,
        )
    return out[0, len(ids) :].tolist()


def make_prompts(
    num: int,
    vocab_lo: int = 3,
    vocab_hi: int = 259,
    seed: int = 0,
    min_len: int = 3,
    max_len: int = 60,
) -> list[list[int]]:
    import random

    rng = random.Random(seed)
    return [
        [rng.randrange(vocab_lo, vocab_hi) for _ in range(rng.randint(min_len, max_len))]
        for _ in range(num)
    ]


def free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class ServerProcess:
    """`pagedserve serve` in a subprocess on a free loopback port."""

    def __init__(self, model: str | None, *args: str, env: dict | None = None) -> None:
        import subprocess
        import sys

        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        cmd = [sys.executable, "-m", "server.cli", "serve"]
        cmd += ([model] if model else []) + ["--port", str(self.port), *args]
        self.log_path = Path(os.environ.get("TMPDIR", "/tmp")) / f"pagedserve-{self.port}.log"
        self._log = open(self.log_path, "w")
        self.proc = subprocess.Popen(
            cmd, stdout=self._log, stderr=subprocess.STDOUT, env={**os.environ, **(env or {})}
        )

    def wait_ready(self, timeout: float = 300.0) -> ServerProcess:
        import time

        import httpx

        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"server exited {self.proc.returncode}:\n{self.log()}")
            try:
                if httpx.get(self.url + "/health", timeout=1.0).status_code == 200:
                    return self
            except httpx.HTTPError:
                pass
            time.sleep(0.2)
        log = self.log()
        self.proc.kill()  # never ready: the fixture that started it will not get to stop it
        self.proc.wait()
        raise TimeoutError(f"server not ready in {timeout}s:\n{log}")

    def log(self) -> str:
        self._log.flush()
        return self.log_path.read_text()[-5000:]

    def stop(self) -> int:
        import subprocess

        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(20)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        self._log.close()
        return self.proc.returncode


def metric_value(text: str, name: str, labels: dict | None = None) -> float:
    """The value of one sample in a Prometheus exposition."""
    from prometheus_client.parser import text_string_to_metric_families

    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            if sample.name == name and all(
                sample.labels.get(k) == v for k, v in (labels or {}).items()
            ):
                return sample.value
    raise KeyError(name)


def serve_float32(model_dir: Path, name: str, *args: str):
    """A fixture body: `pagedserve serve` on the folder in float32 as `name`, stopped after."""
    server = ServerProcess(str(model_dir), "--dtype", "float32", "--served-model-name", name, *args)
    yield server.wait_ready()
    server.stop()


@pytest.fixture(scope="session")
def tiny_server(tiny_model_dir):
    yield from serve_float32(tiny_model_dir, "tiny")


def make_request(request_id: str, num_tokens: int, max_tokens: int = 8, start: int = 0, **params):
    """A Request with prompt tokens start..start+num_tokens-1 (pure Python, no model)."""
    from engine.core.request import Request
    from engine.sampling_params import SamplingParams

    sp = SamplingParams(temperature=0.0, max_tokens=max_tokens, **params)
    return Request(request_id, list(range(start, start + num_tokens)), sp, eos_token_id=None)


def make_scheduler(
    num_blocks: int = 64,
    block_size: int = 4,
    max_num_seqs: int = 16,
    max_num_batched_tokens: int = 64,
    max_model_len: int = 256,
    enable_prefix_caching: bool = True,
):
    from engine.config import EngineConfig
    from engine.core.scheduler import Scheduler

    cfg = EngineConfig(
        block_size=block_size,
        max_num_seqs=max_num_seqs,
        max_num_batched_tokens=max_num_batched_tokens,
        max_model_len=max_model_len,
        enable_prefix_caching=enable_prefix_caching,
    )
    return Scheduler(cfg, num_blocks)


def run_fake_step(scheduler, token_id: int = 7):
    """schedule -> a null model runner that samples `token_id` wherever a token is due -> update."""
    out = scheduler.schedule()
    sampled = [
        token_id if c + n == r.num_tokens else None
        for r, n, c in zip(out.requests, out.num_scheduled_tokens, out.num_computed_tokens)
    ]
    from engine.outputs import ModelRunnerOutput

    return out, scheduler.update_from_output(out, ModelRunnerOutput(sampled))


def run_until_done(scheduler, token_id: int = 7, max_steps: int = 10_000) -> list:
    """run_fake_step until nothing is left; returns every step's SchedulerOutput."""
    outs = []
    while scheduler.has_unfinished_requests():
        assert len(outs) < max_steps, "scheduler did not drain: livelock?"
        outs.append(run_fake_step(scheduler, token_id)[0])
    return outs


def assert_scheduler_drained(scheduler) -> None:
    """Nothing queued or running, every KV block free and the pool consistent."""
    kv = scheduler.kv_cache_manager
    assert not scheduler.has_unfinished_requests() and not scheduler.requests
    kv.block_pool.check_integrity()
    assert kv.block_pool.get_num_free_blocks() == kv.num_blocks
    assert not kv.req_to_blocks and not kv.req_to_block_ids


class ScriptedSampler:
    """Stands in for the engine's sampler: each request emits its scripted tokens in order.

    Lets engine-level tests drive exact texts (emoji, stop strings) through the real
    detokenizer and stop checks: `engine.runner.sampler = ScriptedSampler({rid: ids})`.
    """

    def __init__(self, scripts: dict[str, list[int]]) -> None:
        self.scripts = scripts

    def __call__(self, logits, requests):
        from engine.sample.sampler import SamplerOutput

        return SamplerOutput([self.scripts[r.request_id][r.num_output_tokens] for r in requests])

    def release(self, request_id: str) -> None:
        pass


def run_engine(engine, requests: dict[str, tuple[list[int], object]]) -> dict[str, list]:
    """Adds {request_id: (prompt ids, SamplingParams)} and steps to the end; per-step deltas."""
    deltas: dict[str, list] = {rid: [] for rid in requests}
    for rid, (prompt, params) in requests.items():
        engine.add_request(rid, prompt, params)
    while engine.has_unfinished_requests():
        for out in engine.step()[0]:
            deltas[out.request_id].append(out)
    return deltas


def wait_idle(url: str, timeout: float = 30.0) -> dict[str, float]:
    """Polls /metrics until nothing runs or waits and every KV block is free; returns the gauges."""
    import time

    import httpx

    from server.metrics import metric_name

    names = ("num_requests_running", "num_requests_waiting")
    names += ("kv_cache_free_blocks", "kv_cache_total_blocks")
    deadline = time.monotonic() + timeout
    while True:
        text = httpx.get(url + "/metrics", timeout=10).text
        g = {n: metric_value(text, metric_name(n)) for n in names}
        idle = g["num_requests_running"] == g["num_requests_waiting"] == 0
        if idle and g["kv_cache_free_blocks"] == g["kv_cache_total_blocks"]:
            return g
        if time.monotonic() > deadline:
            raise AssertionError(f"server not idle after {timeout}s: {g}")
        time.sleep(0.2)


# ---- OpenAI surface (server/serving_*): a model whose greedy output is known text -----------
CYCLE_TEXT = "aé🎉世ж"  # distinct UTF-8 bytes, so each byte has exactly one successor


def build_cycle_model_dir(path: Path, text: str = CYCLE_TEXT, entry: str = "\n") -> Path:
    """A tiny Llama that greedily continues `text` forever, one UTF-8 byte per token.

    Attention and MLP write nothing (o_proj, down_proj = 0), so the last hidden state is the
    current token's embedding; lm_head row of each byte's successor is that byte's embedding,
    so argmax is the successor by a wide margin. Every multi-byte character spans tokens.
    `entry` bytes (the end of a chat generation prompt) lead into the cycle too.
    """
    import torch
    from safetensors.torch import load_file, save_file

    build_tiny_model_dir(path, seed=2)
    tokenizer = build_byte_tokenizer()
    ids = tokenizer.encode(text, add_special_tokens=False)
    assert len(set(ids)) == len(ids), "cycle bytes must be distinct"
    weights_path = next(path.glob("*.safetensors"))
    w = load_file(weights_path)
    gen = torch.Generator().manual_seed(0)
    embed = torch.randn(w["model.embed_tokens.weight"].shape, generator=gen)
    embed = embed / embed.norm(dim=-1, keepdim=True)
    head = embed.clone() * 0.2  # every other token: a small random score
    for cur, nxt in zip(ids, ids[1:] + ids[:1]):
        head[nxt] = embed[cur] * 4.0
    for cur in tokenizer.encode(entry, add_special_tokens=False):
        head[ids[0]] += embed[cur] * 4.0
    w["model.embed_tokens.weight"], w["lm_head.weight"] = embed, head
    for name in w:
        if name.endswith(("o_proj.weight", "down_proj.weight")):
            w[name] = torch.zeros_like(w[name])
    save_file(w, weights_path, metadata={"format": "pt"})
    return path


@pytest.fixture(scope="session")
def cycle_model_dir(tmp_path_factory) -> Path:
    return build_cycle_model_dir(tmp_path_factory.mktemp("cycle-llama"))


@pytest.fixture(scope="session")
def cycle_server(cycle_model_dir):
    yield from serve_float32(cycle_model_dir, "cycle")


def _nullable_to_json_schema(node):
    """OpenAPI 3.0 `nullable: true` -> JSON Schema's explicit null alternative."""
    if isinstance(node, list):
        return [_nullable_to_json_schema(x) for x in node]
    if not isinstance(node, dict):
        return node
    node = {k: _nullable_to_json_schema(v) for k, v in node.items()}
    if node.pop("nullable", False):
        return {"anyOf": [node, {"type": "null"}]}
    return node


def openai_schema_validator(component: str, allow_null: tuple[str, ...] = ()):
    """A jsonschema validator for one component of /work/shared/reference/openai-schemas.yaml.

    `allow_null`: choice fields the stream shape of a schema leaves null (e.g. completions
    chunks carry finish_reason null until the last one, which OpenAI's schema does not model).
    """
    import copy

    import jsonschema
    import yaml

    path = Path(__file__).parent / "data" / "openai-schemas.yaml"  # the OpenAI spec excerpt
    spec = yaml.safe_load(path.read_text())
    components = _nullable_to_json_schema(spec["schemas"])  # the excerpt keeps schemas on top
    schema = copy.deepcopy(components[component])
    for name in allow_null:
        props = schema["properties"]["choices"]["items"]["properties"]
        props[name] = {"anyOf": [props[name], {"type": "null"}]}
    schema["components"] = {"schemas": components}
    return jsonschema.Draft202012Validator(schema)


# ---- OpenAI clients on the shared servers (tests/test_openai_*.py) ---------------------------
@pytest.fixture(scope="module")
def client(tiny_server):
    import openai

    return openai.OpenAI(base_url=tiny_server.url + "/v1", api_key="x", max_retries=0)


@pytest.fixture(scope="module")
def cycle(cycle_server):
    import openai

    return openai.OpenAI(base_url=cycle_server.url + "/v1", api_key="x", max_retries=0)


def wire(obj) -> dict:
    """An openai-client object as it came over the wire, for schema validation."""
    return obj.model_dump(mode="json", exclude_unset=True)


# ---- a scripted AsyncEngine facade: the server's OpenAI shapes without a model -------------------
SCRIPTED_TEXT = "hé🎉!"  # 1 + 2 + 4 + 1 bytes: characters split across byte tokens


class ScriptedEngine:
    """Stands in for AsyncEngine's facade: each request generates SCRIPTED_TEXT's bytes, then stops.

    make_request is the engine's own validation (LLMEngine.make_request) over a model-less
    scheduler, so what the server sends is checked and filled in exactly as in production.
    `is_alive = False` makes it dead; `queue_full = True` makes check_queue refuse.
    """

    def __init__(self, tokenizer, max_model_len: int = 64) -> None:
        from types import SimpleNamespace

        self.tokenizer = tokenizer
        self.model_name, self.model_dir = "fake", Path("m")
        self.max_model_len, self.vocab_size = max_model_len, len(tokenizer)
        self.generation_defaults: dict = {}
        self.is_alive, self.queue_full = True, False
        self.requests: list[tuple[str, list[int], object]] = []
        self.output_ids = tokenizer.encode(SCRIPTED_TEXT, add_special_tokens=False)
        self._validator = SimpleNamespace(
            vocab_size=self.vocab_size,
            eos_token_id=None,
            eos_token_ids=frozenset(),
            config=SimpleNamespace(max_model_len=max_model_len),
            scheduler=make_scheduler(max_model_len=max_model_len),
        )

    def check_health(self) -> None:
        from engine.async_engine import EngineDeadError

        if not self.is_alive:
            raise EngineDeadError("the engine is not running")

    def make_request(self, request_id, prompt_ids, params):
        from engine.llm_engine import LLMEngine

        self.check_health()
        return LLMEngine.make_request(self._validator, request_id, prompt_ids, params)

    def check_queue(self, num_new: int) -> None:
        from engine.async_engine import QueueFullError

        if self.queue_full:
            raise QueueFullError("the server's waiting queue is full (0 requests)")

    def logprobs(self, token_id: int, k: int):
        from engine.outputs import TokenLogprobs

        alternatives = [(token_id, -0.25)] + [(t, -1.0 - t / 100) for t in (10, 11, 12, 13)]
        return TokenLogprobs(token_id=token_id, logprob=-0.25, rank=1, top=alternatives[:k])

    async def generate(self, request):
        from engine.output.detokenizer import IncrementalDetokenizer
        from engine.outputs import CompletionOutput, RequestOutput

        request_id, prompt_ids = request.request_id, request.prompt_token_ids
        params = request.sampling_params
        self.requests.append((request_id, prompt_ids, params))
        ids = self.output_ids[: params.max_tokens]
        detok = IncrementalDetokenizer(self.tokenizer, prompt_ids)
        prompt_lps = None
        if params.prompt_logprobs is not None:
            k = params.prompt_logprobs
            prompt_lps = [None] + [self.logprobs(t, k) for t in prompt_ids[1:]]
        for i, token_id in enumerate(ids):
            last = i == len(ids) - 1
            reason = ("stop" if len(ids) == len(self.output_ids) else "length") if last else None
            lps = None if params.logprobs is None else [self.logprobs(token_id, params.logprobs)]
            completion = CompletionOutput(
                index=0,
                text=detok.step([token_id]),
                token_ids=[token_id],
                finish_reason=reason,
                stop_reason="!" if reason == "stop" else None,
                logprobs=lps,
            )
            yield RequestOutput(
                request_id=request_id,
                prompt_token_ids=prompt_ids,
                outputs=[completion],
                finished=last,
                num_cached_tokens=2,
                prompt_logprobs=prompt_lps if i == 0 else None,
            )


# ---- structured outputs, tools and Responses (tests/test_openai_{structured,tools,responses}) --
TOOLS_CHAT_TEMPLATE = (
    "{% if tools %}<|im_start|>system\nTools:\n{% for t in tools %}{{ t | tojson }}\n{% endfor %}"
    "Call one as <tool_call>{\"name\": ..., \"arguments\": ...}</tool_call><|im_end|>\n{% endif %}"
    "{% for m in messages %}"
    "{% if m['role'] == 'assistant' and m.get('tool_calls') %}<|im_start|>assistant\n"
    "{% for c in m['tool_calls'] %}<tool_call>\n{\"name\": \"{{ c['function']['name'] }}\", "
    "\"arguments\": {{ c['function']['arguments'] | tojson }}}\n</tool_call>{% endfor %}"
    "<|im_end|>\n"
    "{% elif m['role'] == 'tool' %}<|im_start|>user\n<tool_response>\n{{ m['content'] }}\n"
    "</tool_response><|im_end|>\n"
    "{% else %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endif %}"
    "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)


@pytest.fixture(scope="session")
def tools_model_dir(tmp_path_factory) -> Path:
    """The tiny model with a chat template that renders `tools` and tool-call history."""
    path = build_tiny_model_dir(tmp_path_factory.mktemp("tiny-tools"))
    (path / "chat_template.jinja").write_text(TOOLS_CHAT_TEMPLATE)
    return path


@pytest.fixture(scope="session")
def tools_server(tools_model_dir):
    yield from serve_float32(
        tools_model_dir, "tiny",
        "--enable-auto-tool-choice",
        "--tool-call-parser", "hermes",
        "--grammar-compile-timeout", "0.25",
    )  # fmt: skip


@pytest.fixture(scope="module")
def tclient(tools_server):
    import openai

    return openai.OpenAI(base_url=tools_server.url + "/v1", api_key="x", max_retries=0)


@pytest.fixture(scope="module")
def tokenizer():
    """The byte tokenizer (files that need another one define their own)."""
    return build_byte_tokenizer()


@pytest.fixture(scope="module")
def compiler(tokenizer):
    """A grammar compiler over the byte tokenizer, its cache shared within a module."""
    from engine.sample.structured_output import GrammarCompiler

    c = GrammarCompiler(tokenizer, vocab_size=len(tokenizer))
    yield c
    c.shutdown()


def count_fused_calls(fused) -> list:
    """Appends to the returned list at each fused step the runner takes."""
    calls, run = [], fused.run

    def spy(*args):
        calls.append(1)
        return run(*args)

    fused.run = spy
    return calls


def count_prefill_tokens(llm) -> list[int]:
    """Wraps the scheduler so each step's prompt tokens scheduled are summed into the list."""
    sched = llm.engine.scheduler
    counted = [0]
    schedule = sched.schedule

    def counting():
        out = schedule()
        counted[0] += sum(
            max(0, min(c + n, r.num_prompt_tokens) - c)
            for r, n, c in zip(out.requests, out.num_scheduled_tokens, out.num_computed_tokens)
        )
        return out

    sched.schedule = counting
    return counted
