/* treadle's CPU kernels, called through ctypes (cpu_kernels.py):

   - paged_decode_attention_f32: decode (and prefill) attention reading the paged KV cache in
     place, its rows float32, float16, bfloat16 or int8 (`--kv-cache-dtype`, common.h);
   - gguf_linear_f32: y = x W^T with W kept in its GGUF blocks (Q4_0, Q4_1, Q8_0) and expanded
     to float32 on the fly, so that a decode step reads 0.75-1.25 bytes per weight instead of 4;
   - gguf_linear_i8: the same product with x quantized to int8 blocks and integer dot products
     (int8.h; `--cpu-activation-dtype int8`), on the tiles up to I8_MAX_ROWS rows, or on the
     blocks laid out 16 outputs wide (G16, common.h, int8_g16.h) at every row count;
   - the small per-layer operations (RMSNorm, add + RMSNorm, RoPE, SiLU * up, the KV write);
   - the structured-output token bitmask applied to the logits in place.

   One source, compiled once per ISA level with that level's flags (cpu_kernels.py picks the
   level from the CPU, or TREADLE_CPU_ISA): the compiler's macros choose the header with the
   level's hand-written parts (avx512.h: 16-wide, avx2.h: 8-wide, portable.h: plain C), and the
   plain loops here are vectorized for the same level. treadle_kernel_isa() says which it was
   built for, so that a library built for another CPU is never used by mistake. */
#include "common.h"
#if defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512DQ__) && defined(__AVX512VL__)
#include "avx512.h"
#elif defined(__AVX2__) && defined(__FMA__) && defined(__F16C__)
#include "avx2.h"
#else
#include "portable.h"
#endif
#include "int8.h"
#include "int8_g16.h"

#if FEW_MAX_ROWS > 0
/* One tile (TILE_N outputs) for `rows` (1 .. FEW_ROWS: 1, 2, 4 or 8) rows of x: the level's few_rows_n,
   specialized per block kind and row count so that its inner loop has no branches. */
#define FEW_CASE(KIND, R) case R: few_rows_n(tile, KIND, nb, x, x_stride, R, out); break
static void few_rows(const char* tile, int kind, int64_t nb, const float* x, int64_t x_stride,
                     int64_t rows, float out[FEW_ROWS][TILE_N]) {
    if (kind == KIND_Q4) {
        switch (rows) {
            FEW_CASE(KIND_Q4, 1);
#if FEW_ROWS >= 2
            FEW_CASE(KIND_Q4, 2);
#endif
#if FEW_ROWS >= 4
            FEW_CASE(KIND_Q4, 3); FEW_CASE(KIND_Q4, 4);
#endif
#if FEW_ROWS >= 8
            FEW_CASE(KIND_Q4, 5); FEW_CASE(KIND_Q4, 6); FEW_CASE(KIND_Q4, 7); FEW_CASE(KIND_Q4, 8);
#endif
        }
    } else {
        switch (rows) {
            FEW_CASE(KIND_Q8, 1);
#if FEW_ROWS >= 2
            FEW_CASE(KIND_Q8, 2);
#endif
#if FEW_ROWS >= 4
            FEW_CASE(KIND_Q8, 3); FEW_CASE(KIND_Q8, 4);
#endif
#if FEW_ROWS >= 8
            FEW_CASE(KIND_Q8, 5); FEW_CASE(KIND_Q8, 6); FEW_CASE(KIND_Q8, 7); FEW_CASE(KIND_Q8, 8);
#endif
        }
    }
}
#undef FEW_CASE
#endif

#if defined(SUM_MAX_ROWS)
/* One tile for 1 or 2 rows of x the sum way (the level's sum_rows_n), specialized per block
   kind and row count. */
static void sum_rows(const char* tile, int kind, int64_t nb, const float* x, int64_t K,
                     const float* xs2, int64_t rows, float out[TILE_N][SUM_MAX_ROWS]) {
    if (kind == KIND_Q4) {
        if (rows == 1) sum_rows_n(tile, KIND_Q4, nb, x, K, xs2, 1, out);
        else sum_rows_n(tile, KIND_Q4, nb, x, K, xs2, 2, out);
    } else {
        if (rows == 1) sum_rows_n(tile, KIND_Q8, nb, x, K, xs2, 1, out);
        else sum_rows_n(tile, KIND_Q8, nb, x, K, xs2, 2, out);
    }
}
#endif

const char* treadle_kernel_isa(void) { return TREADLE_ISA; }
int gguf_linear_i8_max_rows(void) { return I8_MAX_ROWS; }
/* The block kinds (1 << KIND_Q4, 1 << KIND_Q8) this level runs laid out 16 wide (G16). */
int gguf_g16_kinds(void) { return G16_KINDS; }

/* Attention of float32 queries over the paged KV cache, whose rows are of type kv_type
   (common.h: float32, float16, bfloat16 or int8 with a scale per row). The hand-tiled path
   (attend_d64: head size 64, up to 4 query heads per KV head, blocks of 16) widens each row in
   registers; the generic loop widens one row at a time into an L1 buffer of head_dim floats.

   Tasks are (rows, KV head) pairs, where the rows are consecutive rows whose contexts lie on
   the same blocks (one request's positions that a speculative step verifies, or the tokens of
   a prefill chunk: up to ATTN_ROWS of them; each other row alone): their KV is read once for
   all of them, where each row had read it again (attend_rows, common.h). A context longer
   than ATTN_PART tokens is split in parts of that many (flash-decoding), each attended alone
   (its scores' max m, the sum l of exp(s - m), and the unnormalized sum of V), then combined:
   out = sum_c e^(m_c - M) acc_c / sum_c e^(m_c - M) l_c, M = max_c m_c. One request has only
   num_kv (3) tasks, which left a thread of two idle a third of the time (single stream,
   ~1,600 tokens of context: 13.4-14.2 -> 9.3-10.1 ms a token). The parts depend only on the
   row's own length, so a row's bits do not depend on the rows beside it (and a context of up
   to ATTN_PART tokens gives the bits of the whole-context loop), nor on which rows share its
   task: each row's operations are the ones it makes alone, in the same order. */
#define ATTN_PART 256  /* tokens; contexts are split only where the cache blocks divide it */
#ifndef ATTN_TASKS_PER_THREAD
#define ATTN_TASKS_PER_THREAD 2  /* rows of a request are split to make at least this many */
#endif

/* How many parts a context of `len` tokens is attended in. */
static inline int64_t attn_parts(int64_t len, int64_t block_size) {
    return ATTN_PART % block_size == 0 && len > ATTN_PART ? (len + ATTN_PART - 1) / ATTN_PART : 1;
}

/* The generic loop: the rows of R over the blocks in `table` (see attend_rows); `acc` holds
   R->count x group x head_dim floats. */
static void attend_generic(const attend_rows* R, int64_t group, const char* kh, const char* vh,
                           const int64_t* table, float scale, float* scores, int64_t stride,
                           float* acc, float* row, int64_t head_dim, int64_t block_size,
                           int64_t rb, int kv_type) {
    const int64_t len = R->n[R->count - 1];
    const int64_t block_bytes_kv = block_size * rb;
    const int64_t num_used = (len + block_size - 1) / block_size;
    prefetch_bytes(kh + table[0] * block_bytes_kv, block_bytes_kv);
    for (int64_t b = 0, t = 0; t < len; b++) {
        const char* kb = kh + table[b] * block_bytes_kv;
        const char* next = b + 1 < num_used ? kh + table[b + 1] * block_bytes_kv
                                            : vh + table[0] * block_bytes_kv;
        prefetch_bytes(next, block_bytes_kv);
        const int64_t n = len - t < block_size ? len - t : block_size;
        for (int64_t o = 0; o < n; o++, t++) {
            const char* kt = kb + o * rb;
            const float* ktf = kv_type == KV_F32 ? (const float*)kt : row;
            if (kv_type != KV_F32) kv_row_to_f32(kt, kv_type, head_dim, row);
            const float s = scale * kv_row_scale(kt, kv_type, head_dim);
            for (int64_t r = R->count - 1; r >= 0 && t < R->n[r]; r--)
                for (int64_t j = 0; j < group; j++)
                    scores[(r * group + j) * stride + t] =
                        dot(R->q + r * R->q_stride + j * head_dim, ktf, head_dim) * s;
        }
    }
    for (int64_t r = 0; r < R->count; r++)
        softmax_rows(scores + r * group * stride, group, R->n[r], stride, R->ml[r]);
    memset(acc, 0, sizeof(float) * R->count * group * head_dim);
    for (int64_t b = 0, t = 0; t < len; b++) {
        const char* vb = vh + table[b] * block_bytes_kv;
        if (b + 1 < num_used) prefetch_bytes(vh + table[b + 1] * block_bytes_kv, block_bytes_kv);
        const int64_t n = len - t < block_size ? len - t : block_size;
        for (int64_t o = 0; o < n; o++, t++) {
            const char* vt = vb + o * rb;
            const float* vtf = kv_type == KV_F32 ? (const float*)vt : row;
            if (kv_type != KV_F32) kv_row_to_f32(vt, kv_type, head_dim, row);
            const float vs = kv_row_scale(vt, kv_type, head_dim);
            for (int64_t r = R->count - 1; r >= 0 && t < R->n[r]; r--)
                for (int64_t j = 0; j < group; j++) {
                    const float p = scores[(r * group + j) * stride + t] * vs;
                    float* a = acc + (r * group + j) * head_dim;
                    for (int64_t i = 0; i < head_dim; i++) a[i] += p * vtf[i];
                }
        }
    }
    for (int64_t r = 0; r < R->count; r++)
        memcpy(R->out[r], acc + r * group * head_dim, sizeof(float) * group * head_dim);
}

