"""Mixture-of-experts FFN (Qwen3-MoE, Mixtral): a router picks each row's top-k experts and
their weights; each expert's SwiGLU runs once per forward over the rows routed to it (the
tick's rows batched per expert), through the same Linear layers (quantized kernels included)
as a dense FFN. Experts no row picked are not read: a decode step touches k experts per row.
"""
from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn.functional as F

from engine.models.linear import Linear, current_row_routes, row_routes
from engine.models.quant import Weight


class MixtureOfExperts:
    """router [X, E] (dense), experts: X pairs (gate_up [2 I, E], down [E, I]).

    Routing as transformers: softmax over the X router logits in float32, the top k, then
    renormalised to sum 1 where the family does (Mixtral always, Qwen3-MoE per norm_topk_prob).
    """

    def __init__(self, router: torch.Tensor, experts: list[tuple[Weight, Weight]], top_k: int,
                 norm_topk_prob: bool, act_mul: Callable[[torch.Tensor], torch.Tensor], linear: dict):
        if not isinstance(router, torch.Tensor):  # small: [X, E]; a quantized file's router is dequantized
            router = router.dequantize()
        self.router = router.float().contiguous()  # [X, E]
        self.experts = [(Linear(gate_up, None, **linear), Linear(down, None, **linear))
                        for gate_up, down in experts]
        self.top_k = top_k
        self.norm_topk_prob = norm_topk_prob
        self.act_mul = act_mul

    def route(self, h: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """h [T, E] -> (weights [T, k] float32, expert ids [T, k] int64)."""
        probs = F.linear(h.float(), self.router).softmax(dim=-1)  # [T, X]
        weights, ids = probs.topk(self.top_k, dim=-1)  # [T, k]
        if self.norm_topk_prob:
            weights = weights / weights.sum(dim=-1, keepdim=True)
        return weights, ids

    def __call__(self, h: torch.Tensor) -> torch.Tensor:
        """h [T, E] -> [T, E] in h's dtype."""
        weights, ids = self.route(h)
        flat = ids.flatten()  # [T k]
        order = flat.argsort(stable=True)  # the (row, slot) pairs grouped by expert
        counts = torch.bincount(flat, minlength=len(self.experts)).tolist()
        rows = order // self.top_k  # [T k] row of each pair, grouped by expert
        pair_weights = weights.flatten()[order]  # [T k]
        out = torch.zeros(h.shape, dtype=torch.float32)  # [T, E]
        # Each expert's rows keep the tick's order, so its rows of each class of rows
        # (engine.models.linear.row_routes) are consecutive: the classes' counts per expert.
        spans = current_row_routes()
        span_counts = []  # [(rows per expert, route_rows)] when the tick has several classes
        if spans and spans[0][0] < h.shape[0]:
            first = 0
            for num_rows, route_rows in spans:
                end = min(first + num_rows, h.shape[0])
                span_counts.append((torch.bincount(ids[first:end].flatten(), minlength=len(self.experts)).tolist(),
                                    route_rows))
                first = end
        start = 0
        for expert, count in enumerate(counts):
            if count == 0:
                continue
            gate_up, down = self.experts[expert]
            sel = rows[start:start + count]  # [n]
            expert_spans = tuple((c[expert], r) for c, r in span_counts) if span_counts else spans
            with row_routes(expert_spans):
                y = down(self.act_mul(gate_up(h.index_select(0, sel))))  # [n, E]
            out.index_add_(0, sel, y.float() * pair_weights[start:start + count, None])
            start += count
        return out.to(h.dtype)
