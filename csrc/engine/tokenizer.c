/* tokenizer.c: Qwen2's tokenizer (byte-level BPE behind the Qwen2 pre-tokenizer).
 *
 * Encoding a text, top to bottom:
 *   1. the text is checked to be UTF-8 (a bad byte is reported with its offset);
 *   2. whole-token texts (control and user-defined tokens) are cut out, leftmost-longest first,
 *      as HF tokenizers' added vocabulary does; the text between them goes on alone;
 *   3. the Qwen2 pre-tokenizer splits that text into pieces ("words") exactly as the regex
 *        (?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}
 *        | ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+
 *      would under a backtracking engine (Oniguruma, HF's), written out by hand (next_piece);
 *   4. each piece's bytes become their one-byte tokens, and adjacent pairs are merged, lowest
 *      merge rank first (leftmost first among equal ranks), until no pair has a merge.
 * Decoding concatenates each token's bytes, precomputed at build time: normal tokens are GPT-2
 * byte-level strings (every byte stands for a printable character), control and user-defined
 * tokens are their own text.
 */
#include "tokenizer.h"

#include <inttypes.h>
#include <limits.h>
#include <stdlib.h>
#include <string.h>

#include "unicode_data.h"

/* One entry of the merge table: the pair (left, right) of token ids -> its rank and result. */
typedef struct {
    uint64_t key;       /* (left << 32) | right, or EMPTY_KEY */
    uint32_t rank;
    int32_t result;
} merge_slot;

#define EMPTY_KEY UINT64_MAX   /* ids are < 2^31, so no real key has all bits set */

struct qc_tokenizer {
    int64_t n_vocab;
    int32_t *types;            /* (n_vocab) QC_TOKEN_* */
    char *text;                /* every token's vocabulary string, concatenated */
    uint64_t *text_off;        /* (n_vocab + 1) token i is text[text_off[i] .. text_off[i+1]) */
    char *bytes;               /* every token's decoded bytes, concatenated */
    uint64_t *bytes_off;       /* (n_vocab + 1) */
    int32_t byte_token[256];   /* byte -> its one-byte token */
    merge_slot *merges;        /* open addressing, merge_cap slots (a power of two) */
    uint64_t merge_cap;
    int64_t n_merges;          /* merges in the table */
    int32_t *specials;         /* (n_special) control + user-defined ids, ascending */
    int64_t n_special;
    int32_t *match;            /* (n_match) matchable specials by (first byte, longest first) */
    int64_t match_start[257];  /* match[match_start[b] .. match_start[b+1]) start with byte b */
    int32_t bos, eos, pad;
};

/* ---------------------------------------------------------------------------------------- */
/* UTF-8                                                                                     */

size_t qc_utf8_check(const char *text, size_t len) {
    const uint8_t *s = (const uint8_t *)text;
    size_t i = 0;
    while (i < len) {
        uint8_t b = s[i];
        if (b < 0x80) { i++; continue; }
        size_t need;
        uint8_t lo = 0x80, hi = 0xBF;   /* range of the second byte */
        if (b >= 0xC2 && b <= 0xDF) need = 1;
        else if (b >= 0xE0 && b <= 0xEF) {
            need = 2;
            if (b == 0xE0) lo = 0xA0;        /* overlong */
            else if (b == 0xED) hi = 0x9F;   /* UTF-16 surrogates */
        } else if (b >= 0xF0 && b <= 0xF4) {
            need = 3;
            if (b == 0xF0) lo = 0x90;        /* overlong */
            else if (b == 0xF4) hi = 0x8F;   /* above U+10FFFF */
        } else return i;
        if (len - i <= need) return i;
        if (s[i + 1] < lo || s[i + 1] > hi) return i;
        for (size_t k = 2; k <= need; k++)
            if ((s[i + k] & 0xC0) != 0x80) return i;
        i += need + 1;
    }
    return len;
}

/* Decode the character at s (valid UTF-8 assumed); its length in *n. */
static inline uint32_t utf8_at(const uint8_t *s, size_t *n) {
    uint8_t b = s[0];
    if (b < 0x80) { *n = 1; return b; }
    if (b < 0xE0) { *n = 2; return ((uint32_t)(b & 0x1F) << 6) | (s[1] & 0x3F); }
    if (b < 0xF0) {
        *n = 3;
        return ((uint32_t)(b & 0x0F) << 12) | ((uint32_t)(s[1] & 0x3F) << 6) | (s[2] & 0x3F);
    }
    *n = 4;
    return ((uint32_t)(b & 0x07) << 18) | ((uint32_t)(s[1] & 0x3F) << 12) |
           ((uint32_t)(s[2] & 0x3F) << 6) | (s[3] & 0x3F);
}

static size_t utf8_put(uint32_t cp, char out[4]) {
    if (cp < 0x80) { out[0] = (char)cp; return 1; }
    if (cp < 0x800) {
        out[0] = (char)(0xC0 | (cp >> 6));
        out[1] = (char)(0x80 | (cp & 0x3F));
        return 2;
    }
    /* only the GPT-2 byte map uses this: its characters are all below U+0800 */
    out[0] = (char)(0xE0 | (cp >> 12));
    out[1] = (char)(0x80 | ((cp >> 6) & 0x3F));
    out[2] = (char)(0x80 | (cp & 0x3F));
    return 3;
}

/* ---------------------------------------------------------------------------------------- */
/* The Qwen2 pre-tokenizer                                                                    */

/* One character of the text, classified: QC_UC_* bits, plus CRLF for '\r' and '\n'. */
enum { CRLF = 8 };

static inline unsigned class_at(const uint8_t *s, size_t *n, uint32_t *cp_out) {
    uint32_t cp = utf8_at(s, n);
    if (cp_out) *cp_out = cp;
    unsigned c = qc_unicode_class(cp);
    if (cp == '\r' || cp == '\n') c |= CRLF;
    return c;
}

