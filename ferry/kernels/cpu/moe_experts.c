/* One token's routed experts on the CPU, for Q4_0 and Q4_K experts in ggml's repacked CPU layouts (the copies
 * CpuBackend.repack made) and Q6_K experts in their plain GGUF layout (ggml has no repacked one for it): h = silu(gate
 * x) * up x for each selected expert, then the weighted sum of down h. A Q4_K_M file's MoE layers are Q4_K up and
 * gate with Q4_K or Q6_K down.
 * Compiled at first use by ferry/kernels/cpu/native.py, for CPUs with AVX512-VNNI; elsewhere ggml runs these experts.
 *
 * The layouts (ggml's repack for AVX2 and up) keep rows in groups of 8 and, per group, take 8 bytes of each row's
 * nibbles in turn, so that one 512-bit load holds 8 bytes of all 8 rows:
 * - Q4_0 (block_q4_0x8): per block of 32 columns, 144 bytes: the 8 rows' fp16 scales, then 128 bytes of nibbles, for
 *   each half of the block's 16 bytes the 8 rows' 8 bytes, each byte XOR 0x88. Byte j of a row's block holds weight
 *   j (low nibble) and j + 16 (high nibble).
 * - Q4_K (block_q4_Kx8): per super-block of 256 columns, 1152 bytes: the 8 rows' fp16 d, then their fp16 dmin, then
 *   96 bytes of 6-bit scales and mins (12 bytes per sub-block of 32 columns: its 8 scales and 8 mins, packed as one
 *   Q4_K row packs its own 8 and 8), then 1024 bytes of nibbles, 8 bytes of each row in turn. Byte j of a row's
 *   128 holds weight 64 (j / 32) + j % 32 (low nibble) and that plus 32 (high nibble): w = d sc q - dmin m.
 * - Q6_K (block_q6_K, plain: each row its own blocks): per super-block of 256 columns, 210 bytes: 128 of low nibbles,
 *   64 of high bit pairs, 16 int8 scales (one per 16 columns), fp16 d; w = d sc (q - 32). In each half of 128
 *   columns, byte l (l < 64) of the low nibbles holds weight l (low nibble) and l + 64 (high nibble); byte l (l < 32)
 *   of the high pairs holds bits 4-5 of weights l, l + 32, l + 64, l + 96 (its bit pairs 0-1, 2-3, 4-5, 6-7). The
 *   kernel reads 8 rows in turn as one group, so that all three types share the (slot, matrix, group) split.
 *
 * Why it is faster than ggml's mul_mat_id at one token (docs/decisions.md): each 32-bit lane's dot product belongs
 * to one row and the activation's 8 bytes are a broadcast load, so no shuffles but the scales' spread per block.
 * Each phase splits the flattened (expert slot, matrix, row group) list into one contiguous range per thread; the
 * phases are separated by OpenMP barriers (OpenMP's threads: the team ggml's graphs use when built with OpenMP). */

#include <math.h>
#include <stdint.h>
#include <string.h>
#include <omp.h>
#if defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512VNNI__) && defined(__AVX512VL__)
#include <immintrin.h>
#define FAST 1
#else
#define FAST 0
#endif

#define GROUP 8 /* rows interleaved */
enum { Q4_0 = 2, Q4_K = 12, Q6_K = 14 }; /* ggml's type numbers */
#define QK4_0 32
#define Q4_0_BYTES 144  /* a group's block: 8 fp16 scales + 8 x 16 bytes of nibbles */
#define QK_K 256
#define Q4_K_BYTES 1152 /* a group's super-block: 8 d + 8 dmin (fp16), 96 bytes of scales, 8 x 128 of nibbles */
#define Q6_K_BYTES 210  /* one row's super-block: 128 bytes of low nibbles, 64 of high bit pairs, 16 scales, fp16 d */
#ifndef PREFETCH_AHEAD
#define PREFETCH_AHEAD 1152 /* bytes ahead of the block being read (8 Q4_0 blocks, one Q4_K super-block) */
#endif

typedef struct { /* an activation block of 32 for Q4_0 weights, quantized to int8 */
    int8_t q[QK4_0];
    int32_t corr[2]; /* -8 times the sum of q over the elements an even (odd) 32-bit lane meets: Q4_0's offset */
    float d;
} act_q4_0;

