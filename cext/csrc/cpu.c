/* The CPU probe, the instruction-set switch and the kernels' thread pool (cpu.h). */
#include "cpu.h"

#include <pthread.h>
#include <sched.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#if defined(__x86_64__) && defined(__GNUC__)
#define CPU_X86 1
#include <cpuid.h>
#endif
#if defined(CPU_X86) && defined(__linux__)
#include <sys/syscall.h>
#include <unistd.h>
#define CPU_ARCH_GET_XCOMP_PERM 0x1022
#define CPU_ARCH_REQ_XCOMP_PERM 0x1023
#define CPU_XFEATURE_XTILEDATA 18
#endif

/* ---- the probe ---- */

#ifdef CPU_X86
static uint64_t read_xcr0(void) {
    uint32_t eax, edx;
    __asm__ volatile("xgetbv" : "=a"(eax), "=d"(edx) : "c"(0));
    return ((uint64_t)edx << 32) | eax;
}

/* Linux keeps AMX tile data off until a process asks (the signal frame grows by 8 KB). */
static int amx_permitted(void) {
#ifdef __linux__
    if (syscall(SYS_arch_prctl, CPU_ARCH_REQ_XCOMP_PERM, CPU_XFEATURE_XTILEDATA) != 0) return 0;
    uint64_t granted = 0;
    if (syscall(SYS_arch_prctl, CPU_ARCH_GET_XCOMP_PERM, &granted) != 0) return 0;
    return (granted >> CPU_XFEATURE_XTILEDATA) & 1;
#else
    return 0;
#endif
}
#endif

static uint32_t probe(void) {
    uint32_t found = 0;
#ifdef CPU_X86
    unsigned a, b, c, d;
    if (!__get_cpuid(1, &a, &b, &c, &d)) return 0;
    const int osxsave = (c >> 27) & 1, fma = (c >> 12) & 1, f16c = (c >> 29) & 1, avx = (c >> 28) & 1;
    if (!osxsave || !avx) return 0;
    const uint64_t xcr0 = read_xcr0();
    if ((xcr0 & 0x6) != 0x6) return 0;  /* xmm and ymm state */
    if (!__get_cpuid_count(7, 0, &a, &b, &c, &d)) return 0;
    const unsigned b7 = b, c7 = c, d7 = d;
    if (((b7 >> 5) & 1) && fma && f16c) found |= CPU_HAS_AVX2;
    const int zmm_state = (xcr0 & 0xe0) == 0xe0;  /* opmask, upper zmm0-15, zmm16-31 */
    const int avx512 = ((b7 >> 16) & 1) && ((b7 >> 17) & 1) && ((b7 >> 30) & 1) && ((b7 >> 31) & 1);
    if ((found & CPU_HAS_AVX2) && zmm_state && avx512) {
        found |= CPU_HAS_AVX512;
        if ((c7 >> 11) & 1) found |= CPU_HAS_AVX512_VNNI;
        if ((d7 >> 23) & 1) found |= CPU_HAS_AVX512_FP16;
        unsigned a1 = 0, b1, c1, d1;
        if (__get_cpuid_count(7, 1, &a1, &b1, &c1, &d1) && ((a1 >> 5) & 1)) found |= CPU_HAS_AVX512_BF16;
        const int tile = (d7 >> 24) & 1, tile_state = (xcr0 & 0x60000) == 0x60000;
        if (tile && tile_state && (((d7 >> 22) & 1) || ((d7 >> 25) & 1)) && amx_permitted()) {
            if ((d7 >> 22) & 1) found |= CPU_HAS_AMX_BF16;
            if ((d7 >> 25) & 1) found |= CPU_HAS_AMX_INT8;
        }
    }
#endif
    return found;
}

static int features_probed = 0;
static uint32_t features_found = 0;
static pthread_once_t probe_once = PTHREAD_ONCE_INIT;
static void run_probe(void) {
    features_found = probe();
    __atomic_store_n(&features_probed, 1, __ATOMIC_RELEASE);
}

uint32_t cpu_features(void) {
    if (!__atomic_load_n(&features_probed, __ATOMIC_ACQUIRE)) pthread_once(&probe_once, run_probe);
    return features_found;
}

/* ---- the switch ---- */

static int best_isa(void) {
    const uint32_t f = cpu_features();
    return (f & CPU_HAS_AVX512) ? CPU_ISA_AVX512 : (f & CPU_HAS_AVX2) ? CPU_ISA_AVX2 : CPU_ISA_BASELINE;
}

static int active_isa = CPU_ISA_AUTO;  /* AUTO until the first call: then the best */

