"""Rotary position embeddings: inverse frequencies (with the scaling types Llama, Qwen2,
Mistral and Phi-3 configs use) and a precomputed cos/sin table indexed by position.

Partial rotary (``rotary_dim < head_dim``): the table has D/2 frequencies, the last
(D - rotary_dim)/2 of them 0 (cos 1, sin 0), for heads whose q/k rows the model reordered
(engine.models.llama.partial_rotary_order)."""
from __future__ import annotations

import math

import torch

from engine.models.config import ModelConfig


def rope_inv_freq(config: ModelConfig, freq_factors: torch.Tensor | None = None) -> tuple[torch.Tensor, float]:
    """-> (inv_freq [rotary_dim/2] float64, attention_factor applied to cos and sin)."""
    dim = config.rotary_dim or config.head_dim
    base = config.rope_theta
    inv_freq = 1.0 / (base ** (torch.arange(0, dim, 2, dtype=torch.float64) / dim))  # [D/2]
    attention_factor = 1.0
    scaling = config.rope_scaling
    if scaling is not None:
        rope_type = scaling["rope_type"]
        factor = float(scaling.get("factor") or 1.0)
        if rope_type == "linear":
            inv_freq = inv_freq / factor
        elif rope_type == "llama3":
            inv_freq = _llama3_inv_freq(inv_freq, scaling, factor)
        elif rope_type == "yarn":
            inv_freq, attention_factor = _yarn_inv_freq(config, scaling, factor)
        elif rope_type == "longrope":
            inv_freq, attention_factor = _longrope_inv_freq(config, scaling, inv_freq)
        else:  # ModelConfig validation keeps this unreachable
            raise ValueError(f"rope_scaling: unsupported rope_type {rope_type!r}")
    if freq_factors is not None:  # GGUF rope_freqs.weight (llama3 scaling baked into the file)
        inv_freq = inv_freq / freq_factors.to(torch.float64)
    return inv_freq, attention_factor


def _longrope_inv_freq(config: ModelConfig, scaling: dict,
                       inv_freq: torch.Tensor) -> tuple[torch.Tensor, float]:
    """Phi-3's LongRoPE: the frequencies divided by per-frequency factors, the long ones when the
    model's context (max_position_embeddings) exceeds the original one, as llama.cpp chooses by
    its context size (transformers chooses by the current sequence length, so the two agree on
    contexts past the original length); cos and sin times sqrt(1 + ln(s) / ln(original))."""
    original = int(scaling["original_max_position_embeddings"])
    is_long = config.max_position_embeddings > original
    factors = torch.tensor(scaling["long_factor" if is_long else "short_factor"], dtype=torch.float64)
    if factors.shape != inv_freq.shape:
        raise ValueError(f"rope_scaling: {len(factors)} LongRoPE factors for {len(inv_freq)} frequencies")
    attention_factor = scaling.get("attention_factor")
    if attention_factor is None:
        factor = scaling.get("factor") or config.max_position_embeddings / original
        attention_factor = math.sqrt(1 + math.log(factor) / math.log(original)) if factor > 1 else 1.0
    return inv_freq / factors, float(attention_factor)


def _llama3_inv_freq(inv_freq: torch.Tensor, scaling: dict, factor: float) -> torch.Tensor:
    low_freq_factor = float(scaling["low_freq_factor"])
    high_freq_factor = float(scaling["high_freq_factor"])
    old_context_len = float(scaling["original_max_position_embeddings"])
    low_freq_wavelen = old_context_len / low_freq_factor
    high_freq_wavelen = old_context_len / high_freq_factor
    wavelen = 2 * math.pi / inv_freq
    scaled = torch.where(wavelen > low_freq_wavelen, inv_freq / factor, inv_freq)
    smooth = (old_context_len / wavelen - low_freq_factor) / (high_freq_factor - low_freq_factor)
    smoothed = (1 - smooth) * scaled / factor + smooth * scaled
    is_medium = (wavelen >= high_freq_wavelen) & (wavelen <= low_freq_wavelen)
    return torch.where(is_medium, smoothed, scaled)