/* What a call of paged_decode_attention_f32 reads and where each thread works. */
typedef struct {
    int64_t group, head_dim, block_size, rb, stride;  /* stride: between a row's scores */
    float scale;
    int kv_type, d64;
    float *scores, *acc, *row;  /* the thread's buffers */
} attend_ctx;

/* The rows of R over one KV head's blocks in `table`. */
static void attend_span(const attend_ctx* c, const attend_rows* R, const char* kh,
                        const char* vh, const int64_t* table) {
#if HAVE_ATTEND_D64
    if (c->d64) {
        attend_d64(R, c->group, kh, vh, table, c->scale, c->scores, c->stride, c->kv_type);
        return;
    }
#endif
    attend_generic(R, c->group, kh, vh, table, c->scale, c->scores, c->stride, c->acc, c->row,
                   c->head_dim, c->block_size, c->rb, c->kv_type);
}

/* The parts' results (`parts` slots of `slot` floats, in order) combined into
   dst[group x head_dim] (o: head_dim floats of scratch). */
static void combine_parts(const float* base, int64_t parts, int64_t slot, int64_t group,
                          int64_t head_dim, float* o, float* dst) {
    const int64_t at = group * head_dim;  /* where a slot's (m, l) pairs start */
    for (int64_t j = 0; j < group; j++) {
        float m = base[at + 2 * j];
        for (int64_t c = 1; c < parts; c++) {
            const float mc = base[c * slot + at + 2 * j];
            m = mc > m ? mc : m;
        }
        float total = 0.f;
        memset(o, 0, sizeof(float) * head_dim);
        for (int64_t c = 0; c < parts; c++) {
            const float* part = base + c * slot;
            const float w = exp_nonpositive(part[at + 2 * j] - m);
            total += w * part[at + 2 * j + 1];
            for (int64_t i = 0; i < head_dim; i++) o[i] += w * part[j * head_dim + i];
        }
        const float inv = 1.f / total;
        for (int64_t i = 0; i < head_dim; i++) dst[j * head_dim + i] = o[i] * inv;
    }
}

/* Whether row r's context lies on the blocks of row r - 1's (rows `stride` table entries
   apart), as far as row r - 1 reaches, and reaches at least as far: then the two can share
   a task. Transitively, a run of such rows reads its last row's table. */
static inline int extends_row(const int64_t* table, int64_t stride, const int32_t* lens,
                              int64_t r, int64_t block_size) {
    if (lens[r] < lens[r - 1]) return 0;
    if (stride == 0) return 1;
    const int64_t* a = table + (r - 1) * stride;
    const int64_t* b = table + r * stride;
    for (int64_t i = 0; i < (lens[r - 1] + block_size - 1) / block_size; i++)
        if (a[i] != b[i]) return 0;
    return 1;
}

/* The rows' runs (run g: rows at[g] .. at[g + 1] - 1) into `at` (room for num_reqs + 1):
   consecutive rows on the same blocks, at most ATTN_ROWS a run; where they make fewer than
   ATTN_TASKS_PER_THREAD tasks a thread, each run is cut in as many nearly equal runs as make
   that many (a single stream's speculative rows on 2 threads: 3 KV heads are 3 tasks). The
   number of runs. */
static int64_t row_runs(const int64_t* table, int64_t stride, const int32_t* lens,
                        int64_t num_reqs, int64_t num_kv, int64_t block_size, int num_threads,
                        int64_t* at) {
    int64_t runs = 0, tasks = 0;
    for (int64_t r = 0; r < num_reqs; r++) {
        if (r == 0 || r - at[runs - 1] == ATTN_ROWS ||
            !extends_row(table, stride, lens, r, block_size)) {
            if (runs) tasks += num_kv * attn_parts(lens[r - 1], block_size);
            at[runs++] = r;
        }
    }
    tasks += num_kv * attn_parts(lens[num_reqs - 1], block_size);
    at[runs] = num_reqs;
    const int64_t want = (int64_t)ATTN_TASKS_PER_THREAD * num_threads;
    if (tasks >= want || runs == num_reqs) return runs;
    const int64_t cuts = (want + tasks - 1) / tasks;  /* pieces a run is cut in */
    int64_t* old = (int64_t*)malloc(sizeof(int64_t) * (runs + 1));
    memcpy(old, at, sizeof(int64_t) * (runs + 1));
    int64_t out = 0;
    for (int64_t g = 0; g < runs; g++) {
        const int64_t rows = old[g + 1] - old[g], pieces = cuts < rows ? cuts : rows;
        for (int64_t p = 0; p < pieces; p++) at[out++] = old[g] + p * rows / pieces;
    }
    at[out] = num_reqs;
    free(old);
    return out;
}

void paged_decode_attention_f32(
    const float* q, int64_t q_row_stride,          /* q[r, head, :] at q + r*stride + head*d */
    const void* k_cache, const void* v_cache,      /* [num_kv, num_blocks, block_size] rows */
    const int64_t* block_table, int64_t table_stride,
    const int32_t* lens,                           /* context tokens of each request */
    float* out, int64_t out_row_stride,            /* out[r, head*d + i] */
    int64_t num_reqs, int64_t num_heads, int64_t num_kv, int64_t head_dim,
    int64_t num_blocks, int64_t block_size, float scale, int64_t max_len, int num_threads,
    int kv_type)
{
    if (num_reqs <= 0) return;
    const int64_t group = num_heads / num_kv;
    const int64_t rb = kv_row_bytes(kv_type, head_dim);
    const int64_t head_stride = num_blocks * block_size * rb;
#if HAVE_ATTEND_D64
    const int d64 = head_dim == 64 && group <= D64_MAX_GROUP && block_size == D64_BLOCK;
#else
    const int d64 = 0;
#endif
    const int64_t max_parts = attn_parts(max_len, block_size);
    /* a span's scores: at most a part where contexts are split */
    const int64_t stride = ATTN_PART % block_size == 0 && max_len > ATTN_PART ? ATTN_PART
                                                                              : max_len;
    const int64_t slot = group * (head_dim + 2);  /* a part's unnormalized sums, then its (m, l) */
    int64_t* at = (int64_t*)malloc(sizeof(int64_t) * (num_reqs + 1));
    const int64_t runs = row_runs(block_table, table_stride, lens, num_reqs, num_kv, block_size,
                                  num_threads, at);
    int64_t run_rows = 0;  /* the most rows a run has */
    for (int64_t g = 0; g < runs; g++)
        run_rows = at[g + 1] - at[g] > run_rows ? at[g + 1] - at[g] : run_rows;
    /* Where (run, KV head) pairs are few (decode of a few requests), each part is a task of
       its own and the parts are combined after them (`first[g]`: run g's first task; they go
       head by head, part by part; `slots[r]`: row r's first part slot, head by head); else
       each pair is a task that runs its parts in turn (prefill rows: no buffer of every
       part). The same parts and the same combination either way: the same bits. */
    const int by_part = max_parts > 1 && runs * num_kv < 4 * num_threads;
    int64_t* first = (int64_t*)malloc(sizeof(int64_t) * (runs + 1));
    first[0] = 0;
    for (int64_t g = 0; g < runs; g++)
        first[g + 1] = first[g] + num_kv * (by_part ? attn_parts(lens[at[g + 1] - 1], block_size)
                                                    : 1);
    const int64_t num_tasks = first[runs];
    int64_t* slots = NULL;
    float* parts_buf = NULL;
    if (by_part) {
        slots = (int64_t*)malloc(sizeof(int64_t) * (num_reqs + 1));
        slots[0] = 0;
        for (int64_t r = 0; r < num_reqs; r++)
            slots[r + 1] = slots[r] + num_kv * attn_parts(lens[r], block_size);
        parts_buf = (float*)malloc(sizeof(float) * slots[num_reqs] * slot);
    }
    #pragma omp parallel num_threads(num_threads)
    {
        attend_ctx c = {group, head_dim, block_size, rb, stride, scale, kv_type, d64,
                        (float*)malloc(sizeof(float) * run_rows * group * stride),
                        (float*)malloc(sizeof(float) * run_rows * group * head_dim),
                        (float*)malloc(sizeof(float) * head_dim)};
        float* mine = !by_part && max_parts > 1
                          ? (float*)malloc(sizeof(float) * run_rows * max_parts * slot)
                          : NULL;
        #pragma omp for schedule(dynamic, 4)
        for (int64_t task = 0; task < num_tasks; task++) {
            int64_t lo = 0, hi = runs;  /* the run: first[g] <= task < first[g + 1] */
            while (hi - lo > 1) {
                const int64_t mid = (lo + hi) / 2;
                if (first[mid] <= task) lo = mid; else hi = mid;
            }
            const int64_t g = lo, r0 = at[g], r1 = at[g + 1];
            const int64_t tasks_g = (first[g + 1] - first[g]) / num_kv;
            const int64_t h = (task - first[g]) / tasks_g;
            const int64_t run_parts = attn_parts(lens[r1 - 1], block_size);
            const int64_t* table = block_table + (r1 - 1) * table_stride;
            const char* kh = (const char*)k_cache + h * head_stride;
            const char* vh = (const char*)v_cache + h * head_stride;
            /* part p of the run: its rows that reach it (a suffix: lengths do not decrease) */
            const int64_t p_lo = by_part ? (task - first[g]) % tasks_g : 0;
            const int64_t p_hi = by_part ? p_lo + 1 : run_parts;
            for (int64_t p = p_lo; p < p_hi; p++) {
                attend_rows R;
                int64_t r = r0;
                while (attn_parts(lens[r], block_size) <= p) r++;
                R.count = r1 - r;
                R.q = q + r * q_row_stride + h * group * head_dim;
                R.q_stride = q_row_stride;
                for (int64_t i = 0; i < R.count; i++, r++) {
                    const int64_t parts = attn_parts(lens[r], block_size);
                    const int64_t rest = lens[r] - p * ATTN_PART;
                    R.n[i] = parts == 1 ? lens[r] : rest < ATTN_PART ? rest : ATTN_PART;
                    if (parts == 1) {
                        R.out[i] = out + r * out_row_stride + h * group * head_dim;
                        R.ml[i] = NULL;
                        continue;
                    }
                    R.out[i] = by_part ? parts_buf + (slots[r] + h * parts + p) * slot
                                       : mine + ((r - r0) * max_parts + p) * slot;
                    R.ml[i] = R.out[i] + group * head_dim;
                }
                attend_span(&c, &R, kh, vh, table + p * ATTN_PART / block_size);
            }
            if (!by_part)
                for (int64_t r = r0; r < r1; r++) {
                    const int64_t parts = attn_parts(lens[r], block_size);
                    if (parts > 1)
                        combine_parts(mine + (r - r0) * max_parts * slot, parts, slot, group,
                                      head_dim, c.acc,
                                      out + r * out_row_stride + h * group * head_dim);
                }
        }
        if (by_part) {
            #pragma omp for schedule(static)
            for (int64_t rh = 0; rh < num_reqs * num_kv; rh++) {
                const int64_t r = rh / num_kv, h = rh % num_kv;
                const int64_t parts = (slots[r + 1] - slots[r]) / num_kv;
                if (parts > 1)
                    combine_parts(parts_buf + (slots[r] + h * parts) * slot, parts, slot, group,
                                  head_dim, c.acc,
                                  out + r * out_row_stride + h * group * head_dim);
            }
        }
        free(c.scores);
        free(c.acc);
        free(c.row);
        free(mine);
    }
    free(parts_buf);
    free(slots);
    free(first);
    free(at);
}

