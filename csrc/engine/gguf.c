/* gguf.c: the GGUF v2/v3 reader.
 *
 * Layout (little-endian): "GGUF" u32 version, u64 n_tensors, u64 n_kv, then n_kv key-value
 * pairs (gguf string key, u32 value type, value), then n_tensors tensor infos (gguf string
 * name, u32 n_dims, u64 ne[n_dims], u32 type, u64 offset), then padding up to `alignment`,
 * then the data section. A gguf string is a u64 length followed by that many bytes.
 *
 * Every read goes through the `reader` below, which checks the remaining bytes first; every
 * size computed from file values goes through qc_mul_u64 / qc_add_u64. Allocations are
 * bounded by what the file could actually hold: the tables grow as entries are parsed (a
 * corrupted count fails at the end of the bytes, not at malloc), and an array of strings is
 * scanned before its table is allocated.
 */
#include "gguf.h"

#include <errno.h>
#include <fcntl.h>
#include <inttypes.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

#include "quants.h"

#define GGUF_MAGIC "GGUF"
#define GGUF_DEFAULT_ALIGNMENT 32
/* Smallest possible encodings, used to cap counts by the bytes left in the file. */
#define GGUF_MIN_KV_BYTES 13      /* key length (8) + value type (4) + a 1-byte value */
#define GGUF_MIN_TENSOR_BYTES 32  /* name length (8) + n_dims (4) + ne[0] (8) + type (4) + offset (8) */
/* Longest key or tensor name quoted in an error message. */
#define GGUF_QUOTE_MAX 80

/* Open addressing over entry numbers: slots hold index + 1 (0 = empty); size is a power of
 * two, at least twice the entries. */
typedef struct {
    uint64_t *slots;
    uint64_t size;
} gguf_index;

/* gguf_file plus what only this file needs: who owns the mapping, and hash indexes for the
 * duplicate checks and the lookups. The public struct comes first so the pointers convert. */
typedef struct {
    gguf_file pub;
    int owns_map;              /* 1: munmap at close (gguf_open); 0: caller's buffer */
    uint64_t kv_cap, tensor_cap;
    gguf_index kv_index, tensor_index;
} gguf_impl;

typedef struct {
    const uint8_t *buf;
    size_t size;
    uint64_t pos;              /* invariant: pos <= size */
    qc_error *err;
} reader;

/* ------------------------------------------------------------------------------------------ */
/* helpers                                                                                      */

static const char *const value_type_names[GGUF_TYPE_COUNT] = {
    [GGUF_TYPE_UINT8] = "UINT8",     [GGUF_TYPE_INT8] = "INT8",
    [GGUF_TYPE_UINT16] = "UINT16",   [GGUF_TYPE_INT16] = "INT16",
    [GGUF_TYPE_UINT32] = "UINT32",   [GGUF_TYPE_INT32] = "INT32",
    [GGUF_TYPE_FLOAT32] = "FLOAT32", [GGUF_TYPE_BOOL] = "BOOL",
    [GGUF_TYPE_STRING] = "STRING",   [GGUF_TYPE_ARRAY] = "ARRAY",
    [GGUF_TYPE_UINT64] = "UINT64",   [GGUF_TYPE_INT64] = "INT64",
    [GGUF_TYPE_FLOAT64] = "FLOAT64",
};

/* Bytes of one scalar of a fixed-size type; 0 for strings, arrays and unknown types. */
static uint64_t scalar_size(uint32_t t) {
    switch (t) {
    case GGUF_TYPE_UINT8: case GGUF_TYPE_INT8: case GGUF_TYPE_BOOL: return 1;
    case GGUF_TYPE_UINT16: case GGUF_TYPE_INT16: return 2;
    case GGUF_TYPE_UINT32: case GGUF_TYPE_INT32: case GGUF_TYPE_FLOAT32: return 4;
    case GGUF_TYPE_UINT64: case GGUF_TYPE_INT64: case GGUF_TYPE_FLOAT64: return 8;
    default: return 0;
    }
}

const char *gguf_type_name(uint32_t value_type) {
    return value_type < GGUF_TYPE_COUNT ? value_type_names[value_type] : "UNKNOWN";
}

/* Keys and names come from the file: quote them with control and non-ASCII bytes escaped
 * and long ones cut, so an error message stays one readable line. */
static const char *quote(char out[GGUF_QUOTE_MAX + 8], const char *s, uint64_t len) {
    size_t o = 0;
    for (uint64_t i = 0; i < len; i++) {
        unsigned char c = (unsigned char)s[i];
        if (o + 4 > GGUF_QUOTE_MAX) {
            memcpy(out + o, "...", 3);
            o += 3;
            break;
        }
        if (c >= 0x20 && c < 0x7f && c != '\\') {
            out[o++] = (char)c;
        } else {
            snprintf(out + o, 5, "\\x%02x", c);
            o += 4;
        }
    }
    out[o] = '\0';
    return out;
}