int cpu_isa(void) {
    int isa = __atomic_load_n(&active_isa, __ATOMIC_RELAXED);
    if (isa == CPU_ISA_AUTO) {
        isa = best_isa();
        __atomic_store_n(&active_isa, isa, __ATOMIC_RELAXED);
    }
    return isa;
}

int cpu_set_isa(int isa) {
    if (isa == CPU_ISA_AUTO) isa = best_isa();
    if (isa < CPU_ISA_BASELINE || isa > best_isa()) return -1;
    __atomic_store_n(&active_isa, isa, __ATOMIC_RELAXED);
    return isa;
}

int cpu_allows(uint32_t feature) {
    const int isa = cpu_isa();
    if ((cpu_features() & feature) != feature) return 0;
    if (feature & ~(uint32_t)CPU_HAS_AVX2) return isa >= CPU_ISA_AVX512;
    return isa >= CPU_ISA_AVX2;
}

/* ---- per-thread scratch ---- */

static __thread float *scratch_buf = NULL;
static __thread size_t scratch_len = 0;

float *cpu_scratch(size_t num_floats) {
    if (num_floats == 0) num_floats = 1;
    if (num_floats > scratch_len) {
        float *grown = (float *)realloc(scratch_buf, num_floats * sizeof(float));
        if (grown == NULL) return NULL;
        scratch_buf = grown;
        scratch_len = num_floats;
    }
    return scratch_buf;
}

/* ---- thread pool ----
 * An idle worker polls for the next job for spin_ns (300 us by default), yielding the core to
 * any runnable thread between polls, then sleeps on a condition variable; the caller polls the
 * same way for its workers' chunks. Waking a sleeping vCPU costs as much as a whole decode-step
 * product, so sleeping workers made a second thread useless at batch 1 (docs/performance.md,
 * "The kernels' thread pool", has the figures and the command).
 * A job's items are claimed in chunks through one 64-bit word (generation << 32 | next item),
 * so a worker that wakes late, after the caller has taken every chunk, finds nothing and
 * never delays the caller; the caller waits only for chunks actually claimed. */

#define CPU_MAX_THREADS 256

static struct {
    pthread_mutex_t mutex;
    pthread_cond_t work_ready, work_done;
    int num_threads;        /* wanted, caller included */
    int num_started;        /* workers running */
    int num_active;         /* workers 0..num_active-1 take part in the current job */
    uint32_t generation;    /* bumped per job */
    CpuRangeFn fn; const void *args; int64_t num_items, chunk; size_t scratch_floats;
    uint64_t claim;         /* generation << 32 | next item */
    int64_t num_done;       /* items finished in the current job */
    int failed;
} pool = {PTHREAD_MUTEX_INITIALIZER, PTHREAD_COND_INITIALIZER, PTHREAD_COND_INITIALIZER, 1, 0, 0, 0,
          NULL, NULL, 0, 1, 0, 0, 0, 0};

static int64_t parallel_threshold = 1 << 15;
static int64_t spin_ns = 300000;  /* how long an idle worker (and a waiting caller) polls before sleeping */

static inline int64_t now_ns(void) {
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (int64_t)ts.tv_sec * 1000000000 + ts.tv_nsec;
}

static inline void cpu_relax(void) {
#if defined(__x86_64__) || defined(__i386__)
    __builtin_ia32_pause();
#endif
}

/* Polls until *word != value or spin_ns have passed; -> whether it changed. */
static int spin_while_equal32(const uint32_t *word, uint32_t value) {
    const int64_t budget = __atomic_load_n(&spin_ns, __ATOMIC_RELAXED);
    if (budget <= 0) return 0;
    const int64_t deadline = now_ns() + budget;
    for (;;) {
        for (int i = 0; i < 64; i++) {
            if (__atomic_load_n(word, __ATOMIC_ACQUIRE) != value) return 1;
            cpu_relax();
        }
        if (now_ns() > deadline) return 0;
        sched_yield();  /* a runnable thread (torch's team, a neighbour) gets the core first */
    }
}

static int spin_until_at_least(const int64_t *word, int64_t value) {
    const int64_t budget = __atomic_load_n(&spin_ns, __ATOMIC_RELAXED);
    if (budget <= 0) return 0;
    const int64_t deadline = now_ns() + budget;
    for (;;) {
        for (int i = 0; i < 64; i++) {
            if (__atomic_load_n(word, __ATOMIC_ACQUIRE) >= value) return 1;
            cpu_relax();
        }
        if (now_ns() > deadline) return 0;
        sched_yield();  /* a runnable thread (torch's team, a neighbour) gets the core first */
    }
}

typedef struct {
    uint32_t generation; CpuRangeFn fn; const void *args; int64_t num_items, chunk; size_t scratch_floats;
} JobView;