def _yarn_inv_freq(config: ModelConfig, scaling: dict, factor: float) -> tuple[torch.Tensor, float]:
    dim = config.rotary_dim or config.head_dim
    base = config.rope_theta
    original_max = scaling.get("original_max_position_embeddings") or config.max_position_embeddings

    def get_mscale(scale: float, mscale: float = 1.0) -> float:
        return 1.0 if scale <= 1 else 0.1 * mscale * math.log(scale) + 1.0

    attention_factor = scaling.get("attention_factor")
    if attention_factor is None:
        mscale, mscale_all_dim = scaling.get("mscale"), scaling.get("mscale_all_dim")
        if mscale and mscale_all_dim:
            attention_factor = get_mscale(factor, mscale) / get_mscale(factor, mscale_all_dim)
        else:
            attention_factor = get_mscale(factor)
    beta_fast = scaling.get("beta_fast") or 32
    beta_slow = scaling.get("beta_slow") or 1

    def correction_dim(num_rotations: float) -> float:
        return (dim * math.log(original_max / (num_rotations * 2 * math.pi))) / (2 * math.log(base))

    low, high = correction_dim(beta_fast), correction_dim(beta_slow)
    if scaling.get("truncate", True):
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, dim - 1)
    if low == high:
        high += 0.001
    ramp = ((torch.arange(dim // 2, dtype=torch.float64) - low) / (high - low)).clamp(0, 1)  # [D/2]
    pos_freqs = base ** (torch.arange(0, dim, 2, dtype=torch.float64) / dim)
    extrapolation_factor = 1 - ramp
    inv_freq = (1.0 / (factor * pos_freqs)) * ramp + (1.0 / pos_freqs) * extrapolation_factor
    return inv_freq, float(attention_factor)


INITIAL_POSITIONS = 2048  # RotaryTable's first size; it doubles on demand


class RotaryTable:
    """cos/sin for every position up to ``num_positions``, grown on demand.

    The head layout is "rotate half" (Hugging Face): dims [0, D/2) pair with [D/2, D).
    ``cos``/``sin`` [P, D] in the model dtype feed the torch path, made on its first ``lookup``
    (the fused path never reads them: 32 MB for Gemma 3's two tables at 8,192 positions);
    ``cos_half``/``sin_half`` [P, D/2] float32 (the two halves are equal) feed the fused kernel.
    The table starts at INITIAL_POSITIONS and doubles as contexts reach further (Gemma 3's two
    tables at 8,192 positions from the start held 17 MB that short contexts never read).
    """

    def __init__(self, config: ModelConfig, dtype: torch.dtype, freq_factors: torch.Tensor | None = None):
        inv_freq, attention_factor = rope_inv_freq(config, freq_factors)  # [rotary_dim/2]
        num_pass = config.head_dim // 2 - inv_freq.shape[0]  # partial rotary: pairs left as they are
        self.inv_freq = torch.cat([inv_freq, torch.zeros(num_pass, dtype=torch.float64)])  # [D/2]
        self.attention_factor = torch.cat([torch.full_like(inv_freq, attention_factor),
                                           torch.ones(num_pass, dtype=torch.float64)])  # [D/2]
        self.dtype = dtype
        self.num_positions = 0
        self.cos = self.sin = None
        self.cos_half = self.sin_half = None
        self.ensure(min(config.max_position_embeddings, INITIAL_POSITIONS))

    def ensure(self, num_positions: int) -> None:
        if num_positions <= self.num_positions:
            return
        num_positions = max(num_positions, 2 * self.num_positions)
        freqs = self._freqs(num_positions)  # [P, D/2]
        self.cos_half = (freqs.cos() * self.attention_factor).float()  # [P, D/2]
        self.sin_half = (freqs.sin() * self.attention_factor).float()  # [P, D/2]
        self.cos = self.sin = None  # made again, at the new length, by the next lookup
        self.num_positions = num_positions

    def _freqs(self, num_positions: int) -> torch.Tensor:
        return torch.outer(torch.arange(num_positions, dtype=torch.float64), self.inv_freq)  # [P, D/2] float64

    def lookup(self, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """positions [T] -> cos, sin [T, 1, D] (broadcast over heads)."""
        if self.cos is None:  # rounded once from float64 to the model dtype, as cos_half is to float32
            freqs = self._freqs(self.num_positions)
            emb = torch.cat((freqs, freqs), dim=-1)  # [P, D]
            factor = torch.cat((self.attention_factor, self.attention_factor))  # [D]
            self.cos = (emb.cos() * factor).to(self.dtype)
            self.sin = (emb.sin() * factor).to(self.dtype)
        return self.cos[positions].unsqueeze(1), self.sin[positions].unsqueeze(1)


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x [T, N, D], cos/sin [T, 1, D] -> [T, N, D]."""
    half = x.shape[-1] // 2
    rotated = torch.cat((-x[..., half:], x[..., :half]), dim=-1)  # [T, N, D]
    return torch.addcmul(x * cos, rotated, sin)
