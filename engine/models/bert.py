"""BERT-family encoders: BertModel (embeddings) and BertForSequenceClassification (cross-encoders).

Bidirectional attention, absolute learned positions, token types, post-LayerNorm blocks, GELU.
The rows of B sequences are packed back to back ([T, E], no padding) through every projection
and attention: the caller sorts them by length (engine/embedding/runner.py) and attention runs
once per run of equal lengths, over the real rows only (no padding, no mask).
Weights: Hugging Face names (``embeddings.word_embeddings.weight``, ``encoder.layer.0...``; a
``bert.`` prefix, as BertForSequenceClassification saves them, is accepted).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from engine.models.linear import Linear

ARCHITECTURES = ("BertModel", "BertForSequenceClassification")
GELU_APPROXIMATE = {"gelu": "none", "gelu_new": "tanh", "gelu_pytorch_tanh": "tanh", "gelu_fast": "tanh"}


@dataclass(frozen=True)
class BertConfig:
    vocab_size: int
    hidden_size: int
    num_layers: int
    num_heads: int
    intermediate_size: int
    max_position_embeddings: int
    type_vocab_size: int = 2
    layer_norm_eps: float = 1e-12
    hidden_act: str = "gelu"
    num_labels: int = 0  # 0: no classification head (BertModel)

    @property
    def head_dim(self) -> int:
        return self.hidden_size // self.num_heads

    @classmethod
    def from_hf_dict(cls, d: dict) -> BertConfig:
        architecture = (d.get("architectures") or ["BertModel"])[0]
        if architecture not in ARCHITECTURES:
            raise ValueError(
                f"architectures: {architecture!r} is not a BERT encoder ({', '.join(ARCHITECTURES)})"
            )
        if d.get("position_embedding_type", "absolute") != "absolute":
            raise ValueError(
                f"position_embedding_type: only 'absolute' is supported, got {d['position_embedding_type']!r}"
            )
        act = d.get("hidden_act", "gelu")
        if act not in GELU_APPROXIMATE:
            raise ValueError(
                f"hidden_act: {act!r} is not supported (expected one of {', '.join(GELU_APPROXIMATE)})"
            )
        num_labels = 0
        if architecture == "BertForSequenceClassification":
            num_labels = (
                len(d["id2label"]) if isinstance(d.get("id2label"), dict) else int(d.get("num_labels", 2))
            )
        config = cls(
            vocab_size=int(d["vocab_size"]),
            hidden_size=int(d["hidden_size"]),
            num_layers=int(d["num_hidden_layers"]),
            num_heads=int(d["num_attention_heads"]),
            intermediate_size=int(d["intermediate_size"]),
            max_position_embeddings=int(d.get("max_position_embeddings", 512)),
            type_vocab_size=int(d.get("type_vocab_size", 2)),
            layer_norm_eps=float(d.get("layer_norm_eps", 1e-12)),
            hidden_act=act,
            num_labels=num_labels,
        )
        if config.hidden_size % config.num_heads:
            raise ValueError(
                f"hidden_size {config.hidden_size} is not a multiple of "
                f"num_attention_heads {config.num_heads}"
            )
        return config


@dataclass(slots=True)
class EncoderBatch:
    """B sequences packed into T rows; sequence b owns rows starts[b]:starts[b+1]."""

    input_ids: torch.Tensor  # [T] int64
    token_type_ids: torch.Tensor  # [T] int64
    positions: torch.Tensor  # [T] int64, 0.. within each sequence
    starts: list[int]  # [B+1] row offsets


def pack_rows(ids: list[list[int]], type_ids: list[list[int]] | None = None) -> EncoderBatch:
    """Token-id lists (and their token types, default 0) -> one packed EncoderBatch."""
    starts = [0]
    for seq in ids:
        starts.append(starts[-1] + len(seq))
    flat = [t for seq in ids for t in seq]
    types = [0] * len(flat) if type_ids is None else [t for seq in type_ids for t in seq]
    positions = [p for seq in ids for p in range(len(seq))]
    return EncoderBatch(
        torch.tensor(flat, dtype=torch.int64),
        torch.tensor(types, dtype=torch.int64),
        torch.tensor(positions, dtype=torch.int64),
        starts,
    )


class _Runs:
    """A packed batch's sequences in runs of equal length (the caller sorts by length): attention runs
    once per run over [n, H, L, D], no padding and no mask; only the real rows are computed."""

    def __init__(self, starts: list[int]):
        self.runs: list[tuple[int, int, int]] = []  # (first row, row count, sequence length)
        for a, b in zip(starts, starts[1:]):
            n = b - a
            if self.runs and self.runs[-1][2] == n:
                first, count, _ = self.runs[-1]
                self.runs[-1] = (first, count + n, n)
            else:
                self.runs.append((a, n, n))

    def attend(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        """q, k, v [T, H, D] -> [T, H * D], each sequence attending to its own rows only."""
        T, H, D = q.shape
        if len(self.runs) == 1:
            return self._attend_run(q, k, v, *self.runs[0])
        out = q.new_empty((T, H * D))
        for first, count, length in self.runs:
            rows = slice(first, first + count)
            out[rows] = self._attend_run(q[rows], k[rows], v[rows], first, count, length)
        return out

    @staticmethod
    def _attend_run(q, k, v, first: int, count: int, length: int) -> torch.Tensor:
        n = count // length
        H, D = q.shape[1], q.shape[2]
        grid = [t.view(n, length, H, D).transpose(1, 2) for t in (q, k, v)]  # [n, H, L, D] each
        out = F.scaled_dot_product_attention(*grid)  # [n, H, L, D]
        return out.transpose(1, 2).reshape(count, H * D)


class EncoderLayer(nn.Module):
    """Post-LayerNorm block. The residual stream and the norms stay float32; the projections and
    attention run in ``dtype`` (bfloat16: oneDNN's AMX/AVX-512 BF16 products)."""

    def __init__(self, config: BertConfig, w: dict[str, torch.Tensor], dtype: torch.dtype = torch.float32):
        super().__init__()
        self.dtype = dtype
        w = {name: t.to(dtype) if not name.endswith("norm.weight") and not name.endswith("norm.bias") else t
             for name, t in w.items()}
        self.num_heads, self.head_dim = config.num_heads, config.head_dim
        self.eps = config.layer_norm_eps
        self.approximate = GELU_APPROXIMATE[config.hidden_act]
        self.qkv = Linear(
            torch.cat([w["query.weight"], w["key.weight"], w["value.weight"]]),
            torch.cat([w["query.bias"], w["key.bias"], w["value.bias"]]),
        )  # [3 E, E]
        self.attn_out = Linear(w["attn_out.weight"], w["attn_out.bias"])  # [E, E]
        self.attn_norm = (w["attn_norm.weight"], w["attn_norm.bias"])  # [E] each
        self.up = Linear(w["up.weight"], w["up.bias"])  # [I, E]
        self.down = Linear(w["down.weight"], w["down.bias"])  # [E, I]
        self.ffn_norm = (w["ffn_norm.weight"], w["ffn_norm.bias"])  # [E] each
        self.shape = (config.hidden_size,)

    def forward(self, x: torch.Tensor, runs: _Runs) -> torch.Tensor:
        T = x.shape[0]  # x [T, E] float32
        dt = self.dtype
        q, k, v = self.qkv(x.to(dt)).view(T, 3, self.num_heads, self.head_dim).unbind(1)  # [T, H, D] each
        attn = self.attn_out(runs.attend(q, k, v)).float()  # [T, E]
        x = F.layer_norm(x + attn, self.shape, *self.attn_norm, self.eps)
        h = F.gelu(self.up(x.to(dt)), approximate=self.approximate)  # [T, I]
        return F.layer_norm(x + self.down(h).float(), self.shape, *self.ffn_norm, self.eps)  # [T, E]


LAYER_NAMES = {
    "query": "attention.self.query",
    "key": "attention.self.key",
    "value": "attention.self.value",
    "attn_out": "attention.output.dense",
    "attn_norm": "attention.output.LayerNorm",
    "up": "intermediate.dense",
    "down": "output.dense",
    "ffn_norm": "output.LayerNorm",
}


class BertModel(nn.Module):
    """An encoder of the engine: ``encode(batch) -> hidden [T, E]``, ``classify`` for cross-encoders.

    It generates nothing (``can_generate`` is False: the engine refuses generation requests)."""

    can_generate = False

    def __init__(
        self,
        config: BertConfig,
        state_dict: dict[str, torch.Tensor],
        max_model_len: int | None = None,
        dtype: torch.dtype = torch.float32,
    ):
        """dtype: of the projections and attention (float32, or bfloat16); embeddings, norms, the
        residual stream and the classification head stay float32."""
        super().__init__()
        self.config = config
        self.dtype = dtype
        self.vocab_size = config.vocab_size
        self.hidden_size = config.hidden_size
        self.max_model_len = min(
            max_model_len or config.max_position_embeddings, config.max_position_embeddings
        )
        weights = _Weights(state_dict)
        E = config.hidden_size
        self.word_embeddings = weights.take("embeddings.word_embeddings.weight", (config.vocab_size, E))
        self.position_embeddings = weights.take(
            "embeddings.position_embeddings.weight", (config.max_position_embeddings, E)
        )
        self.token_type_embeddings = weights.take(
            "embeddings.token_type_embeddings.weight", (config.type_vocab_size, E)
        )
        self.embed_norm = (
            weights.take("embeddings.LayerNorm.weight", (E,)),
            weights.take("embeddings.LayerNorm.bias", (E,)),
        )
        shapes = {
            "query": (E, E),
            "key": (E, E),
            "value": (E, E),
            "attn_out": (E, E),
            "attn_norm": (E,),
            "up": (config.intermediate_size, E),
            "down": (E, config.intermediate_size),
            "ffn_norm": (E,),
        }
        self.layers = nn.ModuleList()
        for i in range(config.num_layers):
            w = {}
            for short, long in LAYER_NAMES.items():
                out_shape = shapes[short]
                w[f"{short}.weight"] = weights.take(f"encoder.layer.{i}.{long}.weight", out_shape)
                w[f"{short}.bias"] = weights.take(f"encoder.layer.{i}.{long}.bias", out_shape[:1])
            self.layers.append(EncoderLayer(config, w, dtype))
        self.pooler = self.classifier = None
        if config.num_labels:
            self.pooler = Linear(
                weights.take("pooler.dense.weight", (E, E)), weights.take("pooler.dense.bias", (E,))
            )
            self.classifier = Linear(
                weights.take("classifier.weight", (config.num_labels, E), prefixed=False),
                weights.take("classifier.bias", (config.num_labels,), prefixed=False),
            )

    def make_kv_cache(self, num_blocks: int, block_size: int) -> None:
        return None  # an encoder keeps no KV between calls

    def forward(self, batch, kv_cache) -> torch.Tensor:
        raise TypeError("BertModel is an encoder: it computes embeddings and scores, not next-token logits")

    @torch.inference_mode()
    def encode(self, batch: EncoderBatch) -> torch.Tensor:
        """-> the last layer's hidden states [T, E] float32."""
        x = (
            F.embedding(batch.input_ids, self.word_embeddings)
            + F.embedding(batch.positions, self.position_embeddings)
            + F.embedding(batch.token_type_ids, self.token_type_embeddings)
        )  # [T, E]
        x = F.layer_norm(x, (self.hidden_size,), *self.embed_norm, self.config.layer_norm_eps)
        runs = _Runs(batch.starts)
        for layer in self.layers:
            x = layer(x, runs)
        return x

    @torch.inference_mode()
    def classify(self, hidden: torch.Tensor, starts: list[int]) -> torch.Tensor:
        """hidden [T, E] -> logits [B, num_labels] from each sequence's first ([CLS]) row."""
        if self.classifier is None:
            raise TypeError("this BertModel has no classification head (not a BertForSequenceClassification)")
        cls_rows = hidden.index_select(0, torch.tensor(starts[:-1], dtype=torch.int64))  # [B, E]
        return self.classifier(torch.tanh(self.pooler(cls_rows)))  # [B, num_labels]


class _Weights:
    """Dense float32 tensors by name, with or without the ``bert.`` prefix; shapes checked."""

    def __init__(self, state_dict: dict[str, torch.Tensor]):
        self.state_dict = state_dict

    def take(self, name: str, shape: tuple[int, ...], prefixed: bool = True) -> torch.Tensor:
        tensor = self.state_dict.get(name)
        if tensor is None and prefixed:
            tensor = self.state_dict.get("bert." + name)
        if tensor is None:
            raise ValueError(f"missing weight {name!r} (expected shape {list(shape)})")
        if tuple(tensor.shape) != tuple(shape):
            raise ValueError(f"weight {name!r}: shape {list(tensor.shape)}, expected {list(shape)}")
        return tensor.to(torch.float32).contiguous()