typedef struct { /* an activation block of 256 for Q4_K weights, quantized to int8 with one scale, as ggml's Q8_K */
    int8_t q[QK_K];
    int32_t sum[8]; /* the sum of q over each sub-block of 32: what the weights' mins multiply */
    float d;
} act_q4_k;

typedef struct { /* an activation block of 256 for Q6_K weights: Q8_K's rounding, and Q6_K's offset per 32-bit lane */
    int8_t q[QK_K];
    int32_t corr[QK_K / 4]; /* -32 times the sum of each 4 q a lane multiplies: Q6_K's q - 32 */
    float d;
} act_q6_k;

int ferry_moe_fast(void) { return FAST; }

static int block_of(int type) { return type == Q4_0 ? QK4_0 : type == Q4_K || type == Q6_K ? QK_K : 0; }

/* bytes of one activation row of n values, and of one group of 8 weight rows of n columns, for weights of type */
static size_t act_bytes(int type, int n) {
    return type == Q4_0 ? sizeof(act_q4_0) * (size_t)(n / QK4_0)
         : type == Q4_K ? sizeof(act_q4_k) * (size_t)(n / QK_K) : sizeof(act_q6_k) * (size_t)(n / QK_K);
}
static size_t group_bytes(int type, int n) {
    return type == Q4_0 ? (size_t)Q4_0_BYTES * (n / QK4_0)
         : type == Q4_K ? (size_t)Q4_K_BYTES * (n / QK_K) : (size_t)GROUP * Q6_K_BYTES * (n / QK_K);
}

static float scale_of(const float *v, int n) {
    float amax = 0.0f;
    for (int i = 0; i < n; i++) amax = fmaxf(amax, fabsf(v[i]));
    return amax / 127.0f;
}

/* v (256 values) rounded as ggml's Q8_K: one scale, max|v| / 127 */
static float round_q8_k(const float *v, int8_t *q) {
    const float d = scale_of(v, QK_K), id = d > 0.0f ? 1.0f / d : 0.0f;
    for (int i = 0; i < QK_K; i++) q[i] = (int8_t)lrintf(v[i] * id);
    return d;
}

/* x (n values) as the activation blocks that weights of `type` read */
static void quantize_row(int type, const float *x, int n, void *dst) {
    if (type == Q4_0) {
        act_q4_0 *a = (act_q4_0 *)dst;
        for (int b = 0; b < n / QK4_0; b++) {
            const float *v = x + (size_t)b * QK4_0;
            const float d = scale_of(v, QK4_0), id = d > 0.0f ? 1.0f / d : 0.0f;
            int32_t sums[2] = {0, 0};
            for (int i = 0; i < QK4_0; i++) {
                a[b].q[i] = (int8_t)lrintf(v[i] * id);
                sums[(i / 4) & 1] += a[b].q[i]; /* lane parity of element i: 4 bytes a lane, 8 a row's chunk */
            }
            a[b].corr[0] = -8 * sums[0];
            a[b].corr[1] = -8 * sums[1];
            a[b].d = d;
        }
    } else if (type == Q4_K) {
        act_q4_k *a = (act_q4_k *)dst;
        for (int b = 0; b < n / QK_K; b++) {
            a[b].d = round_q8_k(x + (size_t)b * QK_K, a[b].q);
            for (int j = 0; j < 8; j++) {
                int32_t s = 0;
                for (int i = 32 * j; i < 32 * (j + 1); i++) s += a[b].q[i];
                a[b].sum[j] = s;
            }
        }
    } else {
        act_q6_k *a = (act_q6_k *)dst;
        for (int b = 0; b < n / QK_K; b++) {
            a[b].d = round_q8_k(x + (size_t)b * QK_K, a[b].q);
            for (int l = 0; l < QK_K / 4; l++) {
                const int8_t *q = a[b].q + 4 * l;
                a[b].corr[l] = -32 * (q[0] + q[1] + q[2] + q[3]);
            }
        }
    }
}

#if FAST
static inline int64_t load_i64(const void *p) { /* 8 bytes, whatever their type (a broadcast load once compiled) */
    int64_t v;
    memcpy(&v, p, 8);
    return v;
}

