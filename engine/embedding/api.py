"""Engine.embed / aembed / rerank / score: the facade's embedding half (a mixin of engine.api.Engine).

Inputs are tokenized here, on the caller's thread; the forwards run on the engine thread. A
decoder's embedding rows go into the generation ticks' own forwards under the tick budget
(engine/embedding/tick_rows.py); an encoder, which generates nothing, runs packed chunks of the
waiting calls one per engine-loop turn (EngineCore.submit_job, engine/embedding/runner.py).
An encoder (BERT) pools as its
sentence-transformers directory says; a decoder pools with ``pooling`` (the engine option, else
"last"), over the causal forward. ``rerank`` scores (query, document) pairs with a
cross-encoder's classification head, or, for an embedding model, by the cosine of the two
normalised embeddings.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import numpy as np

from ..errors import InvalidParameterError
from .inputs import EncodedInputs, InputEncoder, split_inputs, truncate_limit
from .pooling import check_dimensions, check_pooling, finish
from .runner import EmbedBatcher, EmbedJob, EncoderRunner
from .tick_rows import TickRows


@dataclass
class EmbedCall:
    """A submitted embed or score job: ``result()`` blocks, ``aresult()`` awaits; both return the
    embeddings [N, D] float32 or the scores [N] float64."""

    job: EmbedJob
    num_prompt_tokens: int
    _finish: Callable[[np.ndarray], np.ndarray]

    def result(self) -> np.ndarray:
        return self._finish(self.job.future.result())

    async def aresult(self) -> np.ndarray:
        import asyncio

        try:
            values = await asyncio.wrap_future(self.job.future)
        except asyncio.CancelledError:
            self.job.cancel()
            raise
        return self._finish(values)


class EmbeddingMixin:
    _embedding = None  # (EmbedBatcher | TickRows, embedding size, InputEncoder), built on first use

    def _embedding_parts(self):
        if self._embedding is None:
            model = self.model
            if hasattr(model, "encode") and hasattr(model, "hidden_size"):
                queue = EmbedBatcher(self._core, EncoderRunner(model), busy_tokens=self.config.max_num_batched_tokens)
                size, is_encoder = model.hidden_size, True
            elif hasattr(model, "forward_with_hidden"):
                queue = TickRows(self._core, self.config.block_size)
                self._core.set_tick_rows(queue)
                size, is_encoder = model.config.hidden_size, False
            else:
                raise InvalidParameterError(f"{type(model).__name__} has no hidden states to embed", "model")
            max_len = min(self.max_model_len, getattr(model, "max_model_len", None) or self.max_model_len)
            self._embedding = queue, size, InputEncoder(self.tokenizer, model.vocab_size, max_len, is_encoder)
        return self._embedding

    @property
    def embedding_size(self) -> int:
        return self._embedding_parts()[1]

    @property
    def pooling(self) -> str:
        return self.config.pooling or getattr(self.model, "pooling", None) or "last"

    @property
    def is_cross_encoder(self) -> bool:
        return getattr(self.model, "classifier", None) is not None

    def submit_embed(
        self,
        inputs,
        normalize: bool = True,
        dimensions: int | None = None,
        truncate=False,
        param: str = "input",
        truncate_param: str = "truncate",
    ) -> EmbedCall:
        """Validate and tokenize here, queue the forwards on the engine thread."""
        batcher, size, encoder = self._embedding_parts()
        if not isinstance(normalize, bool):
            raise InvalidParameterError(f"normalize must be a boolean, got {normalize!r}", "normalize")
        dimensions = check_dimensions(dimensions, size)
        limit = truncate_limit(truncate, encoder.max_len, truncate_param)
        encoded = encoder.encode(split_inputs(inputs, param), limit, param)
        pooling = check_pooling(self.pooling)
        return self._submit_job(batcher, encoded, pooling, lambda v: finish(v, normalize, dimensions))

    def _submit_job(self, batcher, encoded: EncodedInputs, pooling, finish_values) -> EmbedCall:
        job = EmbedJob(encoded, pooling)
        batcher.submit(job)
        return EmbedCall(job, encoded.num_tokens, finish_values)

    def embed(
        self, inputs, normalize: bool = True, dimensions: int | None = None, truncate=False
    ) -> np.ndarray:
        """Embeddings [N, D] float32 of ``inputs`` (a string, a list of strings, a list of token ids
        or a list of id lists). ``dimensions``: keep the first so many (Matryoshka), then normalise.
        ``truncate``: False (an input over the model's limit raises ContextLengthError), True or -1
        (cut to the limit), or a token count to cut to; the end of an input is what goes."""
        return self.submit_embed(inputs, normalize, dimensions, truncate).result()

    async def aembed(
        self, inputs, normalize: bool = True, dimensions: int | None = None, truncate=False
    ) -> np.ndarray:
        """Like embed; cancelling the awaiting task drops the job."""
        return await self.submit_embed(inputs, normalize, dimensions, truncate).aresult()

    def submit_score(self, query: str, documents: list[str], param: str = "documents") -> EmbedCall:
        """Relevance of each document to the query, in document order (an EmbedCall of [N] scores):
        a cross-encoder's head (its activation applied), else the cosine of the embeddings."""
        batcher, _, encoder = self._embedding_parts()
        if self.is_cross_encoder:
            num_labels = self.model.config.num_labels
            if num_labels != 1:
                raise InvalidParameterError(
                    f"rerank needs a cross-encoder with one label, this one has {num_labels}", "model"
                )
            activation = self.model.score_activation
            return self._submit_job(
                batcher,
                encoder.encode_pairs(query, documents, param),
                None,
                lambda values: _activated(values[:, 0], activation),
            )
        if not isinstance(query, str):
            raise InvalidParameterError("query must be a string", "query")
        if not isinstance(documents, (list, tuple)) or not documents:
            raise InvalidParameterError(f"{param} must be a non-empty list of strings", param)
        texts = [query, *documents]
        for i, doc in enumerate(documents):
            if not isinstance(doc, str):
                raise InvalidParameterError(f"{param}[{i}] must be a string", f"{param}[{i}]")
        encoded = encoder.encode(texts, encoder.max_len, param)
        return self._submit_job(batcher, encoded, check_pooling(self.pooling), _cosines_to_first)

    def score(self, query: str, documents: list[str]) -> list[float]:
        """Scores of (query, document) pairs in document order."""
        return self.submit_score(query, documents).result().tolist()

    async def ascore(self, query: str, documents: list[str]) -> list[float]:
        return (await self.submit_score(query, documents).aresult()).tolist()

    def rerank(self, query: str, documents: list[str], top_n: int | None = None) -> list[tuple[int, float]]:
        """(document index, score) pairs, best first; ``top_n``: only the best so many."""
        top_n = _check_top_n(top_n, documents)
        return _ranked(self.score(query, documents), top_n)

    async def arerank(
        self, query: str, documents: list[str], top_n: int | None = None
    ) -> list[tuple[int, float]]:
        top_n = _check_top_n(top_n, documents)
        return _ranked(await self.ascore(query, documents), top_n)


def _activated(logits: np.ndarray, activation: str) -> np.ndarray:
    logits = logits.astype(np.float64)
    return 1.0 / (1.0 + np.exp(-logits)) if activation == "sigmoid" else logits


def _cosines_to_first(values: np.ndarray) -> np.ndarray:
    """[1 + N, D] embeddings of the query and the documents -> [N] cosines."""
    vectors = finish(values, normalize=True, dimensions=None)
    return (vectors[1:] @ vectors[0]).astype(np.float64)


def _check_top_n(top_n, documents) -> int | None:
    if top_n is not None and (not isinstance(top_n, int) or isinstance(top_n, bool) or top_n < 1):
        raise InvalidParameterError(f"top_n must be a positive integer, got {top_n!r}", "top_n")
    return top_n


def _ranked(scores: list[float], top_n: int | None) -> list[tuple[int, float]]:
    ranked = sorted(enumerate(scores), key=lambda pair: -pair[1])
    return ranked if top_n is None else ranked[:top_n]