static uint64_t load_u64(const uint8_t *p) {
    uint64_t v = 0;
    for (int i = 7; i >= 0; i--) v = v << 8 | p[i];
    return v;
}

static uint32_t load_u32(const uint8_t *p) {
    return (uint32_t)p[0] | (uint32_t)p[1] << 8 | (uint32_t)p[2] << 16 | (uint32_t)p[3] << 24;
}

static uint64_t hash_bytes(const char *s, uint64_t len) {
    uint64_t h = 1469598103934665603ull;   /* FNV-1a */
    for (uint64_t i = 0; i < len; i++) {
        h ^= (unsigned char)s[i];
        h *= 1099511628211ull;
    }
    return h;
}

/* ------------------------------------------------------------------------------------------ */
/* bounds-checked reads                                                                         */

static int need(reader *r, uint64_t n, const char *what) {
    if (n > r->size - r->pos)
        return qc_fail(r->err, QC_ERR_GGUF,
                       "at offset %" PRIu64 ": %s (%" PRIu64 " bytes) runs past end of file "
                       "(size %zu)", r->pos, what, n, r->size);
    return 0;
}

static int read_u32(reader *r, uint32_t *out, const char *what) {
    if (need(r, 4, what) < 0) return -1;
    *out = load_u32(r->buf + r->pos);
    r->pos += 4;
    return 0;
}

static int read_u64(reader *r, uint64_t *out, const char *what) {
    if (need(r, 8, what) < 0) return -1;
    *out = load_u64(r->buf + r->pos);
    r->pos += 8;
    return 0;
}

static int read_str(reader *r, gguf_str *out, const char *what) {
    uint64_t at = r->pos, len;
    if (read_u64(r, &len, what) < 0) return -1;
    if (len > r->size - r->pos)
        return qc_fail(r->err, QC_ERR_GGUF,
                       "at offset %" PRIu64 ": %s length %" PRIu64 " runs past end of file "
                       "(size %zu)", at, what, len, r->size);
    out->ptr = (const char *)r->buf + r->pos;
    out->len = len;
    r->pos += len;
    return 0;
}

/* ------------------------------------------------------------------------------------------ */
/* hash indexes: open addressing, slot = index + 1                                              */

typedef const gguf_str *(*key_fn)(const gguf_impl *g, uint64_t i, gguf_str *tmp);

/* Make room for entry number n. The index grows with the entries actually parsed, so a
 * corrupted count cannot make it large. */
static int index_reserve(gguf_index *ix, uint64_t n, key_fn key_of, const gguf_impl *g,
                         qc_error *err) {
    if (2 * (n + 1) <= ix->size) return 0;   /* n is capped by the file size: no overflow */
    uint64_t size = ix->size ? ix->size * 2 : 64;
    uint64_t *slots = calloc(size, sizeof *slots);
    if (slots == NULL)
        return qc_fail(err, QC_ERR_NOMEM, "out of memory for a GGUF index of %" PRIu64 " entries",
                       n + 1);
    for (uint64_t i = 0; i < ix->size; i++) {
        if (ix->slots[i] == 0) continue;
        gguf_str tmp;
        const gguf_str *k = key_of(g, ix->slots[i] - 1, &tmp);
        uint64_t j = hash_bytes(k->ptr, k->len) & (size - 1);
        while (slots[j] != 0) j = (j + 1) & (size - 1);
        slots[j] = ix->slots[i];
    }
    free(ix->slots);
    ix->slots = slots;
    ix->size = size;
    return 0;
}

/* The slot of (s, len): the one that holds it, or the empty one where it would go; NULL for
 * an index that was never reserved. */
static uint64_t *index_slot(const gguf_index *ix, const char *s, uint64_t len, key_fn key_of,
                            const gguf_impl *g) {
    if (ix->size == 0) return NULL;
    uint64_t i = hash_bytes(s, len) & (ix->size - 1);
    for (;;) {
        if (ix->slots[i] == 0) return &ix->slots[i];
        gguf_str tmp;
        const gguf_str *k = key_of(g, ix->slots[i] - 1, &tmp);
        if (k->len == len && memcmp(k->ptr, s, len) == 0) return &ix->slots[i];
        i = (i + 1) & (ix->size - 1);
    }
}

static const gguf_str *kv_key(const gguf_impl *g, uint64_t i, gguf_str *tmp) {
    (void)tmp;
    return &g->pub.kv[i].key;
}

static const gguf_str *tensor_key(const gguf_impl *g, uint64_t i, gguf_str *tmp) {
    tmp->ptr = g->pub.tensors[i].name;
    tmp->len = strlen(g->pub.tensors[i].name);
    return tmp;
}