static inline uint32_t load_u32(const void *p) {
    uint32_t v;
    memcpy(&v, p, 4);
    return v;
}

/* out[0..7] = the 8 rows of the Q4_0 group at g (n columns) against the activation blocks */
static void dot_q4_0(const uint8_t *g, const act_q4_0 *a, int n, float *out) {
    const __m512i flip = _mm512_set1_epi8((char)0x88), low = _mm512_set1_epi8(0x0f);
    const __m512i spread = _mm512_set_epi32(7, 7, 6, 6, 5, 5, 4, 4, 3, 3, 2, 2, 1, 1, 0, 0);
    __m512 acc = _mm512_setzero_ps();
    for (int b = 0; b < n / QK4_0; b++, g += Q4_0_BYTES) {
        _mm_prefetch((const char *)g + PREFETCH_AHEAD, _MM_HINT_T0);
        _mm_prefetch((const char *)g + PREFETCH_AHEAD + 64, _MM_HINT_T0);
        _mm_prefetch((const char *)g + PREFETCH_AHEAD + 128, _MM_HINT_T0);
        const __m512i lo = _mm512_loadu_si512(g + 16), hi = _mm512_loadu_si512(g + 80); /* bytes 0-7, 8-15 */
        const int8_t *q = a[b].q;
        __m512i s = _mm512_set1_epi64(load_i64(a[b].corr));
        /* (v ^ 0x88) & 0x0f: ternary logic 0x28 is (A ^ B) & C */
        s = _mm512_dpbusd_epi32(s, _mm512_ternarylogic_epi32(lo, flip, low, 0x28),
                                _mm512_set1_epi64(load_i64(q)));
        s = _mm512_dpbusd_epi32(s, _mm512_ternarylogic_epi32(hi, flip, low, 0x28),
                                _mm512_set1_epi64(load_i64(q + 8)));
        s = _mm512_dpbusd_epi32(s, _mm512_ternarylogic_epi32(_mm512_srli_epi16(lo, 4), flip, low, 0x28),
                                _mm512_set1_epi64(load_i64(q + 16)));
        s = _mm512_dpbusd_epi32(s, _mm512_ternarylogic_epi32(_mm512_srli_epi16(hi, 4), flip, low, 0x28),
                                _mm512_set1_epi64(load_i64(q + 24)));
        const __m512 dw = _mm512_permutexvar_ps(spread, _mm512_castps256_ps512(
                                                            _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)g))));
        acc = _mm512_fmadd_ps(_mm512_cvtepi32_ps(s), _mm512_mul_ps(dw, _mm512_set1_ps(a[b].d)), acc);
    }
    float lanes[16];
    _mm512_storeu_ps(lanes, acc);
    for (int r = 0; r < GROUP; r++) out[r] = lanes[2 * r] + lanes[2 * r + 1];
}

/* the 8 rows' 6-bit values of one sub-block, one byte each, from their 4 low (packed with the top bits of the other
 * 4's) and 4 high; `shift` picks the high ones' nibble */
static inline uint64_t six_bits(uint32_t lo, uint32_t hi_nibbles, int shift) {
    const uint32_t first = lo & 0x3f3f3f3fu, second = ((hi_nibbles >> shift) & 0x0f0f0f0fu) | ((lo >> 2) & 0x30303030u);
    return first | (uint64_t)second << 32;
}

/* each row's byte to the two 32-bit lanes of its row */
static inline __m512i spread_bytes(uint64_t v) {
    const __m128i b = _mm_cvtsi64_si128((long long)v);
    return _mm512_cvtepu8_epi32(_mm_unpacklo_epi8(b, b));
}

