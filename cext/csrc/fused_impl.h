/* Kernel bodies, included once per instruction set by fused_kernels.c with FK_SUFFIX set
 * (and a `#pragma GCC target` around the include). Written for the auto-vectoriser:
 * inner loops over contiguous float32 rows, `omp simd` reductions, no calls to libm.
 * Each function runs items [begin, end) of one kernel call; arguments were validated. */

#define FK_CAT2(a, b) a##_##b
#define FK_CAT(a, b) FK_CAT2(a, b)
#define FK_FN(name) FK_CAT(name, FK_SUFFIX)

/* bfloat16 -> float32: the 16 bits are the top half of the float; float16 (KV caches only)
 * through _Float16 (one vcvtph2ps per 8 values where the variant has F16C). */
static inline void FK_FN(load_row)(float *dst, const void *src, int64_t n, int dtype) {
    if (dtype == FK_FLOAT32) {
        memcpy(dst, src, (size_t)n * sizeof(float));
        return;
    }
    if (dtype == FK_FLOAT16) {
        const _Float16 *h = (const _Float16 *)src;
#pragma omp simd
        for (int64_t i = 0; i < n; i++) dst[i] = (float)h[i];
        return;
    }
    const uint16_t *s = (const uint16_t *)src;
#pragma omp simd
    for (int64_t i = 0; i < n; i++) {
        uint32_t u = (uint32_t)s[i] << 16;
        float f;
        memcpy(&f, &u, sizeof f);
        dst[i] = f;
    }
}

/* float32 -> bfloat16, round to nearest even (NaN stays a quiet NaN), as torch rounds;
 * -> float16 round to nearest even (the hardware conversion, as torch's). */
static inline void FK_FN(store_row)(void *dst, const float *src, int64_t n, int dtype) {
    if (dtype == FK_FLOAT32) {
        memcpy(dst, src, (size_t)n * sizeof(float));
        return;
    }
    if (dtype == FK_FLOAT16) {
        _Float16 *h = (_Float16 *)dst;
#pragma omp simd
        for (int64_t i = 0; i < n; i++) h[i] = (_Float16)src[i];
        return;
    }
    uint16_t *d = (uint16_t *)dst;
#pragma omp simd
    for (int64_t i = 0; i < n; i++) {
        uint32_t u;
        memcpy(&u, &src[i], sizeof u);
        uint32_t rounded = (u + 0x7fffu + ((u >> 16) & 1u)) >> 16;
        uint32_t is_nan = (u & 0x7fffffffu) > 0x7f800000u;
        d[i] = (uint16_t)(is_nan ? ((u >> 16) | 0x40u) : rounded);
    }
}

/* exp(x) for x in float32 range, ~1 ulp; 0 below -87.3 (no libm call, vectorisable). */
static inline float FK_FN(fast_exp)(float x) {
    x = x < 88.3762626647949f ? x : 88.3762626647949f;
    const int is_tiny = x < -87.3365447504f;
    x = x > -87.3365447504f ? x : -87.3365447504f;
    /* round to nearest through the 1.5 * 2^23 trick (no floorf call; exact without -ffast-math) */
    float n = (x * 1.44269504088896341f + 12582912.0f) - 12582912.0f;
    float r = x - n * 0.693359375f;
    r = r - n * -2.12194440e-4f;
    float p = 1.9875691500e-4f;
    p = p * r + 1.3981999507e-3f;
    p = p * r + 8.3334519073e-3f;
    p = p * r + 4.1665795894e-2f;
    p = p * r + 1.6666665459e-1f;
    p = p * r + 5.0000001201e-1f;
    p = p * r * r + r + 1.0f;
    int32_t e = ((int32_t)n + 127) << 23;
    float scale;
    memcpy(&scale, &e, sizeof scale);
    return is_tiny ? 0.0f : p * scale;
}

static void FK_FN(add_rmsnorm_rows)(const AddNormArgs *a, int64_t begin, int64_t end, float *scratch) {
    const int64_t dim = a->dim;
    const size_t esize = a->dtype == FK_FLOAT32 ? 4 : 2;
    float *w = scratch;          /* [E] */
    float *delta = scratch + dim; /* [E] */
    FK_FN(load_row)(w, a->weight, dim, a->dtype);
    for (int64_t t = begin; t < end; t++) {
        float *x = a->resid + t * dim;
        if (a->delta != NULL) {
            FK_FN(load_row)(delta, (const char *)a->delta + (size_t)(t * dim) * esize, dim, a->dtype);
#pragma omp simd
            for (int64_t i = 0; i < dim; i++) x[i] += delta[i];
        }
        float sum_sq = 0.0f;
#pragma omp simd reduction(+ : sum_sq)
        for (int64_t i = 0; i < dim; i++) sum_sq += x[i] * x[i];
        float inv = 1.0f / __builtin_sqrtf(sum_sq / (float)dim + a->eps);
#pragma omp simd
        for (int64_t i = 0; i < dim; i++) delta[i] = x[i] * inv * w[i];
        FK_FN(store_row)((char *)a->out + (size_t)(t * dim) * esize, delta, dim, a->dtype);
    }
}