/* "Other": not \s, \p{L} or \p{N}, the class [^\s\p{L}\p{N}]. */
static inline int is_other(unsigned c) { return (c & (QC_UC_LETTER | QC_UC_NUMBER | QC_UC_SPACE)) == 0; }

/* End of the run of characters from i whose class has any of the bits in `want`. */
static size_t run_end(const uint8_t *s, size_t len, size_t i, unsigned want) {
    while (i < len) {
        size_t n;
        if (s[i] < 0x80) {   /* ASCII without decoding: most text */
            unsigned c = qc_unicode_latin1[s[i]] | ((s[i] == '\r' || s[i] == '\n') ? CRLF : 0);
            if (!(c & want)) break;
            i++;
            continue;
        }
        if (!(class_at(s + i, &n, NULL) & want)) break;
        i += n;
    }
    return i;
}

/* Like run_end for the class "other" (no class bit set). */
static size_t other_run_end(const uint8_t *s, size_t len, size_t i) {
    while (i < len) {
        size_t n;
        if (!is_other(class_at(s + i, &n, NULL))) break;
        i += n;
    }
    return i;
}

/* (?i:'s|'t|'re|'ve|'m|'ll|'d) at s[i] == '\'': the match's end, or 0. Case-insensitive the
 * Unicode way: the only non-ASCII character that folds to one of these letters is U+017F LATIN
 * SMALL LETTER LONG S (to 's'), as scripts/gen_unicode_tables.py checks. */
static size_t contraction_end(const uint8_t *s, size_t len, size_t i) {
    size_t j = i + 1;   /* after the apostrophe */
    if (j >= len) return 0;
    uint8_t c = (uint8_t)(s[j] | 0x20);   /* ASCII lower case (for letters) */
    if (s[j] >= 0x80) {
        return (len - j >= 2 && s[j] == 0xC5 && s[j + 1] == 0xBF) ? j + 2 : 0;   /* ſ */
    }
    int letter = (s[j] >= 'A' && s[j] <= 'Z') || (s[j] >= 'a' && s[j] <= 'z');
    if (!letter) return 0;
    switch (c) {
    case 's': case 't': case 'm': case 'd':
        return j + 1;
    case 'r': case 'v':
        return (j + 1 < len && (s[j + 1] | 0x20) == 'e') ? j + 2 : 0;
    case 'l':
        return (j + 1 < len && (s[j + 1] | 0x20) == 'l') ? j + 2 : 0;
    default:
        return 0;
    }
}

/* The end of the regex match that starts at i < len. Every character is a letter, number,
 * white space or "other", and each of those starts a match of some alternative, so the matches
 * tile the text and the pieces are simply consecutive. The alternatives in order: */
static size_t next_piece(const uint8_t *s, size_t len, size_t i) {
    size_t n0, n1;
    uint32_t c0;
    unsigned k0 = class_at(s + i, &n0, &c0);
    size_t i1 = i + n0;   /* after the first character */

    /* 1. (?i:'s|'t|'re|'ve|'m|'ll|'d) */
    if (c0 == '\'') {
        size_t e = contraction_end(s, len, i);
        if (e) return e;
    }
    /* 2. [^\r\n\p{L}\p{N}]?\p{L}+ : a letter run, or one non-letter/number/newline character
     *    and the letter run right after it. */
    if (k0 & QC_UC_LETTER) return run_end(s, len, i1, QC_UC_LETTER);
    if (!(k0 & (QC_UC_NUMBER | CRLF)) && i1 < len &&
        (class_at(s + i1, &n1, NULL) & QC_UC_LETTER))
        return run_end(s, len, i1 + n1, QC_UC_LETTER);
    /* 3. \p{N}: one digit (or other number) at a time */
    if (k0 & QC_UC_NUMBER) return i1;
    /* 4. ' ?[^\s\p{L}\p{N}]+[\r\n]*' : an optional ASCII space, a run of "other", newlines */
    {
        size_t j = i;
        if (c0 == ' ' && i1 < len && is_other(class_at(s + i1, &n1, NULL))) j = i1;
        if (j != i || is_other(k0)) {
            j = other_run_end(s, len, j);
            return run_end(s, len, j, CRLF);
        }
    }
    /* Only white space is left: c0 is \s. Find the maximal run [i, ws_end), the end of its
     * last newline, and the start of its last character. */
    size_t ws_end = i, last_nl_end = 0, last_start = i, n_chars = 0;
    while (ws_end < len) {
        size_t n;
        unsigned k = class_at(s + ws_end, &n, NULL);
        if (!(k & QC_UC_SPACE)) break;
        last_start = ws_end;
        n_chars++;
        ws_end += n;
        if (k & CRLF) last_nl_end = ws_end;
    }
    /* 5. \s*[\r\n]+ : \s* first takes the whole run, then gives back characters until what
     *    follows is a newline: the match ends after the run's last newline. */
    if (last_nl_end) return last_nl_end;
    /* 6. \s+(?!\S) : the whole run if the text ends there; else one character less, so that the
     *    last space stays with the word after it (needs at least two characters). */
    if (ws_end == len) return len;
    if (n_chars >= 2) return last_start;
    /* 7. \s+ : a single white space character before a non-space */
    return ws_end;
}

int qc_pretokenize(const char *text, size_t len, size_t **ends, size_t *n_out, qc_error *err) {
    size_t *out = NULL, n = 0, cap = 0;
    *ends = NULL;
    *n_out = 0;
    size_t bad = qc_utf8_check(text, len);
    if (bad < len) {
        qc_fail(err, QC_ERR_VALUE, "invalid UTF-8 at byte offset %zu", bad);
        goto fail;
    }
    for (size_t i = 0; i < len;) {
        size_t e = next_piece((const uint8_t *)text, len, i);
        if (n == cap) {
            size_t nc = cap ? cap * 2 : 64;
            size_t *p = nc <= SIZE_MAX / sizeof *p ? realloc(out, nc * sizeof *p) : NULL;
            if (p == NULL) {
                qc_fail(err, QC_ERR_NOMEM, "out of memory splitting %zu bytes", len);
                goto fail;
            }
            out = p;
            cap = nc;
        }
        out[n++] = e;
        i = e;
    }
    *ends = out;
    *n_out = n;
    return 0;
fail:
    free(out);
    return -1;
}