/* out[0..7] = the 8 rows of the Q4_K group at g (n columns) against the activation blocks */
static void dot_q4_k(const uint8_t *g, const act_q4_k *a, int n, float *out) {
    const __m512i low = _mm512_set1_epi8(0x0f);
    __m256 acc = _mm256_setzero_ps();
    for (int b = 0; b < n / QK_K; b++, g += Q4_K_BYTES) {
        const uint8_t *packed = g + 32, *qs = g + 128;
        const int8_t *q = a[b].q;
        __m512i isum = _mm512_setzero_si512();
        __m256i msum = _mm256_setzero_si256();
        for (int c = 0; c < 4; c++) { /* columns 64c..64c+63: sub-blocks 2c (low nibbles) and 2c + 1 (high) */
            const uint8_t *p0 = packed + 24 * c, *p1 = p0 + 12;
            const uint64_t s0 = six_bits(load_u32(p0), load_u32(p0 + 8), 0);
            const uint64_t m0 = six_bits(load_u32(p0 + 4), load_u32(p0 + 8), 4);
            const uint64_t s1 = six_bits(load_u32(p1), load_u32(p1 + 8), 0);
            const uint64_t m1 = six_bits(load_u32(p1 + 4), load_u32(p1 + 8), 4);
            __m512i lo_acc = _mm512_setzero_si512(), hi_acc = _mm512_setzero_si512();
            for (int k = 0; k < 4; k++) {
                const uint8_t *v8 = qs + 64 * (4 * c + k);
                _mm_prefetch((const char *)v8 + PREFETCH_AHEAD, _MM_HINT_T0);
                const __m512i v = _mm512_loadu_si512(v8);
                lo_acc = _mm512_dpbusd_epi32(lo_acc, _mm512_and_si512(v, low),
                                             _mm512_set1_epi64(load_i64(q + 64 * c + 8 * k)));
                hi_acc = _mm512_dpbusd_epi32(hi_acc, _mm512_and_si512(_mm512_srli_epi16(v, 4), low),
                                             _mm512_set1_epi64(load_i64(q + 64 * c + 32 + 8 * k)));
            }
            isum = _mm512_add_epi32(isum, _mm512_add_epi32(_mm512_mullo_epi32(lo_acc, spread_bytes(s0)),
                                                           _mm512_mullo_epi32(hi_acc, spread_bytes(s1))));
            const __m256i mins0 = _mm256_cvtepu8_epi32(_mm_cvtsi64_si128((long long)m0));
            const __m256i mins1 = _mm256_cvtepu8_epi32(_mm_cvtsi64_si128((long long)m1));
            msum = _mm256_add_epi32(msum, _mm256_add_epi32(_mm256_mullo_epi32(mins0, _mm256_set1_epi32(a[b].sum[2 * c])),
                                                           _mm256_mullo_epi32(mins1, _mm256_set1_epi32(a[b].sum[2 * c + 1]))));
        }
        _mm_prefetch((const char *)g + PREFETCH_AHEAD, _MM_HINT_T0);
        _mm_prefetch((const char *)g + PREFETCH_AHEAD + 64, _MM_HINT_T0);
        /* a row's two lanes summed: the even lane of each 64-bit pair, narrowed to the row's 32-bit lane */
        const __m256i rows = _mm512_cvtepi64_epi32(_mm512_add_epi32(isum, _mm512_srli_epi64(isum, 32)));
        const __m256 dx = _mm256_set1_ps(a[b].d);
        const __m256 d = _mm256_mul_ps(_mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)g)), dx);
        const __m256 dmin = _mm256_mul_ps(_mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(g + 16))), dx);
        acc = _mm256_fmadd_ps(_mm256_cvtepi32_ps(rows), d, acc);
        acc = _mm256_fnmadd_ps(_mm256_cvtepi32_ps(msum), dmin, acc);
    }
    _mm256_storeu_ps(out, acc);
}