/* ---- Linear layers over GGUF blocks (layout: common.h) ------------------------------------ */

void gguf_linear_i8(const float* x, int64_t x_row_stride, int64_t M, int64_t K,
                    const void* tiles, int kind, int64_t N, float* y, int64_t y_row_stride,
                    int num_threads);

void gguf_linear_f32(
    const float* x, int64_t x_row_stride, int64_t M, int64_t K,   /* x[M, K], rows may be strided */
    const void* tiles, int kind, int64_t N,                        /* W[N, K] as above */
    float* y, int64_t y_row_stride, int num_threads)               /* y[M, N] */
{
    if (kind >= KIND_Q4_G16) {  /* laid out for int8 activations only */
        gguf_linear_i8(x, x_row_stride, M, K, tiles, kind, N, y, y_row_stride, num_threads);
        return;
    }
    const int64_t nb = K / 32;
    const int64_t ntiles = (N + TILE_N - 1) / TILE_N;
    const int64_t tile_bytes = nb * TILE_N * block_bytes(kind);
    if (M > FEW_MAX_ROWS) {
        /* Many rows: expand each tile once into float32 (L1-sized) and multiply all rows by
           it; x is read in place, but for a last partial group of rows, copied zero-padded. */
        const int64_t full = M / GEMM_ROWS * GEMM_ROWS;
        float* tail = (float*)calloc(GEMM_ROWS * K, sizeof(float));
        for (int64_t r = full; r < M; r++)
            memcpy(tail + (r - full) * K, x + r * x_row_stride, sizeof(float) * K);
        #pragma omp parallel num_threads(num_threads)
        {
            float* w = (float*)malloc(sizeof(float) * TILE_N * K);
            #pragma omp for schedule(static)
            for (int64_t t = 0; t < ntiles; t++) {
                expand_tile((const char*)tiles + t * tile_bytes, kind, nb, K, w);
                const int64_t n0 = t * TILE_N, valid = N - n0 < TILE_N ? N - n0 : TILE_N;
                tile_gemm(w, x, x_row_stride, full, K, y, y_row_stride, n0, valid);
                if (full < M)
                    tile_gemm(w, tail, K, M - full, K, y + full * y_row_stride, y_row_stride, n0,
                              valid);
            }
            free(w);
        }
        free(tail);
        return;
    }
#if defined(SUM_MAX_ROWS)
    if (M <= SUM_MAX_ROWS) {
        /* x's rows made contiguous, and each block's sum as a pair [0, sum] */
        float* xs2 = (float*)malloc(sizeof(float) * 2 * M * nb);
        float* xc = (float*)malloc(sizeof(float) * M * K);
        for (int64_t r = 0; r < M; r++) {
            memcpy(xc + r * K, x + r * x_row_stride, sizeof(float) * K);
            for (int64_t b = 0; b < nb; b++) {
                float s = 0.f;
                for (int i = 0; i < 32; i++) s += xc[r * K + b * 32 + i];
                xs2[2 * (r * nb + b)] = 0.f;
                xs2[2 * (r * nb + b) + 1] = s;
            }
        }
        #pragma omp parallel for num_threads(num_threads) schedule(static)
        for (int64_t t = 0; t < ntiles; t++) {
            float out[TILE_N][SUM_MAX_ROWS];
            sum_rows((const char*)tiles + t * tile_bytes, kind, nb, xc, K, xs2, M, out);
            for (int j = 0; j < TILE_N && t * TILE_N + j < N; j++)
                for (int64_t r = 0; r < M; r++) y[r * y_row_stride + t * TILE_N + j] = out[j][r];
        }
        free(xs2);
        free(xc);
        return;
    }
#endif
#if FEW_MAX_ROWS > 0
    /* Few rows: each block expanded in registers for FEW_ROWS rows at a time, x in place. */
    #pragma omp parallel for num_threads(num_threads) schedule(static)
    for (int64_t t = 0; t < ntiles; t++) {
        const char* tile = (const char*)tiles + t * tile_bytes;
        for (int64_t r0 = 0; r0 < M; r0 += FEW_ROWS) {
            const int64_t rows = M - r0 < FEW_ROWS ? M - r0 : FEW_ROWS;
            float out[FEW_ROWS][TILE_N];
            few_rows(tile, kind, nb, x + r0 * x_row_stride, x_row_stride, rows, out);
            for (int64_t r = 0; r < rows; r++)
                for (int j = 0; j < TILE_N && t * TILE_N + j < N; j++)
                    y[(r0 + r) * y_row_stride + t * TILE_N + j] = out[r][j];
        }
    }
#endif
}

/* Rows ids[0..n) of a weight in tiles or laid out 16 wide, as float32 (out[i * K + k]): an
   embedding table kept only as blocks (the tied LM head's), looked up per step. The values of
   gguf's numpy dequantization, d q (+ m): d (a half: 11 significant bits) times q (at most 8)
   is exact in float32, so a fused d q + m rounds as the separate sum does. An id outside
   [0, N) gives zeros. */
