"""GPU check body (run by bench/gpu_check.sh): greedy parity on a real model, decode throughput.

    python bench/gpu_decode.py MODEL_DIR [--batches 1 32 256] [--steps 64]

1. Copy bandwidth of the card: a large device-to-device copy, bytes read + written per second.
2. Parity: the engine (float32, CUDA graphs on) against transformers' greedy `generate` on the
   same GPU in float32, token for token.
3. Decode throughput in the serving dtype at each batch size: timed pure-decode steps, with
   the bytes a step must read (all weights once + every sequence's KV) over the step time,
   as a fraction of the copy bandwidth.
"""

from __future__ import annotations

import argparse
import sys
import time

import torch

from engine.config import EngineConfig
from engine.llm_engine import LLMEngine
from engine.sampling_params import SamplingParams

DEV = "cuda" if torch.cuda.is_available() else "cpu"  # CPU: a smoke run of this script only


def sync() -> None:
    if DEV == "cuda":
        torch.cuda.synchronize()


def copy_bandwidth(num_bytes: int = 4 * 1024**3, repeat: int = 20) -> float:
    """Bytes/s of a device-to-device copy, counting bytes read plus bytes written."""
    src = torch.empty(num_bytes // 2, dtype=torch.bfloat16, device=DEV).normal_()
    dst = torch.empty_like(src)
    dst.copy_(src)
    sync()
    t0 = time.perf_counter()
    for _ in range(repeat):
        dst.copy_(src)
    sync()
    seconds = (time.perf_counter() - t0) / repeat
    del src, dst
    return 2 * num_bytes / seconds


def check_parity(model_dir: str, num_prompts: int, max_new: int) -> bool:
    from transformers import AutoModelForCausalLM

    engine = LLMEngine(
        EngineConfig(model=model_dir, dtype="float32", max_model_len=1024, max_num_seqs=64)
    )
    tok = engine.tokenizer
    texts = [f"Question {i}: what is {i} plus {2 * i + 1}? Answer:" for i in range(num_prompts)]
    texts[:3] = ["The capital of France is", "def fibonacci(n):", "Once upon a time"]
    prompts = [tok.encode(t) for t in texts]
    params = SamplingParams(temperature=0.0, max_tokens=max_new, ignore_eos=True)
    got = run_to_completion(engine, prompts, params)
    graphs = engine.runner.decode_graphs
    print(
        f"engine: backend={engine.runner.backend.name} dtype={engine.runner.dtype} "
        f"block_size={engine.config.block_size} cuda_graphs={graphs is not None}"
    )
    del engine
    hf = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).to(DEV).eval()
    hf.generation_config.eos_token_id = None
    equal = 0
    for i, ids in enumerate(prompts):
        with torch.inference_mode():
            out = hf.generate(
                torch.tensor([ids], device=DEV),
                attention_mask=torch.ones(1, len(ids), dtype=torch.long, device=DEV),
                max_new_tokens=max_new,
                do_sample=False,
            )
        want = out[0, len(ids) :].tolist()
        same = got[i] == want
        equal += same
        if not same:
            first = next(j for j, (a, b) in enumerate(zip(got[i], want)) if a != b)
            print(f"  prompt {i}: first difference at token {first}")
    print(f"PARITY {equal}/{len(prompts)} prompts token-identical over {max_new} tokens")
    return equal == len(prompts)


def run_to_completion(engine: LLMEngine, prompts: list[list[int]], params) -> list[list[int]]:
    tokens: dict[str, list[int]] = {str(i): [] for i in range(len(prompts))}
    for i, ids in enumerate(prompts):
        engine.add_request(str(i), ids, params)
    while engine.has_unfinished_requests():
        outputs, _ = engine.step()
        for out in outputs:
            tokens[out.request_id].extend(out.outputs[0].token_ids)
    return [tokens[str(i)] for i in range(len(prompts))]