/* out[0..7] = the 8 Q6_K rows at g (n columns each, one after another) against the activation blocks */
static void dot_q6_k(const uint8_t *g, const act_q6_k *a, int n, float *out) {
    const __m512i nibble = _mm512_set1_epi8(0x0f), pair = _mm512_set1_epi8(0x30);
    /* the high pairs to bits 4-5 of each byte: weights l, l + 32 (lower, upper 256 bits) shift left 4 and 2, weights
     * l + 64, l + 96 right 0 and 2 (16-bit shifts; the 0x30 mask keeps each byte's own bits) */
    const __m512i left = _mm512_inserti64x4(_mm512_set1_epi16(4), _mm256_set1_epi16(2), 1);
    const __m512i right = _mm512_inserti64x4(_mm512_setzero_si512(), _mm256_set1_epi16(2), 1);
    __m512i lane_of[4]; /* the scale index of each 32-bit lane of the block's 64-column quarter k: 4k + lane / 4 */
    for (int k = 0; k < 4; k++)
        lane_of[k] = _mm512_set_epi32(4 * k + 3, 4 * k + 3, 4 * k + 3, 4 * k + 3, 4 * k + 2, 4 * k + 2, 4 * k + 2,
                                      4 * k + 2, 4 * k + 1, 4 * k + 1, 4 * k + 1, 4 * k + 1, 4 * k, 4 * k, 4 * k, 4 * k);
    const int blocks = n / QK_K;
    for (int r = 0; r < GROUP; r++) {
        const uint8_t *row = g + (size_t)r * blocks * Q6_K_BYTES;
        __m512 acc = _mm512_setzero_ps();
        for (int b = 0; b < blocks; b++, row += Q6_K_BYTES) {
            _mm_prefetch((const char *)row + PREFETCH_AHEAD, _MM_HINT_T0);
            _mm_prefetch((const char *)row + PREFETCH_AHEAD + 64, _MM_HINT_T0);
            _mm_prefetch((const char *)row + PREFETCH_AHEAD + 128, _MM_HINT_T0);
            _mm_prefetch((const char *)row + PREFETCH_AHEAD + 192, _MM_HINT_T0);
            const __m512i scales = _mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i *)(row + 192)));
            const int8_t *q = a[b].q;
            __m512i isum = _mm512_setzero_si512();
            for (int h = 0; h < 2; h++) { /* columns 128h..128h+127 */
                const __m512i lo = _mm512_loadu_si512(row + 64 * h);
                const __m512i hi = _mm512_broadcast_i64x4(_mm256_loadu_si256((const __m256i *)(row + 128 + 32 * h)));
                const __m512i v0 = _mm512_or_si512(_mm512_and_si512(lo, nibble),
                                                   _mm512_and_si512(_mm512_sllv_epi16(hi, left), pair));
                const __m512i v1 = _mm512_or_si512(_mm512_and_si512(_mm512_srli_epi16(lo, 4), nibble),
                                                   _mm512_and_si512(_mm512_srlv_epi16(hi, right), pair));
                const __m512i d0 = _mm512_dpbusd_epi32(_mm512_loadu_si512(a[b].corr + 32 * h), v0,
                                                       _mm512_loadu_si512(q + 128 * h));
                const __m512i d1 = _mm512_dpbusd_epi32(_mm512_loadu_si512(a[b].corr + 32 * h + 16), v1,
                                                       _mm512_loadu_si512(q + 128 * h + 64));
                isum = _mm512_add_epi32(isum, _mm512_mullo_epi32(d0, _mm512_permutexvar_epi32(lane_of[2 * h], scales)));
                isum = _mm512_add_epi32(isum,
                                        _mm512_mullo_epi32(d1, _mm512_permutexvar_epi32(lane_of[2 * h + 1], scales)));
            }
            uint16_t dh;
            memcpy(&dh, row + 208, 2);
            acc = _mm512_fmadd_ps(_mm512_cvtepi32_ps(isum), _mm512_set1_ps(_cvtsh_ss(dh) * a[b].d), acc);
        }
        out[r] = _mm512_reduce_add_ps(acc);
    }
}

/* y for groups lo..hi of the flattened (slot, matrix, group) list, where matrix m of a slot is base[m]'s expert
 * ids[slot], of `groups` row groups of n columns of `type`, against that slot's activation row */
static void groups_of(int type, int64_t lo, int64_t hi, int groups, int mats, const uint8_t *const *base,
                      const int32_t *ids, int n, const uint8_t *act, size_t act_per_slot, float *y) {
    const size_t per_group = group_bytes(type, n), per_expert = per_group * groups;
    for (int64_t u = lo; u < hi; u++) {
        const int64_t slot = u / ((int64_t)mats * groups), rem = u % ((int64_t)mats * groups);
        const uint8_t *g = base[rem / groups] + (size_t)ids[slot] * per_expert + (size_t)(rem % groups) * per_group;
        const uint8_t *x = act + slot * act_per_slot;
        if (type == Q4_0)
            dot_q4_0(g, (const act_q4_0 *)x, n, y + u * GROUP);
        else if (type == Q4_K)
            dot_q4_k(g, (const act_q4_k *)x, n, y + u * GROUP);
        else
            dot_q6_k(g, (const act_q6_k *)x, n, y + u * GROUP);
    }
}
#endif