void gguf_dequantize_rows_f32(const void* w, int kind, int64_t N, int64_t K, const int64_t* ids,
                              int64_t n, float* out)
{
    const int64_t nb = K / 32;
    const uint8_t* base = (const uint8_t*)w;
    for (int64_t i = 0; i < n; i++) {
        float* row = out + i * K;
        const int64_t id = ids[i];
        if (id < 0 || id >= N) {
            memset(row, 0, sizeof(float) * K);
            continue;
        }
        for (int64_t b = 0; b < nb; b++) {
            float* o = row + b * 32;
            uint16_t dh, mh = 0;
            uint8_t q[32];  /* Q4: 0..15; Q8: the int8 bits */
            int q8 = 0;
            if (kind == KIND_Q4 || kind == KIND_Q8) {
                const uint8_t* blk = base + ((id / TILE_N * nb + b) * TILE_N + id % TILE_N)
                                            * block_bytes(kind);
                memcpy(&dh, blk, 2);
                if (kind == KIND_Q4) {
                    memcpy(&mh, blk + 2, 2);
                    for (int k = 0; k < 16; k++) {
                        q[k] = blk[4 + k] & 15;
                        q[k + 16] = blk[4 + k] >> 4;
                    }
                } else {
                    memcpy(q, blk + 2, 32);
                    q8 = 1;
                }
            } else {
                const int64_t oo = id % G16;
                const uint8_t* blk = base + ((id / G16) * nb + b) * g16_block_bytes(kind);
                memcpy(&dh, blk + 2 * oo, 2);
                if (kind == KIND_Q4_G16) {
                    memcpy(&mh, blk + 32 + 2 * oo, 2);
                    for (int k = 0; k < 16; k++) {
                        const uint8_t byte = blk[64 + (k / 4) * 64 + 4 * oo + k % 4];
                        q[k] = byte & 15;
                        q[k + 16] = byte >> 4;
                    }
                } else {
                    for (int k = 0; k < 32; k++)
                        q[k] = (uint8_t)(blk[32 + (k / 4) * 64 + 4 * oo + k % 4] ^ 0x80);
                    q8 = 1;
                }
            }
            const float d = half_to_float(dh);
            if (q8) {
                for (int k = 0; k < 32; k++) o[k] = d * (float)(int8_t)q[k];
            } else {
                const float m = half_to_float(mh);
                for (int k = 0; k < 32; k++) o[k] = d * (float)q[k] + m;
            }
        }
    }
}

/* W[N, K] in float32 (row-major) from its tiles, as the many-row path above expands them: for
   products of many rows, the weight expanded once into a scratch buffer for oneDNN's GEMM. */
void gguf_dequantize_f32(const void* tiles, int kind, int64_t N, int64_t K, float* w,
                         int num_threads)
{
    if (kind >= KIND_Q4_G16) {  /* 16 wide (int8x2's many-row products): row by row */
        int64_t* ids = (int64_t*)malloc(sizeof(int64_t) * N);
        for (int64_t n = 0; n < N; n++) ids[n] = n;
        const int64_t chunk = 64;
        #pragma omp parallel for num_threads(num_threads) schedule(static)
        for (int64_t n0 = 0; n0 < N; n0 += chunk)
            gguf_dequantize_rows_f32(tiles, kind, N, K, ids + n0, N - n0 < chunk ? N - n0 : chunk,
                                     w + n0 * K);
        free(ids);
        return;
    }
    const int64_t nb = K / 32;
    const int64_t ntiles = (N + TILE_N - 1) / TILE_N;
    const int64_t tile_bytes = nb * TILE_N * block_bytes(kind);
    #pragma omp parallel num_threads(num_threads)
    {
        float* part = (float*)malloc(sizeof(float) * TILE_N * K);  /* a last partial tile */
        #pragma omp for schedule(static)
        for (int64_t t = 0; t < ntiles; t++) {
            const int64_t n0 = t * TILE_N, valid = N - n0 < TILE_N ? N - n0 : TILE_N;
            const char* tile = (const char*)tiles + t * tile_bytes;
            if (valid == TILE_N) {
                expand_tile(tile, kind, nb, K, w + n0 * K);
            } else {
                expand_tile(tile, kind, nb, K, part);
                memcpy(w + n0 * K, part, sizeof(float) * valid * K);
            }
        }
        free(part);
    }
}

/* Per-thread scratch that a decode step's calls reuse (grow-only, up to SCRATCH_MAX bytes a
   slot; larger asks are malloc'ed and the caller frees them: *owned). Freed each call, a
   step's buffers of more than glibc's trim threshold went back to the OS and came back as
   zeroed pages: 3-6% of a 64-row decode step in the kernel's clear_page. Kept: at most ~2.3
   MiB a thread (64 rows of the default model). */
enum { SCRATCH_XQ, SCRATCH_XDS, SCRATCH_DECODE, SCRATCH_SLOTS };
#define SCRATCH_MAX ((size_t)4 << 20)
static __thread void* scratch_buf[SCRATCH_SLOTS];
static __thread size_t scratch_cap[SCRATCH_SLOTS];

static void* scratch(int slot, size_t bytes, int* owned) {
    *owned = bytes > SCRATCH_MAX;
    if (*owned) return malloc(bytes);
    if (bytes > scratch_cap[slot]) {
        free(scratch_buf[slot]);
        scratch_buf[slot] = malloc(bytes);
        scratch_cap[slot] = bytes;
    }
    return scratch_buf[slot];
}

/* x's M rows as int8 blocks (int8.h, quantize_rows_q8): the quants, and in *xds the pairs
   (d, s); both malloc'ed, for the caller to free. */
static int8_t* quantized_rows(const float* x, int64_t x_row_stride, int64_t M, int64_t K,
                              float** xds) {
    int8_t* xq = (int8_t*)malloc((size_t)(M * K));
    *xds = (float*)malloc(sizeof(float) * 2 * M * (K / 32));
    quantize_rows_q8(x, x_row_stride, M, K, xq, *xds);
    return xq;
}

/* A G16 weight (common.h, int8_g16.h) against int8 activations, for every row count: each group
   of 16 outputs passes over G16_ROWS rows at a time while it stays in L1. A kind this level
   does not run 16 wide (Python never lays one out so) gives NaN. `parts`: 1, or 2 for each row
   as two int8 rows (quantize_row_q8_x2: rows 2r and 2r + 1, the row's blocks, then the blocks
   of what their rounding left, at most d / 2 an element), whose products are added. */
#define G16_BLOCK_BYTES (256 * 1024)  /* quantized rows a block: well inside Zen 4's 1 MB L2 */
#define G16_QUANTIZE_EACH 2  /* rows that every thread quantizes for itself (below) */

/* Row r of x into xq, xds: two int8 rows (parts == 2) or one. */
static inline void quantize_g16_row(const float* x, int64_t x_row_stride, int64_t K, int64_t nb,
                                    int parts, int64_t r, int8_t* xq, float* xds) {
    if (parts == 2)
        quantize_row_q8_x2(x + r * x_row_stride, K, xq + 2 * r * K, xds + 2 * 2 * r * nb);
    else
        quantize_rows_q8(x + r * x_row_stride, x_row_stride, 1, K, xq + r * K, xds + 2 * r * nb);
}

#if G16_KINDS
/* Whether a row of int8x2 makes one sum of its two int8 rows here (g16_x2_rows,
   g16_pair_rows) for this kind; how many 16-output groups a pass takes (2 where the level has
   g16_pair_rows: AVX-512 with vpdpbusd); how many of xq's rows a pass takes (a row of int8x2
   is two). */
static inline int g16_x2(int kind, int parts) {
#ifdef G16_X2_ROWS
    return parts == 2 && (G16_X2_KINDS >> (kind - KIND_Q4_G16) & 1);
#else
    (void)kind;
    (void)parts;
    return 0;
#endif
}

static inline int g16_width(void) {
#ifdef G16_PAIR_ROWS
    return 2;
#else
    return 1;
#endif
}

static inline int64_t g16_step(int kind, int parts) {
#if defined(G16_PAIR_ROWS)
    (void)kind;
    return parts == 2 ? 2 * G16_X2P_ROWS : G16_X1P_ROWS;
#elif defined(G16_X2_ROWS)
    return g16_x2(kind, parts) ? 2 * G16_X2_ROWS : G16_ROWS;
#else
    (void)kind;
    (void)parts;
    return G16_ROWS;
#endif
}

/* One pass: `rows` of xq's rows (g16_step) against `span` groups (g16_width) at grp, into y
   (that pass's first row and group; `valid` of its outputs). */
static void g16_pass(const char* grp, int64_t group_bytes, int span, int kind, int64_t nb,
                     const int8_t* xq, int64_t K, const float* xds, int64_t rows, int parts,
                     float* y, int64_t y_row_stride, int64_t valid) {
#ifdef G16_PAIR_ROWS
    if (span == 2) {
        float out[G16_PAIR_ROWS][2 * G16];
        g16_pair_rows(grp, group_bytes, kind, parts, nb, xq, K, xds, rows / parts, out);
        for (int64_t r = 0; r < rows / parts; r++) memcpy(y + r * y_row_stride, out[r], sizeof(float) * valid);
        return;
    }
#else
    (void)group_bytes;
    (void)span;
#endif
#ifdef G16_X2_ROWS
    if (g16_x2(kind, parts)) {  /* (at AVX-512 with vpdpbusd: a lone last group) */
        float out[G16_X2_ROWS][G16];
        g16_x2_rows(grp, kind, nb, xq, K, xds, rows / 2, out);
        for (int64_t r = 0; r < rows / 2; r++) memcpy(y + r * y_row_stride, out[r], sizeof(float) * valid);
        return;
    }
#endif
    float out[G16_ROWS][G16];
    g16_rows(grp, kind, nb, xq, K, xds, rows, out);
    if (parts == 1) {
        for (int64_t r = 0; r < rows; r++) memcpy(y + r * y_row_stride, out[r], sizeof(float) * valid);
    } else {  /* a row's two int8 rows, added */
        for (int64_t r = 0; r < rows; r += 2)
            for (int64_t n = 0; n < valid; n++) y[r / 2 * y_row_stride + n] = out[r][n] + out[r + 1][n];
    }
}
#endif

