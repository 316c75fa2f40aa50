"""N-gram speculative decoding against plain decoding, side by side, in-process (no HTTP).

    python bench/spec_decode.py [--dtype bfloat16] [--num-speculative-tokens 4]
        [--prompt-lookup-max 4] [--prompt-lookup-min 2] [--concurrency 1 4] [--num-requests 8]

Workload: the default model (SmolLM2-135M-Instruct) asked to rewrite a code snippet with one
identifier renamed, so its output mostly repeats the prompt (the repeat column says how much:
the share of output tokens whose 3-gram ending there occurs in the prompt). Greedy, up to
`--max-tokens` tokens, EOS ends a request. For each concurrency (requests kept in flight) the
same requests run without and with speculation on one engine each; printed: time per output
token (mean over requests, after the first token), output tokens/s, the acceptance rate
(accepted / draft tokens), how many answers were identical, and the mean time of a plain
decode step and of a step that verified drafts (with the tokens it emitted per request).
"""

from __future__ import annotations

import argparse
import time

import engine.runner.model_runner as model_runner
from engine.llm import LLM
from engine.sampling_params import SamplingParams
from engine.spec_decode.ngram import SpecDecodeStats

SNIPPETS = [
    '''def moving_average(values, window):
    result = []
    total = 0.0
    for i, x in enumerate(values):
        total += x
        if i >= window:
            total -= values[i - window]
        if i >= window - 1:
            result.append(total / window)
    return result
''',
    '''class Stack:
    def __init__(self):
        self.items = []

    def push(self, item):
        self.items.append(item)

    def pop(self):
        if not self.items:
            raise IndexError("pop from an empty stack")
        return self.items.pop()

    def peek(self):
        return self.items[-1]
''',
    '''def binary_search(items, target):
    lo, hi = 0, len(items) - 1
    while lo <= hi:
        mid = (lo + hi) // 2
        if items[mid] == target:
            return mid
        if items[mid] < target:
            lo = mid + 1
        else:
            hi = mid - 1
    return -1
''',
    '''def word_counts(text):
    counts = {}
    for line in text.splitlines():
        for word in line.lower().split():
            word = word.strip(".,;:!?")
            if word:
                counts[word] = counts.get(word, 0) + 1
    return sorted(counts.items(), key=lambda kv: -kv[1])
''',
]
RENAMES = [("result", "averages"), ("items", "elements"), ("items", "values"), ("counts", "freq")]


def build_prompts(tokenizer, n: int) -> list[list[int]]:
    prompts = []
    for i in range(n):
        code, (old, new) = SNIPPETS[i % len(SNIPPETS)], RENAMES[i % len(RENAMES)]
        msg = (
            f"Rewrite this Python code with the variable `{old}` renamed to `{new}`. "
            f"Output only the code.\n\n```python\n{code}```"
        )
        messages = [{"role": "user", "content": msg}]
        text = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
        prompts.append(tokenizer.encode(text, add_special_tokens=False))
    return prompts


def repeat_share(prompt: list[int], output: list[int], n: int = 3) -> float:
    grams = {tuple(prompt[i : i + n]) for i in range(len(prompt) - n + 1)}
    seq = prompt[-(n - 1) :] + output
    hits = sum(tuple(seq[i : i + n]) in grams for i in range(len(output)))
    return hits / max(len(output), 1)


class StepTimer:
    """Times ModelRunner.execute by kind: plain decode steps, steps that verified drafts."""

    def __init__(self) -> None:
        self.kinds = {"decode": [0, 0.0], "verify": [0, 0.0]}
        self.original = model_runner.ModelRunner.execute

    def __enter__(self) -> StepTimer:
        original, kinds = self.original, self.kinds

        def timed(runner, out):
            t = time.perf_counter()
            result = original(runner, out)
            took = time.perf_counter() - t
            if out.spec_token_ids:
                kinds["verify"][0] += 1
                kinds["verify"][1] += took
            elif out.requests and sum(out.num_scheduled_tokens) == len(out.requests):
                kinds["decode"][0] += 1
                kinds["decode"][1] += took
            return result

        model_runner.ModelRunner.execute = timed
        return self

    def __exit__(self, *exc) -> None:
        model_runner.ModelRunner.execute = self.original

    def mean_ms(self, kind: str) -> float:
        n, total = self.kinds[kind]
        return 1000 * total / n if n else float("nan")