/* Grow a table of `elem` bytes per entry so that index `n` fits; capacity doubles. */
static int grow(void **table, uint64_t *cap, uint64_t n, size_t elem, qc_error *err) {
    if (n < *cap) return 0;
    uint64_t new_cap = *cap ? *cap * 2 : 64;
    uint64_t bytes;
    if (qc_mul_u64(new_cap, elem, &bytes) < 0 || bytes > SIZE_MAX)
        return qc_fail(err, QC_ERR_NOMEM, "GGUF table of %" PRIu64 " entries is too large", new_cap);
    void *p = realloc(*table, (size_t)bytes);
    if (p == NULL)
        return qc_fail(err, QC_ERR_NOMEM, "out of memory for a GGUF table of %" PRIu64 " entries",
                       new_cap);
    memset((char *)p + *cap * elem, 0, (size_t)((new_cap - *cap) * elem));
    *table = p;
    *cap = new_cap;
    return 0;
}

/* ------------------------------------------------------------------------------------------ */
/* metadata                                                                                     */

/* Check n values of type t at r->pos and step over them: one scalar (is_array 0), or the
 * elements of an array whose length was read at offset `at`. */
static int read_scalars(reader *r, uint32_t t, uint64_t n, int is_array, const char *key,
                        uint64_t at) {
    uint64_t size = scalar_size(t), bytes;
    if (qc_mul_u64(size, n, &bytes) < 0 || bytes > r->size - r->pos) {
        if (!is_array)
            return qc_fail(r->err, QC_ERR_GGUF,
                           "at offset %" PRIu64 ": key '%s': %s value (%" PRIu64 " bytes) runs "
                           "past end of file (size %zu)", at, key, gguf_type_name(t), size,
                           r->size);
        return qc_fail(r->err, QC_ERR_GGUF,
                       "at offset %" PRIu64 ": key '%s': array of %" PRIu64 " %s values runs past "
                       "end of file (size %zu)", at, key, n, gguf_type_name(t), r->size);
    }
    if (t == GGUF_TYPE_BOOL) {
        for (uint64_t i = 0; i < n; i++) {
            uint8_t b = r->buf[r->pos + i];
            if (b > 1)
                return qc_fail(r->err, QC_ERR_GGUF,
                               "at offset %" PRIu64 ": key '%s': bool value %u is neither 0 nor 1",
                               r->pos + i, key, b);
        }
    }
    r->pos += bytes;
    return 0;
}

static int read_kv(reader *r, gguf_kv *kv, qc_error *err) {
    char qkey[GGUF_QUOTE_MAX + 8];
    kv->offset = r->pos;
    if (read_str(r, &kv->key, "metadata key") < 0) return -1;
    quote(qkey, kv->key.ptr, kv->key.len);
    uint64_t type_at = r->pos;
    if (read_u32(r, &kv->type, "metadata value type") < 0) return -1;
    if (kv->type >= GGUF_TYPE_COUNT)
        return qc_fail(err, QC_ERR_GGUF, "at offset %" PRIu64 ": key '%s': unknown value type %u",
                       type_at, qkey, (unsigned)kv->type);
    uint64_t at = r->pos;
    if (kv->type == GGUF_TYPE_STRING) {
        char what[GGUF_QUOTE_MAX + 32];
        snprintf(what, sizeof what, "key '%s': string", qkey);
        return read_str(r, &kv->str, what);
    }
    if (kv->type != GGUF_TYPE_ARRAY) {
        kv->data = r->buf + r->pos;
        kv->n = 1;
        return read_scalars(r, kv->type, 1, 0, qkey, at);
    }
    if (read_u32(r, &kv->arr_type, "array element type") < 0) return -1;
    if (kv->arr_type >= GGUF_TYPE_COUNT)
        return qc_fail(err, QC_ERR_GGUF, "at offset %" PRIu64 ": key '%s': unknown array element "
                       "type %u", at, qkey, (unsigned)kv->arr_type);
    if (kv->arr_type == GGUF_TYPE_ARRAY)
        return qc_fail(err, QC_ERR_GGUF, "at offset %" PRIu64 ": key '%s': arrays of arrays are "
                       "not supported", at, qkey);
    uint64_t count_at = r->pos;
    if (read_u64(r, &kv->n, "array length") < 0) return -1;
    kv->data = r->buf + r->pos;
    if (kv->arr_type != GGUF_TYPE_STRING)
        return read_scalars(r, kv->arr_type, kv->n, 1, qkey, count_at);

    /* Strings: check that all n fit before allocating n entries, so a corrupted count fails on
     * the bytes instead of asking malloc for a huge table. */
    if (kv->n > (r->size - r->pos) / 8)
        return qc_fail(err, QC_ERR_GGUF, "at offset %" PRIu64 ": key '%s': array of %" PRIu64
                       " strings runs past end of file (size %zu)", count_at, qkey, kv->n, r->size);
    uint64_t start = r->pos;
    for (uint64_t i = 0; i < kv->n; i++) {
        uint64_t left = r->size - r->pos, len = 0;
        if (left < 8)
            return qc_fail(err, QC_ERR_GGUF, "at offset %" PRIu64 ": key '%s': string %" PRIu64
                           " of %" PRIu64 ": length field runs past end of file (size %zu)",
                           r->pos, qkey, i, kv->n, r->size);
        if ((len = load_u64(r->buf + r->pos)) > left - 8)
            return qc_fail(err, QC_ERR_GGUF, "at offset %" PRIu64 ": key '%s': string %" PRIu64
                           " of %" PRIu64 ": length %" PRIu64 " runs past end of file (size %zu)",
                           r->pos, qkey, i, kv->n, len, r->size);
        r->pos += 8 + len;
    }
    if (kv->n == 0) return 0;
    kv->strs = malloc((size_t)kv->n * sizeof *kv->strs);   /* n <= size / 8: fits size_t */
    if (kv->strs == NULL)
        return qc_fail(err, QC_ERR_NOMEM, "out of memory for %" PRIu64 " strings of key '%s'",
                       kv->n, qkey);
    r->pos = start;
    for (uint64_t i = 0; i < kv->n; i++) read_str(r, &kv->strs[i], "string");   /* checked above */
    return 0;
}

