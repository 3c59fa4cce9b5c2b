"""Regenerate tests/data/<model>_llamacpp_greedy.json: llama.cpp's greedy continuations with top-5 logprobs.

Not run by the tests (it needs llama-cpp-python); kept as the provenance of the data file.
Each entry: prompt, prompt_ids (llama.cpp's tokenization, special tokens parsed, no BOS added),
greedy_ids (llama.cpp's greedy tokens, up to MAX_NEW_TOKENS, ending at the first end-of-generation
token inclusive), greedy_text, and top5: per generated position the five most likely
(token id, logprob) pairs, rounded to 4 decimals. Decoding runs one token at a time on llama.cpp's
own KV cache, so position i is conditioned on the prompt plus greedy_ids[:i]: the teacher-forced
positions that tests/test_parity_llamacpp.py compares against.

    make llamacpp testdata      # llama-cpp-python==0.3.36 from its sdist; the GGUF files
    .venv/bin/python tests/data/llamacpp_greedy_gen.py [--model qwen|qwen15|gemma3|smollm2] [--out PATH]

Models: `qwen` (Qwen2.5-Coder-0.5B-Instruct Q4_K_M), `qwen15` (Qwen2.5-Coder-1.5B-Instruct Q4_K_M,
the same six prompts), `gemma3` (Gemma 3 270M Q4_K_M, a base model: raw-text prompts that start
with "<bos>", as llama.cpp's own tokenization of a Gemma prompt does; the last prompt is ~680
tokens, longer than its 512-token sliding window, so the reference covers positions where the
sliding layers see only part of the context). `--model smollm2` regenerates the SmolLM2 prompts of
smollm2_llamacpp_greedy.json with the same procedure (written to /tmp unless --out is given), to
check the procedure against that file.

`--via server` runs the same procedure through llama.cpp's own llama-server built from the same
sdist (`make llamacpp`, .cache/llamacpp/server-0.3.36/): /tokenize with special tokens parsed,
then /completion greedy (temperature 0, top_k 1) with n_probs 5, whose top logprobs are the
softmax of the raw logits (pre-sampling: llama-server's get_token_probabilities), one slot, one
thread, `--no-repack` (the build's repacked/AMX weight buffers die of SIGILL at load on these
VMs; the plain ggml CPU kernels quantize activations to int8 blocks all the same). Checked
against smollm2_llamacpp_greedy.json (made by llama-cpp-python on another build): the same
prompt ids, the same greedy ids on 3 of 6 prompts, the rest parting at near-ties (0.01-0.2 nats),
and up to 0.55 nats apart on a SmolLM2 logprob before they part: llama.cpp's own kernel paths
disagree on that small 4-bit model by more than our 0.35 bound (ours stay within it of both:
max 0.28 from the server's, 0 top-3 misses; 0.21 from the bindings').
Each entry's "reference" names which of the two made it.
"""
from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import numpy as np

REPO = Path(__file__).resolve().parents[2]
DATA = Path(__file__).resolve().parent
TESTDATA = REPO / ".cache" / "testdata"
GGUF_FILES = {"qwen": "qwen2.5-coder-0.5b-instruct-q4_k_m.gguf", "qwen15": "qwen2.5-coder-1.5b-instruct-q4_k_m.gguf",
              "gemma3": "gemma-3-270m-q4_k_m.gguf"}
CONTEXT_LENGTHS = {"gemma3": 1024}  # its long prompt crosses the 512-token window; the others fit 512
LLAMACPP_VERSION = "0.3.36"
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
GEMMA3_PROMPTS = [
    "The capital of France is",
    "def fibonacci(n):\n",
    "Once upon a time, in a small village by the sea,",
    "The quick brown fox",
    "Water boils at a temperature of",
]
# ~680 tokens: a fact, a list past the 512-token window, then a question about the fact.
GEMMA3_LONG = ("Remember this: the password is 'blue harbor'.\nHere are the numbers: "
               + ", ".join(str(i) for i in range(1, 150)) + ".\nWhat was the password? The password is '")
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
    if model in ("qwen", "qwen15"):
        return [chatml(QWEN_SYSTEM, q) for q in QWEN_QUESTIONS] + [QWEN_RAW]
    if model == "gemma3":
        return ["<bos>" + p for p in GEMMA3_PROMPTS + [GEMMA3_LONG]]
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


