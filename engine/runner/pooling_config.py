"""How a pooling model turns hidden states into one vector: read from the checkpoint.

A sentence-transformers folder says it in modules.json (Transformer -> Pooling -> Normalize),
the Pooling module's config.json (cls / mean / lasttoken / max) and sentence_bert_config.json
(max_seq_length). Without them: BERT-family encoders pool the CLS token, decoders the last
token, both normalized (vLLM's defaults for embedding models).
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

RUNNERS = ("auto", "generate", "pooling")  # vLLM's --runner
TASKS = ("auto", "generate", "embed", "embedding")  # vLLM's older --task spellings served here
POOLING_TASKS = ("embed", "embedding")
# Encoder-only architectures: served by the pooling runner whatever --runner says.
ENCODER_ARCHITECTURES = ("BertModel", "BertForMaskedLM", "BertForSequenceClassification")
POOLING_TYPES = ("CLS", "MEAN", "LAST", "MAX")
_ST_MODES = {
    "pooling_mode_cls_token": "CLS",
    "pooling_mode_mean_tokens": "MEAN",
    "pooling_mode_lasttoken": "LAST",
    "pooling_mode_max_tokens": "MAX",
}


@dataclass(frozen=True)
class PoolingConfig:
    pooling_type: str  # one of POOLING_TYPES
    normalize: bool
    max_seq_length: int | None = None  # sentence_bert_config.json's, when it says one
    matryoshka: bool = False  # trained for truncated outputs (`dimensions` allowed)
    source: str = "default"  # where it was read from, for the start-up log


def is_pooling_checkpoint(model_dir: Path, hf_config) -> bool:
    """True for a sentence-transformers folder or an encoder / bare-backbone architecture."""
    arch = (getattr(hf_config, "architectures", None) or [""])[0]
    return (
        (Path(model_dir) / "modules.json").is_file()
        or arch in ENCODER_ARCHITECTURES
        or arch.endswith(("Model", "ForSequenceClassification"))
    )


def is_cross_encoder(hf_config) -> bool:
    """A reranker: scores (query, document) pairs with one logit instead of embedding."""
    arch = (getattr(hf_config, "architectures", None) or [""])[0]
    return arch.endswith("ForSequenceClassification")


def is_encoder(hf_config) -> bool:
    arch = (getattr(hf_config, "architectures", None) or [""])[0]
    return arch in ENCODER_ARCHITECTURES or getattr(hf_config, "model_type", "") == "bert"


def read_pooling_config(model_dir: Path, hf_config) -> PoolingConfig:
    """The model's pooling; ValueError for a sentence-transformers module this cannot run."""
    model_dir = Path(model_dir)
    matryoshka = bool(
        getattr(hf_config, "is_matryoshka", False)
        or getattr(hf_config, "matryoshka_dimensions", None)
    )
    max_len = _st_max_seq_length(model_dir)
    modules_file = model_dir / "modules.json"
    if not modules_file.is_file():
        default = "CLS" if is_encoder(hf_config) else "LAST"
        return PoolingConfig(default, True, max_len, matryoshka)
    modules = json.loads(modules_file.read_text())
    pooling_type, normalize = None, False
    for module in modules:
        kind = module.get("type", "").rsplit(".", 1)[-1]
        if kind == "Pooling":
            pooling_type = _st_pooling_type(model_dir / module.get("path", ""))
        elif kind == "Normalize":
            normalize = True
        elif kind != "Transformer":
            raise ValueError(
                f"{modules_file}: sentence-transformers module {kind!r} is not supported "
                "(Transformer, Pooling and Normalize are)"
            )
    if pooling_type is None:
        pooling_type = "CLS" if is_encoder(hf_config) else "LAST"
    return PoolingConfig(pooling_type, normalize, max_len, matryoshka, "modules.json")


def _st_pooling_type(folder: Path) -> str:
    cfg = json.loads((folder / "config.json").read_text())
    modes = [name for key, name in _ST_MODES.items() if cfg.get(key)]
    if cfg.get("pooling_mode_mean_sqrt_len_tokens") or len(modes) != 1:
        raise ValueError(
            f"{folder / 'config.json'}: exactly one of cls, mean, lasttoken or max pooling is "
            "supported"
        )
    return modes[0]


def _st_max_seq_length(model_dir: Path) -> int | None:
    path = model_dir / "sentence_bert_config.json"
    if not path.is_file():
        return None
    return json.loads(path.read_text()).get("max_seq_length")
