/* A request's content-tag chain (engine/tags.py) over a prompt, in C.

   tag[i] = BLAKE2b-64_k(tag[i-1] as 8 little-endian bytes || token[i] as 4 little-endian bytes)

   is keyed BLAKE2b (RFC 7693) with an 8-byte digest, exactly what hashlib.blake2b(data, key=k,
   digest_size=8) gives: Python hashed one token at a time (~1.7 us a token, 21 ms of a 4-prompt,
   12.6 k-token prefill - 7 % of the bf16 `long` run of bench/engine.py). A keyed hash first
   compresses the key, padded to a block, from a state that depends only on the key and the digest
   size: kvl_blake2b_key_state computes that state once per chain, and each token then costs one
   compression of its 12-byte block (the final one). The Python path stays the reference (tests
   compare every tag) and the fallback. */
#include <stdint.h>
#include <string.h>

static const uint64_t IV[8] = {
    0x6a09e667f3bcc908ULL, 0xbb67ae8584caa73bULL, 0x3c6ef372fe94f82bULL, 0xa54ff53a5f1d36f1ULL,
    0x510e527fade682d1ULL, 0x9b05688c2b3e6c1fULL, 0x1f83d9abfb41bd6bULL, 0x5be0cd19137e2179ULL,
};

static const uint8_t SIGMA[12][16] = {
    {0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15}, {14, 10, 4, 8, 9, 15, 13, 6, 1, 12, 0, 2, 11, 7, 5, 3},
    {11, 8, 12, 0, 5, 2, 15, 13, 10, 14, 3, 6, 7, 1, 9, 4}, {7, 9, 3, 1, 13, 12, 11, 14, 2, 6, 5, 10, 4, 0, 15, 8},
    {9, 0, 5, 7, 2, 4, 10, 15, 14, 1, 11, 12, 6, 8, 3, 13}, {2, 12, 6, 10, 0, 11, 8, 3, 4, 13, 7, 5, 15, 14, 1, 9},
    {12, 5, 1, 15, 14, 13, 4, 10, 0, 7, 6, 3, 9, 2, 8, 11}, {13, 11, 7, 14, 12, 1, 3, 9, 5, 0, 15, 4, 8, 6, 2, 10},
    {6, 15, 14, 9, 11, 3, 0, 8, 12, 2, 13, 7, 1, 4, 10, 5}, {10, 2, 8, 4, 7, 6, 1, 5, 15, 11, 9, 14, 3, 12, 13, 0},
    {0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15}, {14, 10, 4, 8, 9, 15, 13, 6, 1, 12, 0, 2, 11, 7, 5, 3},
};

static inline uint64_t rotr(uint64_t x, int n) { return (x >> n) | (x << (64 - n)); }

#define G(a, b, c, d, x, y)                 \
    do {                                    \
        v[a] = v[a] + v[b] + (x);           \
        v[d] = rotr(v[d] ^ v[a], 32);       \
        v[c] = v[c] + v[d];                 \
        v[b] = rotr(v[b] ^ v[c], 24);       \
        v[a] = v[a] + v[b] + (y);           \
        v[d] = rotr(v[d] ^ v[a], 16);       \
        v[c] = v[c] + v[d];                 \
        v[b] = rotr(v[b] ^ v[c], 63);       \
    } while (0)

/* h <- F(h, m, t, last): one compression (RFC 7693 3.2); t < 2^64 here (the counter's high word 0);
   the words of m are the block read little-endian (x86 and arm64 read them so) */
static inline __attribute__((always_inline)) void compress(uint64_t h[8], const uint64_t m[16], uint64_t t, int last) {
    uint64_t v[16];
    for (int i = 0; i < 8; i++) {
        v[i] = h[i];
        v[i + 8] = IV[i];
    }
    v[12] ^= t;
    if (last)
        v[14] = ~v[14];
#pragma GCC unroll 12          /* constant message indices: a token's block is 2 words and 14 zeros, folded away */
    for (int r = 0; r < 12; r++) {
        const uint8_t *s = SIGMA[r];
        G(0, 4, 8, 12, m[s[0]], m[s[1]]);
        G(1, 5, 9, 13, m[s[2]], m[s[3]]);
        G(2, 6, 10, 14, m[s[4]], m[s[5]]);
        G(3, 7, 11, 15, m[s[6]], m[s[7]]);
        G(0, 5, 10, 15, m[s[8]], m[s[9]]);
        G(1, 6, 11, 12, m[s[10]], m[s[11]]);
        G(2, 7, 8, 13, m[s[12]], m[s[13]]);
        G(3, 4, 9, 14, m[s[14]], m[s[15]]);
    }
    for (int i = 0; i < 8; i++)
        h[i] ^= v[i] ^ v[i + 8];
}

/* the state after the parameter block (digest size, key size, fanout 1, depth 1) and the key's block,
   for a message that follows it: 0, or -1 for a key of 0 or more than 64 bytes, or a digest size
   outside 1..64 (hashlib's limits; a chain's key is 32 bytes) */
int kvl_blake2b_key_state(const uint8_t *key, int64_t keylen, int64_t outlen, uint64_t st[8]) {
#if defined(__BYTE_ORDER__) && __BYTE_ORDER__ != __ORDER_LITTLE_ENDIAN__
    return -1;          /* the words are read little-endian below: a big-endian host keeps the Python path */
#endif
    if (keylen < 1 || keylen > 64 || outlen < 1 || outlen > 64)
        return -1;
    uint64_t block[16] = {0};
    memcpy(block, key, (size_t)keylen);
    for (int i = 0; i < 8; i++)
        st[i] = IV[i];
    st[0] ^= 0x01010000ULL ^ ((uint64_t)keylen << 8) ^ (uint64_t)outlen;
    compress(st, block, 128, 0);
    return 0;
}

/* out[i] = tag of token i after prev (out[i - 1] after the first): a 12-byte message each (prev,
   token as int32), the final block of a keyed hash whose key block gave st; the 8-byte digest is
   the state's first word (little-endian) */
void kvl_tag_chain(const uint64_t st[8], int64_t prev, const int32_t *tokens, int64_t n, int64_t *out) {
    for (int64_t i = 0; i < n; i++) {
        uint64_t h[8], m[16] = {0};
        memcpy(h, st, sizeof h);
        m[0] = (uint64_t)prev;
        m[1] = (uint64_t)(uint32_t)tokens[i];
        compress(h, m, 128 + 12, 1);
        prev = (int64_t)h[0];
        out[i] = prev;
    }
}