static void FK_FN(rope_kv_rows)(const RopeArgs *a, int64_t begin, int64_t end, float *scratch) {
    const int dim = a->head_dim, half = dim / 2;
    const int num_kv = a->num_kv_heads, num_rot = a->num_heads + a->num_kv_heads;
    const size_t esize = a->dtype == FK_FLOAT32 ? 4 : 2;
    const size_t cache_esize = a->cache_dtype == FK_FLOAT32 ? 4 : 2;
    float *head = scratch;          /* [D] */
    float *rot = scratch + dim;     /* [D] */
    for (int64_t t = begin; t < end; t++) {
        char *row = (char *)a->qkv + (size_t)(t * a->row_stride) * esize;
        const float *c = a->cos + a->positions[t] * half;
        const float *s = a->sin + a->positions[t] * half;
        const int64_t slot = a->slots[t];
        char *k_dst = (char *)a->k_cache + (size_t)(slot * num_kv * dim) * cache_esize;
        char *v_dst = (char *)a->v_cache + (size_t)(slot * num_kv * dim) * cache_esize;
        for (int h = 0; h < num_rot; h++) {
            char *src = row + (size_t)h * dim * esize;
            FK_FN(load_row)(head, src, dim, a->dtype);
#pragma omp simd
            for (int i = 0; i < half; i++) {
                rot[i] = head[i] * c[i] - head[i + half] * s[i];
                rot[i + half] = head[i + half] * c[i] + head[i] * s[i];
            }
            FK_FN(store_row)(src, rot, dim, a->dtype);
        }
        /* k (now rotated) and v are adjacent in the row: [KH, D] each. */
        if (a->cache_dtype == a->dtype) {
            const size_t kv_bytes = (size_t)num_kv * dim * esize;
            memcpy(k_dst, row + (size_t)a->num_heads * dim * esize, kv_bytes);
            memcpy(v_dst, row + (size_t)num_rot * dim * esize, kv_bytes);
        } else {
            for (int h = 0; h < 2 * num_kv; h++) {  /* k heads, then v heads */
                FK_FN(load_row)(head, row + (size_t)(a->num_heads + h) * dim * esize, dim, a->dtype);
                char *dst = h < num_kv ? k_dst + (size_t)h * dim * cache_esize
                                       : v_dst + (size_t)(h - num_kv) * dim * cache_esize;
                FK_FN(store_row)(dst, head, dim, a->cache_dtype);
            }
        }
    }
}

/* Item i = sequence i / KH, kv head i % KH: its G = H / KH query heads walk the block
 * table together, one key row at a time, with an online softmax per block. */
