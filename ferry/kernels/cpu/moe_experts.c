/* ferry's CPU matrix kernels: routed experts of one token (ferry_moe_experts) or of many (ferry_moe_batch: h =
 * silu(gate x) * up x, or gpt-oss's clamped SwiGLU with biases, for each selected expert, then the weighted sum of
 * down h), dense weights (ferry_linear: y = W x) and attention over a float16 or Q8_0 cache (ferry_attention, at the
 * end), each also as a node of a ggml graph (ferry_moe_ggml, ferry_linear_ggml, ferry_attention_ggml). Q4_0 and Q4_K
 * weights in ggml's repacked CPU layouts (the copies CpuBackend.repack made), Q5_K, Q6_K, IQ4_XS and MXFP4 in their
 * plain GGUF layouts (ggml has no repacked ones for them), Q8_0 in a layout of ferry's own (ferry_repack_q8_0; dense
 * weights). A Q4_K_M file's MoE layers are Q4_K up and gate with Q4_K or Q6_K down, a Q5_K_M file's Q5_K with Q5_K or Q6_K, an IQ4_XS file's
 * IQ4_XS throughout, gpt-oss's MXFP4 throughout.
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
 *   of the high pairs holds bits 4-5 of weights l, l + 32, l + 64, l + 96 (its bit pairs 0-1, 2-3, 4-5, 6-7).
 * - Q5_K (block_q5_K, plain): per super-block 176 bytes: fp16 d and dmin, 12 bytes of 6-bit scales and mins (as
 *   Q4_K's), 32 of high bits, 128 of nibbles; in each 64 columns j, byte l (l < 32) of the nibbles holds weight 64 j +
 *   l (low) and 64 j + 32 + l (high), bits 2 j and 2 j + 1 of high-bit byte l their fifth bits: w = d sc q - dmin m.
 * - IQ4_XS (block_iq4_xs, plain): per super-block 136 bytes: fp16 d, then each sub-block of 32's 6-bit scale ls (its
 *   high 2 bits in a uint16, low 4 in 4 bytes), then 16 bytes per sub-block, byte j holding indices into IQ4_NL's
 *   16 values for weights j (low) and j + 16 (high): w = d (ls - 32) table[index].
 * - MXFP4 (block_mxfp4, plain): per block of 32 columns 17 bytes: the E8M0 exponent e, then 16 bytes, byte j holding
 *   indices into FP4's (doubled) table for weights j (low nibble) and j + 16 (high): w = 2^(e - 128) table[index].
 * The plain types' kernels read 8 rows in turn as one group, so that all types share the (slot, matrix, group) split.
 *
 * Why it is faster than ggml's mul_mat_id at one token (docs/decisions.md): each 32-bit lane's dot product belongs
 * to one row and the activation's 8 bytes are a broadcast load, so no shuffles but the scales' spread per block.
 * One token's work is a list of bundles the threads take from a counter; many tokens' phases hand out (expert,
 * matrix, row group) jobs of tiles of tokens from a counter too (run_jobs); the phases are separated by barriers
 * (sync_threads). */

#include <math.h>
#include <sched.h>
#include <time.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#include <omp.h>
#if defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512VNNI__) && defined(__AVX512VL__) && defined(__BMI2__)
#include <immintrin.h>
#define FAST 1
#else
#define FAST 0
#endif
#if FAST && defined(__AMX_TILE__) && defined(__AMX_INT8__)
#include <sys/syscall.h>
#include <unistd.h>
/* many tokens against Q4_0 / Q8_0 / K-quant / IQ4_XS weights on AMX-INT8 tiles (amx_tile), where ferry_amx says */
#define AMX 1
#else
#define AMX 0
#endif

#define GROUP 8 /* rows interleaved */
enum { F16 = 1, Q4_0 = 2, Q8_0 = 8, Q4_K = 12, Q5_K = 13, Q6_K = 14, IQ4_XS = 23, MXFP4 = 39 }; /* ggml's numbers */
enum { IQ2_K = 137, IQ3_K = 138, IQ4_K = 139, IQ4_KS = 144, IQ2_KS = 145, IQ4_KSS = 146, IQ5_KS = 152, IQ3_KS = 156,
       IQ2_KL = 157 }; /* ik_llama.cpp's numbers */
#define QK4_0 32
#define Q4_0_BYTES 144  /* a group's block: 8 fp16 scales + 8 x 16 bytes of nibbles */
#define Q8_0_BYTES 272  /* a group's block: 8 fp16 scales + 8 x 32 bytes, each XOR 0x80 (ferry_repack_q8_0) */
#define QK_K 256
#define Q4_K_BYTES 1152 /* a group's super-block: 8 d + 8 dmin (fp16), 96 bytes of scales, 8 x 128 of nibbles */
#define Q6_K_BYTES 210  /* one row's super-block: 128 bytes of low nibbles, 64 of high bit pairs, 16 scales, fp16 d */
#define Q5_K_BYTES 176  /* one row's super-block: fp16 d and dmin, 12 bytes of 6-bit scales and mins, 32 of high bits,
                         * 128 of low nibbles */
#define IQ4_XS_BYTES 136 /* one row's super-block: fp16 d, 2 bytes of the scales' high bits, 4 of their low nibbles,
                          * 128 of nibbles indexing IQ4_NL's table */
#define IQ4_K_BYTES 144 /* one row's super-block: fp16 d, 16 bits of table halves, 4 bytes of the scales' high bit pairs,
                        * 8 of their low nibbles, 128 of nibbles indexing IQ4K's tables (as IQ4_XS's) */
#define IQ3_KS_BYTES 102 /* one row's super-block (after the row's fp16 d): 16 bits of fifth scale bits (0-7) and table
                         * halves (8-15), 4 bytes of scale nibbles, 64 of 2-bit indices, 32 of their third bits */
#define IQ2_KS_BYTES 70 /* as IQ3_KS without the third bits, the 16 bits' halves swapped (table halves 0-7) */
#define IQ2_K_BYTES 76 /* one row's super-block: fp16 d, 16 bits of table halves (one a 16), 8 scale bytes (a nibble a 16,
                       * less 8), IQ2_KS's 64 bytes of 2-bit indices */
#define IQ3_K_BYTES 110 /* one row's super-block: fp16 d, 16 bits of table halves, 16 of scale signs, 8 scale bytes (a
                        * nibble n a 16: 2n + 1), IQ3_KS's 64 bytes of 2-bit indices and 32 of third bits */
#define IQ5_KS_BYTES 168 /* one row's super-block (after the row's float32 d): 8 scale bytes, 128 of nibbles (byte j of
                         * group g: sub-blocks 2g low, 2g + 1 high), 32 of their fifth bits (bit ib of byte j) */
#define IQ4_KS_BYTES 136 /* one row's super-block: 8 scale bytes, 128 of nibbles indexing IQ4K's tables (the row's
                          * float32 scale before its first) */
#define IQ4_KSS_BYTES 128 /* one row's super-block (after the row's float32 d): IQ4_KS's folded into 16-bit words, each
                           * sub-block's 8 holding its scale byte's bits 0-7 in their bit 0 and its 16 nibble bytes
                           * as x ^ (x >> 1) of the word less that bit */
#define IQ2_KL_BYTES 86 /* one row's super-block (after the row's fp16 d): 16 bits of the scales' high bit pairs, 4 bytes
                        * of their low nibbles, 64 of the low 4 bits of 5-bit indices (byte j of group g: sub-blocks 2g
                        * low, 2g + 1 high), 16 of their fifth bits (bit s of byte j); an index picks 2 values */
#define MXFP4_BYTES 17 /* one row's block of 32: the E8M0 exponent, 16 bytes of nibbles indexing the FP4 table */
#define QK_MX 64       /* MXFP4's activation block: two weight blocks, one 512-bit vector of int8 */
#define MX_OFFSET 12   /* added to MXFP4's table (-12..12) so that its values are unsigned for VNNI */
#ifndef PREFETCH_AHEAD
#define PREFETCH_AHEAD 1152 /* bytes ahead of the block being read (8 Q4_0 blocks, one Q4_K super-block) */
#endif

typedef struct { /* an activation block of 32 for Q4_0 (Q8_0) weights, quantized to int8 */
    int8_t q[QK4_0];
    int32_t corr[2]; /* -8 (-128) times the sum of q over the elements an even (odd) 32-bit lane meets: the offset
                      * of Q4_0's nibbles (of Q8_0's bytes as the kernel stores them, XOR 0x80) */
    float d;
} act_q4_0;

typedef struct { /* an activation block of 256 for Q4_K (Q5_K) weights, quantized to int8 with one scale, as ggml's
                  * Q8_K; for Q5_K q is in the order of the weights' 64-byte vectors (q5_k_order) */
    int8_t q[QK_K];
    int32_t sum[8]; /* the sum of q over each sub-block of 32: what the weights' mins multiply */
    float d;
    float sumf[8]; /* the sums in float32 (exact), of q's 32 bytes m (for Q5_K in q5_k_order): AMX's tiles take the
                    * mins in float32 */
} act_q4_k;

typedef struct { /* an activation block of 256 for Q6_K (IQ4_XS) weights: Q8_K's rounding, and what the weights'
                  * offset takes; for IQ4_XS q is in the order of the weights' 64-byte vectors (iq4_xs_order) */
    int8_t q[QK_K];
    int32_t corr[QK_K / 4];   /* IQ4_XS: -128 times the sum of each 4 q a lane multiplies (its table's values are
                               * stored + 128) */
    int16_t sum16[QK_K / 16]; /* Q6_K: the sum of q over each sub-block of 16, which q - 32's 32 multiplies */
    float d;
} act_q6_k;

typedef struct { /* an activation block of 64 for MXFP4 weights: two blocks of 32, each quantized to int8 with its own
                  * scale, in column order */
    int8_t q[QK_MX];
    int32_t corr[16]; /* lanes 0 and 8: -MX_OFFSET times the sum of each block's q (the table's offset taken back) */
    float d[16];      /* each block's scale, halved (the E8M0 exponent's 2^(e - 127) times this is the weights' scale
                       * times the activation's), over the 8 lanes its 32 columns fill */
} act_mxfp4;

int ferry_moe_fast(void) { return FAST; }

static int amx_on; /* ferry_amx's choice: 1 where the CPU has AMX-INT8, the OS lets this process use it, and it is asked */

/* AMX-INT8 for many tokens' Q4_0 / Q8_0 / Q4_K / Q5_K / Q6_K / IQ4_XS weights, on (want 1), off (0: AVX512-VNNI's
 * kernels everywhere) or as it is (-1): returns whether it is on. Linux gives a process the tiles' state only when asked (ARCH_REQ_XCOMP_PERM). */
int ferry_amx(int want) {
#if AMX
    static int granted = -1;
    if (want > 0 && granted < 0)
        granted = syscall(SYS_arch_prctl, 0x1023 /* ARCH_REQ_XCOMP_PERM */, 18 /* XTILEDATA */) == 0;
    if (want >= 0) amx_on = want && granted > 0;
#else
    (void)want;
#endif
    return amx_on;
}

#define AMX_ROWS 16
#define AMX_TOKENS 16
#define AMX_B 512 /* bytes of one block's B tile: its 8 rows of 64, row r columns 4r..4r + 3 of the 16 weight rows */
#ifndef AMX_MIN_PAIRS
#define AMX_MIN_PAIRS 12 /* an expert (or a dense weight) with fewer of a call's tokens stays on the VNNI kernels: a
                          * block of 16 rows costs AMX about 33 ns and 1.2 a token, VNNI 3.9 ns a token (dev VM's Xeon,
                          * one thread) */
#endif

/* whether a phase of `tokens` tokens over weights of type may run experts on AMX (amx_units) where it is on: fewer
 * tokens give no expert AMX_MIN_PAIRS (amx_can: the scratch is sized for it whether it is on or not, so that
 * ferry_amx may turn it on between calls) */
static int amx_can(int type, int tokens) {
    return AMX && (type == Q4_0 || type == Q8_0 || type == Q4_K || type == Q5_K || type == Q6_K || type == IQ4_XS)
           && tokens >= AMX_MIN_PAIRS;
}
static int amx_for(int type, int tokens) { return amx_on && amx_can(type, tokens); }

static int block_of(int type) {
    return type == Q4_0 || type == Q8_0 ? QK4_0
         : type == Q4_K || type == Q5_K || type == Q6_K || type == IQ4_XS || type == IQ4_KS || type == IQ4_K
                   || type == IQ3_KS || type == IQ2_KS || type == IQ5_KS || type == IQ4_KSS || type == IQ2_KL
                   || type == IQ2_K || type == IQ3_K ? QK_K
         : type == MXFP4 ? QK_MX : 0;
}

/* bytes of one activation row of n values, and of one group of 8 weight rows of n columns, for weights of type */
static size_t act_bytes(int type, int n) {
    return type == Q4_0 || type == Q8_0 ? sizeof(act_q4_0) * (size_t)(n / QK4_0)
         : type == MXFP4 ? sizeof(act_mxfp4) * (size_t)(n / QK_MX)
         : type == Q4_K || type == Q5_K ? sizeof(act_q4_k) * (size_t)(n / QK_K) : sizeof(act_q6_k) * (size_t)(n / QK_K);
}
static size_t group_bytes(int type, int n) {
    return type == Q4_0 ? (size_t)Q4_0_BYTES * (n / QK4_0)
         : type == Q8_0 ? (size_t)Q8_0_BYTES * (n / QK4_0)
         : type == Q4_K ? (size_t)Q4_K_BYTES * (n / QK_K)
         : type == MXFP4 ? (size_t)GROUP * MXFP4_BYTES * (n / QK4_0)
         : type == IQ4_KS || type == IQ5_KS || type == IQ4_KSS
               ? (size_t)GROUP * (4 + (size_t)(type == IQ4_KS ? IQ4_KS_BYTES : type == IQ5_KS ? IQ5_KS_BYTES
                                                                                          : IQ4_KSS_BYTES) * (n / QK_K))
         : type == IQ3_KS || type == IQ2_KS || type == IQ2_KL
               ? (size_t)GROUP * (2 + (size_t)(type == IQ3_KS ? IQ3_KS_BYTES : type == IQ2_KS ? IQ2_KS_BYTES
                                                                                          : IQ2_KL_BYTES) * (n / QK_K))
         : (size_t)GROUP * (type == Q5_K ? Q5_K_BYTES : type == Q6_K ? Q6_K_BYTES : type == IQ4_K ? IQ4_K_BYTES
                            : type == IQ2_K ? IQ2_K_BYTES : type == IQ3_K ? IQ3_K_BYTES : IQ4_XS_BYTES) * (n / QK_K);
}

static float scale_of(const float *v, int n) {
    float amax = 0.0f;
    for (int i = 0; i < n; i++) amax = fmaxf(amax, fabsf(v[i]));
    return amax / 127.0f;
}

/* v (256 values) rounded as ggml's Q8_K: one scale, max|v| / 127 */
static float round_q8_k(const float *v, int8_t *q) {
#if FAST /* the loop below, 16 values a vector (the same roundings) */
    __m512 amax = _mm512_setzero_ps();
    for (int i = 0; i < QK_K; i += 16) amax = _mm512_max_ps(amax, _mm512_abs_ps(_mm512_loadu_ps(v + i)));
    const float d = _mm512_reduce_max_ps(amax) / 127.0f;
    const __m512 id = _mm512_set1_ps(d > 0.0f ? 1.0f / d : 0.0f);
    for (int i = 0; i < QK_K; i += 16)
        _mm_storeu_si128((__m128i *)(q + i), _mm512_cvtsepi32_epi8(_mm512_cvtps_epi32(_mm512_mul_ps(_mm512_loadu_ps(v + i),
                                                                                                    id))));
    return d;
#else
    const float d = scale_of(v, QK_K), id = d > 0.0f ? 1.0f / d : 0.0f;
    for (int i = 0; i < QK_K; i++) q[i] = (int8_t)lrintf(v[i] * id);
    return d;
#endif
}

/* the sum of 32 int8 values */
static inline int32_t sum_32(const int8_t *q) {
#if FAST
    const __m512i wide = _mm512_cvtepi8_epi16(_mm256_loadu_si256((const __m256i *)q));
    return _mm512_reduce_add_epi32(_mm512_madd_epi16(wide, _mm512_set1_epi16(1)));
#else
    int32_t s = 0;
    for (int i = 0; i < 32; i++) s += q[i];
    return s;
#endif
}

/* Where column i of a super-block goes in the activation block that the plain Q5_K / IQ4_XS kernels read: in the
 * order of the 64-byte vectors they unpack from a row's nibbles.
 * Q5_K: the row's 128 bytes of nibbles as two loads of 64 (h = 0, 1), each byte l (l < 32) of the first half holding
 * columns 128h + l (low nibble) and 128h + 32 + l (high), of the second half 128h + 64 + l and 128h + 96 + l; vector
 * 2h is the low nibbles, 2h + 1 the high. */
static int q5_k_order(int i) {
    const int h = i / 128, r = i % 128, half = r / 64, high = r % 64 / 32;
    return 64 * (2 * h + high) + 32 * half + r % 32;
}
/* the sub-block whose 32 columns q5_k_order puts at bytes 32m..32m + 31 */
static inline int q5_k_sub(int m) { return 4 * (m / 4) + (m / 2) % 2 + 2 * (m % 2); }
/* IQ4_XS: sub-block s (32 columns) is 16 bytes, byte j holding columns 32s + j (low nibble) and 32s + 16 + j (high);
 * a load of 64 holds sub-blocks 4h..4h + 3, vector 2h their low nibbles, 2h + 1 their high */
static int iq4_xs_order(int i) {
    const int s = i / 32, high = i % 32 / 16;
    return 64 * (2 * (s / 4) + high) + 16 * (s % 4) + i % 16;
}
/* IQ3_KS / IQ2_KS: sub-block s's 2-bit indices are bits 2 (s % 4) of the 32 bytes of group s / 4; vector k (the two
 * groups' bits 2k) holds sub-block k in its low 32 bytes and 4 + k in its high */
static int iq_ks_order(int i) {
    const int s = i / 32;
    return 64 * (s % 4) + 32 * (s / 4) + i % 32;
}
/* IQ5_KS: a load of 64 index bytes (h) holds sub-blocks 4h..4h + 3, its low nibbles (vector 2h) sub-blocks 4h and
 * 4h + 2, its high nibbles (2h + 1) 4h + 1 and 4h + 3, each in 32 bytes */
static int iq5_ks_order(int i) {
    const int s = i / 32, r = s % 4;
    return 64 * (2 * (s / 4) + r % 2) + 32 * (r / 2) + i % 32;
}

/* x (n values) as the activation blocks that weights of `type` read */
static void quantize_row(int type, const float *x, int n, void *dst) {
    if (type == Q4_0 || type == Q8_0) {
        const int32_t offset = type == Q4_0 ? 8 : 128;
        act_q4_0 *a = (act_q4_0 *)dst;
#if FAST /* the loop below, 16 values a vector (the same roundings: max / 127, then to nearest even) */
        for (int b = 0; b < n / QK4_0; b++) {
            const __m512 v0 = _mm512_loadu_ps(x + (size_t)b * QK4_0), v1 = _mm512_loadu_ps(x + (size_t)b * QK4_0 + 16);
            const float d = _mm512_reduce_max_ps(_mm512_max_ps(_mm512_abs_ps(v0), _mm512_abs_ps(v1))) / 127.0f;
            const __m512 id = _mm512_set1_ps(d > 0.0f ? 1.0f / d : 0.0f);
            const __m512i q0 = _mm512_cvtps_epi32(_mm512_mul_ps(v0, id)), q1 = _mm512_cvtps_epi32(_mm512_mul_ps(v1, id));
            _mm_storeu_si128((__m128i *)a[b].q, _mm512_cvtsepi32_epi8(q0));
            _mm_storeu_si128((__m128i *)(a[b].q + 16), _mm512_cvtsepi32_epi8(q1));
            const __m512i q = _mm512_add_epi32(q0, q1); /* elements i and i + 16 share their lane's parity */
            a[b].corr[0] = -offset * _mm512_mask_reduce_add_epi32(0x0f0f, q);
            a[b].corr[1] = -offset * _mm512_mask_reduce_add_epi32(0xf0f0, q);
            a[b].d = d;
        }
        return;
#endif
        for (int b = 0; b < n / QK4_0; b++) {
            const float *v = x + (size_t)b * QK4_0;
            const float d = scale_of(v, QK4_0), id = d > 0.0f ? 1.0f / d : 0.0f;
            int32_t sums[2] = {0, 0};
            for (int i = 0; i < QK4_0; i++) {
                a[b].q[i] = (int8_t)lrintf(v[i] * id);
                sums[(i / 4) & 1] += a[b].q[i]; /* lane parity of element i: 4 bytes a lane, 8 a row's chunk */
            }
            a[b].corr[0] = -offset * sums[0];
            a[b].corr[1] = -offset * sums[1];
            a[b].d = d;
        }
    } else if (type == MXFP4) {
        act_mxfp4 *a = (act_mxfp4 *)dst;
        for (int p = 0; p < n / QK_MX; p++) {
            memset(a[p].corr, 0, sizeof a[p].corr);
            for (int k = 0; k < 2; k++) {
                const float *v = x + (size_t)p * QK_MX + QK4_0 * k;
                const float d = scale_of(v, QK4_0), id = d > 0.0f ? 1.0f / d : 0.0f;
                int32_t sum = 0;
                for (int i = 0; i < QK4_0; i++) {
                    a[p].q[QK4_0 * k + i] = (int8_t)lrintf(v[i] * id);
                    sum += a[p].q[QK4_0 * k + i];
                }
                a[p].corr[8 * k] = -MX_OFFSET * sum;
                for (int l = 0; l < 8; l++) a[p].d[8 * k + l] = 0.5f * d;
            }
        }
    } else if (type == Q4_K || type == Q5_K) {
        act_q4_k *a = (act_q4_k *)dst;
        int8_t q[QK_K];
        for (int b = 0; b < n / QK_K; b++) {
            a[b].d = round_q8_k(x + (size_t)b * QK_K, q);
            for (int j = 0; j < 8; j++) a[b].sum[j] = sum_32(q + 32 * j);
            for (int m = 0; m < 8; m++) a[b].sumf[m] = (float)a[b].sum[type == Q5_K ? q5_k_sub(m) : m];
            if (type == Q5_K)
                for (int i = 0; i < QK_K; i++) a[b].q[q5_k_order(i)] = q[i];
            else
                memcpy(a[b].q, q, QK_K);
        }
    } else {
        const int iq4 = type == IQ4_XS || type == IQ4_KS || type == IQ4_K || type == IQ4_KSS; /* one nibble order */
        const int low_bits = type == IQ3_KS || type == IQ2_KS || type == IQ5_KS || type == IQ3_K || type == IQ2_K;
        const int offset = iq4 || low_bits || type == IQ2_KL; /* table values stored + 128; IQ2_KL in column order */
        act_q6_k *a = (act_q6_k *)dst;
        int8_t q[QK_K];
        for (int b = 0; b < n / QK_K; b++) {
            a[b].d = round_q8_k(x + (size_t)b * QK_K, q);
            for (int i = 0; i < QK_K; i++)
                a[b].q[iq4 ? iq4_xs_order(i) : type == IQ5_KS ? iq5_ks_order(i) : low_bits ? iq_ks_order(i) : i] = q[i];
            if (offset) {
                for (int l = 0; l < QK_K / 4; l++) {
                    const int8_t *ql = a[b].q + 4 * l;
                    a[b].corr[l] = -128 * (ql[0] + ql[1] + ql[2] + ql[3]);
                }
            } else {
                for (int j = 0; j < QK_K / 16; j++) {
                    int s = 0;
                    for (int i = 16 * j; i < 16 * (j + 1); i++) s += q[i];
                    a[b].sum16[j] = (int16_t)s;
                }
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

/* the 8 rows' 6-bit values of one sub-block, one byte each, from their 4 low (packed with the top bits of the other
 * 4's) and 4 high; `shift` picks the high ones' nibble */
static inline uint64_t six_bits(uint32_t lo, uint32_t hi_nibbles, int shift) {
    const uint32_t first = lo & 0x3f3f3f3fu, second = ((hi_nibbles >> shift) & 0x0f0f0f0fu) | ((lo >> 2) & 0x30303030u);
    return first | (uint64_t)second << 32;
}

/* for the lanes of 64-byte vector k, each 4 bytes of one group of 16 columns: 4k + lane / 4 (the group's scale index) */
static inline __m512i groups_of_16(int k) {
    return _mm512_set_epi32(4 * k + 3, 4 * k + 3, 4 * k + 3, 4 * k + 3, 4 * k + 2, 4 * k + 2, 4 * k + 2, 4 * k + 2,
                            4 * k + 1, 4 * k + 1, 4 * k + 1, 4 * k + 1, 4 * k, 4 * k, 4 * k, 4 * k);
}

/* each row's byte to the two 32-bit lanes of its row */
static inline __m512i spread_bytes(uint64_t v) {
    const __m128i b = _mm_cvtsi64_si128((long long)v);
    return _mm512_cvtepu8_epi32(_mm_unpacklo_epi8(b, b));
}

/* Many tokens: each weight group is read once for a tile of up to TILE of the tokens routed to its expert. For Q4_0
 * the 4 unpacked registers of a block serve every token of the tile (one token's work less the loads and
 * unpacking, TILE times over); for Q4_K and Q6_K a block's unpacked nibbles and scales serve 4 tokens at a time (their
 * accumulators would not fit the registers for 8). One token is a tile of one. */
#define TILE 8

/* Q4_0 (ggml's block_q4_0x8) or Q8_0 (ferry_repack_q8_0's layout: per block of 32 columns the 8 rows' fp16 scales,
 * then for each 8 columns the 8 rows' 8 bytes, each XOR 0x80, so unsigned: w + 128, the 128 taken back by the
 * activation's corr) against T tokens: the block's 4 registers of 8 bytes of 8 rows, unpacked once */
static inline __attribute__((always_inline)) void tile_32(const uint8_t *g, const uint8_t *const *act, int n,
                                                           float *const *out, const int T, const int q8) {
    const __m512i flip = _mm512_set1_epi8((char)0x88), low = _mm512_set1_epi8(0x0f);
    const __m512i spread = _mm512_set_epi32(7, 7, 6, 6, 5, 5, 4, 4, 3, 3, 2, 2, 1, 1, 0, 0);
    const int bytes = q8 ? Q8_0_BYTES : Q4_0_BYTES, ahead = q8 ? 2 * Q8_0_BYTES : PREFETCH_AHEAD;
    __m512 acc[TILE];
    for (int t = 0; t < T; t++) acc[t] = _mm512_setzero_ps();
    for (int b = 0; b < n / QK4_0; b++, g += bytes) {
        for (int line = 0; line < bytes; line += 64) _mm_prefetch((const char *)g + ahead + line, _MM_HINT_T0);
        __m512i w[4];
        if (q8) {
            for (int k = 0; k < 4; k++) w[k] = _mm512_loadu_si512(g + 16 + 64 * k);
        } else { /* (v ^ 0x88) & 0x0f: ternary logic 0x28 is (A ^ B) & C; bytes 0-7, 8-15, then their high nibbles */
            const __m512i lo = _mm512_loadu_si512(g + 16), hi = _mm512_loadu_si512(g + 80);
            w[0] = _mm512_ternarylogic_epi32(lo, flip, low, 0x28);
            w[1] = _mm512_ternarylogic_epi32(hi, flip, low, 0x28);
            w[2] = _mm512_ternarylogic_epi32(_mm512_srli_epi16(lo, 4), flip, low, 0x28);
            w[3] = _mm512_ternarylogic_epi32(_mm512_srli_epi16(hi, 4), flip, low, 0x28);
        }
        const __m512 dw = _mm512_permutexvar_ps(spread, _mm512_castps256_ps512(
                                                            _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)g))));
        for (int t = 0; t < T; t++) {
            const act_q4_0 *a = (const act_q4_0 *)act[t] + b;
            __m512i s = _mm512_set1_epi64(load_i64(a->corr));
            for (int k = 0; k < 4; k++) s = _mm512_dpbusd_epi32(s, w[k], _mm512_set1_epi64(load_i64(a->q + 8 * k)));
            acc[t] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(s), _mm512_mul_ps(dw, _mm512_set1_ps(a->d)), acc[t]);
        }
    }
    for (int t = 0; t < T; t++) { /* a row's two lanes summed */
        const __m512 pairs = _mm512_add_ps(acc[t], _mm512_permute_ps(acc[t], 0xb1)); /* lane i + lane i ^ 1 */
        _mm256_storeu_ps(out[t], _mm512_castps512_ps256(_mm512_permutexvar_ps(
                                     _mm512_set_epi32(0, 0, 0, 0, 0, 0, 0, 0, 14, 12, 10, 8, 6, 4, 2, 0), pairs)));
    }
}