/* Claims and runs chunks of the job `job` describes until none is left. */
static void run_chunks(const JobView *job) {
    float *buf = NULL;
    for (;;) {
        uint64_t seen = __atomic_load_n(&pool.claim, __ATOMIC_ACQUIRE);
        int64_t begin;
        do {
            if ((uint32_t)(seen >> 32) != job->generation) return;
            begin = (int64_t)(seen & 0xffffffffu);
            if (begin >= job->num_items) return;
        } while (!__atomic_compare_exchange_n(&pool.claim, &seen, seen + (uint64_t)job->chunk, 1,
                                              __ATOMIC_ACQ_REL, __ATOMIC_ACQUIRE));
        int64_t end = begin + job->chunk < job->num_items ? begin + job->chunk : job->num_items;
        if (buf == NULL) buf = cpu_scratch(job->scratch_floats);
        if (buf != NULL) {
            job->fn(job->args, begin, end, buf);
        } else {
            __atomic_store_n(&pool.failed, 1, __ATOMIC_RELAXED);
        }
        if (__atomic_add_fetch(&pool.num_done, end - begin, __ATOMIC_ACQ_REL) == job->num_items) {
            pthread_mutex_lock(&pool.mutex);
            pthread_cond_broadcast(&pool.work_done);
            pthread_mutex_unlock(&pool.mutex);
        }
    }
}

static void *worker_main(void *arg) {
    const int index = (int)(intptr_t)arg;
    pthread_mutex_lock(&pool.mutex);
    uint32_t seen = pool.generation;
    for (;;) {
        if (__atomic_load_n(&pool.generation, __ATOMIC_ACQUIRE) == seen) {
            pthread_mutex_unlock(&pool.mutex);
            spin_while_equal32(&pool.generation, seen);
            pthread_mutex_lock(&pool.mutex);
        }
        while (pool.generation == seen) pthread_cond_wait(&pool.work_ready, &pool.mutex);
        seen = pool.generation;
        JobView job = {pool.generation, pool.fn, pool.args, pool.num_items, pool.chunk, pool.scratch_floats};
        const int is_active = index < pool.num_active;
        pthread_mutex_unlock(&pool.mutex);
        if (is_active) run_chunks(&job);
        pthread_mutex_lock(&pool.mutex);
    }
    return NULL;
}

static void reset_after_fork(void) {
    /* The child has only the forking thread: forget the workers. */
    pthread_mutex_init(&pool.mutex, NULL);
    pthread_cond_init(&pool.work_ready, NULL);
    pthread_cond_init(&pool.work_done, NULL);
    pool.num_started = 0;
}

static int ensure_workers(int wanted) {
    static int is_atfork_set = 0;
    if (!is_atfork_set) {
        pthread_atfork(NULL, NULL, reset_after_fork);
        is_atfork_set = 1;
    }
    while (pool.num_started < wanted) {
        pthread_t thread;
        pthread_attr_t attr;
        pthread_attr_init(&attr);
        pthread_attr_setdetachstate(&attr, PTHREAD_CREATE_DETACHED);
        int rc = pthread_create(&thread, &attr, worker_main, (void *)(intptr_t)pool.num_started);
        pthread_attr_destroy(&attr);
        if (rc != 0) break;
        pool.num_started++;
    }
    return pool.num_started;
}

/* Runs fn over [0, num_items): on the caller alone when the work is small or the pool has
 * one thread, else split in chunks claimed by the caller and the workers. Calls from
 * several Python threads at once are serialised by job_mutex. */
static pthread_mutex_t job_mutex = PTHREAD_MUTEX_INITIALIZER;

