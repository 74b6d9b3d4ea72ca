/* What the AMX kernels share (paged_prefill.c, paged_decode.c): the process's permission for the tile
   data state, a thread's tile configuration set and put back. Included only where the compiler
   targets AMX-TILE, AMX-BF16, AVX-512F and AVX512-BF16 (``-march=native`` on such a CPU). */
#ifndef KVL_AMX_H
#define KVL_AMX_H
#include <immintrin.h>
#include <stdint.h>
#include <string.h>
#include <sys/syscall.h>
#include <unistd.h>

#define ARCH_REQ_XCOMP_PERM 0x1023
#define XFEATURE_XTILEDATA 18

/* the kernel's permission for the tile data state, asked once a process (0 not asked yet, 1
   granted, -1 refused); each translation unit asks once, the kernel answers the same */
static int amx_state;

static inline int amx_granted(void) {
    if (amx_state == 0)
        amx_state = syscall(SYS_arch_prctl, ARCH_REQ_XCOMP_PERM, XFEATURE_XTILEDATA) == 0 ? 1 : -1;
    return amx_state == 1;
}

typedef struct {
    uint8_t palette, start_row, reserved[14];
    uint16_t colsb[16];
    uint8_t rows[16];
} __attribute__((packed)) tile_config;

/* this thread's tiles set to ``rows[i]`` rows of 64 bytes (tiles 0..7), its configuration before
   kept in ``saved`` and put back by tiles_off: a library that configured this thread's tiles earlier
   (oneDNN, torch's brgemm keep the palette they last set per thread) finds it as it left it - the
   tiles' contents are never kept across calls by anyone */
static inline void tiles_set(tile_config *saved, const uint8_t rows[8]) {
    _tile_storeconfig(saved);
    tile_config c;
    memset(&c, 0, sizeof c);
    c.palette = 1;
    for (int i = 0; i < 8; i++) {
        c.colsb[i] = 64;
        c.rows[i] = rows[i];
    }
    _tile_loadconfig(&c);
}

static inline void tiles_off(const tile_config *saved) {
    if (saved->palette) _tile_loadconfig(saved);
    else _tile_release();
}

#endif