/* the 8 rows of the Q4_K group at g (n columns) against up to 4 tokens, each block's nibbles and 6-bit scales
 * unpacked once for all: w = d sc q - dmin m, the mins against the activation's sums per sub-block */
static inline __attribute__((always_inline)) void tile_q4_k(const uint8_t *g, const uint8_t *const *act, int n,
                                                             float *const *out, const int T) {
    const __m512i low = _mm512_set1_epi8(0x0f);
    __m256 acc[4];
    for (int t = 0; t < T; t++) acc[t] = _mm256_setzero_ps();
    for (int b = 0; b < n / QK_K; b++, g += Q4_K_BYTES) {
        const uint8_t *packed = g + 32, *qs = g + 128;
        const act_q4_k *a[4];
        __m512i isum[4];
        __m256i msum[4];
        for (int t = 0; t < T; t++) {
            a[t] = (const act_q4_k *)act[t] + b;
            isum[t] = _mm512_setzero_si512();
            msum[t] = _mm256_setzero_si256();
        }
        for (int c = 0; c < 4; c++) { /* columns 64c..64c+63: sub-blocks 2c (low nibbles) and 2c + 1 (high) */
            const uint8_t *p0 = packed + 24 * c, *p1 = p0 + 12;
            const __m512i sc0 = spread_bytes(six_bits(load_u32(p0), load_u32(p0 + 8), 0));
            const __m512i sc1 = spread_bytes(six_bits(load_u32(p1), load_u32(p1 + 8), 0));
            const __m256i mins0 = _mm256_cvtepu8_epi32(
                _mm_cvtsi64_si128((long long)six_bits(load_u32(p0 + 4), load_u32(p0 + 8), 4)));
            const __m256i mins1 = _mm256_cvtepu8_epi32(
                _mm_cvtsi64_si128((long long)six_bits(load_u32(p1 + 4), load_u32(p1 + 8), 4)));
            __m512i lo_acc[4], hi_acc[4];
            for (int t = 0; t < T; t++) lo_acc[t] = hi_acc[t] = _mm512_setzero_si512();
            for (int k = 0; k < 4; k++) {
                const uint8_t *v8 = qs + 64 * (4 * c + k);
                _mm_prefetch((const char *)v8 + PREFETCH_AHEAD, _MM_HINT_T0);
                const __m512i v = _mm512_loadu_si512(v8);
                const __m512i vl = _mm512_and_si512(v, low), vh = _mm512_and_si512(_mm512_srli_epi16(v, 4), low);
                for (int t = 0; t < T; t++) {
                    lo_acc[t] = _mm512_dpbusd_epi32(lo_acc[t], vl,
                                                    _mm512_set1_epi64(load_i64(a[t]->q + 64 * c + 8 * k)));
                    hi_acc[t] = _mm512_dpbusd_epi32(hi_acc[t], vh,
                                                    _mm512_set1_epi64(load_i64(a[t]->q + 64 * c + 32 + 8 * k)));
                }
            }
            for (int t = 0; t < T; t++) {
                isum[t] = _mm512_add_epi32(isum[t], _mm512_add_epi32(_mm512_mullo_epi32(lo_acc[t], sc0),
                                                                     _mm512_mullo_epi32(hi_acc[t], sc1)));
                const __m256i m0 = _mm256_mullo_epi32(mins0, _mm256_set1_epi32(a[t]->sum[2 * c]));
                const __m256i m1 = _mm256_mullo_epi32(mins1, _mm256_set1_epi32(a[t]->sum[2 * c + 1]));
                msum[t] = _mm256_add_epi32(msum[t], _mm256_add_epi32(m0, m1));
            }
        }
        _mm_prefetch((const char *)g + PREFETCH_AHEAD, _MM_HINT_T0);
        _mm_prefetch((const char *)g + PREFETCH_AHEAD + 64, _MM_HINT_T0);
        const __m256 d = _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)g));
        const __m256 dmin = _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(g + 16)));
        for (int t = 0; t < T; t++) {
            const __m256i rows = _mm512_cvtepi64_epi32(_mm512_add_epi32(isum[t], _mm512_srli_epi64(isum[t], 32)));
            const __m256 dx = _mm256_set1_ps(a[t]->d);
            acc[t] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(rows), _mm256_mul_ps(d, dx), acc[t]);
            acc[t] = _mm256_fnmadd_ps(_mm256_cvtepi32_ps(msum[t]), _mm256_mul_ps(dmin, dx), acc[t]);
        }
    }
    for (int t = 0; t < T; t++) _mm256_storeu_ps(out[t], acc[t]);
}

/* a Q6_K row's super-block at row as its 4 vectors of values q (0..63; the weight is d sc (q - 32)) in column order:
 * vector 2h + i columns 128h + 64i..128h + 64i + 63 */
static inline __attribute__((always_inline)) void q6_k_vectors(const uint8_t *row, __m512i *v) {
    const __m512i nibble = _mm512_set1_epi8(0x0f), pair = _mm512_set1_epi8(0x30);
    /* the high pairs to bits 4-5 of each byte: weights l, l + 32 (lower, upper 256 bits) shift left 4 and 2, weights
     * l + 64, l + 96 right 0 and 2 (16-bit shifts; the 0x30 mask keeps each byte's own bits) */
    const __m512i left = _mm512_inserti64x4(_mm512_set1_epi16(4), _mm256_set1_epi16(2), 1);
    const __m512i right = _mm512_inserti64x4(_mm512_setzero_si512(), _mm256_set1_epi16(2), 1);
    for (int h = 0; h < 2; h++) {
        const __m512i lo = _mm512_loadu_si512(row + 64 * h);
        const __m512i hi = _mm512_broadcast_i64x4(_mm256_loadu_si256((const __m256i *)(row + 128 + 32 * h)));
        v[2 * h] = _mm512_or_si512(_mm512_and_si512(lo, nibble), _mm512_and_si512(_mm512_sllv_epi16(hi, left), pair));
        v[2 * h + 1] = _mm512_or_si512(_mm512_and_si512(_mm512_srli_epi16(lo, 4), nibble),
                                       _mm512_and_si512(_mm512_srlv_epi16(hi, right), pair));
    }
}

/* the 8 Q6_K rows at g (n columns each, one after another: plain, so that all types share the (slot, matrix, group)
 * split) against up to 4 tokens: each row's quarter-blocks and scales unpacked once for all */
static inline __attribute__((always_inline)) void tile_q6_k(const uint8_t *g, const uint8_t *const *act, int n,
                                                             float *const *out, const int T) {
    const __m512i low16 = _mm512_set1_epi32(0xffff);
    __m512i lane_of[4]; /* the scale index of each 32-bit lane of the block's 64-column quarter k */
    for (int k = 0; k < 4; k++) lane_of[k] = groups_of_16(k);
    const int blocks = n / QK_K;
    for (int r = 0; r < GROUP; r++) {
        const uint8_t *row = g + (size_t)r * blocks * Q6_K_BYTES;
        __m512 acc[4];
        for (int t = 0; t < T; t++) acc[t] = _mm512_setzero_ps();
        for (int b = 0; b < blocks; b++, row += Q6_K_BYTES) {
            _mm_prefetch((const char *)row + PREFETCH_AHEAD, _MM_HINT_T0);
            _mm_prefetch((const char *)row + PREFETCH_AHEAD + 64, _MM_HINT_T0);
            _mm_prefetch((const char *)row + PREFETCH_AHEAD + 128, _MM_HINT_T0);
            _mm_prefetch((const char *)row + PREFETCH_AHEAD + 192, _MM_HINT_T0);
            const __m512i scales = _mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i *)(row + 192)));
            __m512i isum[4];
            for (int t = 0; t < T; t++) isum[t] = _mm512_setzero_si512();
            __m512i v[4];
            q6_k_vectors(row, v);
            for (int h = 0; h < 2; h++) { /* columns 128h..128h+127 */
                const __m512i v0 = v[2 * h], v1 = v[2 * h + 1];
                const __m512i s0 = _mm512_permutexvar_epi32(lane_of[2 * h], scales);
                const __m512i s1 = _mm512_permutexvar_epi32(lane_of[2 * h + 1], scales);
                /* each lane's scale in both its 16-bit halves, for vpmaddwd after vpmaddubsw (vpmulld after vpdpbusd
                 * was 9% slower at 512 tokens on the H100 machine's Xeon); q - 32's offset is taken off per block */
                const __m512i m0 = _mm512_or_si512(_mm512_and_si512(s0, low16), _mm512_slli_epi32(s0, 16));
                const __m512i m1 = _mm512_or_si512(_mm512_and_si512(s1, low16), _mm512_slli_epi32(s1, 16));
                for (int t = 0; t < T; t++) {
                    const act_q6_k *a = (const act_q6_k *)act[t] + b;
                    const __m512i d0 = _mm512_madd_epi16(_mm512_maddubs_epi16(v0, _mm512_loadu_si512(a->q + 128 * h)),
                                                         m0);
                    const __m512i d1 = _mm512_madd_epi16(
                        _mm512_maddubs_epi16(v1, _mm512_loadu_si512(a->q + 128 * h + 64)), m1);
                    isum[t] = _mm512_add_epi32(isum[t], _mm512_add_epi32(d0, d1));
                }
            }
            /* - 32 sum over sub-blocks of scale * (the sum of its 16 activations) */
            const __m256i sc16 = _mm256_cvtepi8_epi16(_mm_loadu_si128((const __m128i *)(row + 192)));
            for (int t = 0; t < T; t++) {
                const __m256i off = _mm256_madd_epi16(sc16, _mm256_loadu_si256(
                                                                (const __m256i *)((const act_q6_k *)act[t] + b)->sum16));
                isum[t] = _mm512_sub_epi32(isum[t], _mm512_zextsi256_si512(_mm256_slli_epi32(off, 5)));
            }
            uint16_t dh;
            memcpy(&dh, row + 208, 2);
            const float d = _cvtsh_ss(dh);
            for (int t = 0; t < T; t++)
                acc[t] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(isum[t]),
                                         _mm512_set1_ps(d * ((const act_q6_k *)act[t] + b)->d), acc[t]);
        }
        for (int t = 0; t < T; t++) out[t][r] = _mm512_reduce_add_ps(acc[t]);
    }
}

/* the 8 Q5_K rows at g (plain, one after another) against up to 4 tokens: each super-block's 5-bit values unpacked
 * once for all (low nibbles, and the high bit of qh moved to bit 4), its scales per 32-bit lane; w = d sc q - dmin m,
 * the mins against the activation's sums per sub-block */
/* a Q5_K row's super-block at row as its 4 vectors of values (0..31) in q5_k_order: vector 2h the low nibbles of
 * bytes 64h..64h + 63 with their fifth bits, 2h + 1 the high */
static inline __attribute__((always_inline)) void q5_k_vectors(const uint8_t *row, __m512i *w) {
    const __m512i nibble = _mm512_set1_epi8(0x0f), bit4 = _mm512_set1_epi8(0x10);
    /* qh's bit 4h (lower 256 bits) and 4h + 2 (upper) to bit 4 for vector 2h, bits 4h + 1 and 4h + 3 for 2h + 1:
     * 16-bit shifts (a byte's bit 4 comes from its own bits for shifts of 4 left to 3 right) */
    const __m512i left0 = _mm512_inserti64x4(_mm512_set1_epi16(4), _mm256_set1_epi16(2), 1);
    const __m512i left1 = _mm512_inserti64x4(_mm512_set1_epi16(3), _mm256_set1_epi16(1), 1);
    const __m512i right0 = _mm512_inserti64x4(_mm512_setzero_si512(), _mm256_set1_epi16(2), 1);
    const __m512i right1 = _mm512_inserti64x4(_mm512_set1_epi16(1), _mm256_set1_epi16(3), 1);
    const __m512i qh = _mm512_broadcast_i64x4(_mm256_loadu_si256((const __m256i *)(row + 16)));
    for (int h = 0; h < 2; h++) {
        const __m512i v = _mm512_loadu_si512(row + 48 + 64 * h);
        const __m512i hi0 = h ? _mm512_srlv_epi16(qh, right0) : _mm512_sllv_epi16(qh, left0);
        const __m512i hi1 = h ? _mm512_srlv_epi16(qh, right1) : _mm512_sllv_epi16(qh, left1);
        /* ternary logic 0xf8: A | (B & C) */
        w[2 * h] = _mm512_ternarylogic_epi32(_mm512_and_si512(v, nibble), hi0, bit4, 0xf8);
        w[2 * h + 1] = _mm512_ternarylogic_epi32(_mm512_and_si512(_mm512_srli_epi16(v, 4), nibble), hi1, bit4, 0xf8);
    }
}

static inline __attribute__((always_inline)) void tile_q5_k(const uint8_t *g, const uint8_t *const *act, int n,
                                                             float *const *out, const int T) {
    __m512i lane_of[4]; /* vector k's sub-blocks per lane: lower 8 lanes 4h + (k & 1), upper 4h + (k & 1) + 2 */
    for (int k = 0; k < 4; k++) {
        const int s = 4 * (k / 2) + (k & 1);
        lane_of[k] = _mm512_inserti64x4(_mm512_set1_epi32(s), _mm256_set1_epi32(s + 2), 1);
    }
    const int blocks = n / QK_K;
    for (int r = 0; r < GROUP; r++) {
        const uint8_t *row = g + (size_t)r * blocks * Q5_K_BYTES;
        __m512 acc[4];
        __m256 mins[4];
        for (int t = 0; t < T; t++) acc[t] = _mm512_setzero_ps(), mins[t] = _mm256_setzero_ps();
        for (int b = 0; b < blocks; b++, row += Q5_K_BYTES) {
            for (int line = 0; line < 192; line += 64) _mm_prefetch((const char *)row + PREFETCH_AHEAD + line, _MM_HINT_T0);
            const uint64_t sc8 = six_bits(load_u32(row + 4), load_u32(row + 12), 0);
            const uint64_t m8 = six_bits(load_u32(row + 8), load_u32(row + 12), 4);
            const __m512i scales = _mm512_cvtepu8_epi32(_mm_cvtsi64_si128((long long)sc8));
            const __m256i m32 = _mm256_cvtepu8_epi32(_mm_cvtsi64_si128((long long)m8));
            __m512i w[4];
            q5_k_vectors(row, w);
            __m512i sc[4];
            for (int k = 0; k < 4; k++) {
                sc[k] = _mm512_permutexvar_epi32(lane_of[k], scales);
                sc[k] = _mm512_or_si512(sc[k], _mm512_slli_epi32(sc[k], 16)); /* unsigned: in both 16-bit halves */
            }
            uint16_t dh[2];
            memcpy(dh, row, 4);
            const float d = _cvtsh_ss(dh[0]), dmin = _cvtsh_ss(dh[1]);
            for (int t = 0; t < T; t++) {
                const act_q4_k *a = (const act_q4_k *)act[t] + b;
                __m512i isum = _mm512_setzero_si512();
                for (int k = 0; k < 4; k++) {
                    const __m512i aq = _mm512_loadu_si512(a->q + 64 * k);
                    isum = _mm512_add_epi32(isum, _mm512_madd_epi16(_mm512_maddubs_epi16(w[k], aq), sc[k]));
                }
                acc[t] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(isum), _mm512_set1_ps(d * a->d), acc[t]);
                const __m256i msum = _mm256_mullo_epi32(m32, _mm256_loadu_si256((const __m256i *)a->sum));
                mins[t] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(msum), _mm256_set1_ps(dmin * a->d), mins[t]);
            }
        }
        for (int t = 0; t < T; t++)
            out[t][r] = _mm512_reduce_add_ps(_mm512_sub_ps(acc[t], _mm512_zextps256_ps512(mins[t])));
    }
}

/* IQ4_NL's 16 values (IQ4_XS's table, IQ4_KS's first half) + 128, unsigned for VNNI, in every 128-bit lane */
static inline __m512i iq4nl_table(void) {
    return _mm512_broadcast_i32x4(_mm_setr_epi8((char)1, (char)24, (char)45, (char)63, (char)79, (char)93, (char)106,
                                                (char)118, (char)129, (char)141, (char)153, (char)166, (char)181,
                                                (char)197, (char)217, (char)241));
}

/* one super-block's 4 vectors of table values w (stored + 128; IQ4_XS, ik_llama.cpp's IQ4_KS, IQ4_K, IQ5_KS, IQ3_KS,
 * IQ2_KS) against a token's activation block in their order: each 32-bit lane's dot product times its sub-block's
 * scale: sc[h] for both vectors of load h (IQ4_XS / IQ4_KS: a scale per 32 in each), or with per_vector sc[k] for
 * vector k (its lanes' scales of their own) */
static inline __attribute__((always_inline)) __m512i table_dots(const act_q6_k *a, const __m512i *w, const __m512i *sc,
                                                                const int per_vector) {
    __m512i isum = _mm512_setzero_si512();
    for (int h = 0; h < 2; h++) {
        const __m512i lo = _mm512_dpbusd_epi32(_mm512_loadu_si512(a->corr + 32 * h), w[2 * h],
                                               _mm512_loadu_si512(a->q + 128 * h));
        const __m512i hi = _mm512_dpbusd_epi32(_mm512_loadu_si512(a->corr + 32 * h + 16), w[2 * h + 1],
                                               _mm512_loadu_si512(a->q + 128 * h + 64));
        if (per_vector)
            isum = _mm512_add_epi32(isum, _mm512_add_epi32(_mm512_mullo_epi32(lo, sc[2 * h]),
                                                           _mm512_mullo_epi32(hi, sc[2 * h + 1])));
        else
            isum = _mm512_add_epi32(isum, _mm512_mullo_epi32(_mm512_add_epi32(lo, hi), sc[h]));
    }
    return isum;
}

/* IQ4_KS's / IQ5_KS's 8 scale bytes S (the low 8 of S) as their sub-blocks' scales (S & 254) - 127, 32-bit lanes 0-7 */
static inline __m512i ks_scales(__m128i S) {
    return _mm512_castsi256_si512(_mm256_sub_epi32(_mm256_and_si256(_mm256_cvtepu8_epi32(S), _mm256_set1_epi32(254)),
                                                   _mm256_set1_epi32(127)));
}

/* super-block b's table values w and scales sc (table_dots) against up to 4 tokens' activation blocks, times d and
 * each token's scale, into acc */
static inline __attribute__((always_inline)) void add_block(__m512 *acc, const uint8_t *const *act, int b,
                                                             const __m512i *w, const __m512i *sc, const int per_vector,
                                                             float d, const int T) {
    for (int t = 0; t < T; t++) {
        const act_q6_k *a = (const act_q6_k *)act[t] + b;
        acc[t] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(table_dots(a, w, sc, per_vector)), _mm512_set1_ps(d * a->d), acc[t]);
    }
}

/* the 8 IQ4_XS rows at g (plain, one after another) against up to 4 tokens: each super-block's nibbles looked up in
 * IQ4_NL's table once for all (stored + 128, unsigned for VNNI; the activation's corr takes the 128 back), its 6-bit
 * scales less 32 per 32-bit lane: w = d (ls - 32) table[q] */