static void gguf_linear_g16(const float* x, int64_t x_row_stride, int64_t M, int64_t K,
                            const void* w, int kind, int64_t N, float* y, int64_t y_row_stride,
                            int num_threads, int parts)
{
    if (!(G16_KINDS & (1 << (kind - KIND_Q4_G16)))) {
        for (int64_t r = 0; r < M; r++)
            for (int64_t n = 0; n < N; n++) y[r * y_row_stride + n] = NAN;
        return;
    }
#if G16_KINDS
    const int64_t nb = K / 32, ngroups = (N + G16 - 1) / G16;
    const int64_t group_bytes = nb * g16_block_bytes(kind);
    const int64_t R = parts * M;  /* G16_ROWS is even: a row's two parts share a pass */
    /* The rows are quantized by the same threads, a row each (the same bits as one thread's
       loop), into the calling thread's scratch (a decode step's sizes: kept, not a malloc,
       munmap and page faults a call). At G16_QUANTIZE_EACH rows or fewer (a decode step of
       one or two requests) every thread quantizes them all into its own scratch instead:
       the same bits, and no barrier between the quantization and the products (each barrier
       a few microseconds, and a single-stream step has 120 such calls). */
    const int each = M <= G16_QUANTIZE_EACH;
    int own_q = 0, own_d = 0;
    int8_t* const xq_shared = each ? NULL : (int8_t*)scratch(SCRATCH_XQ, (size_t)(R * K), &own_q);
    float* const xds_shared =
        each ? NULL : (float*)scratch(SCRATCH_XDS, sizeof(float) * 2 * R * nb, &own_d);
    #pragma omp parallel num_threads(num_threads)
    {
        int8_t* xq = xq_shared;
        float* xds = xds_shared;
        int own_tq = 0, own_td = 0;
        if (each) {  /* (the same for every thread: all of them take the omp for or none) */
            xq = (int8_t*)scratch(SCRATCH_XQ, (size_t)(R * K), &own_tq);
            xds = (float*)scratch(SCRATCH_XDS, sizeof(float) * 2 * R * nb, &own_td);
            for (int64_t r = 0; r < M; r++)
                quantize_g16_row(x, x_row_stride, K, nb, parts, r, xq, xds);
        } else {
            #pragma omp for schedule(static)
            for (int64_t r = 0; r < M; r++)
                quantize_g16_row(x, x_row_stride, K, nb, parts, r, xq, xds);
        }
        /* A prefill's quantized rows (2,048 rows of int8x2 at K = 576: 2.4 MB) outgrow L2,
           and every 16-output group reads them all again: past G16_BLOCK_BYTES they go in
           blocks of whole passes (the same passes, so the same bits), each block over every
           group while it stays in L2; the groups (a few KB each) are read once a block. */
        const int width = g16_width();
        const int64_t step = g16_step(kind, parts), ntasks = (ngroups + width - 1) / width;
        int64_t block = (G16_BLOCK_BYTES / K) / step * step;
        if (block < step) block = step;
        for (int64_t b0 = 0; b0 < R; b0 += block) {
        const int64_t b1 = R - b0 < block ? R : b0 + block;
        const int64_t passes = (b1 - b0 + step - 1) / step;
        #pragma omp for schedule(static)
        for (int64_t t = 0; t < ntasks; t++) {
            const int64_t g = t * width;
            const char* grp = (const char*)w + g * group_bytes;
            const int span = ngroups - g < width ? (int)(ngroups - g) : width;
            const int64_t valid = N - g * G16 < span * G16 ? N - g * G16 : span * G16;
            for (int64_t r0 = b0; r0 < b1; r0 += step) {
                const int64_t rows = b1 - r0 < step ? b1 - r0 : step;
                /* Passes after the first read the task's groups from L1 and ask nothing of
                   memory (no miss trains the hardware's prefetcher), so they ask for a share
                   of the next task's each, which then streams in beside their arithmetic. */
                const int64_t pass = (r0 - b0) / step;
                if (pass > 0 && t + 1 < ntasks) {  /* (a lone last group: its bytes only) */
                    const int64_t next = (ngroups - g - span < width ? ngroups - g - span : width) * group_bytes;
                    const int64_t from = (pass - 1) * next / (passes - 1);
                    const int64_t to = pass * next / (passes - 1);
                    for (int64_t off = from & ~(int64_t)63; off < to; off += 64)
                        __builtin_prefetch(grp + span * group_bytes + off, 0, 2);
                }
                g16_pass(grp, group_bytes, span, kind, nb, xq + r0 * K, K, xds + 2 * r0 * nb, rows,
                         parts, y + r0 / parts * y_row_stride + g * G16, y_row_stride, valid);
            }
        }
        }
        if (own_tq) free(xq);
        if (own_td) free(xds);
    }
    if (own_q) free(xq_shared);
    if (own_d) free(xds_shared);
#endif
}

/* The same product with x's rows quantized to int8 blocks of 32 (int8.h), up to I8_MAX_ROWS
   rows (beyond: gguf_linear_f32): rows go I8_ROWS at a time over a tile that stays in L1. */
void gguf_linear_i8(
    const float* x, int64_t x_row_stride, int64_t M, int64_t K,
    const void* tiles, int kind, int64_t N,
    float* y, int64_t y_row_stride, int num_threads)
{
    if (kind >= KIND_Q4_G16) {
        gguf_linear_g16(x, x_row_stride, M, K, tiles, kind, N, y, y_row_stride, num_threads, 1);
        return;
    }
    if (M > I8_MAX_ROWS) {
        gguf_linear_f32(x, x_row_stride, M, K, tiles, kind, N, y, y_row_stride, num_threads);
        return;
    }
    const int64_t nb = K / 32;
    const int64_t ntiles = (N + TILE_N - 1) / TILE_N;
    const int64_t tile_bytes = nb * TILE_N * block_bytes(kind);
    float* xds;
    int8_t* xq = quantized_rows(x, x_row_stride, M, K, &xds);
    #pragma omp parallel for num_threads(num_threads) schedule(static)
    for (int64_t t = 0; t < ntiles; t++) {
        const char* tile = (const char*)tiles + t * tile_bytes;
        for (int64_t r0 = 0; r0 < M; r0 += I8_ROWS) {
            const int64_t rows = M - r0 < I8_ROWS ? M - r0 : I8_ROWS;
            float out[TILE_N][I8_ROWS];
            tile_rows_i8(tile, kind, nb, xq + r0 * K, K, xds + 2 * r0 * nb, rows, out);
            for (int j = 0; j < TILE_N && t * TILE_N + j < N; j++)
                for (int64_t r = 0; r < rows; r++) y[(r0 + r) * y_row_stride + t * TILE_N + j] = out[j][r];
        }
    }
    free(xq);
    free(xds);
}

/* The same with each row as two int8 rows, its blocks and their rounding's (quantize_row_q8_x2):
   nearly float32's products at int8's speed on few rows. Weights not laid out 16 wide take the
   float32 product. */
void gguf_linear_i8x2(
    const float* x, int64_t x_row_stride, int64_t M, int64_t K,
    const void* tiles, int kind, int64_t N,
    float* y, int64_t y_row_stride, int num_threads)
{
    if (kind >= KIND_Q4_G16)
        gguf_linear_g16(x, x_row_stride, M, K, tiles, kind, N, y, y_row_stride, num_threads, 2);
    else
        gguf_linear_f32(x, x_row_stride, M, K, tiles, kind, N, y, y_row_stride, num_threads);
}

/* ---- The small per-layer operations -------------------------------------------------------

   Each is a handful of PyTorch ops (RMSNorm alone is five), and at decode sizes every op costs
   more in dispatch than in arithmetic. One call each here; rows in parallel only when there
   are enough of them to pay for waking the other threads. */

#define PARALLEL_MIN_FLOATS 32768

static inline float rms_scale(const float* x, int64_t n, float eps) {
    float s = 0.f;
    #pragma omp simd reduction(+:s)
    for (int64_t i = 0; i < n; i++) s += x[i] * x[i];
    return 1.f / sqrtf(s / (float)n + eps);
}