def server_entries(gguf: Path, prompts: list[str], num_ctx: int, binary: str | None = None) -> list[dict]:
    """The greedy entries through llama-server (see the module docstring); binary: its path
    (default: the one `make llamacpp` builds)."""
    sys.path.insert(0, str(REPO))
    from benchmarks import llama_server

    binary = binary or llama_server.server_binary()
    if binary is None or not Path(binary).is_file():
        raise SystemExit(f"{binary or llama_server.SERVER_DIR / 'llama-server'} is missing: run `make llamacpp`")
    port = llama_server.free_port()
    argv = [str(binary), "-m", str(gguf), "--host", "127.0.0.1", "--port", str(port), "--parallel", "1",
            "-c", str(num_ctx), "-t", str(NUM_THREADS), "-tb", str(NUM_THREADS), "--no-webui", "--no-warmup",
            "--no-repack"]
    server = llama_server.Server("llama-server", argv, port, Path("/tmp/llamacpp_greedy_gen-server.log"))

    def post(path: str, body: dict) -> dict:
        return llama_server.post_json(port, path, body, timeout=3600)

    entries = []
    try:
        for prompt in prompts:
            prompt_ids = post("/tokenize", {"content": prompt, "add_special": False, "parse_special": True})["tokens"]
            done = post("/completion", {"prompt": prompt_ids, "n_predict": MAX_NEW_TOKENS, "temperature": 0,
                                        "top_k": 1, "n_probs": NUM_TOP, "cache_prompt": False})
            steps = done["completion_probabilities"]
            greedy_ids = [int(step["id"]) for step in steps]
            top5 = [[[int(t["id"]), round(float(t["logprob"]), 4)] for t in step["top_logprobs"]] for step in steps]
            entries.append({"prompt": prompt, "prompt_ids": prompt_ids, "greedy_ids": greedy_ids,
                            "greedy_text": done["content"], "top5": top5,
                            "reference": f"llama-server {LLAMACPP_VERSION} (/completion, n_probs {NUM_TOP}, "
                                         "--no-repack)"})
    finally:
        server.close()
    return entries


def model_files(args: argparse.Namespace) -> tuple[Path, Path]:
    """-> (the GGUF file, the JSON to write) of --model / --gguf / --out."""
    if args.model in GGUF_FILES:
        return (Path(args.gguf or TESTDATA / GGUF_FILES[args.model]),
                Path(args.out or DATA / f"{args.model}_llamacpp_greedy.json"))
    sys.path.insert(0, str(REPO))
    from engine.loader import default_model_path

    return Path(args.gguf or default_model_path()), Path(args.out or "/tmp/smollm2_llamacpp_greedy.json")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", choices=["qwen", "qwen15", "gemma3", "smollm2"], default="qwen")
    parser.add_argument("--gguf", default=None, help="the GGUF file (default: the cached test data / embedded model)")
    parser.add_argument("--out", default=None)
    parser.add_argument("--via", choices=["python", "server"], default="python",
                        help="llama-cpp-python (default) or llama.cpp's llama-server, both 0.3.36")
    parser.add_argument("--server-binary", default=None, help="llama-server's path for --via server")
    args = parser.parse_args(argv)
    gguf, out = model_files(args)
    if not gguf.is_file():
        raise SystemExit(f"{gguf} is missing: run `make testdata`")
    if args.via == "server":
        num_ctx = CONTEXT_LENGTHS.get(args.model, 512)
        return _write(server_entries(gguf, prompts_for(args.model), num_ctx, args.server_binary), out)
    try:
        import llama_cpp
    except ImportError as e:
        raise SystemExit("llama-cpp-python is not installed: run `make llamacpp` (builds 0.3.36 from its sdist)") from e
    if llama_cpp.__version__ != LLAMACPP_VERSION:
        raise SystemExit(f"llama-cpp-python {llama_cpp.__version__} found; the reference data pins 0.3.36")
    num_ctx = CONTEXT_LENGTHS.get(args.model, 512)
    llm = llama_cpp.Llama(model_path=str(gguf), n_ctx=num_ctx, n_batch=num_ctx, n_threads=NUM_THREADS,
                          n_threads_batch=NUM_THREADS, logits_all=False, verbose=False)
    entries = [dict(greedy_entry(llm, llama_cpp, prompt), reference=f"llama-cpp-python {LLAMACPP_VERSION}")
               for prompt in prompts_for(args.model)]
    return _write(entries, out)


def _write(entries: list[dict], out: Path) -> int:
    out.write_text(json.dumps(entries, ensure_ascii=False, indent=1) + "\n", encoding="utf-8")
    for entry in entries:
        print(f"{len(entry['prompt_ids']):4d} prompt ids, {len(entry['greedy_ids']):3d} greedy: "
              f"{entry['greedy_text'][:60]!r}")
    print(f"wrote {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
