/* One token's routed experts on the CPU, for Q4_0 experts in ggml's repacked CPU layout (block_q4_0x8, the copy
 * CpuBackend.repack made): h = silu(gate x) * up x for each selected expert, then the weighted sum of down h.
 * Compiled at first use by ferry/ops/native.py, for CPUs with AVX512-VNNI; elsewhere ggml runs these experts.
 *
 * The layout (ggml's repack for AVX2 and up): rows in groups of 8; per group and block of 32 columns, 144 bytes:
 * the 8 rows' fp16 scales, then 128 bytes of nibbles, for each half of the block's 16 bytes the 8 rows' 8 bytes in
 * row order, each byte XOR 0x88. Byte j of a row's block holds weight j (low nibble) and j + 16 (high nibble).
 *
 * Why it is faster than ggml's mul_mat_id at one token (docs/decisions.md): one 512-bit load holds 8 bytes of all 8
 * rows, so each 32-bit lane's dot product belongs to one row, and the activation's 8 bytes are a broadcast load:
 * no shuffles but one scale spread per block, and Q4_0's offset of 8 is folded into the integer sum's start. Each
 * phase splits the flattened (expert slot, row group) list into one contiguous range per thread; the phases are
 * separated by OpenMP barriers (OpenMP's threads: the team ggml's graphs use when ggml is built with OpenMP). */

#include <math.h>
#include <stdint.h>
#include <string.h>
#include <omp.h>
#if defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512VNNI__)
#include <immintrin.h>
#define FAST 1
#else
#define FAST 0
#endif

#define QK 32
#define GROUP 8           /* rows interleaved */
#define GROUP_BYTES 144   /* 8 fp16 scales + 8 x 16 bytes of nibbles */
#ifndef PREFETCH_AHEAD
#define PREFETCH_AHEAD 1152 /* bytes ahead of the block being read (8 blocks of a group) */
#endif

typedef struct { /* one activation block of 32, quantized to int8 */
    int8_t q[QK];
    int32_t corr[2]; /* -8 times the sum of q over the elements an even (odd) 32-bit lane meets: Q4_0's offset */
    float d;
} act_block;

int ferry_moe_q4_0_fast(void) { return FAST; }

static void quantize_row(const float *x, int nb, act_block *a) {
    for (int b = 0; b < nb; b++) {
        const float *v = x + (size_t)b * QK;
        float amax = 0.0f;
        for (int i = 0; i < QK; i++) amax = fmaxf(amax, fabsf(v[i]));
        const float d = amax / 127.0f, id = d > 0.0f ? 1.0f / d : 0.0f;
        int32_t sums[2] = {0, 0};
        for (int i = 0; i < QK; i++) {
            a[b].q[i] = (int8_t)lrintf(v[i] * id);
            sums[(i / 4) & 1] += a[b].q[i]; /* lane parity of element i: 4 bytes a lane, 8 a row's chunk */
        }
        a[b].corr[0] = -8 * sums[0];
        a[b].corr[1] = -8 * sums[1];
        a[b].d = d;
    }
}

#if FAST
static inline int64_t load_i64(const void *p) { /* 8 bytes, whatever their type (a broadcast load once compiled) */
    int64_t v;
    memcpy(&v, p, 8);
    return v;
}