def run(engine, prompts, params, concurrency: int) -> dict:
    """Keeps `concurrency` requests in flight until all finished; per-request tokens, TPOT."""
    pending = list(enumerate(prompts))
    tokens: dict[str, list[int]] = {}
    tpots = []
    start = time.perf_counter()
    while pending or engine.has_unfinished_requests():
        while pending and len(engine.scheduler.requests) < concurrency:
            i, ids = pending.pop(0)
            engine.add_request(str(i), ids, params)
            tokens[str(i)] = []
        for out in engine.step()[0]:
            tokens[out.request_id] += out.outputs[0].token_ids
            m = out.metrics
            if out.finished and m.num_generation_tokens > 1:
                tpots.append((m.finished_time - m.first_token_time) / (m.num_generation_tokens - 1))
    elapsed = time.perf_counter() - start
    num_tokens = sum(len(t) for t in tokens.values())
    return {
        "tokens": [tokens[str(i)] for i in range(len(prompts))],
        "tpot_ms": 1000 * sum(tpots) / len(tpots),
        "tok_s": num_tokens / elapsed,
        "num_tokens": num_tokens,
    }


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--dtype", default="bfloat16")
    p.add_argument("--num-speculative-tokens", type=int, default=4)
    p.add_argument("--prompt-lookup-max", type=int, default=4)
    p.add_argument("--prompt-lookup-min", type=int, default=2)
    p.add_argument("--concurrency", type=int, nargs="+", default=[1, 4])
    p.add_argument("--num-requests", type=int, default=8)
    p.add_argument("--max-tokens", type=int, default=160)
    args = p.parse_args()
    spec = {
        "method": "ngram",
        "num_speculative_tokens": args.num_speculative_tokens,
        "prompt_lookup_max": args.prompt_lookup_max,
        "prompt_lookup_min": args.prompt_lookup_min,
    }
    params = SamplingParams(temperature=0.0, max_tokens=args.max_tokens)
    results: dict[tuple[str, int], dict] = {}
    engines = {}
    for name, speculative_config in (("plain", None), ("ngram", spec)):
        llm = LLM(
            None,
            dtype=args.dtype,
            max_model_len=2048,
            kv_cache_memory_bytes=256 * 1024**2,
            speculative_config=speculative_config,
        )
        engines[name] = llm.engine
    prompts = build_prompts(engines["plain"].tokenizer, args.num_requests)
    warm_up = SamplingParams(temperature=0.0, max_tokens=8)
    for engine in engines.values():
        run(engine, prompts[:1], warm_up, 1)
    for c in args.concurrency:  # the two modes back to back, so they share the machine's load
        for name, engine in engines.items():
            if engine.spec_decode_totals is not None:  # this concurrency's counts only
                engine.spec_decode_totals = SpecDecodeStats.empty(args.num_speculative_tokens)
            with StepTimer() as timer:
                r = run(engine, prompts, params, c)
            r["decode_ms"], r["verify_ms"] = timer.mean_ms("decode"), timer.mean_ms("verify")
            totals = engine.spec_decode_totals
            if totals is not None and totals.num_draft_tokens:
                r["acceptance"] = totals.num_accepted_tokens / totals.num_draft_tokens
                r["per_verify"] = 1 + totals.num_accepted_tokens / totals.num_drafts
            results[(name, c)] = r

    repeat = [repeat_share(pr, t) for pr, t in zip(prompts, results[("plain", 1)]["tokens"])]
    print(
        f"dtype {args.dtype}, {args.num_requests} requests, max_tokens {args.max_tokens}, "
        f"spec {spec}; output repeats the prompt: {100 * sum(repeat) / len(repeat):.0f}% of "
        "tokens (3-grams)"
    )
    header = ("c", "mode", "TPOT ms", "tok/s", "accept", "tok/verify", "decode ms", "verify ms")
    print("| " + " | ".join(header) + " | same answers |")
    print("|" + "---|" * (len(header) + 1))
    for c in args.concurrency:
        plain = results[("plain", c)]
        for name in ("plain", "ngram"):
            r = results[(name, c)]
            same = sum(a == b for a, b in zip(r["tokens"], plain["tokens"]))
            acc = f"{100 * r['acceptance']:.0f}%" if "acceptance" in r else "-"
            per = f"{r['per_verify']:.2f}" if "per_verify" in r else "-"
            print(
                f"| {c} | {name} | {r['tpot_ms']:.1f} | {r['tok_s']:.1f} | {acc} | {per} | "
                f"{r['decode_ms']:.1f} | {r['verify_ms']:.1f} | {same}/{len(prompts)} |"
            )
        speedup = results[("ngram", c)]["tok_s"] / plain["tok_s"]
        print(f"c={c}: ngram/plain tokens/s = {speedup:.2f}x")


if __name__ == "__main__":
    main()
