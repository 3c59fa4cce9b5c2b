/* The sampler kernel: per row of logits, in one call and without a full sort,
 *   logits processing (allowed ids, -inf masks, logit_bias + repetition penalty + frequency /
 *   presence penalties over the few touched ids), then the choice (greedy argmax, or
 *   softmax(l / temperature) under the min-p, top-k and top-p masks, drawn by inverting the CDF
 *   in id order at one uniform from the row's MT19937 stream), then the logprob, rank and top
 *   logprobs of the row's raw (unprocessed) log-softmax.
 * Plain C over raw pointers; the caller (cext/sampler.pyx) owns every array. */
#ifndef SAMPLER_KERNELS_H
#define SAMPLER_KERNELS_H

#include <stdint.h>

enum {
    SK_OK = 0,
    SK_BAD_ID = 1,        /* a token id outside [0, vocab) */
    SK_NO_MEMORY = 2,
};

/* MT19937 with torch's CPU generator's seeding (the low 32 bits of the seed) and its float64
 * uniform ((two 32-bit outputs, first high) & (2^53 - 1)) * 2^-53: the same stream as
 * torch.rand((), dtype=torch.float64, generator=torch.Generator().manual_seed(seed)). */
typedef struct {
    uint32_t state[624];
    int index;
    uint64_t claim;  /* the sk_sample_rows call that last met this stream (0: none) */
} sk_mt19937;

void sk_mt_seed(sk_mt19937 *mt, uint64_t seed);
double sk_mt_uniform(sk_mt19937 *mt);

typedef struct {
    float temperature;          /* 0: greedy (argmax of the processed row) */
    int32_t top_k;              /* 0: off */
    float top_p;                /* 1: off */
    float min_p;                /* 0: off */
    sk_mt19937 *rng;            /* random rows: the request's stream (one uniform per token) */
    const int64_t *allowed_ids; /* NULL: every id allowed */
    int64_t num_allowed;
    const int64_t *masked_ids;  /* set to -inf (min_tokens stop ids, bad words) */
    int64_t num_masked;
    const int64_t *ids;         /* touched ids: l = rep(l + bias) - sub, rep(x) = x > 0 ? x / scale : x * scale */
    const float *bias, *scale, *sub;
    int64_t num_touched;
    int32_t num_top;            /* -1: no logprobs; else the number of top logprobs wanted */
} sk_row;

typedef struct {
    int64_t token_id;
    float logprob;              /* of token_id under the raw row's log-softmax (when num_top >= 0) */
    int64_t rank;               /* 1 + number of other ids with logprob >= it (vLLM's rank) */
    int64_t *top_ids;           /* [num_top], best first, ties by lower id */
    float *top_logprobs;        /* [num_top] */
} sk_result;

/* logits [num_rows, vocab] are processed in place. process_only: stop after the processing
 * (results untouched). Rows are shared with cpu.h's pool from SK_PARALLEL_ROWS rows on. Returns SK_OK or
 * the error of a bad row (the other rows may or may not be done). */
int sk_sample_rows(float *logits, int64_t num_rows, int64_t vocab, const sk_row *rows, sk_result *results,
                   int process_only);

/* Raw log-softmax of each row [num_rows, vocab]: logprob and rank of target_ids[i], top num_top. */
int sk_logprob_rows(const float *logits, int64_t num_rows, int64_t vocab, const int64_t *target_ids,
                    int32_t num_top, float *logprobs, int64_t *ranks, int64_t *top_ids, float *top_logprobs);

/* The hand-written AVX2 passes run when cpu.h's switch is at CPU_ISA_AVX2 or above
 * (cext.cpu.set_isa("baseline") runs the portable code, for tests of both paths). */

#endif