static inline __attribute__((always_inline)) void tile_iq4_xs(const uint8_t *g, const uint8_t *const *act, int n,
                                                               float *const *out, const int T) {
    const __m512i nibble = _mm512_set1_epi8(0x0f);
    const __m512i table = iq4nl_table();
    const __m256i four_s = _mm256_setr_epi32(0, 4, 8, 12, 16, 20, 24, 28), two_s = _mm256_setr_epi32(0, 2, 4, 6, 8, 10,
                                                                                                      12, 14);
    __m512i lane_of[2]; /* the sub-block of each 32-bit lane in load h (16 bytes each: as Q6_K's groups of 16) */
    for (int h = 0; h < 2; h++) lane_of[h] = groups_of_16(h);
    const int blocks = n / QK_K;
    for (int r = 0; r < GROUP; r++) {
        const uint8_t *row = g + (size_t)r * blocks * IQ4_XS_BYTES;
        __m512 acc[4];
        for (int t = 0; t < T; t++) acc[t] = _mm512_setzero_ps();
        for (int b = 0; b < blocks; b++, row += IQ4_XS_BYTES) {
            for (int line = 0; line < 192; line += 64) _mm_prefetch((const char *)row + PREFETCH_AHEAD + line, _MM_HINT_T0);
            uint16_t dh, high;
            memcpy(&dh, row, 2);
            memcpy(&high, row + 2, 2);
            /* sub-block s's low 4 bits at bit 4 s of the 4 bytes after, its high 2 at bit 2 s of `high` */
            const __m256i lo4 = _mm256_srlv_epi32(_mm256_set1_epi32((int)load_u32(row + 4)), four_s);
            const __m256i hi2 = _mm256_srlv_epi32(_mm256_set1_epi32(high), two_s);
            const __m512i scales = _mm512_castsi256_si512(_mm256_sub_epi32(_mm256_or_si256(
                _mm256_and_si256(lo4, _mm256_set1_epi32(0xf)),
                _mm256_slli_epi32(_mm256_and_si256(hi2, _mm256_set1_epi32(3)), 4)), _mm256_set1_epi32(32)));
            __m512i w[4], sc[2];
            for (int h = 0; h < 2; h++) {
                const __m512i v = _mm512_loadu_si512(row + 8 + 64 * h);
                w[2 * h] = _mm512_shuffle_epi8(table, _mm512_and_si512(v, nibble));
                w[2 * h + 1] = _mm512_shuffle_epi8(table, _mm512_and_si512(_mm512_srli_epi16(v, 4), nibble));
                sc[h] = _mm512_permutexvar_epi32(lane_of[h], scales);
            }
            const float d = _cvtsh_ss(dh);
            add_block(acc, act, b, w, sc, 0, d, T);
        }
        for (int t = 0; t < T; t++) out[t][r] = _mm512_reduce_add_ps(acc[t]);
    }
}

/* the 8 IQ4_KS rows at g (plain, one after another, each after its float32 scale d) against up to 4 tokens: as
 * IQ4_XS, with a sub-block's scale byte S giving its scale (S & 254) - 127 and its table (S & 1: IQ4K's second half,
 * the first plus 4, added to each 128-bit lane's looked-up values; a blend of two tables by a mask made the tile
 * twice as slow, benchmarks/cpu_experts.py): w = d ((S & 254) - 127) table[S & 1][q]. kss: IQ4_KSS rows, unfolded
 * into IQ4_KS's scale bytes and nibbles first */
static inline __attribute__((always_inline)) void tile_iq4_ks(const uint8_t *g, const uint8_t *const *act, int n,
                                                               float *const *out, const int T, const int kss) {
    const __m512i nibble = _mm512_set1_epi8(0x0f), bit0 = _mm512_set1_epi16(1);
    const __m512i first = iq4nl_table();
    __m512i lane_of[2], lane_byte[2]; /* lane_byte[h]: byte 4h + k in every byte of 128-bit lane k */
    for (int h = 0; h < 2; h++) {
        lane_of[h] = groups_of_16(h);
        lane_byte[h] = _mm512_set_epi64(0x0101010101010101LL * (4 * h + 3), 0x0101010101010101LL * (4 * h + 3),
                                        0x0101010101010101LL * (4 * h + 2), 0x0101010101010101LL * (4 * h + 2),
                                        0x0101010101010101LL * (4 * h + 1), 0x0101010101010101LL * (4 * h + 1),
                                        0x0101010101010101LL * (4 * h), 0x0101010101010101LL * (4 * h));
    }
    const int blocks = n / QK_K, bytes = kss ? IQ4_KSS_BYTES : IQ4_KS_BYTES;
    const size_t row_bytes = 4 + (size_t)blocks * bytes;
    for (int r = 0; r < GROUP; r++) {
        const uint8_t *row = g + (size_t)r * row_bytes;
        float d;
        memcpy(&d, row, 4);
        row += 4;
        __m512 acc[4];
        for (int t = 0; t < T; t++) acc[t] = _mm512_setzero_ps();
        for (int b = 0; b < blocks; b++, row += bytes) {
            for (int line = 0; line < 192; line += 64) _mm_prefetch((const char *)row + PREFETCH_AHEAD + line, _MM_HINT_T0);
            __m512i qs[2];
            __m128i S;
            if (kss) { /* IQ4_KSS: word k of load h is word k % 8 of sub-block 4h + k / 8, bit 0 its scale byte's bit
                        * k % 8; the rest x gives IQ4_KS's two nibble bytes as x ^ (x >> 1) */
                for (int h = 0; h < 2; h++) {
                    const __m512i v = _mm512_andnot_si512(bit0, _mm512_loadu_si512(row + 64 * h));
                    qs[h] = _mm512_xor_si512(v, _mm512_srli_epi16(v, 1));
                }
                const uint64_t bits = (uint64_t)_mm512_test_epi16_mask(_mm512_loadu_si512(row), bit0)
                                      | (uint64_t)_mm512_test_epi16_mask(_mm512_loadu_si512(row + 64), bit0) << 32;
                S = _mm_cvtsi64_si128((long long)bits);
            } else {
                for (int h = 0; h < 2; h++) qs[h] = _mm512_loadu_si512(row + 8 + 64 * h);
                S = _mm_loadl_epi64((const __m128i *)row);
            }
            const __m512i scales = ks_scales(S);
            /* 4 where a sub-block takes the second table (its values the first's plus 4), spread over its 16 bytes:
             * lane k of load h is sub-block 4h + k */
            const __m512i four = _mm512_broadcast_i32x4(_mm_and_si128(_mm_slli_epi16(S, 2), _mm_set1_epi8(4)));
            __m512i w[4], sc[2];
            for (int h = 0; h < 2; h++) {
                const __m512i shift = _mm512_shuffle_epi8(four, lane_byte[h]);
                const __m512i v = qs[h];
                w[2 * h] = _mm512_add_epi8(_mm512_shuffle_epi8(first, _mm512_and_si512(v, nibble)), shift);
                w[2 * h + 1] = _mm512_add_epi8(
                    _mm512_shuffle_epi8(first, _mm512_and_si512(_mm512_srli_epi16(v, 4), nibble)), shift);
                sc[h] = _mm512_permutexvar_epi32(lane_of[h], scales);
            }
            add_block(acc, act, b, w, sc, 0, d, T);
        }
        for (int t = 0; t < T; t++) out[t][r] = _mm512_reduce_add_ps(acc[t]);
    }
}

/* the 8 IQ4_K rows at g (plain, one after another) against up to 4 tokens: as IQ4_XS with a scale per 16 (6 bits
 * less 32: a nibble of the 8 bytes at 8, a bit pair of the 4 at 4) and a table per 16 (bit k of `extra`: IQ4K's
 * second half, the first plus 4, added to the k-th 16's looked-up values under a mask):
 * w = d s_k table[extra_k][q] */
static inline __attribute__((always_inline)) void tile_iq4_k(const uint8_t *g, const uint8_t *const *act, int n,
                                                              float *const *out, const int T) {
    const __m512i nibble = _mm512_set1_epi8(0x0f), four = _mm512_set1_epi8(4), first = iq4nl_table();
    const __m256i four_s = _mm256_setr_epi32(0, 4, 8, 12, 16, 20, 24, 28), fifteen = _mm256_set1_epi32(15);
    const __m256i three = _mm256_set1_epi32(3), thirty_two = _mm256_set1_epi32(32);
    __m512i lane_of[2];
    for (int h = 0; h < 2; h++) lane_of[h] = groups_of_16(h);
    const int blocks = n / QK_K;
    for (int r = 0; r < GROUP; r++) {
        const uint8_t *row = g + (size_t)r * blocks * IQ4_K_BYTES;
        __m512 acc[4];
        for (int t = 0; t < T; t++) acc[t] = _mm512_setzero_ps();
        for (int b = 0; b < blocks; b++, row += IQ4_K_BYTES) {
            for (int line = 0; line < 192; line += 64) _mm_prefetch((const char *)row + PREFETCH_AHEAD + line, _MM_HINT_T0);
            uint16_t dh, extra;
            memcpy(&dh, row, 2);
            memcpy(&extra, row + 2, 2);
            /* 32 ib's bit pairs: bits 4 ib of the 4 bytes at 4 (byte ib / 2, nibble ib % 2); its nibbles: byte 8 + ib */
            const __m256i high = _mm256_and_si256(_mm256_srlv_epi32(_mm256_set1_epi32((int)load_u32(row + 4)), four_s),
                                                  fifteen);
            const __m256i low = _mm256_cvtepu8_epi32(_mm_loadl_epi64((const __m128i *)(row + 8)));
            const __m256i s_first = _mm256_sub_epi32(_mm256_or_si256(_mm256_and_si256(low, fifteen),
                                                                     _mm256_slli_epi32(_mm256_and_si256(high, three), 4)),
                                                     thirty_two);
            const __m256i s_second = _mm256_sub_epi32(_mm256_or_si256(_mm256_srli_epi32(low, 4),
                                                                      _mm256_slli_epi32(_mm256_srli_epi32(high, 2), 4)),
                                                      thirty_two);
            __m512i w[4], sc[4];
            for (int h = 0; h < 2; h++) {
                const __m512i v = _mm512_loadu_si512(row + 16 + 64 * h);
                for (int p = 0; p < 2; p++) { /* p = 0: each 32's first 16 (low nibbles), 1: its second */
                    /* extra's bits 2 (4h + k) + p, k = 0..3, each to the 16 bytes of lane k */
                    const __mmask64 second = _pdep_u64(_pext_u32((uint32_t)extra >> (8 * h + p), 0x55),
                                                       0x0001000100010001ULL) * 0xffff;
                    const __m512i q = _mm512_and_si512(p ? _mm512_srli_epi16(v, 4) : v, nibble);
                    const __m512i t = _mm512_shuffle_epi8(first, q);
                    w[2 * h + p] = _mm512_mask_add_epi8(t, second, t, four);
                    sc[2 * h + p] = _mm512_permutexvar_epi32(lane_of[h], _mm512_castsi256_si512(p ? s_second : s_first));
                }
            }
            const float d = _cvtsh_ss(dh);
            add_block(acc, act, b, w, sc, 1, d, T);
        }
        for (int t = 0; t < T; t++) out[t][r] = _mm512_reduce_add_ps(acc[t]);
    }
}

/* the bytes of a vector holding sub-blocks lo (its low 32 bytes) and hi (its high 32) whose bit in `halves` is set:
 * where the table's second half applies */
static inline __mmask64 halves_mask(uint32_t halves, int lo, int hi) {
    return (halves >> lo & 1 ? 0xffffffffULL : 0) | (halves >> hi & 1 ? ~0xffffffffULL : 0);
}

/* the 8 IQ3_KS (three = 1) or IQ2_KS rows at g (plain, one after another, each after its fp16 d) against up to 4
 * tokens: vector k of a super-block holds sub-blocks k and 4 + k (the 2-bit indices at bits 2k of its 64 bytes, and
 * for IQ3_KS a third bit from bit k / 4 + k of the 32 bytes after), looked up in the first half of IQ3NL's / IQ2NL's
 * table (stored + 128), the second half (the first plus 4 / 5) added where the sub-block's bit says; each sub-block's
 * scale is its 5 bits less 16: w = d (ls - 16) table[half][q] */
static inline __attribute__((always_inline)) void tile_iq_ks_low(const uint8_t *g, const uint8_t *const *act, int n,
                                                                  float *const *out, const int T, const int three) {
    const __m512i pair = _mm512_set1_epi8(3), one = _mm512_set1_epi8(1);
    const __m512i table = three ? _mm512_broadcast_i32x4(_mm_setr_epi8(65, 88, 105, 118, (char)129, (char)141,
                                                                       (char)156, (char)175, 0, 0, 0, 0, 0, 0, 0, 0))
                                : _mm512_broadcast_i32x4(_mm_setr_epi8(97, 115, (char)129, (char)145, 0, 0, 0, 0, 0, 0,
                                                                       0, 0, 0, 0, 0, 0));
    const __m512i shift = _mm512_set1_epi8(three ? 4 : 5);
    /* the scale nibble of sub-block ib: IQ3_KS bits 8 (ib % 4) + 4 (ib / 4) of the 4 bytes, IQ2_KS 4 ib */
    const __m256i nibble_at = three ? _mm256_setr_epi32(0, 8, 16, 24, 4, 12, 20, 28)
                                    : _mm256_setr_epi32(0, 4, 8, 12, 16, 20, 24, 28);
    const __m256i bit_at = _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7), fifteen = _mm256_set1_epi32(15);
    __m512i lane_of[4], third_at[4]; /* vector k: lanes 0-7 sub-block k, 8-15 sub-block 4 + k; qh's bit k, 4 + k */
    for (int k = 0; k < 4; k++) {
        lane_of[k] = _mm512_inserti64x4(_mm512_set1_epi32(k), _mm256_set1_epi32(4 + k), 1);
        third_at[k] = _mm512_inserti64x4(_mm512_set1_epi16((short)k), _mm256_set1_epi16((short)(4 + k)), 1);
    }
    const int blocks = n / QK_K, bytes = three ? IQ3_KS_BYTES : IQ2_KS_BYTES;
    const size_t row_bytes = 2 + (size_t)blocks * bytes;
    for (int r = 0; r < GROUP; r++) {
        const uint8_t *row = g + (size_t)r * row_bytes;
        uint16_t dh;
        memcpy(&dh, row, 2);
        const float d = _cvtsh_ss(dh);
        row += 2;
        __m512 acc[4];
        for (int t = 0; t < T; t++) acc[t] = _mm512_setzero_ps();
        for (int b = 0; b < blocks; b++, row += bytes) {
            for (int line = 0; line < 128; line += 64) _mm_prefetch((const char *)row + PREFETCH_AHEAD + line, _MM_HINT_T0);
            uint16_t extra;
            memcpy(&extra, row, 2);
            const uint32_t fifth = three ? extra & 0xff : extra >> 8, halves = three ? extra >> 8 : extra & 0xff;
            const __m256i ls = _mm256_or_si256(
                _mm256_and_si256(_mm256_srlv_epi32(_mm256_set1_epi32((int)load_u32(row + 2)), nibble_at), fifteen),
                _mm256_slli_epi32(_mm256_and_si256(_mm256_srlv_epi32(_mm256_set1_epi32((int)fifth), bit_at),
                                                   _mm256_set1_epi32(1)), 4));
            const __m512i scales = _mm512_castsi256_si512(_mm256_sub_epi32(ls, _mm256_set1_epi32(16)));
            const __m512i v = _mm512_loadu_si512(row + 6);
            __m512i qh = _mm512_setzero_si512();
            if (three) qh = _mm512_broadcast_i64x4(_mm256_loadu_si256((const __m256i *)(row + 70)));
            __m512i w[4], sc[4];
            for (int k = 0; k < 4; k++) {
                __m512i q = _mm512_and_si512(_mm512_srli_epi16(v, 2 * k), pair);
                if (three)
                    q = _mm512_or_si512(q, _mm512_slli_epi16(_mm512_and_si512(_mm512_srlv_epi16(qh, third_at[k]), one),
                                                             2));
                const __m512i t = _mm512_shuffle_epi8(table, q);
                const __mmask64 second = halves_mask(halves, k, 4 + k);
                w[k] = _mm512_mask_add_epi8(t, second, t, shift);
                sc[k] = _mm512_permutexvar_epi32(lane_of[k], scales);
            }
            add_block(acc, act, b, w, sc, 1, d, T);
        }
        for (int t = 0; t < T; t++) out[t][r] = _mm512_reduce_add_ps(acc[t]);
    }
}
/* the 8 IQ5_KS rows at g (plain, one after another, each after its float32 d) against up to 4 tokens: vector 2h + p
 * holds sub-blocks 4h + p and 4h + 2 + p (nibble p of the 64 bytes of load h, a fifth bit from qh), looked up in IQ5NL's
 * first half (stored + 128: two 16-value shuffles, the second where bit 4 is set), the second half (the first plus 2)
 * added where the sub-block's scale byte S says (S & 1); w = d ((S & 254) - 127) table[S & 1][q] */
static inline __attribute__((always_inline)) void tile_iq5_ks(const uint8_t *g, const uint8_t *const *act, int n,
                                                               float *const *out, const int T) {
    const __m512i nibble = _mm512_set1_epi8(0x0f), bit4 = _mm512_set1_epi8(0x10), two = _mm512_set1_epi8(2);
    const __m512i low = _mm512_broadcast_i32x4(_mm_setr_epi8(2, 14, 25, 36, 45, 54, 63, 71, 78, 85, 92, 98, 104, 110,
                                                              116, 122));
    const __m512i high = _mm512_broadcast_i32x4(_mm_setr_epi8((char)127, (char)133, (char)139, (char)145, (char)151,
                                                               (char)157, (char)164, (char)171, (char)179, (char)187,
                                                               (char)196, (char)205, (char)215, (char)225, (char)237,
                                                               (char)249));
    __m512i lane_of[4], fifth_at[4]; /* vector 2h + p: sub-blocks 4h + p (lanes 0-7) and 4h + 2 + p (8-15) */
    for (int h = 0; h < 2; h++)
        for (int p = 0; p < 2; p++) {
            const int s0 = 4 * h + p, s1 = 4 * h + 2 + p;
            lane_of[2 * h + p] = _mm512_inserti64x4(_mm512_set1_epi32(s0), _mm256_set1_epi32(s1), 1);
            fifth_at[2 * h + p] = _mm512_inserti64x4(_mm512_set1_epi16((short)s0), _mm256_set1_epi16((short)s1), 1);
        }
    const int blocks = n / QK_K;
    const size_t row_bytes = 4 + (size_t)blocks * IQ5_KS_BYTES;
    for (int r = 0; r < GROUP; r++) {
        const uint8_t *row = g + (size_t)r * row_bytes;
        float d;
        memcpy(&d, row, 4);
        row += 4;
        __m512 acc[4];
        for (int t = 0; t < T; t++) acc[t] = _mm512_setzero_ps();
        for (int b = 0; b < blocks; b++, row += IQ5_KS_BYTES) {
            for (int line = 0; line < 192; line += 64) _mm_prefetch((const char *)row + PREFETCH_AHEAD + line, _MM_HINT_T0);
            const __m128i S = _mm_loadl_epi64((const __m128i *)row);
            const __m512i scales = ks_scales(S);
            const uint32_t halves = (uint32_t)_mm_movemask_epi8(_mm_slli_epi16(S, 7)); /* bit ib: S_ib & 1 */
            const __m512i qh = _mm512_broadcast_i64x4(_mm256_loadu_si256((const __m256i *)(row + 136)));
            __m512i w[4], sc[4];
            for (int h = 0; h < 2; h++) {
                const __m512i v = _mm512_loadu_si512(row + 8 + 64 * h);
                for (int p = 0; p < 2; p++) {
                    const int k = 2 * h + p;
                    const __m512i q = _mm512_or_si512(
                        _mm512_and_si512(p ? _mm512_srli_epi16(v, 4) : v, nibble),
                        _mm512_and_si512(_mm512_slli_epi16(_mm512_srlv_epi16(qh, fifth_at[k]), 4), bit4));
                    const __m512i t = _mm512_mask_shuffle_epi8(_mm512_shuffle_epi8(low, q),
                                                               _mm512_test_epi8_mask(q, bit4), high, q);
                    const __mmask64 second = halves_mask(halves, 4 * h + p, 4 * h + 2 + p);
                    w[k] = _mm512_mask_add_epi8(t, second, t, two);
                    sc[k] = _mm512_permutexvar_epi32(lane_of[k], scales);
                }
            }
            add_block(acc, act, b, w, sc, 1, d, T);
        }
        for (int t = 0; t < T; t++) out[t][r] = _mm512_reduce_add_ps(acc[t]);
    }
}
/* the 8 IQ3_K (three = 1) or IQ2_K rows at g (plain, one after another) against up to 4 tokens: IQ3_KS's / IQ2_KS's
 * vectors (vector k: sub-blocks k and 4 + k) with a scale and a table half per 16 (each 16 bytes of a vector: the
 * 16s 2k, 2k + 1, 8 + 2k, 9 + 2k): IQ2_K's scale a nibble less 8, IQ3_K's 2 n + 1 under a sign bit; the block's fp16
 * d: w = d s_16 table[extra_16][q] */
static inline __attribute__((always_inline)) void tile_iq_k_low(const uint8_t *g, const uint8_t *const *act, int n,
                                                                 float *const *out, const int T, const int three) {
    const __m512i pair = _mm512_set1_epi8(3), one = _mm512_set1_epi8(1);
    const __m512i table = three ? _mm512_broadcast_i32x4(_mm_setr_epi8(65, 88, 105, 118, (char)129, (char)141,
                                                                       (char)156, (char)175, 0, 0, 0, 0, 0, 0, 0, 0))
                                : _mm512_broadcast_i32x4(_mm_setr_epi8(97, 115, (char)129, (char)145, 0, 0, 0, 0, 0, 0,
                                                                       0, 0, 0, 0, 0, 0));
    const __m512i shift = _mm512_set1_epi8(three ? 4 : 5);
    __m512i lane_of[4], third_at[4]; /* vector k's lanes: the 16s 2k (0-3), 2k + 1 (4-7), 8 + 2k (8-11), 9 + 2k */
    for (int k = 0; k < 4; k++) {
        lane_of[k] = _mm512_set_epi32(9 + 2 * k, 9 + 2 * k, 9 + 2 * k, 9 + 2 * k, 8 + 2 * k, 8 + 2 * k, 8 + 2 * k,
                                      8 + 2 * k, 2 * k + 1, 2 * k + 1, 2 * k + 1, 2 * k + 1, 2 * k, 2 * k, 2 * k, 2 * k);
        third_at[k] = _mm512_inserti64x4(_mm512_set1_epi16((short)k), _mm256_set1_epi16((short)(4 + k)), 1);
    }
    const int blocks = n / QK_K, bytes = three ? IQ3_K_BYTES : IQ2_K_BYTES, at = three ? 6 : 4;
    for (int r = 0; r < GROUP; r++) {
        const uint8_t *row = g + (size_t)r * blocks * bytes;
        __m512 acc[4];
        for (int t = 0; t < T; t++) acc[t] = _mm512_setzero_ps();
        for (int b = 0; b < blocks; b++, row += bytes) {
            for (int line = 0; line < 128; line += 64) _mm_prefetch((const char *)row + PREFETCH_AHEAD + line, _MM_HINT_T0);
            uint16_t dh, extra;
            memcpy(&dh, row, 2);
            memcpy(&extra, row + 2, 2);
            /* the 16s' scale nibbles as 32-bit lanes: the 16th l's is bits 4l of the 8 bytes (byte l / 2, nibble l % 2) */
            const uint64_t sc8 = (uint64_t)load_i64(row + at);
            const __m512i nib = _mm512_cvtepu8_epi32(_mm_set_epi64x((long long)_pdep_u64(sc8 >> 32, 0x0f0f0f0f0f0f0f0fULL),
                                                                    (long long)_pdep_u64(sc8, 0x0f0f0f0f0f0f0f0fULL)));
            __m512i scales;
            if (three) {
                uint16_t sign;
                memcpy(&sign, row + 4, 2);
                const __m512i odd = _mm512_add_epi32(_mm512_slli_epi32(nib, 1), _mm512_set1_epi32(1));
                scales = _mm512_mask_sub_epi32(odd, (__mmask16)sign, _mm512_setzero_si512(), odd);
            } else {
                scales = _mm512_sub_epi32(nib, _mm512_set1_epi32(8));
            }
            const __m512i v = _mm512_loadu_si512(row + at + 8);
            __m512i qh = _mm512_setzero_si512();
            if (three) qh = _mm512_broadcast_i64x4(_mm256_loadu_si256((const __m256i *)(row + 78)));
            __m512i w[4], sc[4];
            for (int k = 0; k < 4; k++) {
                __m512i q = _mm512_and_si512(_mm512_srli_epi16(v, 2 * k), pair);
                if (three)
                    q = _mm512_or_si512(q, _mm512_slli_epi16(_mm512_and_si512(_mm512_srlv_epi16(qh, third_at[k]), one),
                                                             2));
                const __m512i t = _mm512_shuffle_epi8(table, q);
                /* extra's bits 2k, 2k + 1, 8 + 2k, 9 + 2k, each to 16 bytes */
                const uint64_t bits = (extra >> (2 * k) & 3) | (extra >> (8 + 2 * k) & 3) << 2;
                const __mmask64 second = _pdep_u64(bits, 0x0001000100010001ULL) * 0xffff;
                w[k] = _mm512_mask_add_epi8(t, second, t, shift);
                sc[k] = _mm512_permutexvar_epi32(lane_of[k], scales);
            }
            add_block(acc, act, b, w, sc, 1, _cvtsh_ss(dh), T);
        }
        for (int t = 0; t < T; t++) out[t][r] = _mm512_reduce_add_ps(acc[t]);
    }
}

