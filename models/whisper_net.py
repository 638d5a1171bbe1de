"""Whisper in plain torch, built from a CTranslate2 WhisperSpec, with a slot KV cache.

The weights are ctranslate2's converter (converters/transformers.py, WhisperLoader) read
backwards: fused self-attention QKV is split into three projections, the cross-attention keeps
its query apart and fuses key/value, the key projections carry zero biases, the output
projection is the token embedding (a file alias), and the sinusoidal encoder positions are
stored as a table.

Decoding runs one token per row per step over rows 0..n-1 of a preallocated cache: each row is
one sequence at its own position. Self-attention keys/values are written at the row's position
and read up to it (a mask hides the rest); cross-attention keys/values are computed once when
the sequence joins. A finished row is refilled by moving the last row into it, so the active
rows stay a contiguous prefix and a step reads a view of the cache, not a gathered copy.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn

ENCODER_FRAMES = 1500  # 30 s of audio after the stride-2 convolution
LN_EPS = 1e-5
CPU_GEMM_ROWS = 4  # the output projection's row count is padded to a multiple of this on a CPU


@dataclass(frozen=True)
class WhisperDims:
    n_mels: int
    d_model: int
    encoder_layers: int
    encoder_heads: int
    decoder_layers: int
    decoder_heads: int
    vocab_size: int
    max_target_positions: int

    @classmethod
    def from_variables(cls, v: dict[str, np.ndarray]) -> WhisperDims:
        d_model = v["decoder/embeddings/weight"].shape[1]

        def layers(prefix: str) -> int:
            pattern = re.compile(rf"^{prefix}/layer_(\d+)/")
            return len({m.group(1) for m in map(pattern.match, v) if m})

        return cls(
            n_mels=v["encoder/conv1/weight"].shape[1],
            d_model=d_model,
            encoder_layers=layers("encoder"),
            encoder_heads=int(v["encoder/num_heads"]),
            decoder_layers=layers("decoder"),
            decoder_heads=int(v["decoder/num_heads"]),
            vocab_size=v["decoder/embeddings/weight"].shape[0],
            max_target_positions=v["decoder/position_encodings/encodings"].shape[0],
        )


def _linear(v: dict[str, np.ndarray], prefix: str) -> nn.Linear:
    weight = torch.from_numpy(v[f"{prefix}/weight"].astype(np.float32))
    layer = nn.Linear(weight.shape[1], weight.shape[0])
    layer.weight.data.copy_(weight)
    layer.bias.data.copy_(torch.from_numpy(v[f"{prefix}/bias"].astype(np.float32)))
    return layer


def _split_linear(v: dict[str, np.ndarray], prefix: str, parts: int) -> list[nn.Linear]:
    """A fused projection [parts * d, d_in] back into `parts` projections."""
    weight = v[f"{prefix}/weight"].astype(np.float32)
    bias = v[f"{prefix}/bias"].astype(np.float32)
    layers = []
    for w, b in zip(np.split(weight, parts), np.split(bias, parts)):
        layer = nn.Linear(w.shape[1], w.shape[0])
        layer.weight.data.copy_(torch.from_numpy(w))
        layer.bias.data.copy_(torch.from_numpy(b))
        layers.append(layer)
    return layers


def _layer_norm(v: dict[str, np.ndarray], prefix: str) -> nn.LayerNorm:
    gamma = torch.from_numpy(v[f"{prefix}/gamma"].astype(np.float32))
    norm = nn.LayerNorm(gamma.shape[0], eps=LN_EPS)
    norm.weight.data.copy_(gamma)
    norm.bias.data.copy_(torch.from_numpy(v[f"{prefix}/beta"].astype(np.float32)))
    return norm


def _heads(x: torch.Tensor, heads: int) -> torch.Tensor:
    """[B, T, d] -> [B, H, T, d / H]"""
    b, t, d = x.shape
    return x.view(b, t, heads, d // heads).transpose(1, 2)


def _merge(x: torch.Tensor) -> torch.Tensor:
    b, h, t, d = x.shape
    return x.transpose(1, 2).reshape(b, t, h * d)


class Ffn(nn.Module):
    def __init__(self, v: dict[str, np.ndarray], prefix: str) -> None:
        super().__init__()
        self.norm = _layer_norm(v, f"{prefix}/layer_norm")
        self.fc1 = _linear(v, f"{prefix}/linear_0")
        self.fc2 = _linear(v, f"{prefix}/linear_1")

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.fc2(F.gelu(self.fc1(self.norm(x))))


class EncoderLayer(nn.Module):
    def __init__(self, v: dict[str, np.ndarray], prefix: str, heads: int) -> None:
        super().__init__()
        self.heads = heads
        self.norm = _layer_norm(v, f"{prefix}/self_attention/layer_norm")
        self.q, self.k, self.v = _split_linear(v, f"{prefix}/self_attention/linear_0", 3)
        self.out = _linear(v, f"{prefix}/self_attention/linear_1")
        self.ffn = Ffn(v, f"{prefix}/ffn")

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.norm(x)
        q, k, v = (_heads(proj(h), self.heads) for proj in (self.q, self.k, self.v))
        x = x + self.out(_merge(F.scaled_dot_product_attention(q, k, v)))
        return self.ffn(x)


class Encoder(nn.Module):
    def __init__(self, v: dict[str, np.ndarray], dims: WhisperDims) -> None:
        super().__init__()
        self.conv1 = nn.Conv1d(dims.n_mels, dims.d_model, 3, padding=1)
        self.conv2 = nn.Conv1d(dims.d_model, dims.d_model, 3, stride=2, padding=1)
        for conv, name in ((self.conv1, "conv1"), (self.conv2, "conv2")):
            conv.weight.data.copy_(torch.from_numpy(v[f"encoder/{name}/weight"].astype(np.float32)))
            conv.bias.data.copy_(torch.from_numpy(v[f"encoder/{name}/bias"].astype(np.float32)))
        positions = torch.from_numpy(v["encoder/position_encodings/encodings"].astype(np.float32))
        self.register_buffer("positions", positions, persistent=False)
        self.layers = nn.ModuleList(
            EncoderLayer(v, f"encoder/layer_{i}", dims.encoder_heads) for i in range(dims.encoder_layers)
        )
        self.norm = _layer_norm(v, "encoder/layer_norm")

    def forward(self, mel: torch.Tensor) -> torch.Tensor:
        """[B, n_mels, 3000] log-mel -> [B, 1500, d_model]"""
        x = F.gelu(self.conv2(F.gelu(self.conv1(mel)))).transpose(1, 2)
        x = x + self.positions[: x.shape[1]]
        for layer in self.layers:
            x = layer(x)
        return self.norm(x)


class SlotCache:
    """Preallocated keys/values: [layers, rows, heads, length, head_dim] for self-attention up
    to the token limit, and the same over the encoder frames for cross-attention."""

    def __init__(self, dims: WhisperDims, rows: int, self_length: int, dtype: torch.dtype, device: str) -> None:
        heads, head_dim = dims.decoder_heads, dims.d_model // dims.decoder_heads
        self_shape = (dims.decoder_layers, rows, heads, self_length, head_dim)
        cross_shape = (dims.decoder_layers, rows, heads, ENCODER_FRAMES, head_dim)
        self.self_k = torch.zeros(self_shape, dtype=dtype, device=device)
        self.self_v = torch.zeros(self_shape, dtype=dtype, device=device)
        self.cross_k = torch.zeros(cross_shape, dtype=dtype, device=device)
        self.cross_v = torch.zeros(cross_shape, dtype=dtype, device=device)
        self.rows = rows
        self.self_length = self_length

    @staticmethod
    def bytes_per_row(dims: WhisperDims, self_length: int, dtype: torch.dtype) -> int:
        item = torch.empty((), dtype=dtype).element_size()
        return dims.decoder_layers * 2 * dims.d_model * (self_length + ENCODER_FRAMES) * item

    def move(self, src: int, dst: int) -> None:
        for tensor in (self.self_k, self.self_v, self.cross_k, self.cross_v):
            tensor[:, dst].copy_(tensor[:, src])


class DecoderLayer(nn.Module):
    def __init__(self, v: dict[str, np.ndarray], prefix: str, heads: int) -> None:
        super().__init__()
        self.heads = heads
        self.self_norm = _layer_norm(v, f"{prefix}/self_attention/layer_norm")
        self.self_q, self.self_k, self.self_v = _split_linear(v, f"{prefix}/self_attention/linear_0", 3)
        self.self_out = _linear(v, f"{prefix}/self_attention/linear_1")
        self.cross_norm = _layer_norm(v, f"{prefix}/attention/layer_norm")
        self.cross_q = _linear(v, f"{prefix}/attention/linear_0")
        self.cross_k, self.cross_v = _split_linear(v, f"{prefix}/attention/linear_1", 2)
        self.cross_out = _linear(v, f"{prefix}/attention/linear_2")
        self.ffn = Ffn(v, f"{prefix}/ffn")

    def cross_kv(self, memory: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return _heads(self.cross_k(memory), self.heads), _heads(self.cross_v(memory), self.heads)

    def step(self, x: torch.Tensor, index: int, cache: SlotCache, positions: torch.Tensor,
             mask: torch.Tensor) -> torch.Tensor:
        """x: [n, 1, d], one token per row at `positions` [n]; rows 0..n-1 of the cache."""
        n, span = x.shape[0], mask.shape[-1]
        rows = torch.arange(n, device=x.device)
        h = self.self_norm(x)
        q = _heads(self.self_q(h), self.heads)
        cache.self_k[index, rows, :, positions] = _heads(self.self_k(h), self.heads)[:, :, 0].to(cache.self_k.dtype)
        cache.self_v[index, rows, :, positions] = _heads(self.self_v(h), self.heads)[:, :, 0].to(cache.self_v.dtype)
        keys = cache.self_k[index, :n, :, :span].to(q.dtype)
        values = cache.self_v[index, :n, :, :span].to(q.dtype)
        x = x + self.self_out(_merge(F.scaled_dot_product_attention(q, keys, values, attn_mask=mask)))
        q = _heads(self.cross_q(self.cross_norm(x)), self.heads)
        keys, values = cache.cross_k[index, :n].to(q.dtype), cache.cross_v[index, :n].to(q.dtype)
        x = x + self.cross_out(_merge(F.scaled_dot_product_attention(q, keys, values)))
        return self.ffn(x)


class Decoder(nn.Module):
    def __init__(self, v: dict[str, np.ndarray], dims: WhisperDims) -> None:
        super().__init__()
        self.embeddings = nn.Embedding(dims.vocab_size, dims.d_model)
        self.embeddings.weight.data.copy_(torch.from_numpy(v["decoder/embeddings/weight"].astype(np.float32)))
        positions = torch.from_numpy(v["decoder/position_encodings/encodings"].astype(np.float32))
        self.register_buffer("positions", positions, persistent=False)
        self.layers = nn.ModuleList(
            DecoderLayer(v, f"decoder/layer_{i}", dims.decoder_heads) for i in range(dims.decoder_layers)
        )
        self.norm = _layer_norm(v, "decoder/layer_norm")

    def fill_cross(self, cache: SlotCache, rows: list[int], memory: torch.Tensor) -> None:
        index = torch.tensor(rows, device=memory.device)
        for i, layer in enumerate(self.layers):
            k, v = layer.cross_kv(memory)
            cache.cross_k[i, index] = k.to(cache.cross_k.dtype)
            cache.cross_v[i, index] = v.to(cache.cross_v.dtype)

    def step(self, cache: SlotCache, tokens: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        """One token for each of rows 0..n-1 -> logits [n, vocab]. The output projection is
        the token embedding (tied, as ctranslate2 stores it)."""
        span = int(positions.max()) + 1
        mask = (torch.arange(span, device=tokens.device)[None, :] <= positions[:, None])[:, None, None, :]
        x = (self.embeddings(tokens) + self.positions[positions])[:, None, :]
        for i, layer in enumerate(self.layers):
            x = layer.step(x, i, cache, positions, mask)
        return self.project(self.norm(x[:, 0]))

    def project(self, h: torch.Tensor) -> torch.Tensor:
        """[n, d] -> logits [n, vocab], the step's largest product (51,864 x 384). On a CPU it
        runs on rows padded to a multiple of 4: measured here (2 threads), 2, 3, 7 and 11 rows
        took 19-28 ms against 12-14 ms for 4, 8 or 12 (benchmarks/whisper_step_cost.py)."""
        n = h.shape[0]
        rows = n if h.device.type != "cpu" or n == 1 else -(-n // CPU_GEMM_ROWS) * CPU_GEMM_ROWS
        if rows != n:
            h = torch.cat([h, h.new_zeros(rows - n, h.shape[1])])
        return (h @ self.embeddings.weight.T)[:n]


class WhisperNet(nn.Module):
    def __init__(self, variables: dict[str, np.ndarray]) -> None:
        super().__init__()
        self.dims = WhisperDims.from_variables(variables)
        self.encoder = Encoder(variables, self.dims)
        self.decoder = Decoder(variables, self.dims)