/* ------------------------------------------------------------------------------------------ */
/* tensor table                                                                                 */

static int read_tensor_info(reader *r, gguf_tensor *t, qc_error *err) {
    char qname[GGUF_QUOTE_MAX + 8];
    uint64_t at = r->pos;
    gguf_str name;
    if (read_str(r, &name, "tensor name") < 0) return -1;
    quote(qname, name.ptr, name.len);
    if (memchr(name.ptr, '\0', (size_t)name.len) != NULL)
        return qc_fail(err, QC_ERR_GGUF, "at offset %" PRIu64 ": tensor name '%s' contains a NUL "
                       "byte", at, qname);
    t->name = malloc((size_t)name.len + 1);
    if (t->name == NULL)
        return qc_fail(err, QC_ERR_NOMEM, "out of memory for a tensor name of %" PRIu64 " bytes",
                       name.len);
    memcpy(t->name, name.ptr, (size_t)name.len);
    t->name[name.len] = '\0';

    uint64_t dims_at = r->pos;
    if (read_u32(r, &t->n_dims, "tensor n_dims") < 0) return -1;
    if (t->n_dims < 1 || t->n_dims > GGUF_MAX_DIMS)
        return qc_fail(err, QC_ERR_GGUF, "at offset %" PRIu64 ": tensor '%s': n_dims %u is not in "
                       "1..%d", dims_at, qname, (unsigned)t->n_dims, GGUF_MAX_DIMS);
    /* The product of the nonzero dimensions must fit int64, whatever their order: a zero
     * dimension must not hide the overflow of the others. */
    uint64_t product = 1;
    for (uint32_t d = 0; d < GGUF_MAX_DIMS; d++) {
        uint64_t ne = 1;
        uint64_t ne_at = r->pos;
        if (d < t->n_dims && read_u64(r, &ne, "tensor dimension") < 0) return -1;
        if (ne > (uint64_t)INT64_MAX)
            return qc_fail(err, QC_ERR_GGUF, "at offset %" PRIu64 ": tensor '%s': dimension %u is "
                           "negative (%" PRId64 ")", ne_at, qname, (unsigned)d, (int64_t)ne);
        t->ne[d] = (int64_t)ne;
        if (ne != 0 && (qc_mul_u64(product, ne, &product) < 0 || product > (uint64_t)INT64_MAX))
            return qc_fail(err, QC_ERR_GGUF, "at offset %" PRIu64 ": tensor '%s': element count "
                           "%" PRId64 " x %" PRId64 " x %" PRId64 " x %" PRId64 " overflows",
                           at, qname, t->ne[0], d >= 1 ? t->ne[1] : 1, d >= 2 ? t->ne[2] : 1,
                           d >= 3 ? t->ne[3] : 1);
    }
    /* Unsigned: a zero factor makes the product 0 whatever the order, without signed overflow. */
    t->n_elements = (int64_t)((uint64_t)t->ne[0] * (uint64_t)t->ne[1] * (uint64_t)t->ne[2] *
                              (uint64_t)t->ne[3]);

    uint64_t type_at = r->pos;
    if (read_u32(r, &t->type, "tensor type") < 0) return -1;
    const qc_type_traits *tr = qc_type_get(t->type);
    if (tr == NULL)
        return qc_fail(err, QC_ERR_GGUF, "at offset %" PRIu64 ": tensor '%s': unknown tensor type "
                       "%u", type_at, qname, (unsigned)t->type);
    if (tr->type_size == 0)
        return qc_fail(err, QC_ERR_GGUF, "at offset %" PRIu64 ": tensor '%s': tensor type %s (%u) "
                       "was removed from GGUF and has no known size", type_at, qname, tr->name,
                       (unsigned)t->type);
    if (t->ne[0] % tr->block_size != 0)
        return qc_fail(err, QC_ERR_GGUF, "at offset %" PRIu64 ": tensor '%s': row of %" PRId64
                       " elements is not a multiple of the %s block size %" PRId64, at, qname,
                       t->ne[0], tr->name, tr->block_size);
    int64_t row = qc_row_bytes(t->type, t->ne[0]);
    uint64_t rows = (uint64_t)t->ne[1] * (uint64_t)t->ne[2] * (uint64_t)t->ne[3];
    if (row < 0 || qc_mul_u64((uint64_t)row, rows, &t->nbytes) < 0)
        return qc_fail(err, QC_ERR_GGUF, "at offset %" PRIu64 ": tensor '%s': byte size of %"
                       PRId64 " elements of %s overflows", at, qname, t->n_elements, tr->name);
    if (read_u64(r, &t->offset, "tensor data offset") < 0) return -1;
    return 0;
}