/* out = x / rms(x) * w, row by row. */
void rms_norm_f32(const float* x, int64_t x_stride, int64_t rows, int64_t n, const float* w,
                  float eps, float* out, int64_t out_stride, int num_threads) {
    #pragma omp parallel for num_threads(num_threads) if (rows * n >= PARALLEL_MIN_FLOATS)
    for (int64_t r = 0; r < rows; r++) {
        const float* xr = x + r * x_stride;
        float* o = out + r * out_stride;
        const float s = rms_scale(xr, n, eps);
        #pragma omp simd
        for (int64_t i = 0; i < n; i++) o[i] = w[i] * (xr[i] * s);
    }
}

/* residual += y, then out = rms_norm(residual) * w: the residual stream between sublayers. */
void add_rms_norm_f32(float* residual, const float* y, int64_t rows, int64_t n, const float* w,
                      float eps, float* out, int num_threads) {
    #pragma omp parallel for num_threads(num_threads) if (rows * n >= PARALLEL_MIN_FLOATS)
    for (int64_t r = 0; r < rows; r++) {
        float* xr = residual + r * n;
        const float* yr = y + r * n;
        float* o = out + r * n;
        #pragma omp simd
        for (int64_t i = 0; i < n; i++) xr[i] += yr[i];
        const float s = rms_scale(xr, n, eps);
        #pragma omp simd
        for (int64_t i = 0; i < n; i++) o[i] = w[i] * (xr[i] * s);
    }
}

/* Neox-style rotary embedding in place: x[r, h, :] of `heads` heads of size d at
   x + r * row_stride + h * d; cos/sin are [rows, d], the rows' positions already looked up. */
void rope_f32(float* x, int64_t row_stride, int64_t rows, int64_t heads, int64_t d,
              const float* cos, const float* sin, int num_threads) {
    const int64_t half = d / 2;
    #pragma omp parallel for num_threads(num_threads) if (rows * heads * d >= PARALLEL_MIN_FLOATS)
    for (int64_t r = 0; r < rows; r++) {
        const float* c = cos + r * d;
        const float* s = sin + r * d;
        for (int64_t h = 0; h < heads; h++) {
            float* a = x + r * row_stride + h * d;
            float* b = a + half;
            #pragma omp simd
            for (int64_t i = 0; i < half; i++) {
                const float x1 = a[i], x2 = b[i];
                a[i] = x1 * c[i] - x2 * s[i];
                b[i] = x2 * c[i + half] + x1 * s[i + half];
            }
        }
    }
}

/* out[r, :] = silu(gate) * up, with gate_up[r] = [gate | up], each n wide. */
void silu_and_mul_f32(const float* gate_up, int64_t rows, int64_t n, float* out,
                      int num_threads) {
    #pragma omp parallel for num_threads(num_threads) if (rows * n >= PARALLEL_MIN_FLOATS)
    for (int64_t r = 0; r < rows; r++) {
        const float* g = gate_up + r * 2 * n;
        const float* u = g + n;
        float* o = out + r * n;
        #pragma omp simd
        for (int64_t i = 0; i < n; i++) {
            const float e = exp_nonpositive(-fabsf(g[i]));   /* exp(-|g|), never overflows */
            const float sig = g[i] >= 0.f ? 1.f / (1.f + e) : e / (1.f + e);
            o[i] = g[i] * sig * u[i];
        }
    }
}

/* LoRA updates of a step's rows (model/lora.py). Slot s of a layer holds its adapter's
   A [shards * rank, in] (shard k's rows from k * rank) and B^T [rank, n_out] (scaled), float32,
   bfloat16 or int8 (`wtype` LORA_F32, _BF16, _I8: int8 rows with a float scale each, A's per
   row in a_scale [slots, shards * rank], B^T's per tiled block's row in b_scale [slots, blocks,
   rank]); a packed layer's outputs are its shards' columns side by side (shard k
   ends at column shard_end[k]), and each column takes its own shard's rank rows only (B of a
   packed layer is block-diagonal: only those blocks are kept). Row r with slot[r] >= 0 gets
   out[r, c] += sum_j (x[r] . A[s, k rank + j]) B^T[s, j, c], c in shard k; a row of the base
   model (slot -1) is left alone. The rows are taken slot by slot, so that each slot's weights
   are read from memory once a step, however many rows use them: at a decode step's few rows
   the update is bound by those reads, not by its arithmetic. */
#define LORA_COLS 64  /* the columns of B^T one work item updates */
enum { LORA_F32 = 0, LORA_BF16 = 1, LORA_I8 = 2 };

/* h[r, k] = x[r] . A[k] and h[r, k + 1] = x[r] . A[k + 1] (`pair`: else A[k] only) for the
   rows `rs`, 4 at a time: each read of the two rows of A serves 8 products. */
static inline void lora_shrink_rows(const float* x, int64_t x_stride, const int64_t* rs,
                                    int64_t n, const void* a_row, int pair, int wtype,
                                    const float* a_scale, int64_t in, float* h,
                                    int64_t h_stride) {
    const float* restrict a32 = (const float*)a_row;
    const uint16_t* restrict a16 = (const uint16_t*)a_row;
    const int8_t* restrict a8 = (const int8_t*)a_row;
    const int64_t next = pair ? in : 0;  /* (no pair: the same row twice, its sums dropped) */
    for (int64_t g = 0; g < n; g += 4) {
        const int64_t t = n - g < 4 ? n - g : 4;
        const float* restrict x0 = x + rs[g] * x_stride;
        const float* restrict x1 = x + rs[g + (t > 1)] * x_stride;
        const float* restrict x2 = x + rs[g + (t > 2) * 2] * x_stride;
        const float* restrict x3 = x + rs[g + (t > 3) * 3] * x_stride;
        float s0 = 0.f, s1 = 0.f, s2 = 0.f, s3 = 0.f, u0 = 0.f, u1 = 0.f, u2 = 0.f, u3 = 0.f;
        if (wtype == LORA_I8) {
            #pragma omp simd reduction(+ : s0, s1, s2, s3, u0, u1, u2, u3)
            for (int64_t i = 0; i < in; i++) {
                const float w = (float)a8[i], z = (float)a8[next + i];
                s0 += x0[i] * w; s1 += x1[i] * w; s2 += x2[i] * w; s3 += x3[i] * w;
                u0 += x0[i] * z; u1 += x1[i] * z; u2 += x2[i] * z; u3 += x3[i] * z;
            }
            const float sa = a_scale[0], sz = a_scale[pair ? 1 : 0];
            s0 *= sa; s1 *= sa; s2 *= sa; s3 *= sa; u0 *= sz; u1 *= sz; u2 *= sz; u3 *= sz;
        } else if (wtype == LORA_BF16) {
            #pragma omp simd reduction(+ : s0, s1, s2, s3, u0, u1, u2, u3)
            for (int64_t i = 0; i < in; i++) {
                const float w = bf16_to_float(a16[i]), z = bf16_to_float(a16[next + i]);
                s0 += x0[i] * w; s1 += x1[i] * w; s2 += x2[i] * w; s3 += x3[i] * w;
                u0 += x0[i] * z; u1 += x1[i] * z; u2 += x2[i] * z; u3 += x3[i] * z;
            }
        } else {
            #pragma omp simd reduction(+ : s0, s1, s2, s3, u0, u1, u2, u3)
            for (int64_t i = 0; i < in; i++) {
                const float w = a32[i], z = a32[next + i];
                s0 += x0[i] * w; s1 += x1[i] * w; s2 += x2[i] * w; s3 += x3[i] * w;
                u0 += x0[i] * z; u1 += x1[i] * z; u2 += x2[i] * z; u3 += x3[i] * z;
            }
        }
        const float sk[4] = {s0, s1, s2, s3}, uk[4] = {u0, u1, u2, u3};
        for (int64_t e = 0; e < t; e++) {
            h[rs[g + e] * h_stride] = sk[e];
            if (pair) h[rs[g + e] * h_stride + 1] = uk[e];
        }
    }
}

/* out[r, p:q] += h[r, 0:rank] B for the rows `rs`, with B's row j at b + j * b_stride
   (columns p:q of it at b[p - c0 .. q - c0)): two rows of out at a time, 4 rows of B per
   pass over them (each read of B serves 8 products). */
