"""Constrained decoding cost: grammar mask fill + apply per decode step, as a ratio of an
unconstrained decode step, at batch 1 and 32; and time to first token, cold and cached grammar.

python bench/structured_output.py [--model DIR] [--batch 1 32] [--steps 32] [--dtype auto]

Per batch size: the same requests decode twice, unconstrained and under a JSON schema; the
sampler's mask fill and apply are timed inside the real steps (every row constrained), and the
ratio is their sum per step over the unconstrained step. TTFT: one request from compile start
to its first token, with a schema never seen (cold: compile + first mask) and the same schema
again (cached).
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

from engine.config import EngineConfig
from engine.llm_engine import LLMEngine
from engine.sample.grammar_mask import GrammarBitmask
from engine.sampling_params import GrammarSpec, SamplingParams

# Long strings keep rows inside "string" states, where most of the vocabulary is allowed and
# the mask is the most expensive to compute.
SCHEMA = {
    "type": "object",
    "properties": {
        "title": {"type": "string"},
        "year": {"type": "integer"},
        "tags": {"type": "array", "items": {"type": "string"}},
        "rating": {"enum": ["G", "PG", "R"]},
    },
    "required": ["title", "year", "tags", "rating"],
    "additionalProperties": False,
}


class MaskTimer:
    """Wraps a GrammarBitmask's fill and apply, summing their wall time (device synced)."""

    def __init__(self, masks: GrammarBitmask, sync) -> None:
        self.fill_s = self.apply_s = 0.0
        self.num_calls = 0
        fill, apply = masks.fill, masks.apply

        def timed_fill(matchers):
            t = time.perf_counter()
            out = fill(matchers)
            self.fill_s += time.perf_counter() - t
            return out

        def timed_apply(*args, **kw):
            sync()
            t = time.perf_counter()
            out = apply(*args, **kw)
            sync()
            self.apply_s += time.perf_counter() - t
            self.num_calls += 1
            return out

        masks.fill, masks.apply = timed_fill, timed_apply


def decode_step_times(engine: LLMEngine, batch: int, steps: int, spec, tag: str) -> list[float]:
    """Adds `batch` requests, runs them past prefill, then times `steps` decode steps."""
    params = SamplingParams(
        max_tokens=steps + 8, temperature=0.0, ignore_eos=spec is None, structured_outputs=spec
    )
    for i in range(batch):
        prompt = engine.tokenizer.encode(f"Describe film number {i} as JSON.")
        engine.add_request(f"{tag}-{i}", prompt, params)
    while any(r.num_output_tokens == 0 for r in engine.scheduler.requests.values()):
        engine.step()
    sync = _sync(engine)
    times = []
    for _ in range(steps):
        sync()
        t = time.perf_counter()
        outputs, _ = engine.step()
        sync()
        times.append(time.perf_counter() - t)
        if len(outputs) < batch:  # a row finished: the batch is no longer `batch` wide
            break
    engine.abort_request([f"{tag}-{i}" for i in range(batch)])
    while engine.has_unfinished_requests():
        engine.step()
    return times


def _sync(engine: LLMEngine):
    import torch

    if engine.runner.device.type == "cuda":
        return torch.cuda.synchronize
    return lambda: None


def time_to_first_token(engine: LLMEngine, spec: GrammarSpec | None, tag: str) -> float:
    t = time.perf_counter()
    if spec is not None:
        engine.grammar_compiler.compile(spec)
    params = SamplingParams(max_tokens=4, temperature=0.0, structured_outputs=spec)
    engine.add_request(tag, engine.tokenizer.encode("Give me a film as JSON."), params)
    while True:
        outputs, _ = engine.step()
        if any(o.request_id == tag and o.outputs[0].token_ids for o in outputs):
            break
    ttft = time.perf_counter() - t
    engine.abort_request([tag])
    while engine.has_unfinished_requests():
        engine.step()
    return ttft


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default=None, help="default: the embedded SmolLM2-135M-Instruct")
    ap.add_argument("--batch", type=int, nargs="+", default=[1, 32])
    ap.add_argument("--steps", type=int, default=32)
    ap.add_argument("--dtype", default="auto")
    ap.add_argument("--device", default="auto")
    args = ap.parse_args()
    engine = LLMEngine(EngineConfig(model=args.model, dtype=args.dtype, device=args.device))
    spec = GrammarSpec.json_schema(SCHEMA)
    engine.grammar_compiler.compile(spec)  # cached from here on
    rows = []
    for batch in args.batch:
        decode_step_times(engine, batch, 4, None, f"warm{batch}")  # warm-up (graphs, caches)
        free = decode_step_times(engine, batch, args.steps, None, f"free{batch}")
        sampler = engine.runner.sampler
        masks = sampler.grammar_masks_for(engine.vocab_size)
        timer = MaskTimer(masks, _sync(engine))
        constrained = decode_step_times(engine, batch, args.steps, spec, f"json{batch}")
        del masks.fill, masks.apply  # back to the class methods
        step = statistics.median(free)
        per_step = (timer.fill_s + timer.apply_s) / max(timer.num_calls, 1)
        rows.append(
            {
                "batch": batch,
                "decode_step_ms": round(step * 1e3, 3),
                "constrained_step_ms": round(statistics.median(constrained) * 1e3, 3),
                "mask_fill_ms": round(timer.fill_s / max(timer.num_calls, 1) * 1e3, 3),
                "mask_apply_ms": round(timer.apply_s / max(timer.num_calls, 1) * 1e3, 3),
                "mask_over_step": round(per_step / step, 4),
                "num_masked_steps": timer.num_calls,
            }
        )
    cold_spec = GrammarSpec.json_schema({**SCHEMA, "title": f"cold-{time.time_ns()}"})
    ttft = {
        "ttft_unconstrained_ms": time_to_first_token(engine, None, "t-free") * 1e3,
        "ttft_cold_grammar_ms": time_to_first_token(engine, cold_spec, "t-cold") * 1e3,
        "ttft_cached_grammar_ms": time_to_first_token(engine, cold_spec, "t-cached") * 1e3,
    }
    device = str(engine.runner.device)
    print(json.dumps({"device": device, "dtype": str(engine.runner.dtype), "rows": rows}))
    print(json.dumps({k: round(v, 2) for k, v in ttft.items()}))
    print("| batch | decode step ms | constrained step ms | fill ms | apply ms | mask / step |")
    print("|---|---|---|---|---|---|")
    for r in rows:
        print(
            f"| {r['batch']} | {r['decode_step_ms']} | {r['constrained_step_ms']} | "
            f"{r['mask_fill_ms']} | {r['mask_apply_ms']} | {r['mask_over_step']:.1%} |"
        )


if __name__ == "__main__":
    main()