/* the 8 IQ2_KL rows at g (plain, one after another, each after its fp16 d) against up to 4 tokens: vector k holds
 * sub-blocks 2k and 2k + 1 in column order, their 16 five-bit indices each (group k's low and high nibbles, fifth
 * bits 2k and 2k + 1 of the 16 qh bytes) as 16-bit lanes, each picking its two values (stored + 128) from the 32
 * pairs' words in one permute; each sub-block's scale is its 6 bits less 32: w = d (ls - 32) pairs[q][column % 2] */
static inline __attribute__((always_inline)) void tile_iq2_kl(const uint8_t *g, const uint8_t *const *act, int n,
                                                               float *const *out, const int T) {
    /* ik's iq2kl pairs, each value + 128 (a word's low byte the pair's first value) */
    const __m512i pairs = _mm512_xor_si512(_mm512_set_epi16(
        0x0d2f, (short)0xe92f, 0x2f1c, 0x1c1c, 0x011c, (short)0xe91c, (short)0xc11c, 0x0d0d, 0x010d, (short)0xf60d,
        (short)0xe90d, (short)0xd80d, 0x1c01, 0x0d01, 0x0101, (short)0xf601, (short)0xe901, 0x2ff6, 0x0df6, 0x01f6,
        (short)0xc1f6, 0x1ce9, 0x0de9, 0x01e9, (short)0xe9e9, (short)0xd8e9, 0x2fd8, 0x0dd8, (short)0xf6d8,
        (short)0xc1d8, 0x0dc1, (short)0xe9c1), _mm512_set1_epi16((short)0x8080));
    const __m256i nibble = _mm256_set1_epi16(0x0f), one = _mm256_set1_epi16(1);
    /* sub-block s's low 4 scale bits at bit 8 (s % 4) + 4 (s / 4) of the 4 bytes, its high 2 at bit 2 s of the 16 */
    const __m256i nibble_at = _mm256_setr_epi32(0, 8, 16, 24, 4, 12, 20, 28);
    const __m256i pair_at = _mm256_setr_epi32(0, 2, 4, 6, 8, 10, 12, 14);
    __m512i lane_of[4];
    for (int k = 0; k < 4; k++) lane_of[k] = _mm512_inserti64x4(_mm512_set1_epi32(2 * k), _mm256_set1_epi32(2 * k + 1), 1);
    const int blocks = n / QK_K;
    const size_t row_bytes = 2 + (size_t)blocks * IQ2_KL_BYTES;
    for (int r = 0; r < GROUP; r++) {
        const uint8_t *row = g + (size_t)r * row_bytes;
        uint16_t dh;
        memcpy(&dh, row, 2);
        const float d = _cvtsh_ss(dh);
        row += 2;
        __m512 acc[4];
        for (int t = 0; t < T; t++) acc[t] = _mm512_setzero_ps();
        for (int b = 0; b < blocks; b++, row += IQ2_KL_BYTES) {
            for (int line = 0; line < 128; line += 64) _mm_prefetch((const char *)row + PREFETCH_AHEAD + line, _MM_HINT_T0);
            uint16_t high;
            memcpy(&high, row, 2);
            const __m256i ls = _mm256_or_si256(
                _mm256_and_si256(_mm256_srlv_epi32(_mm256_set1_epi32((int)load_u32(row + 2)), nibble_at),
                                 _mm256_set1_epi32(15)),
                _mm256_slli_epi32(_mm256_and_si256(_mm256_srlv_epi32(_mm256_set1_epi32(high), pair_at),
                                                   _mm256_set1_epi32(3)), 4));
            const __m512i scales = _mm512_castsi256_si512(_mm256_sub_epi32(ls, _mm256_set1_epi32(32)));
            const __m256i qh = _mm256_cvtepu8_epi16(_mm_loadu_si128((const __m128i *)(row + 70)));
            __m512i w[4], sc[4];
            for (int k = 0; k < 4; k++) {
                const __m256i q = _mm256_cvtepu8_epi16(_mm_loadu_si128((const __m128i *)(row + 6 + 16 * k)));
                const __m256i lo = _mm256_or_si256(_mm256_and_si256(q, nibble), _mm256_slli_epi16(
                    _mm256_and_si256(_mm256_srli_epi16(qh, 2 * k), one), 4));
                const __m256i hi = _mm256_or_si256(_mm256_srli_epi16(q, 4), _mm256_slli_epi16(
                    _mm256_and_si256(_mm256_srli_epi16(qh, 2 * k + 1), one), 4));
                w[k] = _mm512_permutexvar_epi16(_mm512_inserti64x4(_mm512_castsi256_si512(lo), hi, 1), pairs);
                sc[k] = _mm512_permutexvar_epi32(lane_of[k], scales);
            }
            add_block(acc, act, b, w, sc, 1, d, T);
        }
        for (int t = 0; t < T; t++) out[t][r] = _mm512_reduce_add_ps(acc[t]);
    }
}

/* the 8 MXFP4 rows at g (plain, one after another) against up to 4 tokens: two blocks (34 bytes) at a time, their
 * 2 x 16 bytes of nibbles each spread over two 128-bit lanes, the second lane's shifted to its high nibbles, so that
 * one lookup in the FP4 table (stored + MX_OFFSET) gives the 64 weights in column order; each 32-bit lane's dot
 * product scaled by its block's 2^(e - 127) and the activation's halved scale: w = 2^(e - 128) table[q] */
static inline __attribute__((always_inline)) void tile_mxfp4(const uint8_t *g, const uint8_t *const *act, int n,
                                                              float *const *out, const int T) {
    const __m512i nibble = _mm512_set1_epi8(0x0f), lanes = _mm512_setr_epi64(0, 1, 0, 1, 2, 3, 2, 3);
    const __m512i table = _mm512_broadcast_i32x4(_mm_setr_epi8(12, 13, 14, 15, 16, 18, 20, 24, 12, 11, 10, 9, 8, 6,
                                                               4, 0));
    const int blocks = n / QK4_0, pairs = n / QK_MX;
    for (int r = 0; r < GROUP; r++) {
        const uint8_t *row = g + (size_t)r * blocks * MXFP4_BYTES;
        __m512 acc[4];
        for (int t = 0; t < T; t++) acc[t] = _mm512_setzero_ps();
        for (int p = 0; p < pairs; p++, row += 2 * MXFP4_BYTES) {
            _mm_prefetch((const char *)row + PREFETCH_AHEAD, _MM_HINT_T0);
            const __m256i two = _mm256_inserti128_si256(_mm256_castsi128_si256(_mm_loadu_si128((const __m128i *)(row + 1))),
                                                        _mm_loadu_si128((const __m128i *)(row + 1 + MXFP4_BYTES)), 1);
            __m512i v = _mm512_permutexvar_epi64(lanes, _mm512_castsi256_si512(two)); /* lanes: b0, b0, b1, b1 */
            v = _mm512_mask_srli_epi16(v, 0xff00ff00u, v, 4);                         /* lanes 1 and 3: high nibbles */
            const __m512i w = _mm512_shuffle_epi8(table, _mm512_and_si512(v, nibble));
            const uint32_t e0 = row[0], e1 = row[MXFP4_BYTES]; /* 2^(e - 127) as bits (e = 0: the denormal 2^-127) */
            const __m512 ws = _mm512_castsi512_ps(_mm512_mask_blend_epi32(
                0xff00, _mm512_set1_epi32((int)(e0 ? e0 << 23 : 0x00400000u)),
                _mm512_set1_epi32((int)(e1 ? e1 << 23 : 0x00400000u))));
            for (int t = 0; t < T; t++) {
                const act_mxfp4 *a = (const act_mxfp4 *)act[t] + p;
                const __m512i s = _mm512_dpbusd_epi32(_mm512_loadu_si512(a->corr), w, _mm512_loadu_si512(a->q));
                acc[t] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(s), _mm512_mul_ps(ws, _mm512_loadu_ps(a->d)), acc[t]);
            }
        }
        for (int t = 0; t < T; t++) out[t][r] = _mm512_reduce_add_ps(acc[t]);
    }
}

/* the group at g (8 rows of n columns of type) against T activation rows: out[t][0..7] */
static void tile_of(int type, const uint8_t *g, const uint8_t *const *act, int n, float *const *out, int T) {
    if (type == Q4_0 || type == Q8_0) {
        const int q8 = type == Q8_0;
        switch (T) { /* constant tile sizes, so that the accumulators stay in registers */
        case 8: q8 ? tile_32(g, act, n, out, 8, 1) : tile_32(g, act, n, out, 8, 0); return;
        case 7: q8 ? tile_32(g, act, n, out, 7, 1) : tile_32(g, act, n, out, 7, 0); return;
        case 6: q8 ? tile_32(g, act, n, out, 6, 1) : tile_32(g, act, n, out, 6, 0); return;
        case 5: q8 ? tile_32(g, act, n, out, 5, 1) : tile_32(g, act, n, out, 5, 0); return;
        case 4: q8 ? tile_32(g, act, n, out, 4, 1) : tile_32(g, act, n, out, 4, 0); return;
        case 3: q8 ? tile_32(g, act, n, out, 3, 1) : tile_32(g, act, n, out, 3, 0); return;
        case 2: q8 ? tile_32(g, act, n, out, 2, 1) : tile_32(g, act, n, out, 2, 0); return;
        default: q8 ? tile_32(g, act, n, out, 1, 1) : tile_32(g, act, n, out, 1, 0); return;
        }
    }
/* fn for up to 4 tokens, the count a constant in each call (the accumulators stay in registers); a shared tile's
 * variant flag after it */
#define K_TILE(fn, ...)                                                                                               \
    switch (left) {                                                                                                   \
    case 4: fn(g, act + t, n, out + t, 4, ##__VA_ARGS__); break;                                                      \
    case 3: fn(g, act + t, n, out + t, 3, ##__VA_ARGS__); break;                                                      \
    case 2: fn(g, act + t, n, out + t, 2, ##__VA_ARGS__); break;                                                      \
    default: fn(g, act + t, n, out + t, 1, ##__VA_ARGS__); break;                                                     \
    }
    for (int t = 0; t < T; t += 4) { /* K-quants 4 tokens at a time: 8 tokens' accumulators would not fit */
        const int left = T - t < 4 ? T - t : 4;
        if (type == Q4_K) {
            K_TILE(tile_q4_k)
        } else if (type == Q5_K) {
            K_TILE(tile_q5_k)
        } else if (type == IQ4_XS) {
            K_TILE(tile_iq4_xs)
        } else if (type == IQ4_KS) {
            K_TILE(tile_iq4_ks, 0)
        } else if (type == IQ4_KSS) {
            K_TILE(tile_iq4_ks, 1)
        } else if (type == IQ2_KL) {
            K_TILE(tile_iq2_kl)
        } else if (type == IQ2_K) {
            K_TILE(tile_iq_k_low, 0)
        } else if (type == IQ3_K) {
            K_TILE(tile_iq_k_low, 1)
        } else if (type == IQ4_K) {
            K_TILE(tile_iq4_k)
        } else if (type == IQ3_KS) {
            K_TILE(tile_iq_ks_low, 1)
        } else if (type == IQ2_KS) {
            K_TILE(tile_iq_ks_low, 0)
        } else if (type == IQ5_KS) {
            K_TILE(tile_iq5_ks)
        } else if (type == MXFP4) {
            K_TILE(tile_mxfp4)
        } else {
            K_TILE(tile_q6_k)
        }
    }
#undef K_TILE
}

/* one phase's units: unit u of expert e (units first[e]..first[e + 1]) is (matrix, row group, tile of e's pairs), the
 * tile innermost so that a group's tiles run one after another (run_jobs hands them out). Pair p (in expert order)
 * reads activation row act + act_row(p) * act_stride and writes out + p * out_stride + matrix * out_matrix + 8 group. */
typedef struct {
    int type, n, groups, mats;
    const uint8_t *const *base; /* each matrix's n_expert stacked experts */
    const int64_t *first;       /* n_expert + 1 unit offsets */
    const int32_t *start;       /* n_expert + 1 pair offsets (pairs in expert order) */
    const int32_t *act_row;     /* pair -> its activation row */
    const uint8_t *act;
    size_t act_stride, out_stride, out_matrix;
    float *out;
    int amx; /* units of amx_units (AMX_ROWS rows, AMX_TOKENS tokens; act_row(p) is act_row(first of e) + p - first) */
} phase;

/* r[m] becomes the 16 rows' 32-bit words m (a 16 x 16 transpose) */
static inline void transpose_16x16(__m512i *r) {
    __m512i t[16], u[16];
    for (int i = 0; i < 8; i++) {
        t[2 * i] = _mm512_unpacklo_epi32(r[2 * i], r[2 * i + 1]);
        t[2 * i + 1] = _mm512_unpackhi_epi32(r[2 * i], r[2 * i + 1]);
    }
    for (int i = 0; i < 4; i++) { /* u[4i + k]: lane L holds rows 4i..4i + 3 of word 4L + k */
        u[4 * i] = _mm512_unpacklo_epi64(t[4 * i], t[4 * i + 2]);
        u[4 * i + 1] = _mm512_unpackhi_epi64(t[4 * i], t[4 * i + 2]);
        u[4 * i + 2] = _mm512_unpacklo_epi64(t[4 * i + 1], t[4 * i + 3]);
        u[4 * i + 3] = _mm512_unpackhi_epi64(t[4 * i + 1], t[4 * i + 3]);
    }
    for (int k = 0; k < 4; k++) {
        const __m512i v1 = _mm512_shuffle_i32x4(u[k], u[4 + k], 0x88), v2 = _mm512_shuffle_i32x4(u[k], u[4 + k], 0xdd);
        const __m512i w1 = _mm512_shuffle_i32x4(u[8 + k], u[12 + k], 0x88);
        const __m512i w2 = _mm512_shuffle_i32x4(u[8 + k], u[12 + k], 0xdd);
        r[k] = _mm512_shuffle_i32x4(v1, w1, 0x88);
        r[8 + k] = _mm512_shuffle_i32x4(v1, w1, 0xdd);
        r[4 + k] = _mm512_shuffle_i32x4(v2, w2, 0x88);
        r[12 + k] = _mm512_shuffle_i32x4(v2, w2, 0xdd);
    }
}

#if AMX
/* Many tokens on AMX-INT8 tiles, for Q4_0, Q8_0, Q4_K, Q5_K, Q6_K and IQ4_XS weights: a unit is AMX_ROWS weight rows
 * (two groups) against a tile of up to AMX_TOKENS tokens whose activation rows are consecutive, so that one tile load
 * takes a block's bytes of all of them (32 columns; Q6_K's and IQ4_XS's 16: a block has one scale, and their
 * activations' 32 bytes hold two). Q5_K and IQ4_XS blocks are in their activations' order (q5_k_order,
 * iq4_xs_order), which the dot products do not mind. The rows' blocks are unpacked once into signed bytes in a B
 * tile's order (amx_unpack, amx_unpack_q4_k, amx_unpack_rows) and kept while the thread's next units read the same
 * rows. A block's 16 x 16 int32 sums are scaled by its rows' and tokens' scales and added in
 * float32: for Q4_0 and Q8_0 as the VNNI kernel does (the same roundings, the sums in another order); the K-quants'
 * sub-blocks each take their rows' d sc (and dmin m) in float32, where their VNNI kernels sum a super-block's
 * sc-weighted sums in int32 first. */
typedef struct {
    uint8_t palette, start;
    uint8_t reserved[14];
    uint16_t colsb[16];
    uint8_t rows[16];
} tile_config;

/* the columns of one block of a type's tiles: Q6_K's scales are per 16 columns, and IQ4_XS's order puts halves of two
 * sub-blocks in 32 bytes of its activations; the others' blocks are 32 */
static inline int amx_width(int type) { return type == Q6_K || type == IQ4_XS ? 16 : 32; }
/* floats of a block's rows at ws: their 16 scales, then for Q4_K and Q5_K their 16 mins */
static inline int amx_floats(int type) { return type == Q4_K || type == Q5_K ? 32 : 16; }

/* tiles 0-3: sums (16 tokens x 16 int32), 4-5: tokens' blocks (16 x width bytes), 6-7: weights' blocks (width / 4 x
 * 64) */
static void amx_configure(int width) {
    tile_config c;
    memset(&c, 0, sizeof c);
    c.palette = 1;
    for (int i = 0; i < 8; i++) {
        c.rows[i] = i < 6 ? 16 : width / 4;
        c.colsb[i] = i == 4 || i == 5 ? width : 64;
    }
    _tile_loadconfig(&c);
}

/* a group's block (Q4_0: ggml's block_q4_0x8, Q8_0: ferry_repack_q8_0's) as 4 vectors of signed bytes, vector k
 * columns 8k..8k + 7 of the 8 rows (row i's at bytes 8i..8i + 7) */
static inline void amx_group(const uint8_t *g, int q8, __m512i *w) {
    if (q8) {
        const __m512i flip = _mm512_set1_epi8((char)0x80);
        for (int k = 0; k < 4; k++) w[k] = _mm512_xor_si512(_mm512_loadu_si512(g + 16 + 64 * k), flip);
    } else { /* a stored nibble is q ^ 8 (ggml's XOR 0x88), which read as 4-bit two's complement is q - 8 */
        const __m512i low = _mm512_set1_epi8(0x0f);
        const __m512i sext = _mm512_broadcast_i32x4(_mm_setr_epi8(0, 1, 2, 3, 4, 5, 6, 7, -8, -7, -6, -5, -4, -3, -2, -1));
        const __m512i lo = _mm512_loadu_si512(g + 16), hi = _mm512_loadu_si512(g + 80);
        w[0] = _mm512_shuffle_epi8(sext, _mm512_and_si512(lo, low));
        w[1] = _mm512_shuffle_epi8(sext, _mm512_and_si512(hi, low));
        w[2] = _mm512_shuffle_epi8(sext, _mm512_and_si512(_mm512_srli_epi16(lo, 4), low));
        w[3] = _mm512_shuffle_epi8(sext, _mm512_and_si512(_mm512_srli_epi16(hi, 4), low));
    }
}

/* one block's B tile at wb from its two groups' 4 vectors each (w0, w1: vector k columns 8k..8k + 7 of the 8 rows):
 * B row r is the 32-bit word r % 2 of each row's 8 bytes in vector r / 2, the first group's 8 rows then the second's */
static inline void amx_store_b(const __m512i *w0, const __m512i *w1, int8_t *wb) {
    const __m512i even = _mm512_setr_epi32(0, 2, 4, 6, 8, 10, 12, 14, 16, 18, 20, 22, 24, 26, 28, 30);
    const __m512i odd = _mm512_add_epi32(even, _mm512_set1_epi32(1));
    for (int r = 0; r < 8; r++) _mm512_store_si512(wb + 64 * r, _mm512_permutex2var_epi32(w0[r / 2], r % 2 ? odd : even,
                                                                                         w1[r / 2]));
}

/* groups g0 and g1 (NULL: zeros, where the rows end in an odd group) of n columns as B tiles (n / 32 of AMX_B bytes
 * at wb) and their 16 rows' scales (16 floats a block at ws) */
static void amx_unpack(const uint8_t *g0, const uint8_t *g1, int n, int q8, int8_t *wb, float *ws) {
    const int bytes = q8 ? Q8_0_BYTES : Q4_0_BYTES;
    for (int b = 0; b < n / QK4_0; b++) {
        const uint8_t *b0 = g0 + (size_t)b * bytes, *b1 = g1 ? g1 + (size_t)b * bytes : NULL;
        __m512i w0[4], w1[4];
        amx_group(b0, q8, w0);
        if (b1)
            amx_group(b1, q8, w1);
        else
            for (int k = 0; k < 4; k++) w1[k] = _mm512_setzero_si512();
        amx_store_b(w0, w1, wb + (size_t)b * AMX_B);
        const __m256 s0 = _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)b0));
        const __m256 s1 = b1 ? _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)b1)) : _mm256_setzero_ps();
        _mm512_store_ps(ws + 16 * b, _mm512_insertf32x8(_mm512_castps256_ps512(s0), s1, 1));
    }
}

/* one Q4_K group's super-block (ggml's block_q4_Kx8) at g, or zeros (g NULL): sub-block j's 4 vectors of nibbles
 * (0..15) at w[4j..4j + 3], in amx_group's order, and its 8 rows' scales d sc and mins dmin m */
static inline void amx_group_q4_k(const uint8_t *g, __m512i *w, __m256 *sc, __m256 *mins) {
    if (!g) {
        for (int k = 0; k < 32; k++) w[k] = _mm512_setzero_si512();
        for (int j = 0; j < 8; j++) sc[j] = mins[j] = _mm256_setzero_ps();
        return;
    }
    const __m512i low = _mm512_set1_epi8(0x0f);
    const __m256 d = _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)g));
    const __m256 dmin = _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(g + 16)));
    for (int c = 0; c < 4; c++) /* columns 64c..64c + 63: sub-block 2c in the low nibbles, 2c + 1 in the high */
        for (int k = 0; k < 4; k++) {
            const __m512i v = _mm512_loadu_si512(g + 128 + 64 * (4 * c + k));
            w[4 * (2 * c) + k] = _mm512_and_si512(v, low);
            w[4 * (2 * c + 1) + k] = _mm512_and_si512(_mm512_srli_epi16(v, 4), low);
        }
    for (int j = 0; j < 8; j++) {
        const uint8_t *p = g + 32 + 12 * j;
        const __m128i s = _mm_cvtsi64_si128((long long)six_bits(load_u32(p), load_u32(p + 8), 0));
        const __m128i m = _mm_cvtsi64_si128((long long)six_bits(load_u32(p + 4), load_u32(p + 8), 4));
        sc[j] = _mm256_mul_ps(d, _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(s)));
        mins[j] = _mm256_mul_ps(dmin, _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(m)));
    }
}

/* Q4_K groups g0 and g1 (g1 NULL as amx_unpack's) of n columns as B tiles (a sub-block of 32 columns a tile) and, per
 * sub-block, the 16 rows' scales and then their mins (32 floats at ws) */