static void FK_FN(attention_items)(const AttnArgs *a, int64_t begin, int64_t end, float *scratch) {
    const int dim = a->head_dim, num_kv = a->num_kv_heads;
    const int groups = a->num_heads / num_kv;
    const int bs = a->block_size;
    const size_t esize = a->dtype == FK_FLOAT32 ? 4 : 2;
    const size_t cache_esize = a->cache_dtype == FK_FLOAT32 ? 4 : 2;
    float *qf = scratch;                     /* [G, D] scaled queries */
    float *acc = qf + groups * dim;          /* [G, D] */
    float *krow = acc + groups * dim;        /* [D] */
    float *vrow = krow + dim;                /* [D] */
    float *scores = vrow + dim;              /* [G, FK_CHUNK] */
    float *run_max = scores + groups * FK_CHUNK; /* [G] */
    float *run_sum = run_max + groups;       /* [G] */
    const int num_splits = a->num_splits;
    for (int64_t item = begin; item < end; item++) {
        const int split = (int)(item % num_splits);
        const int64_t b = item / num_splits / num_kv;
        const int kvh = (int)(item / num_splits % num_kv);
        int64_t len = a->context_lens[b];
        int64_t first = 0;
        if (a->sliding_window > 0 && len > a->sliding_window) first = len - a->sliding_window;
        if (num_splits > 1) {
            /* Keys [first, len) cut in num_splits near-equal ranges; this item takes one. */
            const int64_t total = len - first;
            const int64_t lo = first + total * split / num_splits;
            len = first + total * (split + 1) / num_splits;
            first = lo;
        }
        const int64_t *table = a->block_tables + b * a->table_stride;
        const char *q_row = (const char *)a->q + (size_t)(b * a->q_row_stride) * esize;
        for (int g = 0; g < groups; g++) {
            float *qg = qf + g * dim;
            FK_FN(load_row)(qg, q_row + (size_t)(kvh * groups + g) * dim * esize, dim, a->dtype);
#pragma omp simd
            for (int i = 0; i < dim; i++) qg[i] *= a->scale;
            run_max[g] = -1e30f;
            run_sum[g] = 0.0f;
        }
        memset(acc, 0, sizeof(float) * (size_t)groups * dim);
        int64_t pos = first;
        while (pos < len) {
            /* A chunk of keys inside one block. */
            const int64_t block = table[pos / bs];
            const int64_t offset = pos % bs;
            int64_t count = bs - offset;
            if (count > len - pos) count = len - pos;
            if (count > FK_CHUNK) count = FK_CHUNK;
            const int64_t slot0 = block * bs + offset;
            const size_t slot_stride = (size_t)num_kv * dim * cache_esize;
            const char *k_base = (const char *)a->k_cache + (size_t)(slot0 * num_kv + kvh) * dim * cache_esize;
            const char *v_base = (const char *)a->v_cache + (size_t)(slot0 * num_kv + kvh) * dim * cache_esize;
            for (int64_t j = 0; j < count; j++) {
                const float *k;
                if (a->cache_dtype == FK_FLOAT32) {
                    k = (const float *)(k_base + j * slot_stride);
                } else {
                    FK_FN(load_row)(krow, k_base + j * slot_stride, dim, a->cache_dtype);
                    k = krow;
                }
                for (int g = 0; g < groups; g++) {
                    const float *qg = qf + g * dim;
                    float dot = 0.0f;
#pragma omp simd reduction(+ : dot)
                    for (int i = 0; i < dim; i++) dot += qg[i] * k[i];
                    scores[g * FK_CHUNK + j] = dot;
                }
            }
            for (int g = 0; g < groups; g++) {
                float *sg = scores + g * FK_CHUNK;
                float chunk_max = run_max[g];
                for (int64_t j = 0; j < count; j++) chunk_max = sg[j] > chunk_max ? sg[j] : chunk_max;
                const float correction = FK_FN(fast_exp)(run_max[g] - chunk_max);
                float sum = 0.0f;
#pragma omp simd reduction(+ : sum)
                for (int64_t j = 0; j < count; j++) {
                    sg[j] = FK_FN(fast_exp)(sg[j] - chunk_max);
                    sum += sg[j];
                }
                run_sum[g] = run_sum[g] * correction + sum;
                run_max[g] = chunk_max;
                if (correction != 1.0f) {
                    float *ag = acc + g * dim;
#pragma omp simd
                    for (int i = 0; i < dim; i++) ag[i] *= correction;
                }
            }
            for (int64_t j = 0; j < count; j++) {
                const float *v;
                if (a->cache_dtype == FK_FLOAT32) {
                    v = (const float *)(v_base + j * slot_stride);
                } else {
                    FK_FN(load_row)(vrow, v_base + j * slot_stride, dim, a->cache_dtype);
                    v = vrow;
                }
                for (int g = 0; g < groups; g++) {
                    float *ag = acc + g * dim;
                    const float p = scores[g * FK_CHUNK + j];
#pragma omp simd
                    for (int i = 0; i < dim; i++) ag[i] += p * v[i];
                }
            }
            pos += count;
        }
        if (num_splits > 1) {
            /* Unnormalised partial: [G] max, [G] sum, [G, D] acc, merged by the caller. */
            float *part = a->partials + item * (size_t)groups * (dim + 2);
            memcpy(part, run_max, sizeof(float) * groups);
            memcpy(part + groups, run_sum, sizeof(float) * groups);
            memcpy(part + 2 * groups, acc, sizeof(float) * (size_t)groups * dim);
            continue;
        }
        char *out_row = (char *)a->out + (size_t)(b * a->num_heads * dim) * esize;
        for (int g = 0; g < groups; g++) {
            float *ag = acc + g * dim;
            const float inv = 1.0f / run_sum[g];
#pragma omp simd
            for (int i = 0; i < dim; i++) ag[i] *= inv;
            FK_FN(store_row)(out_row + (size_t)(kvh * groups + g) * dim * esize, ag, dim, a->dtype);
        }
    }
}

static void FK_FN(silu_mul_rows)(const SiluArgs *a, int64_t begin, int64_t end, float *scratch) {
    const int64_t inter = a->inter;
    const size_t esize = a->dtype == FK_FLOAT32 ? 4 : 2;
    float *gate = scratch;        /* [FK_CHUNK_COLS] */
    float *up = scratch + FK_CHUNK_COLS;
    for (int64_t t = begin; t < end; t++) {
        const char *row = (const char *)a->gate_up + (size_t)(t * 2 * inter) * esize;
        char *out = (char *)a->out + (size_t)(t * inter) * esize;
        for (int64_t c0 = 0; c0 < inter; c0 += FK_CHUNK_COLS) {
            const int64_t n = inter - c0 < FK_CHUNK_COLS ? inter - c0 : FK_CHUNK_COLS;
            FK_FN(load_row)(gate, row + (size_t)c0 * esize, n, a->dtype);
            FK_FN(load_row)(up, row + (size_t)(inter + c0) * esize, n, a->dtype);
#pragma omp simd
            for (int64_t i = 0; i < n; i++) gate[i] = gate[i] / (1.0f + FK_FN(fast_exp)(-gate[i])) * up[i];
            FK_FN(store_row)(out + (size_t)c0 * esize, gate, n, a->dtype);
        }
    }
}

static const KernelTable FK_FN(kernel_table) = {
    FK_FN(add_rmsnorm_rows), FK_FN(rope_kv_rows), FK_FN(attention_items), FK_FN(silu_mul_rows),
};

#undef FK_FN
#undef FK_CAT
#undef FK_CAT2
