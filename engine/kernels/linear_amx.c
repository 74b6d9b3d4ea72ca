/* x @ w.T + b for a few rows of bf16 x (a decode step's projections) on AMX tiles, w bf16 packed at
   load (engine.kernels.pack_tiles) as B tiles: blocks of 16 output columns, each [K / 2][16][2]
   (two consecutive K values of a column side by side, TDPBF16PS's operand layout), zero-padded past N.
   The numbers of the bf16 product through oneDNN the engine runs elsewhere (engine/models/llama.py
   Linear: x in bf16, products summed in fp32, bias added in fp32, the result rounded to bf16 once).

   At a decode step's 1-16 rows the weight's bytes are the cost: each weight byte is read once, four
   column blocks at a time (four C tiles share each A tile of x), the blocks split over the threads.
   Measured 2026-12-05 (2 cores, AMX): 1.1-1.3x oneDNN's call on the big shape's weights at 1-16 rows
   (gate_up 9728 x 896: 49 against 43 GB/s alone), ~2x on small ones; in the engine the big bf16
   shape's decode 575 -> 454 ms. More rows stay with oneDNN: the same loop over 32-row blocks was
   0.6-0.85x its blocked product at 512-4096 rows (tried, not kept). */
#include <stdint.h>

#define LINEAR_PARAMS                                                                                          \
    const uint16_t *x, int64_t xs, int64_t M, int64_t K, const uint16_t *w, int64_t N, const uint16_t *bias,     \
    uint16_t *out, int64_t os, int nthreads

#if defined(__AMX_TILE__) && defined(__AMX_BF16__) && defined(__AVX512F__) && defined(__AVX512BF16__)
#include "amx.h"
#include "bf16.h"

#define NBLK 4              /* column blocks a task: C tiles 0..3 */

/* x [M <= 16][K] bf16 (rows xs apart), K a multiple of 32; out [M][N] bf16 (rows os apart) */
int kvl_linear_bf16_amx(LINEAR_PARAMS) {
    if (M < 1 || M > 16 || K % 32 || N < 1 || !amx_granted()) return -1;
    const int64_t NB = (N + 15) / 16, kc = K / 32, blk = K * 16;     /* blk: a column block's values */
    const int64_t tasks = (NB + NBLK - 1) / NBLK;
#pragma omp parallel num_threads(nthreads)
    {
        tile_config saved;
        const uint8_t rows[8] = {(uint8_t)M, (uint8_t)M, (uint8_t)M, (uint8_t)M, (uint8_t)M, 16, 16, 16};
        tiles_set(&saved, rows);
        float c[16 * 16] __attribute__((aligned(64)));
#pragma omp for schedule(static)
        for (int64_t t = 0; t < tasks; t++) {
            const int64_t j0 = t * NBLK, nb = NB - j0 < NBLK ? NB - j0 : NBLK;
            const uint16_t *b0 = w + j0 * blk;
            _tile_zero(0);
            _tile_zero(1);
            _tile_zero(2);
            _tile_zero(3);
            for (int64_t k = 0; k < kc; k++) {
                _tile_loadd(4, x + k * 32, xs * 2);
                const uint16_t *b = b0 + k * 512;            /* 16 pairs x 16 columns x 2 */
                _tile_loadd(5, b, 64);
                _tile_dpbf16ps(0, 4, 5);
                if (nb > 1) {
                    _tile_loadd(6, b + blk, 64);
                    _tile_dpbf16ps(1, 4, 6);
                }
                if (nb > 2) {
                    _tile_loadd(7, b + 2 * blk, 64);
                    _tile_dpbf16ps(2, 4, 7);
                }
                if (nb > 3) {
                    _tile_loadd(5, b + 3 * blk, 64);
                    _tile_dpbf16ps(3, 4, 5);
                }
            }
            for (int64_t j = 0; j < nb; j++) {
                switch (j) {
                case 0: _tile_stored(0, c, 64); break;
                case 1: _tile_stored(1, c, 64); break;
                case 2: _tile_stored(2, c, 64); break;
                default: _tile_stored(3, c, 64); break;
                }
                const int64_t n0 = (j0 + j) * 16, cols = N - n0 < 16 ? N - n0 : 16;
                for (int64_t m = 0; m < M; m++) {
                    uint16_t *o = out + m * os + n0;
                    for (int64_t i = 0; i < cols; i++)
                        o[i] = to_bf16(bias ? c[m * 16 + i] + from_bf16(bias[n0 + i]) : c[m * 16 + i]);
                }
            }
        }
        tiles_off(&saved);
    }
    return 0;
}

#else
/* no AMX in this build: -1, nothing written (the caller's oneDNN path runs) */
int kvl_linear_bf16_amx(LINEAR_PARAMS) {
    (void)x; (void)xs; (void)M; (void)K; (void)w; (void)N; (void)bias; (void)out; (void)os; (void)nthreads;
    return -1;
}
#endif