static void thread_range(int64_t total, int t, int nt, int64_t *lo, int64_t *hi) {
    *lo = total * t / nt;
    *hi = total * (t + 1) / nt;
}

static size_t aligned(size_t n) { return (n + 63) & ~(size_t)63; }

size_t ferry_moe_scratch(int n_embd, int n_ff, int n_used, int up_type, int down_type) {
    return aligned(act_bytes(up_type, n_embd)) + aligned((size_t)n_used * act_bytes(down_type, n_ff))
           + sizeof(float) * ((size_t)2 * n_used * n_ff + (size_t)n_used * n_embd);
}

/* x (n_embd) -> out (n_embd): sum over slots j of weights[j] * down[ids[j]] (silu(gate[ids[j]] x) * up[ids[j]] x).
 * up, gate: n_expert matrices of n_ff rows of n_embd, of up_type; down: n_expert matrices of n_embd rows of n_ff, of
 * down_type; all in the layouts above, each expert's matrix contiguous. scratch: ferry_moe_scratch bytes, 64-byte
 * aligned. Returns 0; -1 when an id is out of range, a type is not Q4_0, Q4_K or Q6_K, or a size is not a multiple of its
 * type's block (rows: of 8); -2 when not built FAST (nothing is written then). */
int ferry_moe_experts(const float *x, const int32_t *ids, const float *weights, int n_used, int n_embd, int n_ff,
                      int n_expert, const uint8_t *up, const uint8_t *gate, const uint8_t *down, int up_type,
                      int down_type, float *out, void *scratch, int n_threads) {
#if !FAST
    return -2; /* native.py asks ferry_moe_fast first and never gets here */
#else
    if (!block_of(up_type) || !block_of(down_type) || n_embd % block_of(up_type) || n_ff % block_of(down_type)
        || n_embd % GROUP || n_ff % GROUP || n_used < 1)
        return -1;
    for (int j = 0; j < n_used; j++)
        if (ids[j] < 0 || ids[j] >= n_expert) return -1;
    const size_t h_bytes = act_bytes(down_type, n_ff);
    uint8_t *xq = (uint8_t *)scratch;
    uint8_t *hq = xq + aligned(act_bytes(up_type, n_embd));        /* n_used activation rows of n_ff */
    float *ug = (float *)(hq + aligned((size_t)n_used * h_bytes)); /* per slot: its up rows, then its gate rows */
    float *y = ug + (size_t)2 * n_used * n_ff;                     /* per slot: its down rows */
    const uint8_t *up_gate[2] = {up, gate};

#pragma omp parallel num_threads(n_threads)
    {
        const int t = omp_get_thread_num(), nt = omp_get_num_threads();
        int64_t lo, hi;
        if (t == 0) quantize_row(up_type, x, n_embd, xq);
#pragma omp barrier
        thread_range((int64_t)n_used * 2 * (n_ff / GROUP), t, nt, &lo, &hi);
        groups_of(up_type, lo, hi, n_ff / GROUP, 2, up_gate, ids, n_embd, xq, 0, ug);
#pragma omp barrier
        for (int64_t s = t; s < n_used; s += nt) {
            float *u = ug + s * 2 * n_ff;
            const float *g = u + n_ff;
            for (int i = 0; i < n_ff; i++) u[i] = g[i] / (1.0f + expf(-g[i])) * u[i];
            quantize_row(down_type, u, n_ff, hq + s * h_bytes);
        }
#pragma omp barrier
        thread_range((int64_t)n_used * (n_embd / GROUP), t, nt, &lo, &hi);
        groups_of(down_type, lo, hi, n_embd / GROUP, 1, &down, ids, n_ff, hq, h_bytes, y);
#pragma omp barrier
        thread_range(n_embd, t, nt, &lo, &hi);
        for (int64_t i = lo; i < hi; i++) {
            float s = 0.0f;
            for (int j = 0; j < n_used; j++) s += weights[j] * y[(size_t)j * n_embd + i];
            out[i] = s;
        }
    }
    return 0;
#endif
}