/* ---------------------------------------------------------------------------------------- */
/* GPT-2's byte-level alphabet                                                                */

/* Bytes '!'..'~', 0xA1..0xAC and 0xAE..0xFF stand for the character with the same number; the
 * other 68 (controls, space, DEL, NBSP, soft hyphen) stand for U+0100, U+0101, ... in byte order,
 * so that every byte has a visible, non-space character. */
static int byte_is_printable(unsigned b) {
    return (b >= 0x21 && b <= 0x7E) || (b >= 0xA1 && b <= 0xAC) || (b >= 0xAE);
}

static void byte_chars(uint32_t b2c[256]) {
    uint32_t next = 256;
    for (unsigned b = 0; b < 256; b++) b2c[b] = byte_is_printable(b) ? b : next++;
}

/* The byte a character stands for, or -1 if it is not in the alphabet. */
static int char_byte(uint32_t cp) {
    if (cp < 256) return byte_is_printable(cp) ? (int)cp : -1;
    if (cp >= 256 + 68) return -1;
    unsigned k = cp - 256;   /* the k-th non-printable byte */
    for (unsigned b = 0; b < 256; b++)
        if (!byte_is_printable(b) && k-- == 0) return (int)b;
    return -1;
}

/* ---------------------------------------------------------------------------------------- */
/* Accessors                                                                                  */

int64_t qc_tokenizer_n_vocab(const qc_tokenizer *t) { return t->n_vocab; }
int64_t qc_tokenizer_n_merges(const qc_tokenizer *t) { return t->n_merges; }
int32_t qc_tokenizer_bos(const qc_tokenizer *t) { return t->bos; }
int32_t qc_tokenizer_eos(const qc_tokenizer *t) { return t->eos; }
int32_t qc_tokenizer_pad(const qc_tokenizer *t) { return t->pad; }
int32_t qc_tokenizer_type(const qc_tokenizer *t, int32_t id) { return t->types[id]; }
int64_t qc_tokenizer_n_special(const qc_tokenizer *t) { return t->n_special; }
int32_t qc_tokenizer_special(const qc_tokenizer *t, int64_t i) { return t->specials[i]; }

gguf_str qc_tokenizer_text(const qc_tokenizer *t, int32_t id) {
    gguf_str s = {t->text + t->text_off[id], t->text_off[id + 1] - t->text_off[id]};
    return s;
}

gguf_str qc_tokenizer_bytes(const qc_tokenizer *t, int32_t id) {
    gguf_str s = {t->bytes + t->bytes_off[id], t->bytes_off[id + 1] - t->bytes_off[id]};
    return s;
}

void qc_tokenizer_free(qc_tokenizer *t) {
    if (t == NULL) return;
    free(t->match);
    free(t->specials);
    free(t->merges);
    free(t->bytes_off);
    free(t->bytes);
    free(t->text_off);
    free(t->text);
    free(t->types);
    free(t);
}

/* ---------------------------------------------------------------------------------------- */
/* Building                                                                                   */

static uint64_t hash_bytes(const char *s, size_t len) {
    uint64_t h = 0xcbf29ce484222325ull;   /* FNV-1a, then a final mix for the low bits */
    for (size_t i = 0; i < len; i++) h = (h ^ (uint8_t)s[i]) * 0x100000001b3ull;
    h ^= h >> 29;
    h *= 0xbf58476d1ce4e5b9ull;
    return h ^ (h >> 32);
}

static uint64_t hash_pair(uint64_t key) {
    key ^= key >> 31;
    key *= 0x9e3779b97f4a7c15ull;
    key ^= key >> 29;
    key *= 0xbf58476d1ce4e5b9ull;
    return key ^ (key >> 32);
}

/* A string -> id map over the tokenizer's own vocabulary strings, used only while building. */
typedef struct {
    int32_t *slot;   /* (cap) token id or -1 */
    uint64_t cap;
} vocab_map;

static int32_t vocab_find(const qc_tokenizer *t, const vocab_map *m, const char *s, size_t len) {
    uint64_t mask = m->cap - 1;
    for (uint64_t h = hash_bytes(s, len) & mask;; h = (h + 1) & mask) {
        int32_t id = m->slot[h];
        if (id < 0) return -1;
        gguf_str tx = qc_tokenizer_text(t, id);
        if (tx.len == len && memcmp(tx.ptr, s, len) == 0) return id;
    }
}

/* Later duplicates replace earlier ones, as in HF's vocabulary dictionary. */
static void vocab_insert(const qc_tokenizer *t, vocab_map *m, int32_t id) {
    gguf_str s = qc_tokenizer_text(t, id);
    uint64_t mask = m->cap - 1;
    for (uint64_t h = hash_bytes(s.ptr, s.len) & mask;; h = (h + 1) & mask) {
        int32_t old = m->slot[h];
        if (old < 0) { m->slot[h] = id; return; }
        gguf_str o = qc_tokenizer_text(t, old);
        if (o.len == s.len && memcmp(o.ptr, s.ptr, s.len) == 0) { m->slot[h] = id; return; }
    }
}

static uint64_t pow2_at_least(uint64_t n) {
    uint64_t c = 16;
    while (c < n) c *= 2;
    return c;
}

