"""GGUF files through the project's own reader (engine.gguf_file, a memory map): metadata to
ModelConfig, tensors renamed to Hugging Face names and converted one at a time to the weight
formats of engine.models.linear (engine.loader.repack), and llama.cpp's Q/K row permutation
undone on whatever rows the format has (``convert_hf_to_gguf`` permutes q_proj/k_proj rows for the "llama"
architecture so ggml can rotate adjacent pairs; Qwen2 uses NeoX rotation and is stored
unpermuted)."""
from __future__ import annotations

import os
import re
from collections.abc import Iterator, Mapping
from dataclasses import dataclass

import numpy as np
import torch

from engine.errors import ModelFileError
from engine.gguf_file import GGUFFile, TensorInfo, is_gguf_file
from engine.loader.repack import (
    INT4_TYPES,
    INT5_TYPES,
    PLAIN_TYPES,
    Q5_0,
    Q6_K,
    Q8_0,
    MappedRows,
    dequantize,
    int4_from_q4,
    int5_from_q5,
    q5_0_codes,
)
from engine.loader.validate import check_gguf
from engine.models.config import ModelConfig
from engine.models.families import GGUF_LAYER_ROLES, GGUF_PERMUTED_QK, GGUF_ROLE_OVERRIDES, hf_layer_name
from engine.models.llama import resolve_dtype
from engine.models.quant import Int4Weight, Int8Weight, PackedInt8Weight, PackedQ6Weight, Weight

CHUNK_ROWS = 4096  # rows dequantized at once for dense or int8 conversions (~15 MB of float32)

_GLOBAL_NAMES = {
    "token_embd.weight": "model.embed_tokens.weight",
    "output_norm.weight": "model.norm.weight",
    "output.weight": "lm_head.weight",
}
_LAYER_RE = re.compile(r"blk\.(\d+)\.(.+)")


def hf_names(gguf_name: str, info: TensorInfo | None, config: ModelConfig) -> list[tuple[str, int | None]]:
    """GGUF tensor name -> [(Hugging Face name, expert index or None)] of the family
    (engine.models.families); [] for tensors the model does not use. A [X, rows, cols] experts
    tensor gives one name per expert."""
    if gguf_name in _GLOBAL_NAMES:
        return [(_GLOBAL_NAMES[gguf_name], None)]
    match = _LAYER_RE.fullmatch(gguf_name)
    if not match:
        return []
    layer, suffix = int(match.group(1)), match.group(2)
    role = GGUF_ROLE_OVERRIDES.get(config.architecture, {}).get(suffix) or GGUF_LAYER_ROLES.get(suffix)
    if role is None:
        return []
    if role.startswith("expert_"):
        num_experts = info.dims[2] if info is not None and len(info.dims) == 3 else config.num_experts
        return [(name, j) for j in range(num_experts)
                if (name := hf_layer_name(config.architecture, role, layer, j)) is not None]
    name = hf_layer_name(config.architecture, role, layer)
    return [] if name is None else [(name, None)]


def gguf_name(name: str, architecture: str = "llama") -> str:
    """Hugging Face tensor name -> GGUF name for a dense family (the inverse of hf_names; unknown
    names unchanged). For writers of test files and for naming tensors in errors."""
    inverse = {hf: gguf for gguf, hf in _GLOBAL_NAMES.items()}
    if name in inverse:
        return inverse[name]
    match = _HF_LAYER_RE.fullmatch(name)
    if match:
        layer = int(match.group(1))
        for suffix, role in GGUF_LAYER_ROLES.items():
            role = GGUF_ROLE_OVERRIDES.get(architecture, {}).get(suffix, role)
            if not role.startswith("expert_") and hf_layer_name(architecture, role, layer) == name:
                return f"blk.{layer}.{suffix}"
    return name


_HF_LAYER_RE = re.compile(r"model\.layers\.(\d+)\..+")