/* ------------------------------------------------------------------------------------------ */
/* the data layout                                                                              */

/* Tensor data is stored back to back in table order, each tensor padded to the alignment, the
 * first at offset 0: what llama.cpp and gguf-py write and what llama.cpp's reader demands. A
 * file that breaks this is not a layout choice but a damaged table, and it would otherwise
 * load and compute garbage: an offset that aliases another tensor's data (or 0), a type or
 * shape changed so the tensor's byte size no longer matches its slot, a general.alignment
 * changed without re-padding, a tensor count one too low (the data section then holds bytes
 * that no table entry describes). Called after every tensor's range was checked against the
 * file size, so the sums below cannot overflow. */
static int check_layout(const gguf_file *f, qc_error *err) {
    char q[GGUF_QUOTE_MAX + 8], qp[GGUF_QUOTE_MAX + 8];
    uint64_t expected = 0;     /* where the next tensor's data must start */
    for (uint64_t i = 0; i < f->n_tensors; i++) {
        const gguf_tensor *t = &f->tensors[i];
        if (t->offset != expected) {
            quote(q, t->name, strlen(t->name));
            if (i == 0)
                return qc_fail(err, QC_ERR_GGUF, "tensor '%s': data offset %" PRIu64 ", expected "
                               "0 (the first tensor's data starts the data section)", q, t->offset);
            const gguf_tensor *p = &f->tensors[i - 1];
            quote(qp, p->name, strlen(p->name));
            if (t->offset < expected)
                return qc_fail(err, QC_ERR_GGUF, "tensor '%s': data offset %" PRIu64 " overlaps the "
                               "data of tensor '%s' [%" PRIu64 ", %" PRIu64 ") (expected %" PRIu64
                               ": tensors are stored back to back, each padded to the alignment %"
                               PRIu64 ")", q, t->offset, qp, p->offset, p->offset + p->nbytes,
                               expected, f->alignment);
            return qc_fail(err, QC_ERR_GGUF, "tensor '%s': data offset %" PRIu64 " leaves %" PRIu64
                           " bytes after tensor '%s' (expected %" PRIu64 ": tensors are stored "
                           "back to back, each padded to the alignment %" PRIu64 "; a wrong type "
                           "or shape of '%s'?)", q, t->offset, t->offset - expected, qp, expected,
                           f->alignment, qp);
        }
        expected = t->offset + t->nbytes;
        expected += (f->alignment - expected % f->alignment) % f->alignment;
    }
    /* The last tensor may lack its padding, but no more bytes may follow it. */
    const uint64_t end = f->data_offset + expected;
    if (f->n_tensors > 0 && (uint64_t)f->size > end) {
        const gguf_tensor *p = &f->tensors[f->n_tensors - 1];
        return qc_fail(err, QC_ERR_GGUF, "the data section holds %" PRIu64 " bytes more than the "
                       "%" PRIu64 " tensors of the table describe (file size %zu, data ends at %"
                       PRIu64 " after tensor '%s'): a tensor missing from the table, a wrong "
                       "general.alignment or a wrong size of the last tensor", (uint64_t)f->size - end,
                       f->n_tensors, f->size, end, quote(qp, p->name, strlen(p->name)));
    }
    return 0;
}

/* ------------------------------------------------------------------------------------------ */
/* the whole file                                                                               */