static const merge_slot *merge_find(const qc_tokenizer *t, int32_t left, int32_t right) {
    uint64_t key = ((uint64_t)(uint32_t)left << 32) | (uint32_t)right;
    uint64_t mask = t->merge_cap - 1;
    for (uint64_t h = hash_pair(key) & mask;; h = (h + 1) & mask) {
        const merge_slot *e = &t->merges[h];
        if (e->key == key) return e;
        if (e->key == EMPTY_KEY) return NULL;
    }
}

/* Token strings and their decoded bytes. */
static int build_strings(qc_tokenizer *t, const qc_tokenizer_vocab *v, qc_error *err) {
    uint64_t total = 0;
    int64_t n = v->n_tokens;
    for (int64_t i = 0; i < n; i++)
        if (qc_add_u64(total, v->tokens[i].len, &total) < 0 || total > SIZE_MAX - 1)
            return qc_fail(err, QC_ERR_MODEL, "vocabulary strings are too large");
    t->text = malloc((size_t)total + 1);
    t->bytes = malloc((size_t)total + 1);   /* decoded bytes are never longer than the text */
    t->text_off = malloc(((size_t)n + 1) * sizeof *t->text_off);
    t->bytes_off = malloc(((size_t)n + 1) * sizeof *t->bytes_off);
    if (!t->text || !t->bytes || !t->text_off || !t->bytes_off)
        return qc_fail(err, QC_ERR_NOMEM, "out of memory for %" PRId64 " tokens", n);
    uint64_t at = 0, bat = 0;
    for (int64_t i = 0; i < n; i++) {
        const gguf_str *s = &v->tokens[i];
        t->text_off[i] = at;
        if (s->len) memcpy(t->text + at, s->ptr, (size_t)s->len);
        t->bytes_off[i] = bat;
        /* Byte-level tokens map back character by character; a token that is not entirely made
         * of the alphabet (and control and user-defined tokens) is its own UTF-8 text, as in
         * HF's ByteLevel decoder. */
        int raw = t->types[i] == QC_TOKEN_CONTROL || t->types[i] == QC_TOKEN_USER_DEFINED ||
                  qc_utf8_check(s->ptr, (size_t)s->len) != s->len;
        uint64_t nb = 0;
        for (size_t j = 0; !raw && j < s->len;) {
            size_t cl;
            int b = char_byte(utf8_at((const uint8_t *)s->ptr + j, &cl));
            if (b < 0) raw = 1;
            else t->bytes[bat + nb++] = (char)b;
            j += cl;
        }
        if (raw) {
            nb = s->len;
            if (nb) memcpy(t->bytes + bat, s->ptr, (size_t)nb);
        }
        at += s->len;
        bat += nb;
    }
    t->text_off[n] = at;
    t->bytes_off[n] = bat;
    t->text[at] = '\0';
    return 0;
}

/* The merge table: each "left right" whose parts and concatenation are tokens. A merge that
 * names a missing token can never apply, so it is skipped (HF refuses such a file; llama.cpp
 * ignores them). A repeated pair keeps its first, lowest rank. */
static int build_merges(qc_tokenizer *t, const vocab_map *vm, const qc_tokenizer_vocab *v,
                        qc_error *err) {
    char *buf = NULL;
    size_t buf_cap = 0;
    int rc = -1;
    if (v->n_merges > (int64_t)UINT32_MAX) {
        qc_fail(err, QC_ERR_MODEL, "%" PRId64 " merges is too many", v->n_merges);
        goto fail;
    }
    t->merge_cap = pow2_at_least((uint64_t)v->n_merges * 2);
    if (t->merge_cap > SIZE_MAX / sizeof *t->merges) {
        qc_fail(err, QC_ERR_NOMEM, "merge table too large");
        goto fail;
    }
    t->merges = malloc((size_t)t->merge_cap * sizeof *t->merges);
    if (t->merges == NULL) {
        qc_fail(err, QC_ERR_NOMEM, "out of memory for %" PRId64 " merges", v->n_merges);
        goto fail;
    }
    for (uint64_t i = 0; i < t->merge_cap; i++) t->merges[i].key = EMPTY_KEY;
    for (int64_t r = 0; r < v->n_merges; r++) {
        const gguf_str *m = &v->merges[r];
        const char *sp = m->len ? memchr(m->ptr, ' ', (size_t)m->len) : NULL;
        if (sp == NULL) {
            qc_fail(err, QC_ERR_MODEL, "merge %" PRId64 " has no space between its two parts", r);
            goto fail;
        }
        size_t ll = (size_t)(sp - m->ptr), rl = (size_t)m->len - ll - 1;
        int32_t left = vocab_find(t, vm, m->ptr, ll), right = vocab_find(t, vm, sp + 1, rl);
        if (left < 0 || right < 0) continue;
        if (ll + rl > buf_cap) {
            char *nb = realloc(buf, ll + rl);
            if (nb == NULL) {
                qc_fail(err, QC_ERR_NOMEM, "out of memory reading merges");
                goto fail;
            }
            buf = nb;
            buf_cap = ll + rl;
        }
        memcpy(buf, m->ptr, ll);
        memcpy(buf + ll, sp + 1, rl);
        int32_t result = vocab_find(t, vm, buf, ll + rl);
        if (result < 0) continue;
        uint64_t key = ((uint64_t)(uint32_t)left << 32) | (uint32_t)right, mask = t->merge_cap - 1;
        for (uint64_t h = hash_pair(key) & mask;; h = (h + 1) & mask) {
            merge_slot *e = &t->merges[h];
            if (e->key == key) break;
            if (e->key == EMPTY_KEY) {
                e->key = key;
                e->rank = (uint32_t)r;
                e->result = result;
                t->n_merges++;
                break;
            }
        }
    }
    rc = 0;
fail:
    free(buf);
    return rc;
}

/* qsort has no context argument and two threads may build at once, so the tokenizer travels
 * inside the sorted items rather than in a global. */