int cpu_parallel_for(CpuRangeFn fn, const void *args, int64_t num_items, int64_t work,
                     size_t scratch_floats) {
    int num_threads = __atomic_load_n(&pool.num_threads, __ATOMIC_RELAXED);
    if (num_threads <= 1 || work < cpu_parallel_threshold() || num_items < 2 || num_items > 0x7fffffff) {
        float *buf = cpu_scratch(scratch_floats);
        if (buf == NULL) return CPU_NO_MEMORY;
        fn(args, 0, num_items, buf);
        return CPU_OK;
    }
    pthread_mutex_lock(&job_mutex);
    pthread_mutex_lock(&pool.mutex);
    int num_workers = num_threads - 1;
    if ((int64_t)num_workers > num_items - 1) num_workers = (int)(num_items - 1);
    if (ensure_workers(num_workers) < num_workers) num_workers = pool.num_started;
    pool.num_active = num_workers;
    int64_t num_chunks = (int64_t)(num_workers + 1) * 4;
    JobView job = {pool.generation + 1, fn, args, num_items,
                   num_items / num_chunks > 0 ? num_items / num_chunks : 1, scratch_floats};
    pool.fn = fn;
    pool.args = args;
    pool.num_items = num_items;
    pool.chunk = job.chunk;
    pool.scratch_floats = scratch_floats;
    pool.failed = 0;
    __atomic_store_n(&pool.num_done, 0, __ATOMIC_RELEASE);
    __atomic_store_n(&pool.claim, (uint64_t)job.generation << 32, __ATOMIC_RELEASE);
    __atomic_store_n(&pool.generation, job.generation, __ATOMIC_RELEASE);  /* last: spinning workers read it unlocked */
    pthread_cond_broadcast(&pool.work_ready);
    pthread_mutex_unlock(&pool.mutex);
    run_chunks(&job);
    spin_until_at_least(&pool.num_done, num_items);
    pthread_mutex_lock(&pool.mutex);
    while (__atomic_load_n(&pool.num_done, __ATOMIC_ACQUIRE) < num_items)
        pthread_cond_wait(&pool.work_done, &pool.mutex);
    int failed = pool.failed;
    pthread_mutex_unlock(&pool.mutex);
    pthread_mutex_unlock(&job_mutex);
    return failed ? CPU_NO_MEMORY : CPU_OK;
}

int cpu_set_num_threads(int num_threads) {
    if (num_threads < 1) num_threads = 1;
    if (num_threads > CPU_MAX_THREADS) num_threads = CPU_MAX_THREADS;
    __atomic_store_n(&pool.num_threads, num_threads, __ATOMIC_RELAXED);
    return num_threads;
}

int cpu_num_threads(void) { return __atomic_load_n(&pool.num_threads, __ATOMIC_RELAXED); }
void cpu_set_parallel_threshold(int64_t work) {
    __atomic_store_n(&parallel_threshold, work, __ATOMIC_RELAXED);
}
int64_t cpu_parallel_threshold(void) { return __atomic_load_n(&parallel_threshold, __ATOMIC_RELAXED); }
void cpu_set_spin_ns(int64_t ns) { __atomic_store_n(&spin_ns, ns < 0 ? 0 : ns, __ATOMIC_RELAXED); }
int64_t cpu_get_spin_ns(void) { return __atomic_load_n(&spin_ns, __ATOMIC_RELAXED); }

/* ---- the read-bandwidth probe (cext.cpu.read_bytes) ---- */

#define CPU_READ_CHUNK 65536  /* bytes a pool item reads */

typedef struct {
    const uint8_t *p;
    int64_t nbytes;
    uint64_t sums[256];  /* per item slot % 256: each thread XORs its own items' words in */
} ReadArgs;

static void read_range(const void *args, int64_t begin, int64_t end, float *scratch) {
    (void)scratch;
    ReadArgs *a = (ReadArgs *)args;
    uint64_t acc[8] = {0};
    for (int64_t item = begin; item < end; item++) {
        const int64_t first = item * CPU_READ_CHUNK;
        const int64_t last = first + CPU_READ_CHUNK < a->nbytes ? first + CPU_READ_CHUNK : a->nbytes;
        const uint64_t *w = (const uint64_t *)(a->p + first);
        const int64_t num_words = (last - first) / 8;
        int64_t i = 0;
        for (; i + 8 <= num_words; i += 8)  /* eight independent XOR chains: vectorized loads */
            for (int j = 0; j < 8; j++) acc[j] ^= w[i + j];
        for (; i < num_words; i++) acc[0] ^= w[i];
    }
    uint64_t x = 0;
    for (int j = 0; j < 8; j++) x ^= acc[j];
    __atomic_fetch_xor(&a->sums[begin % 256], x, __ATOMIC_RELAXED);
}

uint64_t cpu_read_words(const void *p, int64_t nbytes) {
    ReadArgs *a = calloc(1, sizeof(ReadArgs));
    if (a == NULL) return 0;
    a->p = (const uint8_t *)p;
    a->nbytes = nbytes - nbytes % 8;
    const int64_t num_items = (a->nbytes + CPU_READ_CHUNK - 1) / CPU_READ_CHUNK;
    cpu_parallel_for(read_range, a, num_items, a->nbytes, 0);
    uint64_t x = 0;
    for (int i = 0; i < 256; i++) x ^= a->sums[i];
    free(a);
    return x;
}

/* ---- the table the other modules call through (cpu_client.c) ---- */

static const CpuApi api = {CPU_API_VERSION, cpu_features, cpu_isa, cpu_allows, cpu_parallel_for,
                           cpu_num_threads, cpu_parallel_threshold, cpu_scratch};

const CpuApi *cpu_api(void) { return &api; }
