/* y = x @ w^T for a few rows of x, fp32, on AVX2 + FMA CPUs (see small_batch_linear.py).
 *
 * x (rows, in), w (out, in), y (rows, out); all row-major and contiguous.
 *
 * A decode step multiplies one row per sequence by every weight matrix, so its cost is
 * reading the weights. Each thread takes whole pairs of weight rows, reads each pair from
 * memory once (prefetching the next pair) and multiplies it into the input rows, four at a
 * time, while they sit in L1.
 */
#include <immintrin.h>

static inline float sum8(__m256 v) {
    __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    s = _mm_hadd_ps(s, s);
    s = _mm_hadd_ps(s, s);
    return _mm_cvtss_f32(s);
}

/* Rows r0 .. r0+n-1 of y at columns o0 and o1 (n <= 4). Inlined, so that the common n == 4
 * keeps its eight accumulators in registers. */
static inline __attribute__((always_inline)) void
pair_times_rows(const float *w0, const float *w1, const float *xr, float *y, long in, long out,
                long o0, long o1, long r0, int n) {
    const long vec_in = in - in % 8; /* columns done 8 at a time; the rest one by one */
    __m256 acc0[4], acc1[4];
    for (int r = 0; r < 4; r++) {
        acc0[r] = _mm256_setzero_ps();
        acc1[r] = _mm256_setzero_ps();
    }
    for (long i = 0; i < vec_in; i += 8) {
        const __m256 v0 = _mm256_loadu_ps(w0 + i), v1 = _mm256_loadu_ps(w1 + i);
        _mm_prefetch((const char *)(w0 + i + 2 * in), _MM_HINT_T0); /* the next pair's rows */
        _mm_prefetch((const char *)(w1 + i + 2 * in), _MM_HINT_T0);
        for (int r = 0; r < n; r++) {
            const __m256 xv = _mm256_loadu_ps(xr + r * in + i);
            acc0[r] = _mm256_fmadd_ps(v0, xv, acc0[r]);
            acc1[r] = _mm256_fmadd_ps(v1, xv, acc1[r]);
        }
    }
    for (int r = 0; r < n; r++) {
        float s0 = sum8(acc0[r]), s1 = sum8(acc1[r]);
        for (long i = vec_in; i < in; i++) {
            s0 += w0[i] * xr[r * in + i];
            s1 += w1[i] * xr[r * in + i];
        }
        y[(r0 + r) * out + o0] = s0;
        y[(r0 + r) * out + o1] = s1;
    }
}

void small_batch_linear(const float *x, const float *w, float *y, long rows, long in, long out,
                        int threads) {
    const long pairs = (out + 1) / 2;
#pragma omp parallel for schedule(static) num_threads(threads)
    for (long p = 0; p < pairs; p++) {
        const long o0 = 2 * p, o1 = o0 + 1 < out ? o0 + 1 : o0; /* an odd last row pairs itself */
        const float *w0 = w + o0 * in, *w1 = w + o1 * in;
        for (long r0 = 0; r0 < rows; r0 += 4) {
            if (rows - r0 >= 4)
                pair_times_rows(w0, w1, x + r0 * in, y, in, out, o0, o1, r0, 4);
            else
                pair_times_rows(w0, w1, x + r0 * in, y, in, out, o0, o1, r0, (int)(rows - r0));
        }
    }
}