typedef struct {
    const qc_tokenizer *t;
    int32_t id;
} match_item;

static int match_cmp(const void *pa, const void *pb) {
    const match_item *a = pa, *b = pb;
    gguf_str x = qc_tokenizer_text(a->t, a->id), y = qc_tokenizer_text(b->t, b->id);
    uint8_t fx = (uint8_t)x.ptr[0], fy = (uint8_t)y.ptr[0];
    if (fx != fy) return fx < fy ? -1 : 1;
    if (x.len != y.len) return x.len > y.len ? -1 : 1;   /* longest first */
    return a->id < b->id ? -1 : a->id > b->id;
}

/* Control and user-defined tokens: the list, and the matching order by first byte. */
static int build_specials(qc_tokenizer *t, qc_error *err) {
    match_item *items = NULL;
    int rc = -1;
    int64_t n = 0, n_match = 0;
    for (int64_t i = 0; i < t->n_vocab; i++)
        if (t->types[i] == QC_TOKEN_CONTROL || t->types[i] == QC_TOKEN_USER_DEFINED) n++;
    t->specials = malloc((size_t)(n ? n : 1) * sizeof *t->specials);
    t->match = malloc((size_t)(n ? n : 1) * sizeof *t->match);
    items = malloc((size_t)(n ? n : 1) * sizeof *items);
    if (!t->specials || !t->match || !items) {
        qc_fail(err, QC_ERR_NOMEM, "out of memory for %" PRId64 " special tokens", n);
        goto fail;
    }
    for (int64_t i = 0; i < t->n_vocab; i++) {
        if (t->types[i] != QC_TOKEN_CONTROL && t->types[i] != QC_TOKEN_USER_DEFINED) continue;
        t->specials[t->n_special++] = (int32_t)i;
        gguf_str s = qc_tokenizer_text(t, (int32_t)i);
        /* An empty or non-UTF-8 text could match nothing sensible (or inside a character). */
        if (s.len == 0 || qc_utf8_check(s.ptr, (size_t)s.len) != s.len) continue;
        items[n_match].t = t;
        items[n_match].id = (int32_t)i;
        n_match++;
    }
    qsort(items, (size_t)n_match, sizeof *items, match_cmp);
    memset(t->match_start, 0, sizeof t->match_start);
    for (int64_t k = 0; k < n_match; k++) {
        t->match[k] = items[k].id;
        t->match_start[(uint8_t)qc_tokenizer_text(t, items[k].id).ptr[0] + 1]++;
    }
    for (int b = 0; b < 256; b++) t->match_start[b + 1] += t->match_start[b];
    rc = 0;
fail:
    free(items);
    return rc;
}

int qc_tokenizer_build(const qc_tokenizer_vocab *v, qc_tokenizer **out, qc_error *err) {
    qc_tokenizer *t = NULL;
    vocab_map vm = {NULL, 0};
    *out = NULL;
    if (v->n_tokens <= 0 || v->n_tokens > INT32_MAX - 1) {
        qc_fail(err, QC_ERR_MODEL, "vocabulary size %" PRId64 " is out of range", v->n_tokens);
        goto fail;
    }
    if (v->n_merges < 0) {
        qc_fail(err, QC_ERR_VALUE, "negative merge count");
        goto fail;
    }
    const int32_t ids[3] = {v->bos_id, v->eos_id, v->pad_id};
    const char *names[3] = {"bos", "eos", "padding"};
    for (int k = 0; k < 3; k++)
        if (ids[k] < -1 || ids[k] >= v->n_tokens) {
            qc_fail(err, QC_ERR_MODEL, "%s token id %" PRId32 " is outside the vocabulary of %"
                    PRId64 " tokens", names[k], ids[k], v->n_tokens);
            goto fail;
        }
    t = calloc(1, sizeof *t);
    if (t == NULL) {
        qc_fail(err, QC_ERR_NOMEM, "out of memory");
        goto fail;
    }
    t->n_vocab = v->n_tokens;
    t->bos = v->bos_id;
    t->eos = v->eos_id;
    t->pad = v->pad_id;
    t->types = malloc((size_t)t->n_vocab * sizeof *t->types);
    if (t->types == NULL) {
        qc_fail(err, QC_ERR_NOMEM, "out of memory for %" PRId64 " tokens", t->n_vocab);
        goto fail;
    }
    for (int64_t i = 0; i < t->n_vocab; i++) t->types[i] = v->types ? v->types[i] : QC_TOKEN_NORMAL;
    if (build_strings(t, v, err) < 0) goto fail;

    vm.cap = pow2_at_least((uint64_t)t->n_vocab * 2);
    vm.slot = malloc((size_t)vm.cap * sizeof *vm.slot);
    if (vm.slot == NULL) {
        qc_fail(err, QC_ERR_NOMEM, "out of memory for the vocabulary map");
        goto fail;
    }
    memset(vm.slot, 0xFF, (size_t)vm.cap * sizeof *vm.slot);   /* all -1 */
    for (int64_t i = 0; i < t->n_vocab; i++) vocab_insert(t, &vm, (int32_t)i);

    uint32_t b2c[256];
    byte_chars(b2c);
    for (unsigned b = 0; b < 256; b++) {
        char c[4];
        t->byte_token[b] = vocab_find(t, &vm, c, utf8_put(b2c[b], c));
        if (t->byte_token[b] < 0) {
            qc_fail(err, QC_ERR_MODEL, "the vocabulary has no token for byte 0x%02X (character "
                    "U+%04X): not a byte-level BPE vocabulary", b, (unsigned)b2c[b]);
            goto fail;
        }
    }
    if (build_merges(t, &vm, v, err) < 0 || build_specials(t, err) < 0) goto fail;
    free(vm.slot);
    *out = t;
    return 0;
fail:
    free(vm.slot);
    qc_tokenizer_free(t);
    return -1;
}