static void amx_unpack_q4_k(const uint8_t *g0, const uint8_t *g1, int n, int8_t *wb, float *ws) {
    for (int sb = 0; sb < n / QK_K; sb++) {
        __m512i w0[32], w1[32];
        __m256 sc0[8], sc1[8], m0[8], m1[8];
        amx_group_q4_k(g0 + (size_t)sb * Q4_K_BYTES, w0, sc0, m0);
        amx_group_q4_k(g1 ? g1 + (size_t)sb * Q4_K_BYTES : NULL, w1, sc1, m1);
        for (int j = 0; j < 8; j++) {
            const int b = 8 * sb + j;
            amx_store_b(w0 + 4 * j, w1 + 4 * j, wb + (size_t)b * AMX_B);
            _mm512_store_ps(ws + 32 * b, _mm512_insertf32x8(_mm512_castps256_ps512(sc0[j]), sc1[j], 1));
            _mm512_store_ps(ws + 32 * b + 16, _mm512_insertf32x8(_mm512_castps256_ps512(m0[j]), m1[j], 1));
        }
    }
}

/* the AMX blocks of a plain row's super-block at `at` (Q5_K, Q6_K, IQ4_XS): its 256 values as signed bytes w, in the
 * order of the activation block the type reads (act_q4_k's / act_q6_k's q), and per block of amx_width(type) of them
 * its scale (sc) and, for Q5_K, its min (mn: dmin m, against act_q4_k.sumf) */
static void amx_row(int type, const uint8_t *at, int8_t *w, float *sc, float *mn) {
    uint16_t h[2]; /* d, and Q5_K's dmin */
    memcpy(h, at + (type == Q6_K ? 208 : 0), type == Q5_K ? 4 : 2);
    const float d = _cvtsh_ss(h[0]);
    if (type == Q6_K) {
        __m512i v[4];
        q6_k_vectors(at, v);
        for (int k = 0; k < 4; k++) _mm512_store_si512(w + 64 * k, _mm512_sub_epi8(v[k], _mm512_set1_epi8(32)));
        for (int j = 0; j < 16; j++) sc[j] = d * (float)((const int8_t *)(at + 192))[j];
    } else if (type == Q5_K) { /* in q5_k_order: 32 bytes m of it are sub-block q5_k_sub(m) */
        __m512i v[4];
        q5_k_vectors(at, v);
        for (int k = 0; k < 4; k++) _mm512_store_si512(w + 64 * k, v[k]);
        const uint64_t sc8 = six_bits(load_u32(at + 4), load_u32(at + 12), 0);
        const uint64_t m8 = six_bits(load_u32(at + 8), load_u32(at + 12), 4);
        const float dmin = _cvtsh_ss(h[1]);
        for (int m = 0; m < 8; m++) {
            const int sub = q5_k_sub(m);
            sc[m] = d * (float)(uint8_t)(sc8 >> (8 * sub));
            mn[m] = dmin * (float)(uint8_t)(m8 >> (8 * sub));
        }
    } else { /* IQ4_XS in iq4_xs_order: 16 bytes m of it are half m % 8 / 4 of sub-block 4 (m / 8) + m % 4 */
        const __m512i table = _mm512_xor_si512(iq4nl_table(), _mm512_set1_epi8((char)0x80)), low = _mm512_set1_epi8(0x0f);
        for (int k = 0; k < 2; k++) {
            const __m512i v = _mm512_loadu_si512(at + 8 + 64 * k);
            _mm512_store_si512(w + 128 * k, _mm512_shuffle_epi8(table, _mm512_and_si512(v, low)));
            _mm512_store_si512(w + 128 * k + 64, _mm512_shuffle_epi8(table, _mm512_and_si512(_mm512_srli_epi16(v, 4), low)));
        }
        uint16_t high;
        memcpy(&high, at + 2, 2);
        for (int m = 0; m < 16; m++) {
            const int sub = 4 * (m / 8) + m % 4;
            const int ls = ((at[4 + sub / 2] >> (4 * (sub % 2))) & 0x0f) | (((high >> (2 * sub)) & 3) << 4);
            sc[m] = d * (float)(ls - 32);
        }
    }
}

/* groups g0 and g1 of plain rows (8 each; g1 NULL as amx_unpack's) of n columns as B tiles of their blocks of
 * amx_width(type) columns (B row r: each weight row's columns 4r..4r + 3 of the block), from the rows' values
 * transposed in 32-bit words; per block the 16 rows' scales (16 floats at ws) and for Q5_K then their mins (16 more) */
static void amx_unpack_rows(int type, const uint8_t *g0, const uint8_t *g1, int n, int8_t *wb, float *ws) {
    const int width = amx_width(type), per_sb = QK_K / width, per_block = amx_floats(type);
    const size_t sb_bytes = type == Q5_K ? Q5_K_BYTES : type == Q6_K ? Q6_K_BYTES : IQ4_XS_BYTES;
    const size_t row_bytes = sb_bytes * (n / QK_K), b_bytes = (size_t)16 * width;
    int8_t w[16][QK_K] __attribute__((aligned(64)));
    float sc[16][16], mn[16][8];
    for (int sb = 0; sb < n / QK_K; sb++) {
        for (int r = 0; r < 16; r++) {
            const uint8_t *row = r < 8 ? g0 + r * row_bytes : g1 ? g1 + (r - 8) * row_bytes : NULL;
            if (row) {
                amx_row(type, row + sb * sb_bytes, w[r], sc[r], mn[r]);
            } else {
                memset(w[r], 0, QK_K);
                memset(sc[r], 0, sizeof sc[r]);
                memset(mn[r], 0, sizeof mn[r]);
            }
        }
        for (int c = 0; c < 4; c++) { /* bytes 64c..64c + 63: word m is B row m % (width / 4) of block c (64 / width) +
                                       * m / (width / 4) */
            __m512i v[16];
            for (int r = 0; r < 16; r++) v[r] = _mm512_load_si512(w[r] + 64 * c);
            transpose_16x16(v);
            for (int m = 0; m < 16; m++) {
                const int block = per_sb * sb + c * (64 / width) + m / (width / 4);
                _mm512_store_si512(wb + (size_t)block * b_bytes + (size_t)(m % (width / 4)) * 64, v[m]);
            }
        }
        for (int j = 0; j < per_sb; j++)
            for (int r = 0; r < 16; r++) {
                ws[(size_t)(per_sb * sb + j) * per_block + r] = sc[r][j];
                if (type == Q5_K) ws[(size_t)(per_sb * sb + j) * per_block + 16 + r] = mn[r][j];
            }
    }
}

enum { AMX_32, AMX_Q4_K, AMX_Q6_K }; /* the tiles' kinds: Q4_0 / Q8_0 (a token scale a block of 32), Q4_K, Q6_K */

/* where block b (of width columns) of a token's activation row starts: an act_q4_0, or sub-block b % per_sb of the
 * act_q4_k / act_q6_k b / per_sb (q first in both) */
#define AMX_BLOCK(b)                                                                                                  \
    (kind == AMX_32 ? (size_t)(b) * sizeof(act_q4_0) : (size_t)((b) / per_sb) * act_size + width * ((b) % per_sb))

/* block b's sums of 16 tokens against the 16 rows into tile C (its tokens' blocks through tile A, its rows' through
 * tile B), when b is a block */
#define AMX_SUMS(C, A, B, b)                                                                                          \
    if ((b) < blocks) {                                                                                               \
        _tile_zero(C);                                                                                                \
        _tile_loadd(A, a + AMX_BLOCK(b), stride);                                                                     \
        _tile_loadd(B, wb + (size_t)(b) * b_bytes, 64);                                                               \
        _tile_dpbssd(C, A, B);                                                                                        \
    }

/* T (1..16) tokens' activation rows at a (act_q4_0 blocks, act_q4_k or act_q6_k super-blocks, by kind), stride bytes
 * apart (16 rows readable), against the 16 weight rows unpacked at wb / ws: out[t][0..rows). Four blocks a step in
 * tiles 0-3, the sums of the next two asked for before those of the last two are scaled, so that the tiles' latency
 * hides behind the float32 work. A block's sums times its rows' scales (Q4_K: less its rows' mins times the token's
 * sum) add up over a super-block in float32; the token's scale multiplies the super-block's once (Q4_0 / Q8_0: each
 * block's, its scale being the block's). */
static inline __attribute__((always_inline)) void amx_tile_of(const int8_t *wb, const float *ws, const uint8_t *a,
                                                               size_t stride, int n, int T, float *const *out, int rows,
                                                               const int kind) {
    int32_t sums[4][AMX_TOKENS * 16] __attribute__((aligned(64)));
    float total[AMX_TOKENS][16] __attribute__((aligned(64))); /* super-block kinds: the sum of the finished ones */
    __m512 acc[AMX_TOKENS]; /* AMX_32: the result; else the super-block's, before the token's scale */
    const int width = kind == AMX_Q6_K ? 16 : 32, blocks = n / width, per_sb = QK_K / width;
    const int per_block = kind == AMX_Q4_K ? 32 : 16; /* floats of ws a block: the rows' scales (Q4_K: and mins) */
    const size_t act_size = kind == AMX_Q4_K ? sizeof(act_q4_k) : sizeof(act_q6_k), b_bytes = (size_t)16 * width;
    for (int t = 0; t < T; t++) {
        acc[t] = _mm512_setzero_ps();
        if (kind != AMX_32) _mm512_store_ps(total[t], acc[t]);
    }
#define AMX_SCALE(k, b)                                                                                               \
    if ((b) < blocks) {                                                                                               \
        _tile_stored(k, sums[k], 64);                                                                                 \
        const __m512 dw = _mm512_load_ps(ws + per_block * (b));                                                       \
        if (kind == AMX_32) {                                                                                         \
            for (int t = 0; t < T; t++) {                                                                             \
                const float da = ((const act_q4_0 *)(a + t * stride) + (b))->d;                                      \
                acc[t] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(_mm512_load_si512(sums[k] + 16 * t)),                     \
                                         _mm512_mul_ps(dw, _mm512_set1_ps(da)), acc[t]);                              \
            }                                                                                                         \
        } else {                                                                                                      \
            for (int t = 0; t < T; t++)                                                                               \
                acc[t] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(_mm512_load_si512(sums[k] + 16 * t)), dw, acc[t]);        \
            if (kind == AMX_Q4_K) {                                                                                   \
                const __m512 dm = _mm512_load_ps(ws + per_block * (b) + 16);                                          \
                for (int t = 0; t < T; t++)                                                                           \
                    acc[t] = _mm512_fnmadd_ps(                                                                        \
                        dm, _mm512_set1_ps(((const act_q4_k *)(a + t * stride) + (b) / 8)->sumf[(b) % 8]), acc[t]);   \
            }                                                                                                         \
            if ((b) % per_sb == per_sb - 1)                                                                           \
                for (int t = 0; t < T; t++) {                                                                         \
                    const float da = kind == AMX_Q4_K ? ((const act_q4_k *)(a + t * stride) + (b) / per_sb)->d        \
                                                      : ((const act_q6_k *)(a + t * stride) + (b) / per_sb)->d;       \
                    _mm512_store_ps(total[t], _mm512_fmadd_ps(acc[t], _mm512_set1_ps(da), _mm512_load_ps(total[t]))); \
                    acc[t] = _mm512_setzero_ps();                                                                     \
                }                                                                                                     \
        }                                                                                                             \
    }
    AMX_SUMS(0, 4, 6, 0)
    AMX_SUMS(1, 5, 7, 1)
    for (int b = 0; b < blocks; b += 4) {
        AMX_SUMS(2, 4, 6, b + 2)
        AMX_SUMS(3, 5, 7, b + 3)
        AMX_SCALE(0, b)
        AMX_SCALE(1, b + 1)
        AMX_SUMS(0, 4, 6, b + 4)
        AMX_SUMS(1, 5, 7, b + 5)
        AMX_SCALE(2, b + 2)
        AMX_SCALE(3, b + 3)
    }
#undef AMX_SCALE
    for (int t = 0; t < T; t++)
        _mm512_mask_storeu_ps(out[t], rows == AMX_ROWS ? 0xffff : 0x00ff,
                              kind == AMX_32 ? acc[t] : _mm512_load_ps(total[t]));
}
#undef AMX_SUMS
#undef AMX_BLOCK

static void amx_tile(const int8_t *wb, const float *ws, const uint8_t *a, size_t stride, int n, int T,
                     float *const *out, int rows, int type) {
    if (type == Q4_K || type == Q5_K)
        amx_tile_of(wb, ws, a, stride, n, T, out, rows, AMX_Q4_K);
    else if (type == Q6_K || type == IQ4_XS)
        amx_tile_of(wb, ws, a, stride, n, T, out, rows, AMX_Q6_K);
    else
        amx_tile_of(wb, ws, a, stride, n, T, out, rows, AMX_32);
}

/* units lo..hi of expert e of a phase on AMX (all within e's): unit u is (matrix, AMX_ROWS rows, tile of up to
 * AMX_TOKENS of e's pairs), the tile innermost. *unpacked: the (expert, matrix, rows) whose blocks are at the thread's
 * buffer, -1 for none (the first call of a phase configures the tiles) */
static void amx_units(const phase *ph, int e, int64_t lo, int64_t hi, int64_t *unpacked) {
    static _Thread_local int8_t *buf;
    static _Thread_local size_t cap;
    const int width = amx_width(ph->type), blocks = ph->n / width, quads = (ph->groups + 1) / 2;
    const int q8 = ph->type == Q8_0;
    const size_t b_bytes = (size_t)16 * width, need = (size_t)blocks * (b_bytes + amx_floats(ph->type) * sizeof(float));
    if (cap < need) {
        free(buf);
        buf = aligned_alloc(64, need);
        cap = buf ? need : 0;
        if (!buf) abort(); /* a few kB a thread: out of memory */
    }
    if (*unpacked < 0) amx_configure(amx_width(ph->type));
    int8_t *wb = buf;
    float *ws = (float *)(buf + (size_t)blocks * b_bytes);
    const size_t per_group = group_bytes(ph->type, ph->n), per_expert = per_group * ph->groups;
    const int count = ph->start[e + 1] - ph->start[e], tiles = (count + AMX_TOKENS - 1) / AMX_TOKENS;
    for (int64_t u = lo; u < hi; u++) {
        const int64_t rem = u - ph->first[e];
        const int tile = (int)(rem % tiles), quad = (int)(rem / tiles % quads), m = (int)(rem / tiles / quads);
        const int group = 2 * quad, two = group + 1 < ph->groups;
        const int64_t rows_id = ((int64_t)e * ph->mats + m) * quads + quad;
        if (rows_id != *unpacked) {
            const uint8_t *g = ph->base[m] + (size_t)e * per_expert + (size_t)group * per_group;
            if (ph->type == Q4_K)
                amx_unpack_q4_k(g, two ? g + per_group : NULL, ph->n, wb, ws);
            else if (ph->type == Q5_K || ph->type == Q6_K || ph->type == IQ4_XS)
                amx_unpack_rows(ph->type, g, two ? g + per_group : NULL, ph->n, wb, ws);
            else
                amx_unpack(g, two ? g + per_group : NULL, ph->n, q8, wb, ws);
            *unpacked = rows_id;
        }
        const int p0 = ph->start[e] + tile * AMX_TOKENS;
        const int T = count - tile * AMX_TOKENS < AMX_TOKENS ? count - tile * AMX_TOKENS : AMX_TOKENS;
        float *out[AMX_TOKENS];
        for (int t = 0; t < T; t++)
            out[t] = ph->out + (size_t)(p0 + t) * ph->out_stride + (size_t)m * ph->out_matrix + (size_t)group * GROUP;
        amx_tile(wb, ws, ph->act + (size_t)ph->act_row[p0] * ph->act_stride, ph->act_stride, ph->n, T, out,
                 two ? AMX_ROWS : GROUP, ph->type);
    }
}
#endif

/* whether expert e of a phase runs on AMX: the phase may (amx_for) and e has pairs enough to fill its tiles */
static inline int amx_expert(int amx, int count) { return amx && count >= AMX_MIN_PAIRS; }

/* the tiles of tokens of an expert of `count` pairs in a phase: its units of one (matrix, row block) */
static inline int64_t tiles_for(int count, int amx) {
    return amx_expert(amx, count) ? (count + AMX_TOKENS - 1) / AMX_TOKENS : (count + TILE - 1) / TILE;
}

/* a phase's units for `count` pairs of one expert (groups row groups, mats matrices) */
static int64_t units_of(int count, int groups, int mats, int amx) {
    return tiles_for(count, amx) * (amx_expert(amx, count) ? (groups + 1) / 2 : groups) * mats;
}

/* units lo..hi of expert e of a phase on the VNNI kernels: unit u is (matrix, row group, tile of up to TILE of e's
 * pairs), the tile innermost */
static void vnni_units(const phase *ph, int e, int64_t lo, int64_t hi) {
    const size_t per_group = group_bytes(ph->type, ph->n), per_expert = per_group * ph->groups;
    const int count = ph->start[e + 1] - ph->start[e], tiles = (count + TILE - 1) / TILE;
    for (int64_t u = lo; u < hi; u++) {
        const int64_t rem = u - ph->first[e];
        const int tile = (int)(rem % tiles), group = (int)(rem / tiles % ph->groups);
        const int m = (int)(rem / tiles / ph->groups);
        const uint8_t *g = ph->base[m] + (size_t)e * per_expert + (size_t)group * per_group;
        const uint8_t *act[TILE];
        float *out[TILE];
        const int p0 = ph->start[e] + tile * TILE, T = count - tile * TILE < TILE ? count - tile * TILE : TILE;
        for (int t = 0; t < T; t++) {
            act[t] = ph->act + (size_t)ph->act_row[p0 + t] * ph->act_stride;
            out[t] = ph->out + (size_t)(p0 + t) * ph->out_stride + (size_t)m * ph->out_matrix + (size_t)group * GROUP;
        }
        tile_of(ph->type, g, act, ph->n, out, T);
    }
}

/* One phase's units, taken in jobs from the counter *next (zeroed before the phase), each job all the tiles of one
 * (expert, matrix, row block): a thread that finishes its job early takes the next, so that threads whose units ran
 * slower (partial tiles, rows to unpack, the memory) do fewer (an even split of the units left the slowest thread
 * 17-40% behind the mean). A thread's jobs come in rising order, so that its expert only moves forward. */
static void run_jobs(const phase *ph, int64_t *next, int n_expert) {
    int64_t unpacked = -1, base = 0; /* jobs of the experts before e */
    int e = 0;
    for (;;) {
        const int64_t j = __atomic_fetch_add(next, 1, __ATOMIC_RELAXED);
        int64_t tiles = 0;
        for (; e < n_expert; e++) {
            tiles = tiles_for(ph->start[e + 1] - ph->start[e], ph->amx);
            const int64_t jobs = tiles ? (ph->first[e + 1] - ph->first[e]) / tiles : 0;
            if (j < base + jobs) break;
            base += jobs;
        }
        if (e >= n_expert) break;
        const int64_t lo = ph->first[e] + (j - base) * tiles;
#if AMX
        if (amx_expert(ph->amx, ph->start[e + 1] - ph->start[e]))
            amx_units(ph, e, lo, lo + tiles, &unpacked);
        else
#endif
            vnni_units(ph, e, lo, lo + tiles);
    }
#if AMX
    if (unpacked >= 0) _tile_release();
#endif
}
#endif

/* Where a batch call's threads spend their time, while ferry_phases turned it on: nanoseconds per thread and phase,
 * the waits at the barriers apart (benchmarks/cpu_experts.py --phases) */
enum { PH_QUANTIZE, PH_SORT, PH_GATHER, PH_UP, PH_GLU, PH_DOWN, PH_SUM, PH_WAIT, PH_COUNT };
#define PH_THREADS 256
static int phases_on;
static int64_t phase_ns[PH_THREADS][PH_COUNT];

static inline int64_t now_ns(void) {
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (int64_t)ts.tv_sec * 1000000000 + ts.tv_nsec;
}

/* the time since *last, to phase k of thread t */
static inline void phase_end(int t, int k, int64_t *last) {
    if (!phases_on || t >= PH_THREADS) return;
    const int64_t now = now_ns();
    phase_ns[t][k] += now - *last;
    *last = now;
}

/* out (PH_THREADS x PH_COUNT int64, or NULL): the times so far; then all zeroed, and the timing on (1) or off (0) */
void ferry_phases(int on, int64_t *out) {
    if (out) memcpy(out, phase_ns, sizeof phase_ns);
    memset(phase_ns, 0, sizeof phase_ns);
    phases_on = on;
}

static void thread_range(int64_t total, int t, int nt, int64_t *lo, int64_t *hi) {
    *lo = total * t / nt;
    *hi = total * (t + 1) / nt;
}

static size_t aligned(size_t n) { return (n + 63) & ~(size_t)63; }

/* The threads of one call wait for each other between phases here: OpenMP's team (the C entry points, and ggml's
 * graph nodes where ggml runs its threads as an OpenMP team) at an OpenMP barrier, which sleeps a waiting thread
 * after a while; other teams (ggml's own thread pool) at a spin barrier that yields the core after a while, so that
 * a thread the OS took off its core gets it back (a pure spin cost hybrid generation 5x: a host thread polling the
 * GPU beside 16 threads on 16 cores). Zeroed once; each full round leaves count at 0. */
typedef struct {
    _Atomic int count, round;
} spin_barrier;

static void sync_threads(spin_barrier *b, int nt) {
    if (nt == 1) return;
    if (omp_in_parallel() && omp_get_num_threads() == nt) {
#pragma omp barrier
        return;
    }
    const int round = __atomic_load_n(&b->round, __ATOMIC_ACQUIRE);
    if (__atomic_add_fetch(&b->count, 1, __ATOMIC_ACQ_REL) == nt) {
        __atomic_store_n(&b->count, 0, __ATOMIC_RELAXED);
        __atomic_store_n(&b->round, round + 1, __ATOMIC_RELEASE);
    } else {
        for (int spins = 0; __atomic_load_n(&b->round, __ATOMIC_ACQUIRE) == round; spins++) {
            if (spins < 4096)
                __builtin_ia32_pause();
            else
                sched_yield();
        }
    }
}

/* the experts' activation: silu(gate) up, gpt-oss's clamped SwiGLU, or DeepSeek-V4's (silu of the gate clamped above,
   times up clamped to +-limit) */
enum { ACT_SILU = 0, ACT_SWIGLU_OAI = 1, ACT_SILU_CLAMP = 2 };

/* the experts' fixed part beside their weights: the activation (gpt-oss's alpha and limit) and each matrix's biases
 * (n_expert rows of n_ff, n_ff and n_embd floats; NULL: none) */
typedef struct {
    int act;
    float alpha, limit;
    const float *up, *gate, *down;
} expert_extras;

/* one call's operands: n tokens' x rows (x_stride floats apart), ids and weights (n_used each, ids_stride and
 * w_stride apart), the stacked experts and their types, out (n rows of n_embd) */
typedef struct {
    const float *x;
    const int32_t *ids;
    const float *weights;
    int64_t x_stride, ids_stride, w_stride;
    int n, n_used, n_embd, n_ff, n_expert, up_type, down_type;
    const uint8_t *up, *gate, *down;
    float *out;
    uint8_t *scratch;
    expert_extras ex;
} moe_call;

#if FAST
/* e^x (2^(x log2 e): the fraction's power by its Taylor polynomial to degree 6, relative error 2e-7), 0 where x is
 * -inf, inf past 88.7; attention takes it for x <= 0, the experts' activation for any x */
static inline __m512 exp_neg(__m512 x) {
    const __mmask16 open = _mm512_cmp_ps_mask(x, _mm512_set1_ps(-INFINITY), _CMP_NEQ_OQ);
    const __m512 t = _mm512_mul_ps(_mm512_max_ps(x, _mm512_set1_ps(-104.0f)), _mm512_set1_ps(1.44269504089f));
    const __m512 n = _mm512_roundscale_ps(t, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    const __m512 f = _mm512_sub_ps(t, n);
    __m512 p = _mm512_set1_ps(1.5403530e-4f);
    p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(1.3333558e-3f));
    p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(9.6181291e-3f));
    p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(5.5504109e-2f));
    p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(2.4022651e-1f));
    p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(6.9314718e-1f));
    p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(1.0f));
    return _mm512_maskz_mov_ps(open, _mm512_scalef_ps(p, n));
}