static inline void lora_expand_rows(const float* h, int64_t h_stride, const int64_t* rs,
                                    int64_t n, const float* b, int64_t b_stride, int64_t rank,
                                    int64_t p, int64_t q, int64_t c0, float* out,
                                    int64_t out_stride) {
    for (int64_t u = 0; u < n; u += 2) {
        const int64_t v = u + 1 < n ? u + 1 : u;  /* (an odd last row pairs with itself) */
        const float* hr = h + rs[u] * h_stride;
        const float* hs = h + rs[v] * h_stride;
        float* restrict o = out + rs[u] * out_stride;
        float* restrict o2 = out + rs[v] * out_stride;
        const int pair = v != u;
        int64_t j = 0;
        for (; j + 4 <= rank; j += 4) {
            const float h0 = hr[j], h1 = hr[j + 1], h2 = hr[j + 2], h3 = hr[j + 3];
            const float g0 = hs[j] * pair, g1 = hs[j + 1] * pair, g2 = hs[j + 2] * pair,
                        g3 = hs[j + 3] * pair;
            const float* restrict b0 = b + j * b_stride - c0;
            const float* restrict b1 = b0 + b_stride;
            const float* restrict b2 = b1 + b_stride;
            const float* restrict b3 = b2 + b_stride;
            if (pair) {
                #pragma omp simd
                for (int64_t c = p; c < q; c++) {
                    o[c] += h0 * b0[c] + h1 * b1[c] + h2 * b2[c] + h3 * b3[c];
                    o2[c] += g0 * b0[c] + g1 * b1[c] + g2 * b2[c] + g3 * b3[c];
                }
            } else {
                #pragma omp simd
                for (int64_t c = p; c < q; c++)
                    o[c] += h0 * b0[c] + h1 * b1[c] + h2 * b2[c] + h3 * b3[c];
            }
        }
        for (; j < rank; j++) {
            const float hj = hr[j], gj = hs[j];
            const float* restrict bj = b + j * b_stride - c0;
            #pragma omp simd
            for (int64_t c = p; c < q; c++) o[c] += hj * bj[c];
            if (pair) {
                #pragma omp simd
                for (int64_t c = p; c < q; c++) o2[c] += gj * bj[c];
            }
        }
    }
}

void lora_apply_sharded(const float* x, int64_t x_stride, int64_t rows, const int64_t* slot,
                        const void* a, const void* b_t, int wtype, int tiled,
                        const float* a_scale, const float* b_scale, int64_t in, int64_t rank,
                        int64_t shards, const int64_t* shard_end, int64_t n_out, float* out,
                        int64_t out_stride, int num_threads) {
    const int64_t w = shards * rank;
    const size_t wsize = wtype == LORA_I8 ? 1 : wtype == LORA_BF16 ? 2 : sizeof(float);
    if (wtype == LORA_I8 && (!tiled || a_scale == NULL || b_scale == NULL)) return;
    int64_t num_slots = 0, used = 0;
    for (int64_t r = 0; r < rows; r++)
        if (slot[r] >= num_slots) num_slots = slot[r] + 1;
    if (num_slots == 0) return;
    /* the rows grouped by slot: rows of slot s at order[start[s] .. start[s + 1]) */
    int64_t* order = (int64_t*)malloc(sizeof(int64_t) * (size_t)(rows + 2 * num_slots + 1));
    float* h = (float*)malloc(sizeof(float) * (size_t)(rows * w));
    if (order == NULL || h == NULL) { free(order); free(h); return; }
    int64_t* start = order + rows;                 /* [num_slots + 1] */
    int64_t* slots_used = start + num_slots + 1;   /* [used] */
    for (int64_t s = 0; s <= num_slots; s++) start[s] = 0;
    for (int64_t r = 0; r < rows; r++)
        if (slot[r] >= 0) start[slot[r] + 1]++;
    for (int64_t s = 0; s < num_slots; s++) {
        if (start[s + 1] > 0) slots_used[used++] = s;
        start[s + 1] += start[s];
    }
    {
        int64_t* fill = (int64_t*)malloc(sizeof(int64_t) * (size_t)num_slots);
        if (fill == NULL) { free(order); free(h); return; }
        memcpy(fill, start, sizeof(int64_t) * (size_t)num_slots);
        for (int64_t r = 0; r < rows; r++)
            if (slot[r] >= 0) order[fill[slot[r]]++] = r;
        free(fill);
    }
    const int64_t blocks = (n_out + LORA_COLS - 1) / LORA_COLS;
    const int64_t work = (rows * w * in + rows * rank * n_out) / 4;
    #pragma omp parallel num_threads(num_threads) if (work >= PARALLEL_MIN_FLOATS)
    {
        const int64_t pairs = (w + 1) / 2;  /* rows of A two at a time */
        #pragma omp for schedule(static)
        for (int64_t item = 0; item < used * pairs; item++) {
            const int64_t s = slots_used[item / pairs], k = (item % pairs) * 2;
            const char* a_row = (const char*)a + ((size_t)(s * w + k) * (size_t)in) * wsize;
            lora_shrink_rows(x, x_stride, order + start[s], start[s + 1] - start[s], a_row,
                             k + 1 < w, wtype, a_scale + s * w + k, in, h + k, w);
        }
        float* scratch = wtype != LORA_F32
                             ? (float*)malloc(sizeof(float) * (size_t)(rank * LORA_COLS)) : NULL;
        #pragma omp for schedule(static)
        for (int64_t item = 0; item < used * blocks; item++) {
            const int64_t s = slots_used[item / blocks];
            const int64_t c0 = (item % blocks) * LORA_COLS;
            const int64_t c1 = c0 + LORA_COLS < n_out ? c0 + LORA_COLS : n_out;
            /* B^T's block: rows n_out apart, or (tiled) the block's rank x LORA_COLS in one
               piece, the blocks of a slot one after another (the last one padded) */
            const size_t first = tiled ? (size_t)(s * blocks + item % blocks) * rank * LORA_COLS
                                       : (size_t)(s * rank * n_out + c0);
            const int64_t stride = tiled ? LORA_COLS : n_out;
            const float* bb = (const float*)b_t + first;
            int64_t b_stride = stride;
            if (wtype != LORA_F32) {  /* the block as float32 */
                if (scratch == NULL) continue;
                const uint16_t* src = (const uint16_t*)b_t + first;
                const int8_t* src8 = (const int8_t*)b_t + first;
                const float* scale = b_scale + (s * blocks + item % blocks) * rank;
                for (int64_t j = 0; j < rank; j++) {
                    float* dst = scratch + j * LORA_COLS;
                    if (wtype == LORA_I8) {
                        const float sj = scale[j];
                        #pragma omp simd
                        for (int64_t c = 0; c < c1 - c0; c++)
                            dst[c] = (float)src8[j * stride + c] * sj;
                    } else {
                        #pragma omp simd
                        for (int64_t c = 0; c < c1 - c0; c++)
                            dst[c] = bf16_to_float(src[j * stride + c]);
                    }
                }
                bb = scratch, b_stride = LORA_COLS;
            }
            int64_t p = c0, k = 0;
            while (p < c1) {  /* the block's pieces, one per shard it spans */
                while (k < shards - 1 && shard_end[k] <= p) k++;
                const int64_t q = shard_end[k] < c1 && k < shards - 1 ? shard_end[k] : c1;
                lora_expand_rows(h + k * rank, w, order + start[s], start[s + 1] - start[s], bb,
                                 b_stride, rank, p, q, c0, out, out_stride);
                p = q;
            }
        }
        free(scratch);
    }
    free(order); free(h);
}

/* The same for one shard of float32 weights: A [slots, w, in], B^T [slots, w, n_out]. */
void lora_apply_f32(const float* x, int64_t x_stride, int64_t rows, const int64_t* slot,
                    const float* a, const float* b_t, int64_t in, int64_t w, int64_t n_out,
                    float* out, int64_t out_stride, int num_threads) {
    lora_apply_sharded(x, x_stride, rows, slot, a, b_t, LORA_F32, 0, NULL, NULL, in, w, 1,
                       &n_out, n_out, out, out_stride, num_threads);
}

/* The new tokens' K and V into the paged cache: caches [num_kv, slots] rows of head size d
   and type kv_type (common.h), row t of k and v (num_kv heads of size d each, rows k_stride
   and v_stride apart) to slot slots[t], converted (rounded, or quantized) on the way. */
void write_kv_f32(const float* k, const float* v, int64_t k_stride, int64_t v_stride,
                  int64_t rows, int64_t num_kv, int64_t d, const int64_t* slots, void* k_cache,
                  void* v_cache, int64_t num_slots, int kv_type) {
    const int64_t rb = kv_row_bytes(kv_type, d);
    for (int64_t t = 0; t < rows; t++)
        for (int64_t h = 0; h < num_kv; h++) {
            const int64_t dst = (h * num_slots + slots[t]) * rb;
            kv_store_row((char*)k_cache + dst, k + t * k_stride + h * d, kv_type, d);
            kv_store_row((char*)v_cache + dst, v + t * v_stride + h * d, kv_type, d);
        }
}

/* Structured outputs, in place: logits[rows[i], t] = -inf where bit t of the int32 bitmask row
   i is clear (bit t % 32 of word t / 32; tokens at or past 32 * words are never allowed). A row
   whose allowed tokens were all -inf already (other bans took every one) becomes 0 where the
   mask allows and -inf elsewhere: the constraint alone decides. Whole words are the common
   case (a JSON string allows almost every token, a JSON structure almost none), so they are
   filled or skipped without looking at their bits. */