/* ---------------------------------------------------------------------------------------- */
/* Loading from GGUF                                                                          */

static int str_is(gguf_str s, const char *lit) {
    return s.len == strlen(lit) && memcmp(s.ptr, lit, (size_t)s.len) == 0;
}

static const gguf_kv *string_array(const gguf_file *f, const char *key, int required,
                                   qc_error *err) {
    const gguf_kv *kv = gguf_find_kv(f, key);
    if (kv == NULL) {
        if (required) qc_fail(err, QC_ERR_MODEL, "metadata key '%s' is missing", key);
        return NULL;
    }
    if (kv->type != GGUF_TYPE_ARRAY || kv->arr_type != GGUF_TYPE_STRING) {
        qc_fail(err, QC_ERR_MODEL, "metadata key '%s' has type %s, expected ARRAY[STRING]", key,
                kv->type == GGUF_TYPE_ARRAY ? "ARRAY" : gguf_type_name(kv->type));
        return NULL;
    }
    return kv;
}

/* Optional token id key: -1 when absent. */
static int optional_id(const gguf_file *f, const char *key, int32_t *out, qc_error *err) {
    uint32_t v;
    *out = -1;
    if (gguf_find_kv(f, key) == NULL) return 0;
    if (gguf_get_u32(f, key, &v, err) < 0) return -1;
    if (v > INT32_MAX) return qc_fail(err, QC_ERR_MODEL, "metadata key '%s' = %u is too large", key, v);
    *out = (int32_t)v;
    return 0;
}

int qc_tokenizer_load(const gguf_file *f, qc_tokenizer **out, qc_error *err) {
    int32_t *types = NULL;
    int rc = -1;
    gguf_str s;
    *out = NULL;
    if (gguf_get_str(f, "tokenizer.ggml.model", &s, err) < 0) goto fail;
    if (!str_is(s, "gpt2")) {
        qc_fail(err, QC_ERR_MODEL, "tokenizer.ggml.model is '%.*s': qwencuda's tokenizer is "
                "byte-level BPE ('gpt2') only", (int)(s.len > 64 ? 64 : s.len), s.ptr);
        goto fail;
    }
    if (gguf_find_kv(f, "tokenizer.ggml.pre") != NULL) {
        if (gguf_get_str(f, "tokenizer.ggml.pre", &s, err) < 0) goto fail;
        if (!str_is(s, "qwen2")) {
            qc_fail(err, QC_ERR_MODEL, "tokenizer.ggml.pre is '%.*s': qwencuda implements the "
                    "'qwen2' pre-tokenizer only", (int)(s.len > 64 ? 64 : s.len), s.ptr);
            goto fail;
        }
    }
    const gguf_kv *tokens = string_array(f, "tokenizer.ggml.tokens", 1, err);
    if (tokens == NULL) goto fail;
    const gguf_kv *merges = string_array(f, "tokenizer.ggml.merges", 1, err);
    if (merges == NULL) goto fail;
    if (tokens->n > (uint64_t)INT32_MAX - 1 || merges->n > (uint64_t)UINT32_MAX) {
        qc_fail(err, QC_ERR_MODEL, "%" PRIu64 " tokens and %" PRIu64 " merges: too many",
                tokens->n, merges->n);
        goto fail;
    }
    const gguf_kv *tt = gguf_find_kv(f, "tokenizer.ggml.token_type");
    if (tt != NULL) {
        static const uint8_t int_size[GGUF_TYPE_COUNT] = {
            [GGUF_TYPE_UINT8] = 1, [GGUF_TYPE_INT8] = 1, [GGUF_TYPE_UINT16] = 2,
            [GGUF_TYPE_INT16] = 2, [GGUF_TYPE_UINT32] = 4, [GGUF_TYPE_INT32] = 4,
            [GGUF_TYPE_UINT64] = 8, [GGUF_TYPE_INT64] = 8};
        unsigned es = tt->type == GGUF_TYPE_ARRAY && tt->arr_type < GGUF_TYPE_COUNT
                      ? int_size[tt->arr_type] : 0;
        if (es == 0) {
            qc_fail(err, QC_ERR_MODEL, "metadata key 'tokenizer.ggml.token_type' is not an "
                    "array of integers");
            goto fail;
        }
        if (tt->n != tokens->n) {
            qc_fail(err, QC_ERR_MODEL, "tokenizer.ggml.token_type has %" PRIu64 " entries, "
                    "tokenizer.ggml.tokens %" PRIu64, tt->n, tokens->n);
            goto fail;
        }
        types = malloc((size_t)(tt->n ? tt->n : 1) * sizeof *types);
        if (types == NULL) {
            qc_fail(err, QC_ERR_NOMEM, "out of memory for token types");
            goto fail;
        }
        for (uint64_t i = 0; i < tt->n; i++) {
            /* little-endian, unaligned inside the mapping: assemble byte by byte */
            const uint8_t *p = tt->data + i * es;
            uint64_t u = 0;
            for (unsigned k = 0; k < es; k++) u |= (uint64_t)p[k] << (8 * k);
            int64_t value = (int64_t)u;
            if (es < 8 && (tt->arr_type == GGUF_TYPE_INT8 || tt->arr_type == GGUF_TYPE_INT16 ||
                           tt->arr_type == GGUF_TYPE_INT32) && (u >> (8 * es - 1)))
                value = (int64_t)(u | (~0ull << (8 * es)));   /* sign-extend */
            /* an unknown type is treated as normal text, which is what it most likely is */
            types[i] = value >= 0 && value <= QC_TOKEN_BYTE ? (int32_t)value : QC_TOKEN_NORMAL;
        }
    }
    qc_tokenizer_vocab v = {
        .tokens = tokens->strs, .n_tokens = (int64_t)tokens->n, .types = types,
        .merges = merges->strs, .n_merges = (int64_t)merges->n,
    };
    if (optional_id(f, "tokenizer.ggml.bos_token_id", &v.bos_id, err) < 0 ||
        optional_id(f, "tokenizer.ggml.eos_token_id", &v.eos_id, err) < 0 ||
        optional_id(f, "tokenizer.ggml.padding_token_id", &v.pad_id, err) < 0)
        goto fail;
    rc = qc_tokenizer_build(&v, out, err);
fail:
    free(types);
    return rc;
}