/* out[0..7] = the 8 rows of the group at g (nb blocks of GROUP_BYTES) against the activation blocks */
static void dot_group(const uint8_t *g, const act_block *a, int nb, float *out) {
    const __m512i flip = _mm512_set1_epi8((char)0x88), low = _mm512_set1_epi8(0x0f);
    const __m512i spread = _mm512_set_epi32(7, 7, 6, 6, 5, 5, 4, 4, 3, 3, 2, 2, 1, 1, 0, 0);
    __m512 acc = _mm512_setzero_ps();
    for (int b = 0; b < nb; b++, g += GROUP_BYTES) {
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
#endif

static void thread_range(int64_t total, int t, int nt, int64_t *lo, int64_t *hi) {
    *lo = total * t / nt;
    *hi = total * (t + 1) / nt;
}

#if FAST
/* y for groups lo..hi of the flattened (slot, matrix, group) list, where matrix m of a slot is base[m]'s expert
 * ids[slot], of `groups` row groups, against that slot's activation blocks */
static void groups_of(int64_t lo, int64_t hi, int groups, int mats, const uint8_t *const *base, const int32_t *ids,
                      size_t expert_bytes, const act_block *act, size_t act_per_slot, int nb, float *y) {
    for (int64_t u = lo; u < hi; u++) {
        const int64_t slot = u / ((int64_t)mats * groups), rem = u % ((int64_t)mats * groups);
        const uint8_t *g = base[rem / groups] + (size_t)ids[slot] * expert_bytes
                           + (size_t)(rem % groups) * nb * GROUP_BYTES;
        dot_group(g, act + slot * act_per_slot, nb, y + u * GROUP);
    }
}
#endif

size_t ferry_moe_q4_0_scratch(int n_embd, int n_ff, int n_used) {
    return sizeof(act_block) * ((size_t)n_embd / QK + (size_t)n_used * n_ff / QK)
           + sizeof(float) * ((size_t)2 * n_used * n_ff + (size_t)n_used * n_embd);
}

/* x (n_embd) -> out (n_embd): sum over slots j of weights[j] * down[ids[j]] (silu(gate[ids[j]] x) * up[ids[j]] x).
 * up, gate: n_expert matrices of n_ff rows of n_embd; down: n_expert matrices of n_embd rows of n_ff; all in the
 * layout above, each expert's matrix contiguous. scratch: ferry_moe_q4_0_scratch bytes, 64-byte aligned. Returns 0;
 * -1 when an id is out of range or a size is not a multiple of 32 (rows: of 8), -2 when not built FAST (nothing is
 * written then). */
int ferry_moe_q4_0(const float *x, const int32_t *ids, const float *weights, int n_used, int n_embd, int n_ff,
                   int n_expert, const uint8_t *up, const uint8_t *gate, const uint8_t *down, float *out,
                   void *scratch, int n_threads) {
#if !FAST
    return -2; /* native.py asks ferry_moe_q4_0_fast first and never gets here */
#else
    if (n_embd % QK || n_ff % QK || n_used < 1) return -1;
    for (int j = 0; j < n_used; j++)
        if (ids[j] < 0 || ids[j] >= n_expert) return -1;
    const int nb_embd = n_embd / QK, nb_ff = n_ff / QK;
    const size_t up_expert = (size_t)n_ff / GROUP * nb_embd * GROUP_BYTES;
    const size_t down_expert = (size_t)n_embd / GROUP * nb_ff * GROUP_BYTES;
    act_block *xq = (act_block *)scratch;
    act_block *hq = xq + nb_embd;                             /* n_used * nb_ff */
    float *ug = (float *)(hq + (size_t)n_used * nb_ff);       /* per slot: its up rows, then its gate rows */
    float *y = ug + (size_t)2 * n_used * n_ff;                /* per slot: its down rows */
    const uint8_t *up_gate[2] = {up, gate};

#pragma omp parallel num_threads(n_threads)
    {
        const int t = omp_get_thread_num(), nt = omp_get_num_threads();
        int64_t lo, hi;
        if (t == 0) quantize_row(x, nb_embd, xq);
#pragma omp barrier
        thread_range((int64_t)n_used * 2 * (n_ff / GROUP), t, nt, &lo, &hi);
        groups_of(lo, hi, n_ff / GROUP, 2, up_gate, ids, up_expert, xq, 0, nb_embd, ug);
#pragma omp barrier
        for (int64_t s = t; s < n_used; s += nt) {
            float *u = ug + s * 2 * n_ff;
            const float *g = u + n_ff;
            for (int i = 0; i < n_ff; i++) u[i] = g[i] / (1.0f + expf(-g[i])) * u[i];
            quantize_row(u, nb_ff, hq + s * nb_ff);
        }
#pragma omp barrier
        thread_range((int64_t)n_used * (n_embd / GROUP), t, nt, &lo, &hi);
        groups_of(lo, hi, n_embd / GROUP, 1, &down, ids, down_expert, hq, nb_ff, nb_ff, y);
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
