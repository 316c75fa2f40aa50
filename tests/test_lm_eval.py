"""lm-eval's `local-completions` with `tokenizer_backend=remote` against a live server.

The remote tokenizer reads /tokenizer_info and tokenizes through /tokenize and /detokenize,
so the client needs no tokenizer files and no model hub. The task is written here: a
multiple-choice set the cycle model (conftest.build_cycle_model_dir, greedy continuation of
"aé🎉世ж" forever) answers right every time, so accuracy 1.0 means every piece worked: the
tokenizer info, token-id prompts, echo + logprobs and lm-eval's parsing of them.
"""

from __future__ import annotations

import json
import os

import httpx
import pytest
from conftest import CYCLE_TEXT

TASK = "pagedserve_cycle_mc"


def _write_task(tmp_path) -> None:
    docs = []
    for i in range(len(CYCLE_TEXT) - 1):
        wrong = [c for c in CYCLE_TEXT if c != CYCLE_TEXT[i + 1]][:2] + ["q"]
        docs.append({"context": CYCLE_TEXT[: i + 1], "choices": [CYCLE_TEXT[i + 1], *wrong]})
    data = tmp_path / "cycle.jsonl"
    data.write_text("".join(json.dumps(d, ensure_ascii=False) + "\n" for d in docs))
    (tmp_path / f"{TASK}.yaml").write_text(
        f"task: {TASK}\n"
        "dataset_path: json\n"
        f"dataset_kwargs:\n  data_files:\n    test: {data}\n"
        "test_split: test\n"
        "output_type: multiple_choice\n"
        "doc_to_text: '{{context}}'\n"
        "doc_to_choice: '{{choices}}'\n"
        "doc_to_target: 0\n"
        "target_delimiter: ''\n"
        "metric_list:\n  - metric: acc\n"
    )


def test_tokenizer_info_has_vllm_shape(cycle_server):
    info = httpx.get(cycle_server.url + "/tokenizer_info", timeout=10).json()
    assert info["eos_token"] == "<|im_end|>" and info["bos_token"] == "<|im_start|>"
    assert info["pad_token"] == "<|endoftext|>"
    assert info["tokenizer_class"] and "{% for m in messages %}" in info["chat_template"]
    assert not {"vocab_file", "merges_file", "tokenizer_file", "name_or_path"} & info.keys()


def test_local_completions_with_remote_tokenizer_scores_a_local_task(cycle_server, tmp_path):
    lm_eval = pytest.importorskip("lm_eval", reason="lm-eval is a dev dependency")
    from lm_eval.tasks import TaskManager
    from lm_eval.utils import check_remote_tokenizer_support

    os.environ.setdefault("HF_DATASETS_OFFLINE", "1")
    _write_task(tmp_path)
    url = cycle_server.url + "/v1/completions"
    assert check_remote_tokenizer_support(url), "lm-eval does not see a remote tokenizer"
    results = lm_eval.simple_evaluate(
        model="local-completions",
        model_args=(
            f"base_url={url},model=cycle,tokenizer_backend=remote,tokenized_requests=True,"
            "num_concurrent=1,max_retries=1"
        ),
        tasks=[TASK],
        task_manager=TaskManager(include_path=str(tmp_path)),
        limit=None,
    )
    scores = results["results"][TASK]
    assert scores["acc,none"] == 1.0, scores
    assert results["n-samples"][TASK]["effective"] == len(CYCLE_TEXT) - 1