#endif

/* h = act(gate + its bias) (up + its bias) for expert e's rows i0..i0 + n (h written over up) */
static inline void glu(const moe_call *c, int e, int i0, float *up, const float *gate, int n) {
    const expert_extras *x = &c->ex;
    const float *ub = x->up ? x->up + (size_t)e * c->n_ff + i0 : NULL;
    const float *gb = x->gate ? x->gate + (size_t)e * c->n_ff + i0 : NULL;
#if FAST /* the loop below, 16 rows a vector, e^-x by exp_neg (relative error 2e-7) instead of libm's expf */
    const __m512 limit = _mm512_set1_ps(x->limit), one = _mm512_set1_ps(1.0f);
    for (int i = 0; i < n; i += 16) {
        const __mmask16 k = n - i >= 16 ? 0xffff : (__mmask16)((1u << (n - i)) - 1);
        __m512 u = _mm512_maskz_loadu_ps(k, up + i), g = _mm512_maskz_loadu_ps(k, gate + i);
        if (ub) u = _mm512_add_ps(u, _mm512_maskz_loadu_ps(k, ub + i));
        if (gb) g = _mm512_add_ps(g, _mm512_maskz_loadu_ps(k, gb + i));
        if (x->act != ACT_SILU) { /* gpt-oss's and DeepSeek-V4's clamps */
            g = _mm512_min_ps(g, limit);
            u = _mm512_min_ps(_mm512_max_ps(u, _mm512_sub_ps(_mm512_setzero_ps(), limit)), limit);
        }
        const __m512 s = x->act == ACT_SWIGLU_OAI ? _mm512_mul_ps(g, _mm512_set1_ps(x->alpha)) : g;
        const __m512 sig = _mm512_div_ps(g, _mm512_add_ps(one, exp_neg(_mm512_sub_ps(_mm512_setzero_ps(), s))));
        _mm512_mask_storeu_ps(up + i, k, _mm512_mul_ps(sig, x->act == ACT_SWIGLU_OAI ? _mm512_add_ps(u, one) : u));
    }
    return;
#endif
    for (int i = 0; i < n; i++) {
        float u = up[i] + (ub ? ub[i] : 0.0f), g = gate[i] + (gb ? gb[i] : 0.0f);
        if (x->act == ACT_SWIGLU_OAI) { /* as ggml's swiglu_oai: the gate clamped above, up to +-limit */
            g = fminf(g, x->limit);
            u = fminf(fmaxf(u, -x->limit), x->limit);
            up[i] = g / (1.0f + expf(-x->alpha * g)) * (u + 1.0f);
        } else if (x->act == ACT_SILU_CLAMP) {
            g = fminf(g, x->limit);
            u = fminf(fmaxf(u, -x->limit), x->limit);
            up[i] = g / (1.0f + expf(-g)) * u;
        } else {
            up[i] = g / (1.0f + expf(-g)) * u;
        }
    }
}

/* expert e's down bias at row i (0 where there is none) */
static inline float down_bias(const moe_call *c, int e, int i) {
    return c->ex.down ? c->ex.down[(size_t)e * c->n_embd + i] : 0.0f;
}

/* one token's counters (token_body): the next bundle, then per (slot, chunk of h), per slot and per bundle of out's
 * rows (at most a group each) */
static size_t token_counter_bytes(int n_used, int n_ff, int n_embd, int down_type) {
    const int chunks = block_of(down_type) ? n_ff / block_of(down_type) : 0;
    return 64 + aligned(sizeof(int) * (size_t)n_used * chunks) + aligned(sizeof(int) * (size_t)n_used)
           + aligned(sizeof(int) * (size_t)(n_embd / GROUP));
}

size_t ferry_moe_scratch(int n_embd, int n_ff, int n_used, int up_type, int down_type) {
    return aligned(act_bytes(up_type, n_embd)) + aligned((size_t)n_used * act_bytes(down_type, n_ff))
           + aligned(sizeof(float) * ((size_t)2 * n_used * n_ff + (size_t)n_used * n_embd))
           + token_counter_bytes(n_used, n_ff, n_embd, down_type);
}
/* scratch bytes for n tokens of n_used slots (one token: ferry_moe_scratch's) */
size_t ferry_moe_batch_scratch(int n, int n_used, int n_embd, int n_ff, int n_expert, int up_type, int down_type) {
    if (n == 1) return ferry_moe_scratch(n_embd, n_ff, n_used, up_type, down_type);
    const size_t pairs = (size_t)n * n_used;
    return aligned((size_t)n * act_bytes(up_type, n_embd)) + aligned(sizeof(int32_t) * (n_expert + 1))
           + 2 * aligned(sizeof(int64_t) * (n_expert + 1)) + 3 * aligned(sizeof(int32_t) * pairs)
           + aligned(sizeof(float) * pairs * 2 * n_ff) + aligned((pairs + AMX_TOKENS) * act_bytes(down_type, n_ff))
           + aligned(sizeof(float) * pairs * n_embd) + 2 * 64
           + (amx_can(up_type, n) ? (pairs + AMX_TOKENS) * act_bytes(up_type, n_embd) : 0);
}

/* whether the call's sizes and types are ones the kernel covers, and its ids in range (-1 allowed over many tokens) */
static int valid(const moe_call *c) {
    if (!block_of(c->up_type) || !block_of(c->down_type) || c->n_embd % block_of(c->up_type)
        || c->n_ff % block_of(c->down_type) || c->n_embd % GROUP || c->n_ff % GROUP || c->n_used < 1 || c->n < 1)
        return 0;
    for (int i = 0; i < c->n; i++)
        for (int j = 0; j < c->n_used; j++) {
            const int32_t e = c->ids[i * c->ids_stride + j];
            if (e < (c->n == 1 ? 0 : -1) || e >= c->n_expert) return 0;
        }
    return 1;
}

#if FAST
/* One token's work as a list of bundles (a few row groups of one matrix of one slot, about BUNDLE_BYTES of weights),
 * first every slot's up and gate, then every slot's down; the threads take bundles in turn from one counter, so that
 * a thread the memory served slower than the others takes fewer, and none waits at a barrier between the phases:
 * - a chunk of a slot's h (one activation block of the down weights: 32 or 256 rows) is silu(gate) * up and
 *   quantized by the thread that finishes the last of its up and gate rows (counted per chunk);
 * - a down bundle waits only until its slot's chunks are all quantized (counted per slot), which bundles taken
 *   earlier are finishing;
 * - a down bundle's rows of out are the weighted sum over the slots, added by the thread that finishes the last slot's
 *   bundle of those rows (counted per bundle).
 * The counters are zeroed with x's quantization, before the call's one barrier. */
#ifndef BUNDLE_BYTES
#define BUNDLE_BYTES 65536
#endif

typedef struct { /* the counters of one call, each array on its own cache lines */
    _Atomic int64_t *next;
    _Atomic int *chunk_done, *slot_ready, *rows_done;
} token_counters;

/* row groups per bundle of a matrix of `groups` groups of n columns of type: about BUNDLE_BYTES, and small enough that
 * `mats` matrices of n_used slots make at least 4 bundles a thread */
static int bundle_groups(int type, int n, int groups, int mats, int n_used, int nt) {
    int64_t by_bytes = BUNDLE_BYTES / (int64_t)group_bytes(type, n);
    const int64_t total = (int64_t)groups * mats * n_used, by_threads = (total + 4 * nt - 1) / (4 * nt);
    if (by_threads < by_bytes) by_bytes = by_threads;
    return by_bytes < 1 ? 1 : by_bytes > groups ? groups : (int)by_bytes;
}

static void wait_for(_Atomic int *v, int value) {
    for (int spins = 0; __atomic_load_n(v, __ATOMIC_ACQUIRE) < value; spins++) {
        if (spins < 4096)
            __builtin_ia32_pause();
        else
            sched_yield();
    }
}

static void token_body(const moe_call *c, int t, int nt, spin_barrier *b) {
    const int n_used = c->n_used, n_embd = c->n_embd, n_ff = c->n_ff;
    const int hblock = block_of(c->down_type), chunks = n_ff / hblock, chunk_groups = hblock / GROUP;
    const size_t h_bytes = act_bytes(c->down_type, n_ff), chunk_bytes = act_bytes(c->down_type, hblock);
    uint8_t *xq = c->scratch;
    uint8_t *hq = xq + aligned(act_bytes(c->up_type, n_embd));      /* n_used activation rows of n_ff */
    float *ug = (float *)(hq + aligned((size_t)n_used * h_bytes)); /* per slot: its up rows, then its gate rows */
    float *y = ug + (size_t)2 * n_used * n_ff;                     /* per slot: its down rows */
    uint8_t *at = (uint8_t *)(y + (size_t)n_used * n_embd);
    at = c->scratch + aligned((size_t)(at - c->scratch));
    token_counters k;
    k.next = (_Atomic int64_t *)at;
    k.chunk_done = (_Atomic int *)(at + 64);
    k.slot_ready = (_Atomic int *)((uint8_t *)k.chunk_done + aligned(sizeof(int) * (size_t)n_used * chunks));
    k.rows_done = (_Atomic int *)((uint8_t *)k.slot_ready + aligned(sizeof(int) * (size_t)n_used));
    if (t == 0) {
        quantize_row(c->up_type, c->x, n_embd, xq);
        memset(at, 0, token_counter_bytes(n_used, n_ff, n_embd, c->down_type));
    }
    sync_threads(b, nt);
    const int ff_groups = n_ff / GROUP, embd_groups = n_embd / GROUP;
    const int ug_per = bundle_groups(c->up_type, n_embd, ff_groups, 2, n_used, nt);
    const int down_per = bundle_groups(c->down_type, n_ff, embd_groups, 1, n_used, nt);
    const int ug_bundles = (ff_groups + ug_per - 1) / ug_per, down_bundles = (embd_groups + down_per - 1) / down_per;
    const int64_t first_down = (int64_t)n_used * 2 * ug_bundles, total = first_down + (int64_t)n_used * down_bundles;
    const size_t ug_expert = group_bytes(c->up_type, n_embd) * ff_groups;
    const size_t down_expert = group_bytes(c->down_type, n_ff) * embd_groups;
    const uint8_t *up_gate[2] = {c->up, c->gate};
    for (;;) {
        const int64_t u = __atomic_fetch_add(k.next, 1, __ATOMIC_RELAXED);
        if (u >= total) break;
        if (u < first_down) { /* groups g0..g1 of matrix m (up, gate) of slot s */
            const int s = (int)(u / (2 * ug_bundles)), m = (int)(u / ug_bundles % 2);
            const int g0 = (int)(u % ug_bundles) * ug_per, g1 = g0 + ug_per < ff_groups ? g0 + ug_per : ff_groups;
            const size_t per_group = group_bytes(c->up_type, n_embd);
            const uint8_t *w = up_gate[m] + (size_t)c->ids[s] * ug_expert;
            float *o = ug + ((size_t)2 * s + m) * n_ff;
            for (int g = g0; g < g1; g++) {
                float *og = o + (size_t)g * GROUP;
                tile_of(c->up_type, w + (size_t)g * per_group, &xq, n_embd, &og, 1);
            }
            for (int ch = g0 / chunk_groups; ch * chunk_groups < g1; ch++) { /* the chunks these groups fall in */
                const int lo = ch * chunk_groups > g0 ? ch * chunk_groups : g0;
                const int hi = (ch + 1) * chunk_groups < g1 ? (ch + 1) * chunk_groups : g1;
                if (__atomic_add_fetch(&k.chunk_done[s * chunks + ch], hi - lo, __ATOMIC_ACQ_REL) < 2 * chunk_groups)
                    continue;
                float *up = ug + (size_t)2 * s * n_ff + (size_t)ch * hblock; /* the chunk's last rows: h */
                glu(c, c->ids[s], ch * hblock, up, up + n_ff, hblock);
                quantize_row(c->down_type, up, hblock, hq + s * h_bytes + ch * chunk_bytes);
                __atomic_add_fetch(&k.slot_ready[s], 1, __ATOMIC_RELEASE);
            }
        } else { /* groups g0..g1 of slot s's down, then maybe those rows of out */
            const int64_t d = u - first_down;
            const int s = (int)(d / down_bundles), j = (int)(d % down_bundles);
            const int g0 = j * down_per, g1 = g0 + down_per < embd_groups ? g0 + down_per : embd_groups;
            const size_t per_group = group_bytes(c->down_type, n_ff);
            const uint8_t *w = c->down + (size_t)c->ids[s] * down_expert, *h = hq + s * h_bytes;
            wait_for(&k.slot_ready[s], chunks);
            for (int g = g0; g < g1; g++) {
                float *og = y + (size_t)s * n_embd + (size_t)g * GROUP;
                tile_of(c->down_type, w + (size_t)g * per_group, &h, n_ff, &og, 1);
            }
            if (__atomic_add_fetch(&k.rows_done[j], 1, __ATOMIC_ACQ_REL) < n_used) continue;
            for (int i = g0 * GROUP; i < g1 * GROUP; i++) {
                float sum = 0.0f;
                for (int q = 0; q < n_used; q++)
                    sum += c->weights[q] * (y[(size_t)q * n_embd + i] + down_bias(c, c->ids[q], i));
                c->out[i] = sum;
            }
        }
    }
}

/* Many tokens (thread t of nt): the (token, slot) pairs sorted by expert, so that each expert's weights are read once
 * per tile of TILE of its tokens; each phase's work a list of equal units (matrix, row group, tile) split into one
 * contiguous range per thread, so that no thread idles while another has a whole expert left. A slot of id -1 adds
 * nothing (an expert held elsewhere). */
static void batch_body(const moe_call *c, int t, int nt, spin_barrier *b) {
    const int n = c->n, n_used = c->n_used, n_embd = c->n_embd, n_ff = c->n_ff, n_expert = c->n_expert;
    const int64_t pairs = (int64_t)n * n_used;
    const size_t x_bytes = act_bytes(c->up_type, n_embd), h_bytes = act_bytes(c->down_type, n_ff);
    uint8_t *at = c->scratch;
    uint8_t *xq = at;
    at += aligned((size_t)n * x_bytes);
    int32_t *start = (int32_t *)at; /* pairs of expert e: start[e]..start[e + 1] in expert order */
    at += aligned(sizeof(int32_t) * (n_expert + 1));
    int64_t *first_ug = (int64_t *)at, *first_down = (int64_t *)(at + aligned(sizeof(int64_t) * (n_expert + 1)));
    at += 2 * aligned(sizeof(int64_t) * (n_expert + 1));
    int32_t *token_of = (int32_t *)at;                                     /* pair in expert order -> its token */
    int32_t *self = (int32_t *)(at + aligned(sizeof(int32_t) * pairs));     /* p -> p: h's rows are the pairs' own */
    int32_t *pos = (int32_t *)(at + 2 * aligned(sizeof(int32_t) * pairs)); /* token * n_used + slot -> p, or -1 */
    at += 3 * aligned(sizeof(int32_t) * pairs);
    float *ug = (float *)at; /* per pair: its up rows, then its gate rows */
    at += aligned(sizeof(float) * pairs * 2 * n_ff);
    uint8_t *hq = at; /* AMX_TOKENS rows more, which a last tile of AMX reads and leaves */
    at += aligned((pairs + AMX_TOKENS) * h_bytes);
    float *y = (float *)at; /* per pair: its down rows */
    at += aligned(sizeof(float) * pairs * n_embd);
    int64_t *next_up = (int64_t *)at, *next_down = (int64_t *)(at + 64); /* run_jobs' counters, a line each */
    at += 2 * 64;
    uint8_t *xs = at; /* on AMX: each pair's x row, in expert order, so that an expert's tokens are consecutive */
    const int amx_up = amx_for(c->up_type, n), amx_down = amx_for(c->down_type, n);
    const uint8_t *up_gate[2] = {c->up, c->gate};
    const int ff_groups = n_ff / GROUP, embd_groups = n_embd / GROUP;
    int64_t lo, hi, last = phases_on ? now_ns() : 0;
#define SYNC(k) phase_end(t, k, &last), sync_threads(b, nt), phase_end(t, PH_WAIT, &last)

    thread_range(n, t, nt, &lo, &hi);
    for (int64_t i = lo; i < hi; i++) quantize_row(c->up_type, c->x + i * c->x_stride, n_embd, xq + i * x_bytes);
    phase_end(t, PH_QUANTIZE, &last);
    if (t == 0) { /* counting sort of the pairs by expert, and each phase's units per expert */
        *next_up = *next_down = 0;
        memset(start, 0, sizeof(int32_t) * (n_expert + 1));
        for (int i = 0; i < n; i++)
            for (int j = 0; j < n_used; j++) {
                const int32_t e = c->ids[i * c->ids_stride + j];
                if (e >= 0) start[e + 1]++;
            }
        for (int e = 0; e < n_expert; e++) start[e + 1] += start[e];
        first_ug[0] = first_down[0] = 0;
        for (int e = 0; e < n_expert; e++) {
            const int count = start[e + 1] - start[e];
            first_ug[e + 1] = first_ug[e] + units_of(count, ff_groups, 2, amx_up);
            first_down[e + 1] = first_down[e] + units_of(count, embd_groups, 1, amx_down);
        }
        for (int e = n_expert; e > 0; e--) start[e] = start[e - 1]; /* shifted: start[e + 1] is e's next free */
        for (int i = 0; i < n; i++)
            for (int j = 0; j < n_used; j++) {
                const int32_t e = c->ids[i * c->ids_stride + j];
                if (e < 0) {
                    pos[i * n_used + j] = -1;
                    continue;
                }
                const int p = start[e + 1]++;
                pos[i * n_used + j] = p;
                token_of[p] = i;
                self[p] = p;
            }
    }
    SYNC(PH_SORT);
    const int live = start[n_expert];
    if (amx_up) {
        thread_range(live, t, nt, &lo, &hi);
        for (int64_t p = lo; p < hi; p++) memcpy(xs + p * x_bytes, xq + (size_t)token_of[p] * x_bytes, x_bytes);
        SYNC(PH_GATHER);
    }
    const phase up_phase = {c->up_type, n_embd, ff_groups, 2, up_gate, first_ug, start, amx_up ? self : token_of,
                            amx_up ? xs : xq, x_bytes, (size_t)2 * n_ff, (size_t)n_ff, ug, amx_up};
    run_jobs(&up_phase, next_up, n_expert);
    SYNC(PH_UP);
    thread_range(live, t, nt, &lo, &hi);
    for (int64_t p = lo, e = 0; p < hi; p++) {
        while (start[e + 1] <= p) e++; /* pair p's expert */
        float *u = ug + p * 2 * n_ff;
        glu(c, (int)e, 0, u, u + n_ff, n_ff);
        quantize_row(c->down_type, u, n_ff, hq + p * h_bytes);
    }
    SYNC(PH_GLU);
    const phase down_phase = {c->down_type, n_ff, embd_groups, 1, &c->down, first_down, start, self, hq, h_bytes,
                              (size_t)n_embd, 0, y, amx_down};
    run_jobs(&down_phase, next_down, n_expert);
    SYNC(PH_DOWN);
#undef SYNC
    const int chunks = (n_embd + 63) / 64; /* (token, 64 columns) units, so that a few tokens use every thread */
    thread_range((int64_t)n * chunks, t, nt, &lo, &hi);
    for (int64_t u = lo; u < hi; u++) {
        const int64_t i = u / chunks;
        const int c0 = (int)(u % chunks) * 64, c1 = c0 + 64 < n_embd ? c0 + 64 : n_embd;
        float *o = c->out + i * n_embd;
        for (int col = c0; col < c1; col++) o[col] = 0.0f;
        for (int j = 0; j < n_used; j++) {
            const int32_t p = pos[i * n_used + j];
            if (p < 0) continue;
            const float w = c->weights[i * c->w_stride + j], *yp = y + (size_t)p * n_embd;
            const int e = c->ids[i * c->ids_stride + j];
            for (int col = c0; col < c1; col++) o[col] += w * (yp[col] + down_bias(c, e, col));
        }
    }
    phase_end(t, PH_SUM, &last);
}

static void run_call(const moe_call *c, int t, int nt, spin_barrier *b) {
    if (c->n == 1)
        token_body(c, t, nt, b);
    else
        batch_body(c, t, nt, b);
}

static int run_omp(const moe_call *c, int n_threads) {
    if (!valid(c)) return -1;
    spin_barrier b = {0, 0};
#pragma omp parallel num_threads(n_threads)
    run_call(c, omp_get_thread_num(), omp_get_num_threads(), &b);
    return 0;
}
#endif

/* x (n_embd) -> out (n_embd): sum over slots j of weights[j] * (down[e] act(gate[e] x, up[e] x)), e = ids[j], each
 * matrix's bias added where it has one (act: ACT_SILU, silu(gate) up, or ACT_SWIGLU_OAI with alpha and limit; biases:
 * NULL or n_expert rows of the matrix's rows, float32). up, gate: n_expert matrices of n_ff rows of n_embd, of up_type;
 * down: n_expert matrices of n_embd rows of n_ff, of down_type; all in the layouts above, each expert's matrix
 * contiguous. scratch: ferry_moe_scratch bytes, 64-byte aligned. Returns 0; -1 when an id is out of range, a type is
 * not one above, or a size is not a multiple of its type's block (rows: of 8); -2 when not built FAST (nothing is
 * written then). */
int ferry_moe_experts(const float *x, const int32_t *ids, const float *weights, int n_used, int n_embd, int n_ff,
                      int n_expert, const uint8_t *up, const uint8_t *gate, const uint8_t *down, int up_type,
                      int down_type, float *out, void *scratch, int n_threads, int act, float alpha, float limit,
                      const float *up_bias, const float *gate_bias, const float *down_bias) {
#if !FAST
    return -2; /* native.py asks ferry_moe_fast first and never gets here */
#else
    const moe_call c = {x, ids, weights, n_embd, n_used, n_used, 1, n_used, n_embd, n_ff, n_expert, up_type,
                        down_type, up, gate, down, out, (uint8_t *)scratch,
                        {act, alpha, limit, up_bias, gate_bias, down_bias}};
    return run_omp(&c, n_threads);
#endif
}

/* n tokens' routed experts: x (n, n_embd) -> out (n, n_embd), row i the sum over its slots j of weights[i, j] *
 * down[e] (silu(gate[e] x_i) * up[e] x_i), e = ids[i, j]; over many tokens a slot of id -1 adds nothing. Layouts,
 * types and returns as ferry_moe_experts'; scratch: ferry_moe_batch_scratch bytes, 64-byte aligned. */
int ferry_moe_batch(const float *x, const int32_t *ids, const float *weights, int n, int n_used, int n_embd, int n_ff,
                    int n_expert, const uint8_t *up, const uint8_t *gate, const uint8_t *down, int up_type,
                    int down_type, float *out, void *scratch, int n_threads, int act, float alpha, float limit,
                    const float *up_bias, const float *gate_bias, const float *down_bias) {
#if !FAST
    return -2;
#else
    const moe_call c = {x, ids, weights, n_embd, n_used, n_used, n, n_used, n_embd, n_ff, n_expert, up_type,
                        down_type, up, gate, down, out, (uint8_t *)scratch,
                        {act, alpha, limit, up_bias, gate_bias, down_bias}};
    return run_omp(&c, n_threads);
#endif
}

/* byte offsets of ggml_tensor's ne, nb, src and data fields (given by the caller, so that no ggml header is needed
 * here), and what a node reads through them */
typedef struct {
    int64_t ne, nb, src, data;
} tensor_fields;