static int parse(gguf_impl *g, qc_error *err) {
    gguf_file *f = &g->pub;
    reader rd = {(const uint8_t *)f->map, f->size, 0, err};
    reader *r = &rd;

    if (need(r, 4, "magic") < 0) return -1;
    if (memcmp(r->buf, GGUF_MAGIC, 4) != 0) {
        char q[GGUF_QUOTE_MAX + 8];
        return qc_fail(err, QC_ERR_GGUF, "at offset 0: not a GGUF file (magic '%s', expected "
                       "'GGUF')", quote(q, (const char *)r->buf, 4));
    }
    r->pos = 4;
    if (read_u32(r, &f->version, "version") < 0) return -1;
    if (f->version != 2 && f->version != 3) {
        uint32_t swapped = __builtin_bswap32(f->version);
        if (swapped >= 1 && swapped <= 3)
            return qc_fail(err, QC_ERR_GGUF, "at offset 4: unsupported version %u (a big-endian "
                           "GGUF v%u file; qwencuda reads little-endian GGUF v2 and v3)",
                           (unsigned)f->version, (unsigned)swapped);
        return qc_fail(err, QC_ERR_GGUF, "at offset 4: unsupported version %u (qwencuda reads "
                       "GGUF v2 and v3)", (unsigned)f->version);
    }
    uint64_t n_tensors, n_kv;
    if (read_u64(r, &n_tensors, "tensor count") < 0 || read_u64(r, &n_kv, "metadata count") < 0)
        return -1;
    uint64_t left = r->size - r->pos;
    if (n_kv > left / GGUF_MIN_KV_BYTES)
        return qc_fail(err, QC_ERR_GGUF, "at offset 16: metadata count %" PRIu64 " is more than "
                       "the %" PRIu64 " bytes left in the file could hold", n_kv, left);
    if (n_tensors > (left - n_kv * GGUF_MIN_KV_BYTES) / GGUF_MIN_TENSOR_BYTES)
        return qc_fail(err, QC_ERR_GGUF, "at offset 8: tensor count %" PRIu64 " is more than "
                       "the %" PRIu64 " bytes left in the file could hold", n_tensors, left);

    for (uint64_t i = 0; i < n_kv; i++) {
        if (grow((void **)&f->kv, &g->kv_cap, i, sizeof *f->kv, err) < 0) return -1;
        f->n_kv = i + 1;   /* counted before the parse so close frees a half-read entry */
        gguf_kv *kv = &f->kv[i];
        if (read_kv(r, kv, err) < 0 || index_reserve(&g->kv_index, i, kv_key, g, err) < 0)
            return -1;
        uint64_t *slot = index_slot(&g->kv_index, kv->key.ptr, kv->key.len, kv_key, g);
        if (*slot != 0) {
            char q[GGUF_QUOTE_MAX + 8];
            return qc_fail(err, QC_ERR_GGUF, "at offset %" PRIu64 ": duplicate metadata key '%s' "
                           "(first at offset %" PRIu64 ")", kv->offset,
                           quote(q, kv->key.ptr, kv->key.len), f->kv[*slot - 1].offset);
        }
        *slot = i + 1;
    }

    f->alignment = GGUF_DEFAULT_ALIGNMENT;
    const gguf_kv *al = gguf_find_kv(f, "general.alignment");
    if (al != NULL) {
        if (al->type != GGUF_TYPE_UINT32)
            return qc_fail(err, QC_ERR_GGUF, "at offset %" PRIu64 ": general.alignment has type "
                           "%s, expected UINT32", al->offset, gguf_type_name(al->type));
        uint32_t a = load_u32(al->data);
        if (a == 0 || (a & (a - 1)) != 0)
            return qc_fail(err, QC_ERR_GGUF, "at offset %" PRIu64 ": general.alignment %u is not "
                           "a nonzero power of two", al->offset, (unsigned)a);
        f->alignment = a;
    }

    for (uint64_t i = 0; i < n_tensors; i++) {
        if (grow((void **)&f->tensors, &g->tensor_cap, i, sizeof *f->tensors, err) < 0) return -1;
        f->n_tensors = i + 1;
        gguf_tensor *t = &f->tensors[i];
        uint64_t at = r->pos;
        if (read_tensor_info(r, t, err) < 0 ||
            index_reserve(&g->tensor_index, i, tensor_key, g, err) < 0)
            return -1;
        uint64_t *slot = index_slot(&g->tensor_index, t->name, strlen(t->name), tensor_key, g);
        if (*slot != 0) {
            char q[GGUF_QUOTE_MAX + 8];
            return qc_fail(err, QC_ERR_GGUF, "at offset %" PRIu64 ": duplicate tensor name '%s' "
                           "(tensors %" PRIu64 " and %" PRIu64 ")", at,
                           quote(q, t->name, strlen(t->name)), *slot - 1, i);
        }
        *slot = i + 1;
        if (t->offset % f->alignment != 0) {
            char q[GGUF_QUOTE_MAX + 8];
            return qc_fail(err, QC_ERR_GGUF, "tensor '%s' (table entry at offset %" PRIu64 "): "
                           "data offset %" PRIu64 " is not a multiple of the alignment %" PRIu64,
                           quote(q, t->name, strlen(t->name)), at, t->offset, f->alignment);
        }
    }

    /* The data section starts at the next multiple of the alignment. */
    uint64_t pad = (f->alignment - r->pos % f->alignment) % f->alignment;
    f->data_offset = r->pos + pad;   /* r->pos <= size < 2^63: no overflow */
    for (uint64_t i = 0; i < f->n_tensors; i++) {
        gguf_tensor *t = &f->tensors[i];
        uint64_t begin, end;
        int over = qc_add_u64(f->data_offset, t->offset, &begin) < 0 ||
                   qc_add_u64(begin, t->nbytes, &end) < 0;
        if (over || end > f->size) {
            char q[GGUF_QUOTE_MAX + 8];
            quote(q, t->name, strlen(t->name));
            if (over)
                return qc_fail(err, QC_ERR_GGUF, "tensor '%s': data at %" PRIu64 " + %" PRIu64
                               " + %" PRIu64 " bytes overflows", q, f->data_offset, t->offset,
                               t->nbytes);
            return qc_fail(err, QC_ERR_GGUF, "tensor '%s': data [%" PRIu64 ", %" PRIu64 ") runs "
                           "past end of file (size %zu)", q, begin, end, f->size);
        }
        t->data = (const uint8_t *)f->map + begin;
    }
    return check_layout(f, err);
}

