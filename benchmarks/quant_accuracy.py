"""Accuracy of the weight formats, teacher-forced, against the exact float32 dequantization of
the same GGUF: max |dlogprob| over tokens with p > 1e-4 and top-1 agreement, on the prompts and
greedy continuations of tests/data/smollm2_llamacpp_greedy.json.

    python benchmarks/quant_accuracy.py [--model PATH] [--variants auto,auto_f32,bfloat16,auto_densehead]

Variants: auto (the default: int4 layers, int8 head, bfloat16 activations), auto_f32 (same
weights, float32 activations: the exact int4 product), bfloat16 (dense bf16 weights),
auto_densehead (int4 layers, dense bf16 head), int4, auto@float32 (float32 activations and
residual, bfloat16 quantized products), auto_int8 (auto with activations="int8": the packed
products' activations in int8 codes, llama.cpp's precision; where the CPU has AVX-512 VNNI).
"""
from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from engine.batch import single_sequence_batch  # noqa: E402
from engine.gguf_file import GGUFFile  # noqa: E402
from engine.loader import default_model_path, load_model  # noqa: E402
from engine.loader.gguf_loader import GGUFStateDict, _freq_factors, read_config  # noqa: E402
from engine.models import LlamaModel  # noqa: E402

REFERENCE = Path(__file__).resolve().parent.parent / "tests" / "data" / "smollm2_llamacpp_greedy.json"
BLOCK_SIZE = 16


def logprobs(model, ids: list[int]) -> torch.Tensor:
    num_blocks = -(-len(ids) // BLOCK_SIZE)
    cache = model.make_kv_cache(num_blocks, BLOCK_SIZE)
    logits = model.forward(single_sequence_batch(ids, 0, list(range(num_blocks)), BLOCK_SIZE, "all"), cache)
    return torch.log_softmax(logits.float(), dim=-1)  # [T, V]


class DenseHead(GGUFStateDict):
    """auto, but the embedding / head dense in the model dtype."""

    def __getitem__(self, name):
        if name in ("model.embed_tokens.weight", "lm_head.weight"):
            info = self.gguf.tensors[self.gguf_names[name]]
            return self._dense(self.gguf.raw(info.name), info, self.dtype)
        return super().__getitem__(name)


def build(path: str, variant: str):
    if variant == "auto_densehead":
        with GGUFFile(path) as f:
            config = read_config(f)
            return LlamaModel(config, DenseHead(f, config, "auto", torch.bfloat16), dtype="bfloat16",
                              rope_freq_factors=_freq_factors(f))
    if variant == "auto_f32":  # the same weights, exact float32 products
        from engine.loader.gguf_loader import load_gguf
        return load_gguf(path, dtype="float32", quantization="auto", exact_products=True)
    if variant == "auto_int8":
        return load_model(path, activations="int8")
    if variant.startswith("auto@"):  # activation dtype, e.g. auto@float32
        return load_model(path, quantization="auto", dtype=variant.split("@")[1])
    return load_model(path, quantization=variant)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--model", default=None)
    parser.add_argument("--variants", default="auto,auto_f32,bfloat16,auto_densehead")
    args = parser.parse_args()
    path = args.model or default_model_path()
    prompts = [e["prompt_ids"] + e["greedy_ids"] for e in json.loads(REFERENCE.read_text())]
    if args.model:  # another vocabulary: keep the ids in range with a fixed token pattern
        vocab = read_config(GGUFFile(path)).vocab_size
        prompts = [[(i * 7919 + 13) % vocab for i in range(len(p))] for p in prompts]
    exact_model = load_model(path, quantization="float32")
    exact = [logprobs(exact_model, ids) for ids in prompts]
    del exact_model
    rows = []
    for variant in args.variants.split(","):
        model = build(path, variant)
        max_diff, agree, total = 0.0, 0, 0
        for ids, ref in zip(prompts, exact):
            ours = logprobs(model, ids)
            mask = ref.exp() > 1e-4
            max_diff = max(max_diff, (ours - ref).abs()[mask].max().item())
            agree += int((ours.argmax(-1) == ref.argmax(-1)).sum())
            total += len(ids)
        rows.append({"variant": variant, "max_abs_dlogprob": round(max_diff, 4), "top1_agree": f"{agree}/{total}"})
        del model
    print(f"{'variant':16s} {'max|dlogprob|':>14s} {'top-1 agree':>12s}")
    for r in rows:
        print(f"{r['variant']:16s} {r['max_abs_dlogprob']:14.4f} {r['top1_agree']:>12s}")
    print(json.dumps({"model": Path(path).name, "rows": rows}))


if __name__ == "__main__":
    main()
