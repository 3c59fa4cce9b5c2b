"""Regenerate tests/data/qwen_llamacpp_greedy.json: llama.cpp's greedy continuations with top-5 logprobs.

Not run by the tests (it needs llama-cpp-python); kept as the provenance of the data file.
Each entry: prompt, prompt_ids (llama.cpp's tokenization, special tokens parsed, no BOS added),
greedy_ids (llama.cpp's greedy tokens, up to MAX_NEW_TOKENS, ending at the first end-of-generation
token inclusive), greedy_text, and top5: per generated position the five most likely
(token id, logprob) pairs, rounded to 4 decimals. Decoding runs one token at a time on llama.cpp's
own KV cache, so position i is conditioned on the prompt plus greedy_ids[:i]: the teacher-forced
positions that tests/test_parity_llamacpp.py compares against.

    make llamacpp testdata      # llama-cpp-python==0.3.36 from its sdist; the Qwen GGUF
    .venv/bin/python tests/data/qwen_llamacpp_gen.py [--model qwen|smollm2] [--out PATH]

`--model smollm2` regenerates the SmolLM2 prompts of smollm2_llamacpp_greedy.json with the same
procedure (written to /tmp unless --out is given), to check the procedure against that file.
"""
from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import numpy as np

REPO = Path(__file__).resolve().parents[2]
DATA = Path(__file__).resolve().parent
QWEN_GGUF = REPO / ".cache" / "testdata" / "qwen2.5-coder-0.5b-instruct-q4_k_m.gguf"
MAX_NEW_TOKENS = 48
NUM_TOP = 5
NUM_THREADS = 1  # one thread: OpenMP teams on a busy shared host stall at every barrier

QWEN_SYSTEM = "You are Qwen, created by Alibaba Cloud. You are a helpful assistant."
SMOLLM2_SYSTEM = "You are a helpful AI assistant named SmolLM, trained by Hugging Face"
QWEN_QUESTIONS = [
    "Write a Python function that returns the n-th Fibonacci number.",
    "What does `git rebase -i` do? Answer in two sentences.",
    "Explain the difference between a list and a tuple in Python.",
    "Write a SQL query that counts the users in each country.",
    "What is the capital of France? Answer in one sentence.",
]
QWEN_RAW = "def quicksort(arr):\n"
SMOLLM2_QUESTIONS = [
    "What is the capital of France? Answer in one sentence.",
    "Write a haiku about the ocean.",
    "List three primary colors.",
    "Translate 'good morning' into Spanish and French.",
]


def chatml(system: str, question: str) -> str:
    """The ChatML rendering both models' templates produce for one system + one user message."""
    return (f"<|im_start|>system\n{system}<|im_end|>\n<|im_start|>user\n{question}<|im_end|>\n"
            "<|im_start|>assistant\n")


def prompts_for(model: str) -> list[str]:
    if model == "qwen":
        return [chatml(QWEN_SYSTEM, q) for q in QWEN_QUESTIONS] + [QWEN_RAW]
    return ([chatml(SMOLLM2_SYSTEM, q) for q in SMOLLM2_QUESTIONS] + ["The quick brown fox"]
            + [chatml(SMOLLM2_SYSTEM, "Explain recursion to a five year old in two sentences.")])


def log_softmax(logits: np.ndarray) -> np.ndarray:
    shifted = logits.astype(np.float64) - logits.max()
    return shifted - np.log(np.exp(shifted).sum())


def greedy_entry(llm, llama_cpp, prompt: str) -> dict:
    """Greedy-decode one prompt token by token; the top-5 logprobs at every generated position."""
    vocab = llama_cpp.llama_model_get_vocab(llm.model)
    num_vocab = llm.n_vocab()
    prompt_ids = llm.tokenize(prompt.encode("utf-8"), add_bos=False, special=True)
    llm.reset()
    llm.eval(prompt_ids)
    greedy_ids, top5 = [], []
    for _ in range(MAX_NEW_TOKENS):
        logits = np.ctypeslib.as_array(llm._ctx.get_logits_ith(-1), shape=(num_vocab,)).copy()  # [V]
        logprobs = log_softmax(logits)
        best = np.argsort(-logprobs, kind="stable")[:NUM_TOP]
        top5.append([[int(t), round(float(logprobs[t]), 4)] for t in best])
        token = int(best[0])
        greedy_ids.append(token)
        if llama_cpp.llama_vocab_is_eog(vocab, token):
            break
        llm.eval([token])
    text = llm.detokenize(greedy_ids, prev_tokens=prompt_ids).decode("utf-8", errors="replace")
    eog_ids = [t for t in greedy_ids if llama_cpp.llama_vocab_is_eog(vocab, t)]
    if eog_ids:  # the text is what a user sees: without the end-of-generation marker
        text = llm.detokenize(greedy_ids[:-1], prev_tokens=prompt_ids).decode("utf-8", errors="replace")
    return {"prompt": prompt, "prompt_ids": prompt_ids, "greedy_ids": greedy_ids, "greedy_text": text,
            "top5": top5}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", choices=["qwen", "smollm2"], default="qwen")
    parser.add_argument("--gguf", default=None, help="the GGUF file (default: the cached test data / embedded model)")
    parser.add_argument("--out", default=None)
    args = parser.parse_args(argv)
    try:
        import llama_cpp
    except ImportError as e:
        raise SystemExit("llama-cpp-python is not installed: run `make llamacpp` (builds 0.3.36 from its sdist)") from e
    if llama_cpp.__version__ != "0.3.36":
        raise SystemExit(f"llama-cpp-python {llama_cpp.__version__} found; the reference data pins 0.3.36")
    if args.model == "qwen":
        gguf = Path(args.gguf or QWEN_GGUF)
        out = Path(args.out or DATA / "qwen_llamacpp_greedy.json")
    else:
        sys.path.insert(0, str(REPO))
        from engine.loader import default_model_path

        gguf = Path(args.gguf or default_model_path())
        out = Path(args.out or "/tmp/smollm2_llamacpp_greedy.json")
    if not gguf.is_file():
        raise SystemExit(f"{gguf} is missing: run `make testdata`")
    llm = llama_cpp.Llama(model_path=str(gguf), n_ctx=512, n_batch=512, n_threads=NUM_THREADS,
                          n_threads_batch=NUM_THREADS, logits_all=False, verbose=False)
    entries = [greedy_entry(llm, llama_cpp, prompt) for prompt in prompts_for(args.model)]
    out.write_text(json.dumps(entries, ensure_ascii=False, indent=1) + "\n", encoding="utf-8")
    for entry in entries:
        print(f"{len(entry['prompt_ids']):4d} prompt ids, {len(entry['greedy_ids']):3d} greedy: "
              f"{entry['greedy_text'][:60]!r}")
    print(f"wrote {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