static const void *src_of(const void *t, const tensor_fields *f, int i) {
    return ((const void *const *)((const uint8_t *)t + f->src))[i];
}
static void *data_of(const void *t, const tensor_fields *f) { return *(void *const *)((const uint8_t *)t + f->data); }
static int64_t ne_of(const void *t, const tensor_fields *f, int i) {
    return ((const int64_t *)((const uint8_t *)t + f->ne))[i];
}
static int64_t nb_of(const void *t, const tensor_fields *f, int i) { /* bytes */
    return (int64_t)((const size_t *)((const uint8_t *)t + f->nb))[i];
}
static int64_t columns_of(const void *t, const tensor_fields *f) { return ne_of(t, f, 1); }
static int64_t row_stride(const void *t, const tensor_fields *f, size_t item) { /* nb[1] in items */
    return nb_of(t, f, 1) / (int64_t)item;
}

/* The same as a node of a ggml graph (ggml_custom_4d, called by each of ggml's nth threads at once with its ith):
 * dst (n_embd, n) float32 = the experts of src[0] x (n_embd, n) float32, src[1] ids (>= n_used, n) int32, src[2]
 * weights (n_used, n) float32, rows of each at their nb[1]. The layer's fixed part is a ferry_ggml_moe. ids are
 * top_k's: in range. */
typedef struct {
    const uint8_t *up, *gate, *down;
    int n_embd, n_ff, n_expert, n_used, up_type, down_type;
    uint8_t *const *scratch; /* where the kernel's scratch is now: ferry_moe_batch_scratch bytes for the largest
                              * graph built (graphs run one at a time and are built before they run) */
    spin_barrier *barrier;
    tensor_fields f;
    expert_extras ex;
} ferry_ggml_moe;

size_t ferry_ggml_moe_size(void) { return sizeof(ferry_ggml_moe); }

void ferry_moe_ggml(void *dst, int ith, int nth, void *userdata) {
#if FAST
    const ferry_ggml_moe *m = (const ferry_ggml_moe *)userdata;
    const tensor_fields *f = &m->f;
    const void *x = src_of(dst, f, 0), *ids = src_of(dst, f, 1), *w = src_of(dst, f, 2);
    const moe_call c = {data_of(x, f), data_of(ids, f), data_of(w, f), row_stride(x, f, sizeof(float)),
                        row_stride(ids, f, sizeof(int32_t)), row_stride(w, f, sizeof(float)), (int)columns_of(dst, f),
                        m->n_used, m->n_embd, m->n_ff, m->n_expert, m->up_type, m->down_type, m->up, m->gate, m->down,
                        data_of(dst, f), *m->scratch, m->ex};
    run_call(&c, ith, nth, m->barrier);
#else
    (void)dst, (void)ith, (void)nth, (void)userdata;
#endif
}

/* Plain Q8_0 rows (34 bytes a block: fp16 d, 32 int8) to the layout tile_32 reads, rows in groups of 8 (rows: a
 * multiple of 8, cols: of 32); the rows split between n_threads. */
void ferry_repack_q8_0(const uint8_t *src, uint8_t *dst, int64_t rows, int64_t cols, int n_threads) {
    const int64_t blocks = cols / QK4_0, groups = rows / GROUP;
#pragma omp parallel for num_threads(n_threads) schedule(static)
    for (int64_t gi = 0; gi < groups; gi++)
        for (int64_t b = 0; b < blocks; b++) {
            uint8_t *o = dst + (gi * blocks + b) * Q8_0_BYTES;
            for (int r = 0; r < GROUP; r++) {
                const uint8_t *blk = src + ((gi * GROUP + r) * blocks + b) * 34;
                memcpy(o + 2 * r, blk, 2);
                for (int c = 0; c < 4; c++)
                    for (int i = 0; i < 8; i++) o[16 + 64 * c + 8 * r + i] = blk[2 + 8 * c + i] ^ 0x80;
            }
        }
}

/* x rounded to fp16's nearest (ties to even) as its bits; x is finite and below 65520 in magnitude (the caller
 * checks). Written out, not by F16C, so that it builds for any CPU: the transcoding below runs wherever C does. */
static uint16_t half_bits(double x) {
    const uint16_t sign = x < 0 ? 0x8000 : 0;
    const double a = fabs(x);
    int e;
    frexp(a, &e); /* a = f 2^e, f in [0.5, 1) */
    e -= 1;       /* a = 1.m 2^e */
    if (a == 0.0) return sign;
    if (e < -14) return sign | (uint16_t)rint(a * 16777216.0); /* subnormal: steps of 2^-24 (may round up to 2^-14) */
    double m = rint(ldexp(a, 10 - e));                             /* 1024..2048 */
    if (m == 2048.0) m = 1024.0, e++;
    return sign | (uint16_t)(((e + 15) << 10) | ((int)m - 1024));
}

static double half_value(uint16_t h) { /* fp16 bits to their value */
    const int e = (h >> 10) & 0x1f, m = h & 0x3ff;
    const double v = e == 0 ? ldexp(m, -24) : e == 31 ? (m ? NAN : INFINITY) : ldexp(1024 + m, e - 25);
    return h & 0x8000 ? -v : v;
}

static const int8_t iq2nl[8] = {-31, -13, 1, 17, -26, -8, 6, 22};
static const int8_t iq3nl[16] = {-63, -40, -23, -10, 1, 13, 28, 47, -59, -36, -19, -6, 5, 17, 32, 51};
static const int8_t iq4k[32] = {-127, -104, -83, -65, -49, -35, -22, -10, 1,  13, 25, 38, 53, 69, 89, 113,
                                -123, -100, -79, -61, -45, -31, -18, -6,  5,  17, 29, 42, 57, 73, 93, 117};
static const int8_t iq5nl[64] = {-126, -114, -103, -92, -83, -74, -65, -57, -50, -43, -36, -30, -24, -18, -12, -6,
                                 -1,   5,    11,   17,  23,  29,  36,  43,  51,  59,  68,  77,  87,  97,  109, 121,
                                 -124, -112, -101, -90, -81, -72, -63, -55, -48, -41, -34, -28, -22, -16, -10, -4,
                                 1,    7,    13,   19,  25,  31,  38,  45,  53,  61,  70,  79,  89,  99,  111, 123};
static const uint16_t iq2kl[32] = {0xe9c1, 0x0dc1, 0xc1d8, 0xf6d8, 0x0dd8, 0x2fd8, 0xd8e9, 0xe9e9, 0x01e9, 0x0de9, 0x1ce9,
                                   0xc1f6, 0x01f6, 0x0df6, 0x2ff6, 0xe901, 0xf601, 0x0101, 0x0d01, 0x1c01, 0xd80d, 0xe90d,
                                   0xf60d, 0x010d, 0x0d0d, 0xc11c, 0xe91c, 0x011c, 0x1c1c, 0x2f1c, 0xe92f, 0x0d2f};
static const int8_t iq6nl[64] = {-127, -121, -115, -109, -104, -98, -93, -88, -84, -79, -74, -70, -66, -62, -58, -54,
                                 -51,  -47,  -44,  -40,  -37,  -34, -31, -28, -25, -22, -19, -16, -13, -11, -8,  -5,
                                 -2,   0,    3,    6,    9,    12,  14,  17,  20,  23,  27,  30,  33,  36,  40,  44,
                                 47,   51,   55,   59,   63,   68,  72,  77,  82,  87,  92,  98,  103, 109, 115, 121};
enum { IK_Q6_0 = 133, IK_IQ2_K = 137, IK_IQ3_K = 138, IK_IQ4_K = 139, IK_IQ5_K = 140, IK_IQ6_K = 141,
       IK_IQ2_KS = 145, IK_IQ4_KSS = 146, IK_IQ4_KS = 144, IK_IQ5_KS = 152, IK_IQ3_KS = 156,
       IK_IQ2_KL = 157, IK_IQ2_KT = 153, IK_IQ3_KT = 154, IK_IQ4_KT = 155, IK_IQ1_KT = 158 }; /* ik_llama.cpp's numbers */

/* the trellis types' generator: each step multiplies the 32-bit state and sums its four bytes' low 6 bits, less 126 */
static inline int kt_step(uint32_t *x) {
    *x *= 0xCBAC1FEDu;
    return (int)(((*x & 0x3f3f3f3fu) * 0x01010101u) >> 24) - 126;
}

/* block ib (32 values) of one 256-value trellis super-block b: its integer scale, and its 32 values in t (gguf/trellis.py
 * describes each layout: groups of 8 (IQ4_KT: 4) values, each from its index + 4096) */
static int kt_block(int type, const uint8_t *b, int ib, int8_t *t) {
    if (type == IK_IQ4_KT) {
        uint32_t w;
        memcpy(&w, b + 4 * ib, 4);
        for (int i = 0; i < 8; i++) {
            const int g = 8 * ib + i;
            uint32_t x = 4096u + (b[32 + g] | (uint32_t)(b[96 + g % 32] >> (4 * (g / 32)) & 15) << 8
                                  | (w >> (8 + 3 * i) & 7) << 12 | (w & 1) << 15);
            for (int k = 0; k < 4; k++) t[4 * i + k] = (int8_t)kt_step(&x);
        }
        return (int)((w & 255) >> 1) - 64;
    }
    int ls;
    for (int i = 0; i < 4; i++) {
        const int g = 4 * ib + i;
        uint32_t x;
        if (type == IK_IQ1_KT)
            x = b[8 + g] | (uint32_t)(b[40 + g % 16] >> (4 * (g / 16)) & 15) << 8 | (uint32_t)(b[g / 4] >> (4 + g % 4) & 1) << 12;
        else
            x = b[4 + 2 * g] | (uint32_t)b[5 + 2 * g] << 8;
        x += 4096u;
        for (int k = 0; k < 8; k++) {
            const int v = kt_step(&x);
            t[8 * i + k] = (int8_t)(type == IK_IQ3_KT ? (b[68 + 8 * i + k] >> ib & 1 ? -abs(v) : abs(v)) : v);
        }
    }
    if (type == IK_IQ1_KT)
        ls = iq4k[b[ib] & 15];
    else {
        const int nib = b[ib % 4] >> (4 * (ib / 4)) & 15;
        ls = type == IK_IQ2_KT ? iq4k[nib] : nib;
    }
    return ls;
}

/* sub-block ib (32 values) of one 256-value block of an IQn_K type: each value's scale (its 16's) times its table
 * value, p[32] (quant._ik_k_parts describes each layout) */
static void ik_k_products(int type, const uint8_t *b, int ib, int32_t *p) {
    const int extra = (b[2] | b[3] << 8) >> (2 * ib);
    int s[2];
    for (int j = 0; j < 32; j++) {
        const int h = j / 16, second = extra >> h & 1;
        int v;
        if (type == IK_IQ2_K) {
            s[h] = (b[4 + ib] >> (4 * h) & 15) - 8;
            v = iq2nl[4 * second + (b[12 + 32 * (ib / 4) + j] >> (2 * (ib % 4)) & 3)];
        } else if (type == IK_IQ3_K) {
            const int sign = (b[4] | b[5] << 8) >> (2 * ib + h) & 1;
            s[h] = (2 * (b[6 + ib] >> (4 * h) & 15) + 1) * (sign ? -1 : 1);
            v = iq3nl[8 * second + ((b[14 + 32 * (ib / 4) + j] >> (2 * (ib % 4)) & 3) | (b[78 + j] >> ib & 1) << 2)];
        } else if (type == IK_IQ4_K || type == IK_IQ5_K) {
            const int high = b[4 + ib / 2] >> (4 * (ib % 2));
            s[h] = ((b[8 + ib] >> (4 * h) & 15) | (high << (4 - 2 * h) & 0x30)) - 32;
            if (type == IK_IQ4_K)
                v = iq4k[16 * second + (b[16 + 16 * ib + j % 16] >> (4 * h) & 15)];
            else
                v = iq5nl[32 * second + ((b[16 + 32 * (ib / 2) + j] >> (4 * (ib % 2)) & 15) | (b[144 + j] >> ib & 1) << 4)];
        } else { /* IQ6_K */
            s[h] = (int8_t)b[4 + 2 * ib + h];
            const int qh = b[148 + 32 * (ib / 4) + j] >> (4 * (ib / 2 % 2) + 2 * (ib % 2)) & 3;
            v = iq6nl[(b[20 + 32 * (ib / 2) + j] >> (4 * (ib % 2)) & 15) | qh << 4] + second;
        }
        p[j] = s[h] * v;
    }
}

/* sub-block ib (32 values) of one 256-value block of an ik_llama.cpp type: its integer scale, and its 32 table values
 * (quant._ik_parts describes each layout) */
static int ik_sub_block(int type, const uint8_t *b, int ib, int8_t *t) {
    int s = 0;
    if (type == IK_IQ4_KS || type == IK_IQ5_KS) {
        const int S = b[ib];
        s = (S & 254) - 127;
        for (int j = 0; j < 32; j++) {
            if (type == IK_IQ4_KS) {
                const int q = b[8 + 16 * ib + j % 16] >> (4 * (j / 16)) & 0xf;
                t[j] = iq4k[16 * (S & 1) + q];
            } else {
                const int q = (b[8 + 32 * (ib / 2) + j] >> (4 * (ib % 2)) & 0xf) | (b[136 + j] >> ib & 1) << 4;
                t[j] = iq5nl[32 * (S & 1) + q];
            }
        }
    } else if (type == IK_IQ4_KSS) {
        uint8_t a[16];
        int ls = 0;
        for (int k = 0; k < 8; k++) {
            const unsigned w = b[16 * ib + 2 * k] | (unsigned)b[16 * ib + 2 * k + 1] << 8, x = w & 0xfffe;
            const unsigned v = (x ^ (x >> 1)) & 0xffff;
            ls |= (int)(w & 1) << k;
            a[2 * k] = (uint8_t)(v & 0xff);
            a[2 * k + 1] = (uint8_t)(v >> 8);
        }
        s = (ls & 254) - 127;
        for (int j = 0; j < 16; j++) {
            t[j] = iq4k[16 * (ls & 1) + (a[j] & 0xf)];
            t[16 + j] = iq4k[16 * (ls & 1) + (a[j] >> 4)];
        }
    } else if (type == IK_IQ3_KS || type == IK_IQ2_KS) {
        const int extra = b[0] | b[1] << 8;
        if (type == IK_IQ3_KS) { /* scales[k]: sub-block k low nibble, k + 4 high; extra: 5th bits 0-7, halves 8-15 */
            s = ((b[2 + ib % 4] >> (4 * (ib / 4)) & 0xf) | (extra >> ib & 1) << 4) - 16;
            const int8_t *table = iq3nl + 8 * (extra >> (8 + ib) & 1);
            for (int j = 0; j < 32; j++)
                t[j] = table[(b[6 + 32 * (ib / 4) + j] >> (2 * (ib % 4)) & 3) | (b[70 + j] >> ib & 1) << 2];
        } else { /* scales[k]: sub-block 2k low nibble, 2k + 1 high; extra: halves bits 0-7, 5th bits 8-15 */
            s = ((b[2 + ib / 2] >> (4 * (ib % 2)) & 0xf) | (extra >> (8 + ib) & 1) << 4) - 16;
            const int8_t *table = iq2nl + 4 * (extra >> ib & 1);
            for (int j = 0; j < 32; j++) t[j] = table[b[6 + 32 * (ib / 4) + j] >> (2 * (ib % 4)) & 3];
        }
    } else { /* IQ2_KL: 6-bit scales, 5-bit indices of pairs */
        const int scales_h = b[0] | b[1] << 8;
        s = ((b[2 + ib % 4] >> (4 * (ib / 4)) & 0xf) | (scales_h >> (2 * ib) & 3) << 4) - 32;
        for (int p = 0; p < 16; p++) {
            const int idx = (b[6 + 16 * (ib / 2) + p] >> (4 * (ib % 2)) & 0xf) | (b[70 + p] >> ib & 1) << 4;
            t[2 * p] = (int8_t)(iq2kl[idx] & 0xff);
            t[2 * p + 1] = (int8_t)(iq2kl[idx] >> 8);
        }
    }
    return s;
}

/* ik_llama.cpp's Q6_0, IQ4_KS, IQ5_KS, IQ4_KSS, IQ3_KS, IQ2_KS or IQ2_KL rows of n values (row_meta bytes of row
 * scale, then blocks of block_bytes) as Q8_0 blocks, the same weights: Q6_0's exactly, the others' table values with
 * each sub-block's scale (the row's times the sub-block's integer) rounded to fp16; the IQn_K types' products of
 * scale and value, kept where a 32's fit int8, else rounded to 255 levels (quant._per_16_as_q8_0). Returns the count of scales at or
 * past fp16's largest (a corrupt file; their blocks are left unwritten). */
int64_t ferry_ik_to_q8_0(const uint8_t *src, uint8_t *dst, int64_t rows, int64_t n, int type, int row_meta,
                         int block_bytes, int n_threads) {
    const int64_t blocks = n / QK4_0, row_bytes = row_meta + n / (type == IK_Q6_0 ? QK4_0 : QK_K) * block_bytes;
    int64_t bad = 0;
#pragma omp parallel for num_threads(n_threads) schedule(static) reduction(+ : bad)
    for (int64_t r = 0; r < rows; r++) {
        const uint8_t *row = src + r * row_bytes;
        uint8_t *o = dst + r * blocks * 34;
        if (type == IK_Q6_0) {
            for (int64_t b = 0; b < blocks; b++, row += 26, o += 34) {
                memcpy(o, row, 2);
                for (int j = 0; j < 16; j++) {
                    const int h = row[2 + j % 8] >> (4 * (j / 8)), q = row[10 + j];
                    o[2 + j] = (uint8_t)(int8_t)(((q & 0x0f) | ((h << 4) & 0x30)) - 32);
                    o[18 + j] = (uint8_t)(int8_t)(((q >> 4) | ((h << 2) & 0x30)) - 32);
                }
            }
            continue;
        }
        if (type >= IK_IQ2_K && type <= IK_IQ6_K) { /* 32 products rounded to 255 levels where they do not fit int8 */
            for (int64_t sb = 0; sb < blocks / 8; sb++, row += block_bytes) {
                uint16_t dh;
                memcpy(&dh, row, 2);
                const double d = half_value(dh);
                for (int ib = 0; ib < 8; ib++, o += 34) {
                    int32_t p[32], m = 0;
                    ik_k_products(type, row, ib, p);
                    for (int j = 0; j < 32; j++) m = abs(p[j]) > m ? abs(p[j]) : m;
                    const double scale = m <= 127 ? d : d * m / 127.0;
                    if (!(fabs(scale) < 65520.0)) {
                        bad++;
                        continue;
                    }
                    const uint16_t h = half_bits(scale);
                    memcpy(o, &h, 2);
                    for (int j = 0; j < 32; j++) {
                        const int32_t a = abs(p[j]), q = m <= 127 ? a : (2 * 127 * a + m) / (2 * m);
                        o[2 + j] = (uint8_t)(int8_t)(p[j] < 0 ? -q : q);
                    }
                }
            }
            continue;
        }
        double d;
        if (row_meta == 4) {
            float f;
            memcpy(&f, row, 4);
            d = f;
        } else {
            uint16_t h;
            memcpy(&h, row, 2);
            d = half_value(h);
        }
        if (type == IK_IQ1_KT || type == IK_IQ2_KT || type == IK_IQ3_KT || type == IK_IQ4_KT) {
            /* the scale as ik's kernels compute it, in float32: (d F) ls, F their factor for IQ2_KT / IQ3_KT */
            const float dF = (float)d * (type == IK_IQ2_KT ? 1.05f : type == IK_IQ3_KT ? 1.01f : 1.0f);
            for (int64_t sb = 0; sb < blocks / 8; sb++) {
                const uint8_t *b = row + row_meta + sb * block_bytes;
                for (int ib = 0; ib < 8; ib++, o += 34) {
                    int8_t t[32];
                    const float scale = dF * (float)kt_block(type, b, ib, t);
                    if (!(fabsf(scale) < 65520.0f)) {
                        bad++;
                        continue;
                    }
                    const uint16_t h = half_bits(scale);
                    memcpy(o, &h, 2);
                    memcpy(o + 2, t, 32);
                }
            }
            continue;
        }
        for (int64_t sb = 0; sb < blocks / 8; sb++) {
            const uint8_t *b = row + row_meta + sb * block_bytes;
            for (int ib = 0; ib < 8; ib++, o += 34) {
                int8_t t[32];
                const double scale = d * ik_sub_block(type, b, ib, t);
                if (!(fabs(scale) < 65520.0)) {
                    bad++;
                    continue;
                }
                const uint16_t h = half_bits(scale);
                memcpy(o, &h, 2);
                memcpy(o + 2, t, 32);
            }
        }
    }
    return bad;
}

/* y = W x for n rows of x: W m rows of k columns of type in the kernel's layout (Q4_0 / Q4_K: ggml's repacked, Q8_0:
 * ferry_repack_q8_0's, Q6_K: plain), x rows x_stride floats apart, y rows out_stride apart */
typedef struct {
    const float *x;
    int64_t x_stride, out_stride;
    int n, m, k, type;
    const uint8_t *w;
    float *out;
    uint8_t *scratch;
} linear_call;

size_t ferry_linear_scratch(int n, int k, int type) { /* AMX_TOKENS rows more, which a last tile of AMX reads; the
                                                        * jobs' counter */
    return aligned((size_t)(n + AMX_TOKENS) * act_bytes(type, k)) + 64 + sizeof(int32_t) * (size_t)n;
}

#if FAST
/* x quantized once (rows split between threads), then (row block, tile of tokens) units in jobs (run_jobs) */
static void linear_body(const linear_call *c, int t, int nt, spin_barrier *b) {
    const size_t x_bytes = act_bytes(c->type, c->k);
    uint8_t *xq = c->scratch;
    int64_t *next = (int64_t *)(xq + aligned((size_t)(c->n + AMX_TOKENS) * x_bytes));
    int32_t *rows = (int32_t *)((uint8_t *)next + 64);
    int64_t lo, hi;
    thread_range(c->n, t, nt, &lo, &hi);
    for (int64_t i = lo; i < hi; i++) {
        quantize_row(c->type, c->x + i * c->x_stride, c->k, xq + i * x_bytes);
        rows[i] = (int32_t)i;
    }
    if (t == 0) *next = 0;
    sync_threads(b, nt);
    const int groups = c->m / GROUP, amx = amx_for(c->type, c->n);
    const int64_t first[2] = {0, units_of(c->n, groups, 1, amx)};
    const int32_t start[2] = {0, c->n};
    const phase ph = {c->type, c->k, groups, 1, &c->w, first, start, rows, xq, x_bytes, (size_t)c->out_stride, 0,
                      c->out, amx};
    run_jobs(&ph, next, 1);
}
#endif

int ferry_linear(const float *x, int n, int64_t x_stride, const uint8_t *w, int type, int m, int k, float *out,
                 int64_t out_stride, void *scratch, int n_threads) {
#if !FAST
    return -2;
#else
    if (!block_of(type) || k % block_of(type) || m % GROUP || n < 1) return -1;
    const linear_call c = {x, x_stride, out_stride, n, m, k, type, w, out, (uint8_t *)scratch};
    spin_barrier b = {0, 0};
#pragma omp parallel num_threads(n_threads)
    linear_body(&c, omp_get_thread_num(), omp_get_num_threads(), &b);
    return 0;
#endif
}

/* ferry_linear as a node of a ggml graph: dst (m, n) float32 = W src[0] (k, n) float32 */
typedef struct {
    const uint8_t *w;
    int type, m, k;
    uint8_t *const *scratch; /* as ferry_ggml_moe's: ferry_linear_scratch bytes for the largest graph built */
    spin_barrier *barrier;
    tensor_fields f;
} ferry_ggml_linear;

size_t ferry_ggml_linear_size(void) { return sizeof(ferry_ggml_linear); }

void ferry_linear_ggml(void *dst, int ith, int nth, void *userdata) {
#if FAST
    const ferry_ggml_linear *l = (const ferry_ggml_linear *)userdata;
    const tensor_fields *f = &l->f;
    const void *x = src_of(dst, f, 0);
    const linear_call c = {data_of(x, f), row_stride(x, f, sizeof(float)), row_stride(dst, f, sizeof(float)),
                           (int)columns_of(dst, f), l->m, l->k, l->type, l->w, data_of(dst, f), *l->scratch};
    linear_body(&c, ith, nth, l->barrier);
#else
    (void)dst, (void)ith, (void)nth, (void)userdata;
#endif
}

