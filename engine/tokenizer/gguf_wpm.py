"""GGUF "bert" vocabularies: WordPiece, as llama.cpp's convert_hf_to_gguf.py stores it.

The converter writes the tokenizer.json vocabulary in "phantom space" form: a word-initial piece
``foo`` becomes ``\u2581foo``, a continuation piece ``##bar`` becomes ``bar``, control tokens
(``[CLS]``, ``[SEP]``, ...) stay as they are. Undone here, the vocabulary is the tokenizer.json's
again, with BERT's normalizer (lower-casing as ``tokenizer.ggml.normalizer.lowercase`` says,
Chinese characters split, control characters dropped), its punctuation/whitespace pre-tokenizer
and the post-processor ``[CLS] $A [SEP]`` (pairs ``[CLS] $A [SEP] $B [SEP]`` with token type 1
for the second), so an encoder's inputs get the ids and token types the directory's do.
"""
from __future__ import annotations

from tokenizers import Tokenizer as HFTokenizer
from tokenizers import decoders, models, normalizers, pre_tokenizers, processors

from .gguf_special import TokenType, header_id

PHANTOM_SPACE = "\u2581"


def wordpiece_tokens(tokens: list[str], types: list[int]) -> list[str]:
    """The converter's phantom-space tokens -> WordPiece's (``##`` marks a continuation)."""
    pieces = []
    for text, token_type in zip(tokens, types):
        if token_type == TokenType.CONTROL:
            pieces.append(text)
        elif text.startswith(PHANTOM_SPACE):
            pieces.append(text[len(PHANTOM_SPACE):])
        else:
            pieces.append("##" + text)
    return pieces


def build_wpm_backend(metadata: dict, tokens: list[str], types: list[int]) -> HFTokenizer:
    num_tokens = len(tokens)
    pieces = wordpiece_tokens(tokens, types)
    vocab = {}
    for token_id, piece in enumerate(pieces):
        vocab.setdefault(piece, token_id)
    unk_id = header_id(metadata, "tokenizer.ggml.unknown_token_id", num_tokens)
    cls_id = header_id(metadata, "tokenizer.ggml.cls_token_id", num_tokens)
    if cls_id is None:
        cls_id = header_id(metadata, "tokenizer.ggml.bos_token_id", num_tokens)
    sep_id = header_id(metadata, "tokenizer.ggml.seperator_token_id", num_tokens)  # (llama.cpp's spelling)
    if sep_id is None:
        sep_id = header_id(metadata, "tokenizer.ggml.eos_token_id", num_tokens)
    if unk_id is None or cls_id is None or sep_id is None:
        raise ValueError("a 'bert' vocabulary needs tokenizer.ggml.unknown_token_id and the [CLS] "
                         "(cls or bos) and [SEP] (seperator or eos) token ids")
    backend = HFTokenizer(models.WordPiece(vocab, unk_token=pieces[unk_id], max_input_chars_per_word=100))
    lowercase = bool(metadata.get("tokenizer.ggml.normalizer.lowercase", True))
    backend.normalizer = normalizers.BertNormalizer(
        clean_text=True, handle_chinese_chars=True, strip_accents=None, lowercase=lowercase
    )
    backend.pre_tokenizer = pre_tokenizers.BertPreTokenizer()
    cls, sep = pieces[cls_id], pieces[sep_id]
    backend.post_processor = processors.TemplateProcessing(
        single=f"{cls}:0 $A:0 {sep}:0",
        pair=f"{cls}:0 $A:0 {sep}:0 $B:1 {sep}:1",
        special_tokens=[(cls, cls_id), (sep, sep_id)],
    )
    backend.decoder = decoders.WordPiece(prefix="##")
    return backend