def weight_bytes(model: torch.nn.Module) -> int:
    """Each distinct parameter once (tied embeddings are read once, by lm_head)."""
    seen = {p.data_ptr(): p.numel() * p.element_size() for p in model.parameters()}
    return sum(seen.values())


def decode_throughput(engine: LLMEngine, batch: int, prompt_len: int, steps: int) -> dict:
    runner = engine.runner
    gen = torch.Generator().manual_seed(batch)
    vocab = engine.vocab_size
    params = SamplingParams(temperature=0.0, max_tokens=steps + 8, ignore_eos=True)
    ids = [f"b{batch}-{i}" for i in range(batch)]
    for rid in ids:
        prompt = torch.randint(0, vocab, (prompt_len,), generator=gen).tolist()
        engine.add_request(rid, prompt, params)
    while any(r.num_output_tokens == 0 for r in engine.scheduler.requests.values()):
        engine.step()  # prefill until every sequence is decoding
    for _ in range(3):
        engine.step()  # warm: every later step is one decode batch of `batch` sequences
    ctx_start = sum(r.num_tokens for r in engine.scheduler.requests.values())
    sync()
    t0 = time.perf_counter()
    for _ in range(steps):
        engine.step()
    sync()
    seconds = time.perf_counter() - t0
    engine.abort_request(ids)
    engine.step()
    kv_per_token = 2 * runner.num_layers * runner.num_kv_heads * runner.head_dim
    kv_per_token *= torch.tensor([], dtype=runner.dtype).element_size()
    mean_ctx = ctx_start + batch * (steps - 1) / 2  # context summed over sequences, mid-run
    step_bytes = weight_bytes(runner.model) + mean_ctx * kv_per_token
    step_s = seconds / steps
    return dict(tok_s=batch / step_s, step_ms=step_s * 1e3, bytes_s=step_bytes / step_s)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("model")
    ap.add_argument("--batches", type=int, nargs="+", default=[1, 32, 256])
    ap.add_argument("--steps", type=int, default=64)
    ap.add_argument("--prompt-len", type=int, default=256)
    ap.add_argument("--parity-prompts", type=int, default=8)
    ap.add_argument("--parity-tokens", type=int, default=32)
    ap.add_argument("--attention-backend", default="auto")
    ap.add_argument("--copy-bytes", type=int, default=4 * 1024**3)
    ap.add_argument("--max-model-len", type=int, default=2048)
    args = ap.parse_args()
    name = torch.cuda.get_device_name() if DEV == "cuda" else "cpu (smoke run)"
    print(f"device: {name} torch {torch.__version__}")
    bw = copy_bandwidth(args.copy_bytes)
    print(f"copy bandwidth: {bw / 1e12:.2f} TB/s (read + write)")
    parity_ok = check_parity(args.model, args.parity_prompts, args.parity_tokens)
    engine = LLMEngine(
        EngineConfig(
            model=args.model,
            max_model_len=args.max_model_len,
            max_num_seqs=max(args.batches),
            max_num_batched_tokens=8192,
            attention_backend=args.attention_backend,
        )
    )
    r = engine.runner
    print(
        f"throughput engine: backend={r.backend.name} dtype={r.dtype} "
        f"cuda_graphs={r.decode_graphs is not None} weights={weight_bytes(r.model) / 1e6:.0f} MB"
    )
    rows = [(b, decode_throughput(engine, b, args.prompt_len, args.steps)) for b in args.batches]
    print(f"\n| batch | step ms | tokens/s | GB/s read | of copy bw |  (prompt {args.prompt_len})")
    print("| ---: | ---: | ---: | ---: | ---: |")
    for b, m in rows:
        frac = m["bytes_s"] / bw
        print(
            f"| {b} | {m['step_ms']:.2f} | {m['tok_s']:.0f} | {m['bytes_s'] / 1e9:.0f} | "
            f"{frac:.1%} |"
        )
    print(f"parity: {'PASS' if parity_ok else 'FAIL'}")
    sys.exit(0 if parity_ok else 1)


if __name__ == "__main__":
    main()