/* ---------------------------------------------------------------------------------------- */
/* Encoding                                                                                   */

static int ids_push(qc_ids *o, int32_t id, qc_error *err) {
    if (o->n == o->cap) {
        size_t nc = o->cap ? o->cap * 2 : 256;
        int32_t *p = nc <= SIZE_MAX / sizeof *p ? realloc(o->ids, nc * sizeof *p) : NULL;
        if (p == NULL) return qc_fail(err, QC_ERR_NOMEM, "out of memory for %zu token ids", nc);
        o->ids = p;
        o->cap = nc;
    }
    o->ids[o->n++] = id;
    return 0;
}

/* A candidate merge of the pair that starts at symbol pos. */
typedef struct {
    uint32_t rank;
    int32_t pos;
    int32_t left, right, result;   /* the pair it was made for; stale once they change */
} heap_item;

/* Per-call working memory: one word's symbols as a linked list, and the candidate heap. */
typedef struct {
    int32_t *sym, *prev, *next;   /* (cap) token id of each symbol (-1: merged away), links */
    size_t cap;
    heap_item *heap;
    size_t heap_n, heap_cap;
} bpe_work;

static void work_free(bpe_work *w) {
    free(w->sym);
    free(w->prev);
    free(w->next);
    free(w->heap);
}

static int work_reserve(bpe_work *w, size_t n, qc_error *err) {
    if (n <= w->cap) return 0;
    if (n > INT32_MAX) return qc_fail(err, QC_ERR_VALUE, "a pre-token of %zu bytes is too long", n);
    size_t nc = n < 64 ? 64 : n;
    int32_t *a = realloc(w->sym, nc * sizeof *a);
    if (a) w->sym = a;
    int32_t *b = realloc(w->prev, nc * sizeof *b);
    if (b) w->prev = b;
    int32_t *c = realloc(w->next, nc * sizeof *c);
    if (c) w->next = c;
    if (!a || !b || !c) return qc_fail(err, QC_ERR_NOMEM, "out of memory for a %zu-byte word", n);
    w->cap = nc;
    return 0;
}

static inline int heap_less(const heap_item *a, const heap_item *b) {
    return a->rank < b->rank || (a->rank == b->rank && a->pos < b->pos);
}

static int heap_push(bpe_work *w, heap_item it, qc_error *err) {
    if (w->heap_n == w->heap_cap) {
        size_t nc = w->heap_cap ? w->heap_cap * 2 : 64;
        heap_item *p = nc <= SIZE_MAX / sizeof *p ? realloc(w->heap, nc * sizeof *p) : NULL;
        if (p == NULL) return qc_fail(err, QC_ERR_NOMEM, "out of memory for the merge queue");
        w->heap = p;
        w->heap_cap = nc;
    }
    size_t i = w->heap_n++;
    while (i > 0) {
        size_t parent = (i - 1) / 2;
        if (!heap_less(&it, &w->heap[parent])) break;
        w->heap[i] = w->heap[parent];
        i = parent;
    }
    w->heap[i] = it;
    return 0;
}

static heap_item heap_pop(bpe_work *w) {
    heap_item top = w->heap[0], last = w->heap[--w->heap_n];
    size_t i = 0, n = w->heap_n;
    for (;;) {
        size_t c = 2 * i + 1;
        if (c >= n) break;
        if (c + 1 < n && heap_less(&w->heap[c + 1], &w->heap[c])) c++;
        if (!heap_less(&w->heap[c], &last)) break;
        w->heap[i] = w->heap[c];
        i = c;
    }
    if (n) w->heap[i] = last;
    return top;
}

/* Queue the merge of symbol pos with its successor, if the pair has one. */
static int queue_pair(const qc_tokenizer *t, bpe_work *w, int32_t pos, qc_error *err) {
    int32_t nx = w->next[pos];
    const merge_slot *m = merge_find(t, w->sym[pos], w->sym[nx]);
    if (m == NULL) return 0;
    heap_item it = {m->rank, pos, w->sym[pos], w->sym[nx], m->result};
    return heap_push(w, it, err);
}

/* BPE over one pre-token: bytes -> one-byte tokens -> merges by rank -> ids appended. */
static int bpe_word(const qc_tokenizer *t, const uint8_t *s, size_t n, bpe_work *w, qc_ids *out,
                    qc_error *err) {
    if (n == 1) return ids_push(out, t->byte_token[s[0]], err);
    if (work_reserve(w, n, err) < 0) return -1;
    int32_t len = (int32_t)n;
    for (int32_t i = 0; i < len; i++) {
        w->sym[i] = t->byte_token[s[i]];
        w->prev[i] = i - 1;
        w->next[i] = i + 1 < len ? i + 1 : -1;
    }
    w->heap_n = 0;
    for (int32_t i = 0; i + 1 < len; i++)
        if (queue_pair(t, w, i, err) < 0) return -1;
    while (w->heap_n) {
        heap_item it = heap_pop(w);
        int32_t nx = w->next[it.pos];
        /* Stale: the left symbol was merged away or changed, or its right neighbour did. */
        if (w->sym[it.pos] != it.left || nx < 0 || w->sym[nx] != it.right) continue;
        w->sym[it.pos] = it.result;
        w->sym[nx] = -1;
        w->next[it.pos] = w->next[nx];
        if (w->next[nx] >= 0) w->prev[w->next[nx]] = it.pos;
        if (w->prev[it.pos] >= 0 && queue_pair(t, w, w->prev[it.pos], err) < 0) return -1;
        if (w->next[it.pos] >= 0 && queue_pair(t, w, it.pos, err) < 0) return -1;
    }
    for (int32_t i = 0; i >= 0; i = w->next[i])
        if (ids_push(out, w->sym[i], err) < 0) return -1;
    return 0;
}