static gguf_impl *impl_new(qc_error *err) {
    gguf_impl *g = calloc(1, sizeof *g);
    if (g == NULL) qc_fail(err, QC_ERR_NOMEM, "out of memory for a GGUF file");
    return g;
}

int gguf_open_buffer(const void *buf, size_t size, gguf_file **out, qc_error *err) {
    *out = NULL;
    if (buf == NULL && size != 0) return qc_fail(err, QC_ERR_VALUE, "gguf_open_buffer: NULL buffer");
    gguf_impl *g = impl_new(err);
    if (g == NULL) return -1;
    g->pub.map = (void *)buf;
    g->pub.size = size;
    if (parse(g, err) < 0) goto fail;
    *out = &g->pub;
    return 0;
fail:
    gguf_close(&g->pub);
    return -1;
}

int gguf_open(const char *path, gguf_file **out, qc_error *err) {
    *out = NULL;
    int fd = -1;
    gguf_impl *g = impl_new(err);
    if (g == NULL) return -1;
    g->pub.path = strdup(path);
    if (g->pub.path == NULL) {
        qc_fail(err, QC_ERR_NOMEM, "out of memory");
        goto fail;
    }
    fd = open(path, O_RDONLY | O_CLOEXEC);
    if (fd < 0) {
        qc_fail(err, QC_ERR_IO, "%s: cannot open: %s", path, strerror(errno));
        goto fail;
    }
    struct stat st;
    if (fstat(fd, &st) < 0) {
        qc_fail(err, QC_ERR_IO, "%s: cannot stat: %s", path, strerror(errno));
        goto fail;
    }
    if (!S_ISREG(st.st_mode)) {
        qc_fail(err, QC_ERR_IO, "%s: not a regular file", path);
        goto fail;
    }
    if ((uint64_t)st.st_size > SIZE_MAX) {
        qc_fail(err, QC_ERR_IO, "%s: file too large to map", path);
        goto fail;
    }
    g->pub.size = (size_t)st.st_size;
    if (g->pub.size > 0) {   /* mmap of 0 bytes fails; an empty file is reported by parse */
        void *map = mmap(NULL, g->pub.size, PROT_READ, MAP_PRIVATE, fd, 0);
        if (map == MAP_FAILED) {
            qc_fail(err, QC_ERR_IO, "%s: cannot mmap %zu bytes: %s", path, g->pub.size,
                    strerror(errno));
            goto fail;
        }
        g->pub.map = map;
        g->owns_map = 1;
    }
    close(fd);
    fd = -1;
    if (parse(g, err) < 0) {
        /* Name the file: a model loader's caller may not know which one was read. */
        if (err) {
            char msg[sizeof err->msg];
            int n = snprintf(msg, sizeof msg, "%.300s: ", path);
            size_t used = n > 0 ? (size_t)n : 0, room = sizeof msg - 1 - used;
            size_t len = strnlen(err->msg, sizeof err->msg);
            if (len > room) len = room;
            memcpy(msg + used, err->msg, len);
            msg[used + len] = '\0';
            memcpy(err->msg, msg, sizeof msg);
        }
        goto fail;
    }
    *out = &g->pub;
    return 0;
fail:
    if (fd >= 0) close(fd);
    gguf_close(&g->pub);
    return -1;
}