/* Attention of many queries over a float16 or Q8_0 cache (ferry_attention, ferry_attention_ggml): out =
 * softmax(scale q k^T + mask) v per query row and head, each group of heads sharing a key head (GQA) read against one
 * block of keys at a time. A unit of work is (key head, heads of its group, a tile of queries): ATT_ROWS rows at most,
 * each key block converted to float32 once for all of them (the keys transposed, so that a row's 64 scores are 4
 * registers of one broadcast and 4 loads per dimension), scores turned into weights by an online softmax (exp by a
 * polynomial and scalef), the values added row by row. A unit's keys run from the first to the last position any of
 * its rows' mask leaves open (the causal or sliding mask's closed blocks are skipped). ggml's own flash attention
 * reads every key and value once per query row, rounding the query to the cache's type. Rows with every key masked
 * get zeros; `sinks` (one logit per head, gpt-oss's) join each head's softmax denominator. */
#define ATT_KEYS 64   /* keys a block */
#define ATT_ROWS 64   /* (query, head) rows a unit: the key block's conversion is shared by them */
#define ATT_DIM 256   /* the largest head size (keys' and values'); larger ones stay with ggml */

typedef struct {
    const uint8_t *q, *k, *v, *mask; /* q float32, k v float16 or Q8_0 (type_k, type_v), mask float16 (NULL: open) */
    int64_t q_row, q_head, k_row, k_head, v_row, v_head, mask_row; /* byte strides */
    const float *sinks;              /* (n_head) or NULL */
    float *out;                      /* (n, n_head, d_v) */
    int n, n_kv, n_head, n_kv_head, d, d_v, type_k, type_v;
    float scale;
} attn_call;

/* whether rows of d values of a cache type are ones the kernel reads: float16 in 16s, Q8_0 in its blocks of 32 */
static int att_reads(int type, int d) {
    return d > 0 && d <= ATT_DIM && ((type == F16 && d % 16 == 0) || (type == Q8_0 && d % QK4_0 == 0));
}

static int attn_valid(const attn_call *c) {
    return att_reads(c->type_k, c->d) && att_reads(c->type_v, c->d_v) && c->n_kv_head > 0 &&
           c->n_head % c->n_kv_head == 0 && c->n > 0 && c->n_kv >= 0;
}

#if FAST
/* S[r][0..64) = Qs[r] . keys for `rows` rows of d values: kt holds the block's keys transposed (d x ATT_KEYS) */
static void att_scores(const float *qs, int rows, int d, const float *kt, float *s) {
    int r = 0;
    for (; r + 4 <= rows; r += 4) {
        __m512 acc[4][4];
        for (int i = 0; i < 4; i++)
            for (int j = 0; j < 4; j++) acc[i][j] = _mm512_setzero_ps();
        for (int k = 0; k < d; k++) {
            const float *col = kt + (size_t)k * ATT_KEYS;
            const __m512 k0 = _mm512_load_ps(col), k1 = _mm512_load_ps(col + 16), k2 = _mm512_load_ps(col + 32),
                         k3 = _mm512_load_ps(col + 48);
            for (int i = 0; i < 4; i++) {
                const __m512 qv = _mm512_set1_ps(qs[(size_t)(r + i) * d + k]);
                acc[i][0] = _mm512_fmadd_ps(qv, k0, acc[i][0]);
                acc[i][1] = _mm512_fmadd_ps(qv, k1, acc[i][1]);
                acc[i][2] = _mm512_fmadd_ps(qv, k2, acc[i][2]);
                acc[i][3] = _mm512_fmadd_ps(qv, k3, acc[i][3]);
            }
        }
        for (int i = 0; i < 4; i++)
            for (int j = 0; j < 4; j++) _mm512_store_ps(s + (size_t)(r + i) * ATT_KEYS + 16 * j, acc[i][j]);
    }
    for (; r < rows; r++) {
        __m512 acc[4] = {_mm512_setzero_ps(), _mm512_setzero_ps(), _mm512_setzero_ps(), _mm512_setzero_ps()};
        for (int k = 0; k < d; k++) {
            const float *col = kt + (size_t)k * ATT_KEYS;
            const __m512 qv = _mm512_set1_ps(qs[(size_t)r * d + k]);
            for (int j = 0; j < 4; j++) acc[j] = _mm512_fmadd_ps(qv, _mm512_load_ps(col + 16 * j), acc[j]);
        }
        for (int j = 0; j < 4; j++) _mm512_store_ps(s + (size_t)r * ATT_KEYS + 16 * j, acc[j]);
    }
}

/* o (d_v) = o alpha + sum over the block's nk keys of p[j] vf[j] (vf's rows d_v apart); DV16 a constant in each call
 * (registers). Two rows at once (o2, alpha2, p2: a second row's, or o2 NULL) read each value row once for both. */
static inline __attribute__((always_inline)) void att_values(float *o, float alpha, const float *p, float *o2,
                                                              float alpha2, const float *p2, const float *vf, int nk,
                                                              const int DV16) {
    __m512 acc[ATT_DIM / 16], acc2[8]; /* two rows: d_v of 128 or less */
    const __m512 a = _mm512_set1_ps(alpha);
    for (int i = 0; i < DV16; i++) acc[i] = _mm512_mul_ps(_mm512_load_ps(o + 16 * i), a);
    if (DV16 <= 8 && o2) {
        const __m512 a2 = _mm512_set1_ps(alpha2);
        for (int i = 0; i < DV16; i++) acc2[i] = _mm512_mul_ps(_mm512_load_ps(o2 + 16 * i), a2);
        for (int j = 0; j < nk; j++) {
            const __m512 pj = _mm512_set1_ps(p[j]), pj2 = _mm512_set1_ps(p2[j]);
            const float *row = vf + (size_t)j * 16 * DV16;
            for (int i = 0; i < DV16; i++) {
                const __m512 v = _mm512_load_ps(row + 16 * i);
                acc[i] = _mm512_fmadd_ps(pj, v, acc[i]);
                acc2[i] = _mm512_fmadd_ps(pj2, v, acc2[i]);
            }
        }
        for (int i = 0; i < DV16; i++) _mm512_store_ps(o2 + 16 * i, acc2[i]);
    } else {
        for (int j = 0; j < nk; j++) {
            if (p[j] == 0.0f) continue; /* a closed key */
            const __m512 pj = _mm512_set1_ps(p[j]);
            const float *row = vf + (size_t)j * 16 * DV16;
            for (int i = 0; i < DV16; i++) acc[i] = _mm512_fmadd_ps(pj, _mm512_load_ps(row + 16 * i), acc[i]);
        }
    }
    for (int i = 0; i < DV16; i++) _mm512_store_ps(o + 16 * i, acc[i]);
}

/* att_values for any d_v (a multiple of 16): one row, or two (o2 not NULL) where d_v is 128 or less */
static void att_values_any(float *o, float alpha, const float *p, float *o2, float alpha2, const float *p2,
                           const float *vf, int nk, int d_v) {
    switch (d_v / 16) {
    case 4: att_values(o, alpha, p, o2, alpha2, p2, vf, nk, 4); return;
    case 8: att_values(o, alpha, p, o2, alpha2, p2, vf, nk, 8); return;
    case 16: att_values(o, alpha, p, NULL, 0.0f, NULL, vf, nk, 16); break;
    default: {
        for (int i = 0; i < d_v; i++) o[i] *= alpha;
        for (int j = 0; j < nk; j++)
            for (int i = 0; i < d_v; i++) o[i] += p[j] * vf[(size_t)j * d_v + i];
    }
    }
    if (o2) att_values_any(o2, alpha2, p2, NULL, 0.0f, NULL, vf, nk, d_v);
}

/* a cache row of d values (float16, or Q8_0 blocks: fp16 scale, 32 int8) as float32 */
static inline void att_row(const uint8_t *src, int type, int d, float *dst) {
    if (type == F16) {
        for (int k = 0; k < d; k += 16)
            _mm512_storeu_ps(dst + k, _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)(src + 2 * k))));
        return;
    }
    for (int b = 0; b < d / QK4_0; b++, src += 34) {
        uint16_t h;
        memcpy(&h, src, 2);
        const __m512 s = _mm512_set1_ps(_cvtsh_ss(h));
        for (int k = 0; k < QK4_0; k += 16)
            _mm512_storeu_ps(dst + QK4_0 * b + k, _mm512_mul_ps(s, _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(
                                                                   _mm_loadu_si128((const __m128i *)(src + 2 + k))))));
    }
}

/* 16 values of a cache row from column k (a multiple of 16) as float32 */
static inline __m512 att_16(const uint8_t *src, int type, int k) {
    if (type == F16) return _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)(src + 2 * k)));
    const uint8_t *b = src + 34 * (k / QK4_0);
    uint16_t h;
    memcpy(&h, b, 2);
    return _mm512_mul_ps(_mm512_set1_ps(_cvtsh_ss(h)),
                         _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i *)(b + 2 + k % QK4_0)))));
}

static inline const uint16_t *mask_row_of(const attn_call *c, int i) {
    return (const uint16_t *)(c->mask + (int64_t)i * c->mask_row);
}

/* the open keys [first, last) of query i's mask row */
static void open_range(const attn_call *c, int i, int *first, int *last) {
    if (c->mask == NULL) {
        *first = 0, *last = c->n_kv;
        return;
    }
    const uint16_t *m = mask_row_of(c, i);
    int a = 0, b = c->n_kv;
    while (a < b && m[a] == 0xfc00) a++; /* float16 -inf */
    while (b > a && m[b - 1] == 0xfc00) b--;
    *first = a, *last = b;
}

typedef struct {
    float qs[ATT_ROWS * ATT_DIM], kt[ATT_DIM * ATT_KEYS], vf[ATT_KEYS * ATT_DIM], s[ATT_ROWS * ATT_KEYS],
        o[ATT_ROWS * ATT_DIM], m[ATT_ROWS], l[ATT_ROWS], alpha[ATT_ROWS];
} att_scratch;

static _Thread_local att_scratch att_tls __attribute__((aligned(64)));

/* a row's result: sinks in its denominator, normalised, to query i's head h in out */
static void att_finish(const attn_call *c, int i, int h, float m, float l, const float *o) {
    float scale = 1.0f;
    if (c->sinks) { /* the sink's share of the denominator, at the larger of the two maxima */
        const float sink = c->sinks[h], top = sink > m ? sink : m;
        scale = m == -INFINITY ? 0.0f : expf(m - top);
        l = l * scale + expf(sink - top);
    }
    const float f = l > 0.0f ? scale / l : 0.0f;
    float *out = c->out + ((int64_t)i * c->n_head + h) * c->d_v;
    for (int k = 0; k < c->d_v; k++) out[k] = o[k] * f;
}

/* unit u: key head g, heads h0.. of its group (hn of them), queries i0.. (qn of them); its open keys, or with parts
 * > 1 their part-th of `parts` runs of whole blocks, whose unnormalised rows (m, l, then d_v values each) go to
 * `partial` for att_combine */
static void att_unit(const attn_call *c, int g, int h0, int hn, int i0, int qn, int part, int parts, float *partial) {
    att_scratch *w = &att_tls;
    const int group = c->n_head / c->n_kv_head, rows = hn * qn, d = c->d, d_v = c->d_v;
    int lo = c->n_kv, hi = 0;
    for (int ii = 0; ii < qn; ii++) {
        int a, b;
        open_range(c, i0 + ii, &a, &b);
        if (a < b) lo = a < lo ? a : lo, hi = b > hi ? b : hi;
    }
    if (parts > 1 && lo < hi) {
        const int blocks = (hi - lo + ATT_KEYS - 1) / ATT_KEYS, per = (blocks + parts - 1) / parts;
        const int a = lo + part * per * ATT_KEYS, b = a + per * ATT_KEYS;
        hi = b < hi ? b : hi, lo = a;
    }
    for (int r = 0; r < rows; r++) { /* row r: query i0 + r / hn, head g group + h0 + r % hn; q scaled */
        const float *q = (const float *)(c->q + (int64_t)(i0 + r / hn) * c->q_row +
                                         (int64_t)(g * group + h0 + r % hn) * c->q_head);
        for (int k = 0; k < d; k++) w->qs[(size_t)r * d + k] = q[k] * c->scale;
        w->m[r] = -INFINITY, w->l[r] = 0.0f;
        memset(w->o + (size_t)r * ATT_DIM, 0, sizeof(float) * d_v);
    }
    const uint8_t *kbase = c->k + (int64_t)g * c->k_head, *vbase = c->v + (int64_t)g * c->v_head;
    for (int kb = lo; kb < hi; kb += ATT_KEYS) {
        const int nk = hi - kb < ATT_KEYS ? hi - kb : ATT_KEYS;
        for (int j0 = 0; j0 < ATT_KEYS; j0 += 16) /* keys transposed 16 x 16 at a time, the missing ones zero */
            for (int k0 = 0; k0 < d; k0 += 16) {
                __m512i r[16];
                for (int j = 0; j < 16; j++)
                    r[j] = j0 + j < nk ? _mm512_castps_si512(att_16(kbase + (int64_t)(kb + j0 + j) * c->k_row,
                                                                    c->type_k, k0))
                                       : _mm512_setzero_si512();
                transpose_16x16(r);
                for (int m = 0; m < 16; m++) _mm512_store_si512(w->kt + (size_t)(k0 + m) * ATT_KEYS + j0, r[m]);
            }
        for (int j = 0; j < nk; j++) /* values in rows, d_v apart */
            att_row(vbase + (int64_t)(kb + j) * c->v_row, c->type_v, d_v, w->vf + (size_t)j * d_v);
        att_scores(w->qs, rows, d, w->kt, w->s);
        int held = -1; /* a row whose values wait to be added with the next row's (att_values' two rows) */
        for (int r = 0; r < rows; r++) {
            float *s = w->s + (size_t)r * ATT_KEYS;
            const uint16_t *mr = c->mask ? mask_row_of(c, i0 + r / hn) + kb : NULL;
            __m512 mx = _mm512_set1_ps(-INFINITY);
            for (int j = 0; j < ATT_KEYS; j += 16) {
                const __mmask16 in = nk - j >= 16 ? 0xffff : nk > j ? (__mmask16)((1u << (nk - j)) - 1) : 0;
                __m512 v = _mm512_load_ps(s + j);
                if (mr) v = _mm512_add_ps(v, _mm512_cvtph_ps(_mm256_maskz_loadu_epi16(in, mr + j)));
                v = _mm512_mask_blend_ps(in, _mm512_set1_ps(-INFINITY), v);
                _mm512_store_ps(s + j, v);
                mx = _mm512_max_ps(mx, v);
            }
            const float bmax = _mm512_reduce_max_ps(mx), m_new = bmax > w->m[r] ? bmax : w->m[r];
            if (m_new == -INFINITY) continue; /* every key so far closed to this row */
            const float alpha = w->m[r] == -INFINITY ? 0.0f : expf(w->m[r] - m_new);
            __m512 sum = _mm512_setzero_ps();
            for (int j = 0; j < ATT_KEYS; j += 16) {
                const __m512 p = exp_neg(_mm512_sub_ps(_mm512_load_ps(s + j), _mm512_set1_ps(m_new)));
                _mm512_store_ps(s + j, p);
                sum = _mm512_add_ps(sum, p);
            }
            w->l[r] = w->l[r] * alpha + _mm512_reduce_add_ps(sum);
            w->m[r] = m_new;
            w->alpha[r] = alpha;
            if (held < 0) {
                held = r;
                continue;
            }
            att_values_any(w->o + (size_t)held * ATT_DIM, w->alpha[held], w->s + (size_t)held * ATT_KEYS,
                           w->o + (size_t)r * ATT_DIM, alpha, s, w->vf, nk, d_v);
            held = -1;
        }
        if (held >= 0)
            att_values_any(w->o + (size_t)held * ATT_DIM, w->alpha[held], w->s + (size_t)held * ATT_KEYS, NULL, 0.0f,
                           NULL, w->vf, nk, d_v);
    }
    for (int r = 0; r < rows; r++) {
        if (partial) {
            float *row = partial + (size_t)r * (d_v + 2);
            row[0] = w->m[r], row[1] = w->l[r];
            memcpy(row + 2, w->o + (size_t)r * ATT_DIM, sizeof(float) * d_v);
        } else {
            att_finish(c, i0 + r / hn, g * group + h0 + r % hn, w->m[r], w->l[r], w->o + (size_t)r * ATT_DIM);
        }
    }
}

/* a unit's rows from its parts' partial results (each ATT_ROWS rows apart): maxima matched, sums and values added */
static void att_combine(const attn_call *c, int g, int h0, int hn, int i0, int qn, int parts, const float *partials) {
    const int group = c->n_head / c->n_kv_head, d_v = c->d_v, stride = ATT_ROWS * (d_v + 2);
    float *o = att_tls.o;
    for (int r = 0; r < hn * qn; r++) {
        float m = -INFINITY, l = 0.0f;
        for (int p = 0; p < parts; p++) {
            const float mp = partials[(size_t)p * stride + (size_t)r * (d_v + 2)];
            m = mp > m ? mp : m;
        }
        memset(o, 0, sizeof(float) * d_v);
        for (int p = 0; m != -INFINITY && p < parts; p++) {
            const float *row = partials + (size_t)p * stride + (size_t)r * (d_v + 2);
            if (row[0] == -INFINITY) continue;
            const float f = expf(row[0] - m);
            l += row[1] * f;
            for (int k = 0; k < d_v; k++) o[k] += row[2 + k] * f;
        }
        att_finish(c, i0 + r / hn, g * group + h0 + r % hn, m, l, o);
    }
}

#endif

/* the units of work of n queries (att_body) */
static int64_t att_units(int n, int n_head, int n_kv_head) {
    const int group = n_head / n_kv_head, hn = group < ATT_ROWS ? group : ATT_ROWS, qn = ATT_ROWS / hn;
    return (int64_t)n_kv_head * ((group + hn - 1) / hn) * ((n + qn - 1) / qn);
}

/* the parts each unit's keys split in: as many as leave no thread idle, each at least two blocks of keys */
static int att_parts(int64_t units, int nt, int n_kv) {
    if (units >= nt) return 1;
    const int most = n_kv / (2 * ATT_KEYS), want = (int)(nt / units);
    return want < most ? want : most > 1 ? most : 1;
}

/* bytes of the partial results nt threads may need (att_body) for values of d_v */
size_t ferry_attention_scratch(int nt, int d_v) { return sizeof(float) * (size_t)nt * ATT_ROWS * (d_v + 2); }

#if FAST
/* thread t of nt: units t, t + nt, ... (interleaved, so that causal masks' longer later tiles spread). Fewer units
 * than threads (a decode step of few key heads) split each unit's keys in parts, one a thread (`partials`: a
 * unit's parts' rows, ferry_attention_scratch bytes), combined after the threads meet at `barrier` */
static void att_body(const attn_call *c, int t, int nt, float *partials, spin_barrier *barrier) {
    const int group = c->n_head / c->n_kv_head, hn = group < ATT_ROWS ? group : ATT_ROWS;
    const int chunks = (group + hn - 1) / hn, qn = ATT_ROWS / hn;
    const int tiles = (c->n + qn - 1) / qn;
    const int64_t units = att_units(c->n, c->n_head, c->n_kv_head);
    const int parts = att_parts(units, nt, c->n_kv);
    for (int64_t task = t; task < units * parts; task += nt) {
        const int64_t u = task / parts;
        const int tile = (int)(u % tiles), chunk = (int)(u / tiles % chunks), g = (int)(u / tiles / chunks);
        const int h0 = chunk * hn, i0 = tile * qn;
        att_unit(c, g, h0, group - h0 < hn ? group - h0 : hn, i0, c->n - i0 < qn ? c->n - i0 : qn, (int)(task % parts),
                 parts, parts > 1 ? partials + (size_t)task * ATT_ROWS * (c->d_v + 2) : NULL);
    }
    if (parts == 1) return;
    sync_threads(barrier, nt);
    for (int64_t u = t; u < units; u += nt) {
        const int tile = (int)(u % tiles), chunk = (int)(u / tiles % chunks), g = (int)(u / tiles / chunks);
        const int h0 = chunk * hn, i0 = tile * qn;
        att_combine(c, g, h0, group - h0 < hn ? group - h0 : hn, i0, c->n - i0 < qn ? c->n - i0 : qn, parts,
                    partials + (size_t)u * parts * ATT_ROWS * (c->d_v + 2));
    }
}
#endif

/* out (n, n_head, d_v) float32: q (float32) rows of query i and head h at q + i q_row + h q_head (bytes), k and v
 * (float16 or Q8_0: type_k, type_v) rows of position j and key head g at k + j k_row + g k_head, mask (float16, n_kv
 * a row, NULL: none) rows mask_row bytes apart, sinks (n_head) or NULL. -1 where the sizes or types are not ones it
 * covers, -2 without AVX512 */
int ferry_attention(const uint8_t *q, int64_t q_row, int64_t q_head, const uint8_t *k, int64_t k_row, int64_t k_head,
                    const uint8_t *v, int64_t v_row, int64_t v_head, const uint8_t *mask, int64_t mask_row,
                    const float *sinks, float *out, int n, int n_kv, int n_head, int n_kv_head, int d, int d_v,
                    int type_k, int type_v, float scale, int n_threads) {
#if !FAST
    return -2;
#else
    const attn_call c = {q, k, v, mask, q_row, q_head, k_row, k_head, v_row, v_head, mask_row, sinks, out, n, n_kv,
                         n_head, n_kv_head, d, d_v, type_k, type_v, scale};
    if (!attn_valid(&c)) return -1;
    float *partials = (float *)malloc(ferry_attention_scratch(n_threads, d_v));
    spin_barrier b = {0, 0};
    if (!partials) return -3;
#pragma omp parallel num_threads(n_threads)
    att_body(&c, omp_get_thread_num(), omp_get_num_threads(), partials, &b);
    free(partials);
    return 0;
#endif
}

/* ferry_attention as a node of a ggml graph: dst (d_v, n_head, n) float32 from src[0] q (d, n_head, n) float32,
 * src[1] k (d, n_kv, n_kv_head) and src[2] v (d_v, n_kv, n_kv_head) of type_k and type_v (views of the cache, n_kv
 * set at each run), src[3] the mask (n_kv, >= n) float16 and, with_sinks, src[4] the sinks (n_head) float32 */
typedef struct {
    float scale;
    int with_sinks, type_k, type_v;
    uint8_t *const *scratch; /* where the partial results' scratch is now (ferry_attention_scratch bytes) */
    spin_barrier *barrier;
    tensor_fields f;
} ferry_ggml_attention;

size_t ferry_ggml_attention_size(void) { return sizeof(ferry_ggml_attention); }

void ferry_attention_ggml(void *dst, int ith, int nth, void *userdata) {
#if FAST
    const ferry_ggml_attention *a = (const ferry_ggml_attention *)userdata;
    const tensor_fields *f = &a->f;
    const void *q = src_of(dst, f, 0), *k = src_of(dst, f, 1), *v = src_of(dst, f, 2), *mask = src_of(dst, f, 3);
    const attn_call c = {data_of(q, f), data_of(k, f), data_of(v, f), data_of(mask, f), nb_of(q, f, 2), nb_of(q, f, 1),
                         nb_of(k, f, 1), nb_of(k, f, 2), nb_of(v, f, 1), nb_of(v, f, 2), nb_of(mask, f, 1),
                         a->with_sinks ? (const float *)data_of(src_of(dst, f, 4), f) : NULL, data_of(dst, f),
                         (int)ne_of(q, f, 2), (int)ne_of(k, f, 1), (int)ne_of(q, f, 1), (int)ne_of(k, f, 2),
                         (int)ne_of(q, f, 0), (int)ne_of(v, f, 0), a->type_k, a->type_v, a->scale};
    att_body(&c, ith, nth, (float *)*a->scratch, a->barrier);
#else
    (void)dst, (void)ith, (void)nth, (void)userdata;
#endif
}