/* Plain text (no whole-token matching): pre-tokenize, then BPE each piece. */
static int encode_plain(const qc_tokenizer *t, const uint8_t *s, size_t len, bpe_work *w,
                        qc_ids *out, qc_error *err) {
    for (size_t i = 0; i < len;) {
        size_t e = next_piece(s, len, i);
        if (bpe_word(t, s + i, e - i, w, out, err) < 0) return -1;
        i = e;
    }
    return 0;
}

/* The leftmost, then longest, whole-token match in s[from..len) allowed by mode: 1 and its
 * start, length and id, or 0 when there is none. */
static int find_special(const qc_tokenizer *t, const uint8_t *s, size_t len, size_t from,
                        qc_special_mode mode, size_t *start, size_t *mlen, int32_t *id) {
    if (mode == QC_SPECIAL_NONE || t->match_start[256] == 0) return 0;
    for (size_t i = from; i < len; i++) {
        int64_t k0 = t->match_start[s[i]], k1 = t->match_start[s[i] + 1];
        for (int64_t k = k0; k < k1; k++) {
            int32_t cand = t->match[k];
            if (mode == QC_SPECIAL_USER && t->types[cand] != QC_TOKEN_USER_DEFINED) continue;
            gguf_str x = qc_tokenizer_text(t, cand);
            if (x.len <= len - i && memcmp(x.ptr, s + i, (size_t)x.len) == 0) {
                *start = i;
                *mlen = (size_t)x.len;
                *id = cand;
                return 1;
            }
        }
    }
    return 0;
}

int qc_tokenizer_encode(const qc_tokenizer *t, const char *text, size_t len, qc_special_mode mode,
                        qc_ids *out, qc_error *err) {
    bpe_work w = {0};
    int rc = -1;
    const uint8_t *s = (const uint8_t *)text;
    size_t bad = qc_utf8_check(text, len);
    if (bad < len) {
        qc_fail(err, QC_ERR_VALUE, "invalid UTF-8 at byte offset %zu", bad);
        goto fail;
    }
    for (size_t pos = 0; pos < len;) {
        size_t ms = len, ml = 0;
        int32_t id = -1;
        int found = find_special(t, s, len, pos, mode, &ms, &ml, &id);
        if (encode_plain(t, s + pos, ms - pos, &w, out, err) < 0) goto fail;
        if (!found) break;
        if (ids_push(out, id, err) < 0) goto fail;
        pos = ms + ml;
    }
    rc = 0;
fail:
    work_free(&w);
    return rc;
}

int qc_tokenizer_split_special(const qc_tokenizer *t, const char *text, size_t len,
                               qc_special_mode mode, qc_segment **out, size_t *n_out,
                               qc_error *err) {
    qc_segment *seg = NULL;
    size_t n = 0, cap = 0;
    const uint8_t *s = (const uint8_t *)text;
    *out = NULL;
    *n_out = 0;
    size_t bad = qc_utf8_check(text, len);
    if (bad < len) {
        qc_fail(err, QC_ERR_VALUE, "invalid UTF-8 at byte offset %zu", bad);
        goto fail;
    }
    for (size_t pos = 0; pos < len;) {
        size_t ms = len, ml = 0;
        int32_t id = -1;
        int found = find_special(t, s, len, pos, mode, &ms, &ml, &id);
        if (n + 2 > cap) {
            size_t nc = cap ? cap * 2 : 16;
            qc_segment *p = nc <= SIZE_MAX / sizeof *p ? realloc(seg, nc * sizeof *p) : NULL;
            if (p == NULL) {
                qc_fail(err, QC_ERR_NOMEM, "out of memory splitting %zu bytes", len);
                goto fail;
            }
            seg = p;
            cap = nc;
        }
        if (ms > pos) seg[n++] = (qc_segment){pos, ms, -1};
        if (!found) break;
        seg[n++] = (qc_segment){ms, ms + ml, id};
        pos = ms + ml;
    }
    *out = seg;
    *n_out = n;
    return 0;
fail:
    free(seg);
    return -1;
}

/* ---------------------------------------------------------------------------------------- */
/* Decoding                                                                                   */

int qc_tokenizer_decode(const qc_tokenizer *t, const int32_t *ids, size_t n, char **out,
                        size_t *out_len, qc_error *err) {
    char *buf = NULL;
    uint64_t total = 0;
    *out = NULL;
    *out_len = 0;
    for (size_t i = 0; i < n; i++) {
        if (ids[i] < 0 || ids[i] >= t->n_vocab)
            return qc_fail(err, QC_ERR_RANGE, "token id %" PRId32 " (at index %zu) is outside the "
                           "vocabulary [0, %" PRId64 ")", ids[i], i, t->n_vocab);
        uint64_t l = t->bytes_off[ids[i] + 1] - t->bytes_off[ids[i]];
        if (qc_add_u64(total, l, &total) < 0 || total > SIZE_MAX - 1)
            return qc_fail(err, QC_ERR_NOMEM, "decoded text too large");
    }
    if (total == 0) return 0;
    buf = malloc((size_t)total);
    if (buf == NULL) return qc_fail(err, QC_ERR_NOMEM, "out of memory for %" PRIu64 " bytes", total);
    size_t at = 0;
    for (size_t i = 0; i < n; i++) {
        gguf_str b = qc_tokenizer_bytes(t, ids[i]);
        memcpy(buf + at, b.ptr, (size_t)b.len);
        at += (size_t)b.len;
    }
    *out = buf;
    *out_len = at;
    return 0;
}