void gguf_close(gguf_file *f) {
    if (f == NULL) return;
    gguf_impl *g = (gguf_impl *)f;
    for (uint64_t i = 0; i < f->n_kv; i++) free(f->kv[i].strs);
    free(f->kv);
    for (uint64_t i = 0; i < f->n_tensors; i++) free(f->tensors[i].name);
    free(f->tensors);
    free(g->kv_index.slots);
    free(g->tensor_index.slots);
    if (g->owns_map && f->map != NULL) munmap(f->map, f->size);
    free(f->path);
    free(g);
}

/* ------------------------------------------------------------------------------------------ */
/* lookups                                                                                      */

const gguf_kv *gguf_find_kv(const gguf_file *f, const char *key) {
    if (f == NULL || key == NULL) return NULL;
    const gguf_impl *g = (const gguf_impl *)f;
    const uint64_t *slot = index_slot(&g->kv_index, key, strlen(key), kv_key, g);
    return slot && *slot ? &f->kv[*slot - 1] : NULL;
}

const gguf_tensor *gguf_find_tensor(const gguf_file *f, const char *name) {
    if (f == NULL || name == NULL) return NULL;
    const gguf_impl *g = (const gguf_impl *)f;
    const uint64_t *slot = index_slot(&g->tensor_index, name, strlen(name), tensor_key, g);
    return slot && *slot ? &f->tensors[*slot - 1] : NULL;
}

/* The scalar value of an integer kv as a signed 128-bit-free pair: -1 if not an integer. */
static int kv_integer(const gguf_kv *kv, int *negative, uint64_t *mag) {
    const uint8_t *p = kv->data;
    int64_t s;
    *negative = 0;
    switch (kv->type) {
    case GGUF_TYPE_UINT8: *mag = p[0]; return 0;
    case GGUF_TYPE_UINT16: *mag = (uint64_t)p[0] | (uint64_t)p[1] << 8; return 0;
    case GGUF_TYPE_UINT32: *mag = load_u32(p); return 0;
    case GGUF_TYPE_UINT64: *mag = load_u64(p); return 0;
    case GGUF_TYPE_INT8: s = (int8_t)p[0]; break;
    case GGUF_TYPE_INT16: s = (int16_t)(uint16_t)((uint16_t)p[0] | (uint16_t)p[1] << 8); break;
    case GGUF_TYPE_INT32: s = (int32_t)load_u32(p); break;
    case GGUF_TYPE_INT64: s = (int64_t)load_u64(p); break;
    default: return -1;
    }
    *negative = s < 0;
    *mag = s < 0 ? (uint64_t)0 - (uint64_t)s : (uint64_t)s;
    return 0;
}

static const gguf_kv *find_required(const gguf_file *f, const char *key, qc_error *err) {
    const gguf_kv *kv = gguf_find_kv(f, key);
    if (kv == NULL) qc_fail(err, QC_ERR_MODEL, "metadata key '%s' is missing", key);
    return kv;
}

int gguf_get_u32(const gguf_file *f, const char *key, uint32_t *out, qc_error *err) {
    const gguf_kv *kv = find_required(f, key, err);
    if (kv == NULL) return -1;
    int negative;
    uint64_t mag;
    if (kv_integer(kv, &negative, &mag) < 0)
        return qc_fail(err, QC_ERR_MODEL, "metadata key '%s' has type %s, expected an integer",
                       key, gguf_type_name(kv->type));
    if (negative || mag > UINT32_MAX)
        return qc_fail(err, QC_ERR_MODEL, "metadata key '%s' = %s%" PRIu64 " does not fit a "
                       "uint32", key, negative ? "-" : "", mag);
    *out = (uint32_t)mag;
    return 0;
}

int gguf_get_f32(const gguf_file *f, const char *key, float *out, qc_error *err) {
    const gguf_kv *kv = find_required(f, key, err);
    if (kv == NULL) return -1;
    if (kv->type == GGUF_TYPE_FLOAT32) {
        union { uint32_t u; float f; } v;
        v.u = load_u32(kv->data);
        *out = v.f;
        return 0;
    }
    if (kv->type == GGUF_TYPE_FLOAT64) {
        union { uint64_t u; double d; } v;
        v.u = load_u64(kv->data);
        *out = (float)v.d;
        return 0;
    }
    int negative;
    uint64_t mag;
    if (kv_integer(kv, &negative, &mag) < 0)
        return qc_fail(err, QC_ERR_MODEL, "metadata key '%s' has type %s, expected a number",
                       key, gguf_type_name(kv->type));
    *out = negative ? -(float)mag : (float)mag;
    return 0;
}

int gguf_get_str(const gguf_file *f, const char *key, gguf_str *out, qc_error *err) {
    const gguf_kv *kv = find_required(f, key, err);
    if (kv == NULL) return -1;
    if (kv->type != GGUF_TYPE_STRING)
        return qc_fail(err, QC_ERR_MODEL, "metadata key '%s' has type %s, expected STRING", key,
                       gguf_type_name(kv->type));
    *out = kv->str;
    return 0;
}
