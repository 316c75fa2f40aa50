"""The naive baseline: Hugging Face transformers' static batching on serve.py's prompts.

Requests all arrive at t=0 and run in arrival order as left-padded batches of --batch-size
through `generate` (greedy, exactly max_tokens new tokens each). A batch starts only when the
one before it has finished, as a server without continuous batching would run them. Times come
from a logits processor that fires once per decoding step, so TTFT and ITL are per token.

  python bench/hf_static.py --workload std --out hf_std.json
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import torch
from serve import RequestResult, build_workload, print_summary, summarize
from transformers import AutoModelForCausalLM, LogitsProcessor, LogitsProcessorList


class _StepClock(LogitsProcessor):
    """Records the wall time of every decoding step (one new token per row)."""

    def __init__(self) -> None:
        self.times: list[float] = []

    def __call__(self, input_ids, scores):
        self.times.append(time.perf_counter())
        return scores


def run_batch(model, batch, pad_id: int) -> list[float]:
    """One padded batch; the step times (first is the first token of every row)."""
    width = max(len(r.prompt_token_ids) for r in batch)
    ids = torch.full((len(batch), width), pad_id, dtype=torch.long)
    mask = torch.zeros_like(ids)
    for i, r in enumerate(batch):  # left padding keeps every row's last token aligned
        ids[i, width - len(r.prompt_token_ids) :] = torch.tensor(r.prompt_token_ids)
        mask[i, width - len(r.prompt_token_ids) :] = 1
    max_new = max(r.max_tokens for r in batch)
    clock = _StepClock()
    with torch.inference_mode():
        model.generate(
            input_ids=ids,
            attention_mask=mask,
            max_new_tokens=max_new,
            min_new_tokens=max_new,
            do_sample=False,
            pad_token_id=pad_id,
            logits_processor=LogitsProcessorList([clock]),
        )
    return clock.times


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--model-dir", help="HF folder; default: pagedserve's default model")
    p.add_argument("--workload", choices=("std", "prefix", "mixed"), default="std")
    p.add_argument("--num-requests", type=int)
    p.add_argument("--batch-size", type=int, default=32)
    p.add_argument("--dtype", default="bfloat16", choices=("bfloat16", "float32"))
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--label", default="hf-static")
    p.add_argument("--out")
    args = p.parse_args()

    if args.model_dir is None:
        from engine.model_loader.loader import resolve_model

        args.model_dir = str(resolve_model(None))
    vocab = json.loads((Path(args.model_dir) / "config.json").read_text())["vocab_size"]
    wl = build_workload(args.workload, vocab, args.seed, args.num_requests)
    model = AutoModelForCausalLM.from_pretrained(args.model_dir, dtype=getattr(torch, args.dtype))
    model.eval()
    pad_id = model.config.pad_token_id or model.config.eos_token_id or 0
    run_batch(model, wl.requests[:2], pad_id)  # warm-up, as serve.py warms a server up

    results: list[RequestResult] = []
    start = time.perf_counter()
    for b in range(0, len(wl.requests), args.batch_size):
        batch = wl.requests[b : b + args.batch_size]
        sent = time.perf_counter()  # the batch's requests are in flight from here, as in serve.py
        times = run_batch(model, batch, pad_id)
        for r in batch:  # a row's tokens are the first max_tokens steps of its batch
            own = times[: r.max_tokens]
            itls = [t1 - t0 for t0, t1 in zip(own, own[1:])]
            results.append(RequestResult(True, len(own), own[0] - sent, own[-1] - sent, itls))
    duration = time.perf_counter() - start
    wl.max_concurrency = args.batch_size
    summary = summarize(args.label, wl, results, duration)
    print_summary(summary)
    if args.out:
        Path(args.out).parent.mkdir(parents=True, exist_ok=True)
        Path(args.out).write_text(json.dumps(summary, indent=2))


if __name__ == "__main__":
    main()