void apply_token_bitmask_f32(float* logits, int64_t row_stride, const int64_t* rows,
                             int64_t n_rows, const int32_t* mask, int64_t words, int64_t vocab,
                             int num_threads) {
    #pragma omp parallel for num_threads(num_threads) if (n_rows * vocab >= PARALLEL_MIN_FLOATS)
    for (int64_t i = 0; i < n_rows; i++) {
        float* x = logits + rows[i] * row_stride;
        const uint32_t* m = (const uint32_t*)(mask + i * words);
        int any = 0;  /* an allowed token keeps a finite logit */
        for (int64_t w = 0; w * 32 < vocab; w++) {
            const uint32_t bits = w < words ? m[w] : 0u;
            float* xw = x + w * 32;
            const int64_t n = vocab - w * 32 < 32 ? vocab - w * 32 : 32;
            if (bits == 0u) {
                for (int64_t k = 0; k < n; k++) xw[k] = -INFINITY;
                continue;
            }
            if (bits == 0xffffffffu && any) continue;
            for (int64_t k = 0; k < n; k++) {
                if ((bits >> k) & 1u) any |= xw[k] != -INFINITY;
                else xw[k] = -INFINITY;
            }
        }
        if (!any)
            for (int64_t t = 0; t < vocab; t++) {
                const int64_t w = t >> 5;
                x[t] = w < words && ((m[w] >> (t & 31)) & 1u) ? 0.f : -INFINITY;
            }
    }
}

/* ---- A whole decode step's decoder layers in one call ---------------------------------------

   What the model's modules do for a step of M decode tokens (M <= the GGUF kernel's rows),
   run here as one call instead of ~12 Python-to-C calls per layer: at one request the Python
   dispatch cost as much as the arithmetic (a CPU's answer to a CUDA graph). Each step is the
   same C function the modules call, in the same order, so the results are the same bits.
   For each layer, with the residual stream r (r = the embeddings at the first layer):

       h = RMSNorm(r) | r += x, h = RMSNorm(r)         input norm (x: the previous MLP out)
       q, k, v = h Wqkv (+ b); RoPE(q, k); cache <- k, v; a = attention(q, cache)
       r += a Wo, h = RMSNorm(r)                        post-attention norm
       x = (silu(h Wgate) * h Wup) Wdown

   and after the last layer out = RMSNorm(r + x) (the final norm). The linear layers are
   gguf_linear_f32 or, with int8_activations, gguf_linear_i8. */

typedef struct {
    const float* input_norm;
    const float* post_norm;
    const void* qkv;        /* tiles of each linear layer, and their block kinds */
    const void* o;
    const void* gate_up;
    const void* down;
    const float* qkv_bias;  /* or NULL */
    void* k_cache;          /* [num_kv, num_blocks, block_size] rows of kv_type (common.h) */
    void* v_cache;
    int32_t qkv_kind, o_kind, gate_up_kind, down_kind;
    /* LoRA slots of each linear layer (model/lora.py's LoRALayer: A, B^T in tiles, each
       shard's end column; rank), or NULL; read only when decode_model.lora_slot is set */
    const void *qkv_lora_a, *qkv_lora_b, *o_lora_a, *o_lora_b;
    const void *gate_up_lora_a, *gate_up_lora_b, *down_lora_a, *down_lora_b;
    const int64_t *qkv_lora_ends, *o_lora_ends, *gate_up_lora_ends, *down_lora_ends;
    const float *qkv_lora_as, *o_lora_as, *gate_up_lora_as, *down_lora_as;  /* (int8) scales */
    const float *qkv_lora_bs, *o_lora_bs, *gate_up_lora_bs, *down_lora_bs;
    int64_t qkv_lora_rank, o_lora_rank, gate_up_lora_rank, down_lora_rank;
    int64_t qkv_lora_shards, o_lora_shards, gate_up_lora_shards, down_lora_shards;
} decode_layer;

typedef struct {
    int64_t hidden, heads, kv_heads, head_dim, intermediate, num_layers;
    int64_t num_blocks, block_size;
    float eps, scale;
    const float* final_norm;
    int32_t int8_activations;  /* the linear layers on gguf_linear_i8 (1), _i8x2 (2), or _f32 */
    int32_t kv_type;           /* the KV cache's rows (common.h's KV_*) */
    const int64_t* lora_slot;  /* [M] each row's LoRA slot (-1: none), or NULL: no adapters */
    int32_t lora_wtype;        /* the LoRA slots' LORA_F32, _BF16 or _I8 */
} decode_model;

/* A linear layer's LoRA updates, where the step has adapters and the layer holds slots. */
#define DECODE_LORA(m, L, name, in, in_dim, M, out, out_dim, num_threads)                     \
    do {                                                                                      \
        if ((m)->lora_slot != NULL && (L)->name##_lora_a != NULL)                             \
            lora_apply_sharded(in, in_dim, M, (m)->lora_slot, (L)->name##_lora_a,             \
                               (L)->name##_lora_b, (m)->lora_wtype, 1, (L)->name##_lora_as,   \
                               (L)->name##_lora_bs, in_dim,                                   \
                               (L)->name##_lora_rank, (L)->name##_lora_shards,                \
                               (L)->name##_lora_ends, out_dim, out, out_dim, num_threads);    \
    } while (0)

void decode_layers_f32(
    const decode_model* m, const decode_layer* layers,
    const float* emb, int64_t M,                    /* [M, hidden]: the tokens' embeddings */
    const float* cos, const float* sin,             /* [M, head_dim]: their positions' rows */
    const int64_t* slots,                           /* [M] where each token's K/V goes */
    const int64_t* block_table, int64_t table_stride, const int32_t* lens, int64_t max_len,
    float* out, int num_threads)                    /* [M, hidden]: the final norm's output */
{
    const int64_t H = m->hidden, d = m->head_dim, I = m->intermediate;
    const int64_t q_size = m->heads * d, kv_size = m->kv_heads * d;
    const int64_t qkv_size = q_size + 2 * kv_size;
    int owned;
    float* const buf = (float*)scratch(
        SCRATCH_DECODE, sizeof(float) * M * (3 * H + qkv_size + q_size + 3 * I), &owned);
    float* residual = buf;
    float* h = residual + M * H;
    float* x = h + M * H;
    float* qkv = x + M * H;
    float* attn = qkv + M * qkv_size;
    float* gate_up = attn + M * q_size;
    float* act = gate_up + M * 2 * I;
    void (*const linear)(const float*, int64_t, int64_t, int64_t, const void*, int, int64_t,
                         float*, int64_t, int) =
        m->int8_activations == 2 ? gguf_linear_i8x2
        : m->int8_activations ? gguf_linear_i8 : gguf_linear_f32;
    memcpy(residual, emb, sizeof(float) * M * H);
    for (int64_t l = 0; l < m->num_layers; l++) {
        const decode_layer* L = layers + l;
        if (l == 0) rms_norm_f32(residual, H, M, H, L->input_norm, m->eps, h, H, num_threads);
        else add_rms_norm_f32(residual, x, M, H, L->input_norm, m->eps, h, num_threads);
        linear(h, H, M, H, L->qkv, L->qkv_kind, qkv_size, qkv, qkv_size, num_threads);
        DECODE_LORA(m, L, qkv, h, H, M, qkv, qkv_size, num_threads);
        if (L->qkv_bias)
            for (int64_t r = 0; r < M; r++)
                for (int64_t i = 0; i < qkv_size; i++) qkv[r * qkv_size + i] += L->qkv_bias[i];
        rope_f32(qkv, qkv_size, M, m->heads, d, cos, sin, num_threads);
        rope_f32(qkv + q_size, qkv_size, M, m->kv_heads, d, cos, sin, num_threads);
        write_kv_f32(qkv + q_size, qkv + q_size + kv_size, qkv_size, qkv_size, M, m->kv_heads, d,
                     slots, L->k_cache, L->v_cache, m->num_blocks * m->block_size, m->kv_type);
        paged_decode_attention_f32(qkv, qkv_size, L->k_cache, L->v_cache, block_table,
                                   table_stride, lens, attn, q_size, M, m->heads, m->kv_heads, d,
                                   m->num_blocks, m->block_size, m->scale, max_len, num_threads,
                                   m->kv_type);
        linear(attn, q_size, M, q_size, L->o, L->o_kind, H, x, H, num_threads);
        DECODE_LORA(m, L, o, attn, q_size, M, x, H, num_threads);
        add_rms_norm_f32(residual, x, M, H, L->post_norm, m->eps, h, num_threads);
        linear(h, H, M, H, L->gate_up, L->gate_up_kind, 2 * I, gate_up, 2 * I,
                        num_threads);
        DECODE_LORA(m, L, gate_up, h, H, M, gate_up, 2 * I, num_threads);
        silu_and_mul_f32(gate_up, M, I, act, num_threads);
        linear(act, I, M, I, L->down, L->down_kind, H, x, H, num_threads);
        DECODE_LORA(m, L, down, act, I, M, x, H, num_threads);
    }
    add_rms_norm_f32(residual, x, M, H, m->final_norm, m->eps, out, num_threads);
    if (owned) free(buf);
}