@dataclass(frozen=True)
class _ExpertRows:
    """Expert j's [rows, cols] of a [X, rows, cols] GGUF tensor (ggml dims (cols, rows, X))."""
    name: str
    dims: tuple[int, int]
    ggml_type: int
    expert: int

    @property
    def shape(self) -> tuple[int, int]:
        return (self.dims[1], self.dims[0])


def unpermute_qk(w: torch.Tensor, num_heads: int) -> torch.Tensor:
    """Undo llama.cpp's ``permute``: rows per head go from interleaved pairs back to halves.

    w [num_heads * D, ...] (a weight or a bias) -> same shape.
    """
    rows = w.shape[0]
    return (w.reshape(num_heads, rows // num_heads // 2, 2, *w.shape[1:])  # [N, D/2, 2, ...]
            .transpose(1, 2)  # [N, 2, D/2, ...]
            .reshape(w.shape))


def read_config(gguf: GGUFFile) -> ModelConfig:
    """The file's ModelConfig, checked against its tensors (engine.loader.validate) with the
    family's own tensor names (hf_names), then the facts only tensors know (MoE dense layers,
    Phi-3's LongRoPE factors). ModelFileError naming the key or tensor at fault."""
    config = check_gguf(gguf, hf_names, gguf_name)
    tensors = gguf.tensors
    if config.num_experts:  # layers without a router have a dense FFN
        config.dense_layers = tuple(i for i in range(config.num_layers)
                                    if f"blk.{i}.ffn_gate_inp.weight" not in tensors)
    scaling = config.rope_scaling
    if scaling is not None and scaling["rope_type"] == "longrope":  # Phi-3: the factors are tensors
        for kind in ("long", "short"):
            name = f"rope_factors_{kind}.weight"
            if name not in tensors:
                raise ModelFileError(f"{gguf.path}: LongRoPE GGUF file has no {name} tensor", gguf.path)
            info = tensors[name]
            scaling[f"{kind}_factor"] = dequantize(gguf.raw(name), info.ggml_type, info.shape).tolist()
    return config


class GGUFStateDict(Mapping):
    """Hugging Face name -> weight, converted from the memory map when asked (nothing cached,
    so the model's one pass over the names holds one tensor's temporaries at a time).

    quantization (engine.config.QUANTIZATIONS) picks each tensor's format:
    - "auto": Q4_0/Q4_1/Q4_K projections -> Int4Weight, Q5_0/Q5_1 -> Int5Weight (both exact; a
      fused layer mixing Q5_0 with Q8_0 stays in two parts, engine.models.quant.RowParts); Q6_K
      projections and head, where the kernels take strips of 16 rows, -> PackedQ6Weight (the file's
      codes, exact; fused beside other formats: RowParts too); other quantized projections and the head ->
      Int8Weight with a scale per block of 32 (Q8_0: exact; other types re-quantized, and then the
      head's refined logits and a tied embedding read their rows exactly from the map), or, where
      the kernels take strips of 16 rows, PackedInt8Weight (the same codes packed a chunk at a time);
      a quantized untied embedding -> MappedRows (map only); unquantized tensors -> dense.
    - "int4": every projection -> Int4Weight (Q4 exact, others re-quantized); embedding/head int8.
    - "bfloat16" / "float32": everything dense in `dtype` (exact dequantization in float32).
    """

    def __init__(self, gguf: GGUFFile, config: ModelConfig, quantization: str, dtype: torch.dtype,
                 exact_products: bool = False):
        self.gguf = gguf
        self.config = config
        self.quantization = quantization
        self.dtype = dtype
        self.exact_products = exact_products  # the model's products exact: no strips for the head
        self.is_permuted = gguf.metadata["general.architecture"] in GGUF_PERMUTED_QK
        self.gguf_names = {hf: (n, expert) for n, info in gguf.tensors.items()
                           for hf, expert in hf_names(n, info, config)}

    def __getitem__(self, name: str) -> Weight:
        gguf_name, expert = self.gguf_names[name]
        info = self.gguf.tensors[gguf_name]
        if expert is not None:
            info = _ExpertRows(gguf_name, (info.dims[0], info.dims[1]), info.ggml_type, expert)
        try:
            weight = self._convert(name, info)
        finally:
            self.gguf.release(info.name)  # pages a MappedRows reads later fault back in
        if self.is_permuted and ".q_proj." in name:
            return _map_rows(weight, lambda t: unpermute_qk(t, self.config.num_heads))
        if self.is_permuted and ".k_proj." in name:
            return _map_rows(weight, lambda t: unpermute_qk(t, self.config.num_kv_heads))
        return weight

    def _convert(self, name: str, info) -> Weight:
        raw = self.gguf.raw(info.name)
        if isinstance(info, _ExpertRows):
            raw = raw[info.expert * info.dims[1]: (info.expert + 1) * info.dims[1]]
        is_plain = info.ggml_type in PLAIN_TYPES
        is_matrix = len(info.dims) == 2
        if not is_matrix or self.quantization in ("bfloat16", "float32"):
            return self._dense(raw, info, self.dtype if is_matrix else torch.float32)
        is_projection = name.startswith("model.layers.")
        if is_projection and info.ggml_type in INT4_TYPES:
            return int4_from_q4(raw, info.ggml_type, info.dims[0])
        if is_projection and info.ggml_type in INT5_TYPES and self.quantization == "auto":
            return int5_from_q5(raw, info.ggml_type, info.dims[0])
        if is_projection and self.quantization == "int4":
            return Int4Weight.from_dense(self._dense(raw, info, torch.float32))
        if is_plain:
            return self._dense(raw, info, self.dtype)
        source = None if isinstance(info, _ExpertRows) else (self.gguf.path, info.offset)  # rows read with pread
        if self._takes_q6_strips(name, info):
            weight = self._q6_strips(raw, info)
            if not is_projection:  # the head (tied: the embedding): lookups read the file's rows
                weight.exact_rows = MappedRows(raw, info.ggml_type, info.shape, source=source)
            return weight
        rows = MappedRows(raw, info.ggml_type, info.shape, source=source)
        if name == "model.embed_tokens.weight" and not self.config.tie_word_embeddings:
            return rows  # looked up a few rows at a time from the map: no resident copy
        weight = self._int8(raw, info, may_pack=not is_projection)  # the head (tied: also the embedding)
        if not weight.is_exact:  # re-quantized: lookups and the head's refined logits read the map
            weight.exact_rows = rows
        return weight

    def _dense(self, raw, info, dtype: torch.dtype) -> torch.Tensor:
        """Dequantized [rows, cols] in dtype, a chunk of rows at a time (no float32 copy of a
        large embedding)."""
        out = torch.empty(info.shape, dtype=dtype)
        flat = out.view(-1, info.dims[0])  # [rows, cols]
        for start in range(0, flat.shape[0], CHUNK_ROWS):
            part = raw[start:start + CHUNK_ROWS]
            flat[start:start + len(part)] = torch.from_numpy(self._dequantize(part, info, len(part)))
        return out

    def _takes_q6_strips(self, name: str, info) -> bool:
        """Whether a tensor loads as PackedQ6Weight: Q6_K (``auto``), where the kernels take strips of 16
        rows (engine.models.linear.packs), K a multiple of 256, and no rows reordered after load (a
        permuted family's q/k, MoE experts' slices); not an untied embedding (it stays in the map). ``ENGINE_Q6=0``
        in the environment: never (int8 re-quantized, as before them; benchmarks' A/B)."""
        from engine.models.linear import packs

        num_rows, num_cols = info.shape
        permuted = self.is_permuted and (".q_proj." in name or ".k_proj." in name)
        untied_embedding = name == "model.embed_tokens.weight" and not self.config.tie_word_embeddings
        return (info.ggml_type == Q6_K and self.quantization == "auto" and not permuted and not untied_embedding
                and os.environ.get("ENGINE_Q6", "1") != "0"
                and not isinstance(info, _ExpertRows) and num_cols % 256 == 0
                and packs(num_rows, self.exact_products))

    def _q6_strips(self, raw, info) -> PackedQ6Weight:
        """A Q6_K tensor -> its own codes and scales in strips of 16 rows (cext.qgemm.q6k_pack), a chunk of
        rows at a time, the file's pages dropped as they are used."""
        from cext import qgemm

        num_rows, num_cols = info.shape
        strips = torch.empty(num_rows // 16, qgemm.packed_strip_bytes(qgemm.Q6 | qgemm.PACKED, num_cols),
                             dtype=torch.uint8)
        for start in range(0, num_rows, CHUNK_ROWS):  # CHUNK_ROWS: a multiple of 16
            part = np.ascontiguousarray(raw[start:start + CHUNK_ROWS])
            qgemm.q6k_pack(part.ctypes.data, len(part), num_cols, strips[start // 16].data_ptr())
            self.gguf.release(info.name, start, start + len(part))
        return PackedQ6Weight(strips, (num_rows, num_cols))

    def _int8_chunks(self, raw, info):
        """-> (is_exact, iterator of (first row, codes int8 [n, K] in the kernels' order, scales [n, K / 32]))
        a chunk of CHUNK_ROWS rows at a time: Q8_0 and Q5_0 their own codes and scales (fp16 d, exact);
        any other type dequantized and re-quantized per block of 32 (float32 scales)."""
        num_rows, num_cols = info.shape

        def q8_0():  # d * q: byte 2i element i, 2i + 1 element 16 + i
            blocks = raw.reshape(num_rows, num_cols // 32, 34)
            for start in range(0, num_rows, CHUNK_ROWS):  # the file's pages dropped as they are used (the
                part = blocks[start:start + CHUNK_ROWS]  # head: 145 MB mapped beside its copy otherwise)
                q = np.empty((len(part), num_cols // 32, 16, 2), dtype=np.uint8)
                q[..., 0], q[..., 1] = part[..., 2:18], part[..., 18:34]
                d = np.ascontiguousarray(part[..., :2]).view(np.float16)[..., 0]  # the file's d, exactly
                yield start, torch.from_numpy(q.view(np.int8).reshape(len(part), num_cols)), torch.from_numpy(d)
                self.gguf.release(info.name, start, start + len(part))

        def q5_0():  # d * (q - 16): exact as codes q - 16 with scale d (fp16 values)
            for start in range(0, num_rows, CHUNK_ROWS):
                codes, d = q5_0_codes(raw[start:start + CHUNK_ROWS], num_cols)
                yield start, torch.from_numpy(codes), torch.from_numpy(d).half()
                self.gguf.release(info.name, start, min(start + CHUNK_ROWS, num_rows))

        def requantized():  # its pages dropped as they are used too (Qwen2.5-Coder-1.5B's Q6_K head: 191 MB)
            for start in range(0, num_rows, CHUNK_ROWS):
                part = raw[start:start + CHUNK_ROWS]
                chunk = Int8Weight.from_dense(torch.from_numpy(self._dequantize(part, info, len(part))))
                yield start, chunk.q, chunk.scales
                self.gguf.release(info.name, start, start + len(part))

        if info.ggml_type == Q8_0:
            return True, q8_0()
        if info.ggml_type == Q5_0:
            return True, q5_0()
        return False, requantized()

    def _int8(self, raw, info, may_pack: bool = False) -> Int8Weight | PackedInt8Weight:
        """A weight as int8: Int8Weight, or for the head (``may_pack``: no row operations follow) where the
        kernels take strips of 16 rows (engine.models.linear.packs) those strips, packed a chunk of rows at a
        time so the int8 rows never exist whole beside them (PackedInt8Weight)."""
        from cext import qgemm
        from engine.models.linear import packs

        num_rows, num_cols = info.shape
        is_exact, chunks = self._int8_chunks(raw, info)
        if may_pack and packs(num_rows, self.exact_products) and num_cols % 32 == 0:
            layout = qgemm.Q8 | (qgemm.HALF if is_exact else 0)
            strips = torch.empty(num_rows // 16, qgemm.packed_strip_bytes(layout, num_cols), dtype=torch.uint8)
            for start, q, scales in chunks:
                q, scales = q.contiguous(), scales.contiguous()
                qgemm.pack(layout, q.data_ptr(), scales.data_ptr(), len(q), num_cols, strips[start // 16].data_ptr())
            return PackedInt8Weight(strips, layout, (num_rows, num_cols), is_exact=is_exact)
        q = torch.empty(num_rows, num_cols, dtype=torch.int8)
        scales = torch.empty(num_rows, num_cols // 32, dtype=torch.float16 if is_exact else torch.float32)
        for start, q_part, scales_part in chunks:
            q[start:start + len(q_part)], scales[start:start + len(q_part)] = q_part, scales_part
        return Int8Weight(q, scales, is_exact=is_exact)

    def _dequantize(self, raw, info, num_rows: int) -> np.ndarray:
        try:
            return dequantize(raw, info.ggml_type, (num_rows, info.dims[0]))
        except ValueError as exc:
            raise ModelFileError(f"{self.gguf.path}: tensor {info.name!r}: {exc}", self.gguf.path) from None

    def __iter__(self) -> Iterator[str]:
        return iter(self.gguf_names)

    def __len__(self) -> int:
        return len(self.gguf_names)


def _map_rows(weight: Weight, fn) -> Weight:
    return fn(weight) if isinstance(weight, torch.Tensor) else weight.map_rows(fn)


def load_gguf_state_dict(path: str | os.PathLike, quantization: str = "float32", dtype: str | torch.dtype = "float32"
                         ) -> tuple[ModelConfig, dict[str, Weight], torch.Tensor | None]:
    """-> (config, state dict with Hugging Face names, rope freq factors or None), materialized
    (tests; load_gguf converts lazily). The default: the exact float32 dequantization."""
    with GGUFFile(path, with_vocabulary=False) as gguf:
        config = read_config(gguf)
        lazy = GGUFStateDict(gguf, config, quantization, resolve_dtype(dtype))
        state_dict = {name: lazy[name] for name in lazy}
        return config, state_dict, _freq_factors(gguf)


def _freq_factors(gguf: GGUFFile) -> torch.Tensor | None:
    if "rope_freqs.weight" not in gguf.tensors:
        return None
    info = gguf.tensors["rope_freqs.weight"]
    return torch.from_numpy(dequantize(gguf.raw(info.name), info.ggml_type, info.shape))


def kv_cache_dtype(dtype, quantization: str) -> torch.dtype:
    """float16 K and V beside float32 activations when the weights are quantized (the fast
    default, as llama.cpp); the exact modes ("float32", "bfloat16") keep the activations' dtype."""
    resolved = resolve_dtype(dtype)
    if resolved == torch.float32 and quantization in ("auto", "int4"):
        return torch.float16
    return resolved


def load_gguf(path: str | os.PathLike, dtype: str | torch.dtype = "bfloat16", quantization: str = "auto",
              pack_weights: bool = True, dense_above_rows: int | None = None,
              exact_products: bool = False, activations: str = "int16"):
    from engine.models import LlamaModel

    path = os.fspath(path)
    if not is_gguf_file(path):
        raise ModelFileError(f"{path}: not a GGUF file (the first bytes are not 'GGUF')", path)
    with GGUFFile(path, with_vocabulary=False) as gguf:
        config = read_config(gguf)  # every tensor checked against the metadata before any is used
        state_dict = GGUFStateDict(gguf, config, quantization, resolve_dtype(dtype), exact_products)
        try:
            return LlamaModel(config, state_dict, dtype=dtype, rope_freq_factors=_freq_factors(gguf),
                              pack_weights=pack_weights, dense_above_rows=dense_above_rows,
                              exact_products=exact_products, kv_cache_dtype=kv_cache_dtype(dtype, quantization),
                              activations=activations)
        except ModelFileError:
            raise
        except ValueError as exc:
            raise ModelFileError(f"{path}: {exc}", path) from None
