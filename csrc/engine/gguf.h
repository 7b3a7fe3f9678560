/* gguf.h: a memory-mapped, bounds-checked GGUF v2/v3 reader.
 *
 * gguf_open parses the header, the metadata and the tensor table, checking every count,
 * length, offset and size against the mapping before it is used; a malformed file yields
 * QC_ERR_GGUF with a message that names the problem and the byte offset. Tensor data is never
 * copied: gguf_tensor.data points into the mapping, valid until gguf_close.
 *
 * Rejected as malformed: nested arrays, duplicate keys or tensor names, bool bytes other than
 * 0/1, a general.alignment that is not a UINT32 power of two, tensor data that is not stored
 * back to back in table order from offset 0 (each tensor padded to the alignment, as llama.cpp
 * demands), and bytes after the last tensor beyond its padding. With an alignment below 8
 * tensor data can sit at odd addresses: readers of block structs must check or copy
 * (quants.c copies).
 */
#ifndef QC_GGUF_H
#define QC_GGUF_H

#include <stddef.h>
#include <stdint.h>
#include "common.h"

#ifdef __cplusplus
extern "C" {
#endif

#define GGUF_MAX_DIMS 4

typedef enum {
    GGUF_TYPE_UINT8 = 0,
    GGUF_TYPE_INT8 = 1,
    GGUF_TYPE_UINT16 = 2,
    GGUF_TYPE_INT16 = 3,
    GGUF_TYPE_UINT32 = 4,
    GGUF_TYPE_INT32 = 5,
    GGUF_TYPE_FLOAT32 = 6,
    GGUF_TYPE_BOOL = 7,
    GGUF_TYPE_STRING = 8,
    GGUF_TYPE_ARRAY = 9,
    GGUF_TYPE_UINT64 = 10,
    GGUF_TYPE_INT64 = 11,
    GGUF_TYPE_FLOAT64 = 12,
    GGUF_TYPE_COUNT
} gguf_value_type;

/* A string inside the mapping: not NUL-terminated. */
typedef struct { const char *ptr; uint64_t len; } gguf_str;

typedef struct {
    gguf_str key;
    uint32_t type;            /* gguf_value_type */
    /* Scalars: `data` points at the little-endian value in the mapping; strings: `str`
     * (and `data` is NULL). */
    const uint8_t *data;
    gguf_str str;
    /* Arrays: element type, count; `data` points at the first element. For arrays of strings
     * `strs` holds all `n` of them (allocated by the reader). */
    uint32_t arr_type;
    uint64_t n;
    gguf_str *strs;
    uint64_t offset;          /* byte offset of this key-value pair in the file */
} gguf_kv;

typedef struct {
    char *name;               /* NUL-terminated copy */
    uint32_t n_dims;
    int64_t ne[GGUF_MAX_DIMS];/* ne[0] is the fastest-varying dimension (GGUF order) */
    uint32_t type;            /* qc_type */
    uint64_t offset;          /* relative to the start of the data section */
    uint64_t nbytes;
    int64_t n_elements;
    const void *data;         /* into the mapping */
} gguf_tensor;

typedef struct gguf_file {
    char *path;
    void *map;                /* the whole file, read-only */
    size_t size;
    uint32_t version;
    uint64_t alignment;
    uint64_t data_offset;     /* start of the tensor data section in the file */
    uint64_t n_kv;
    gguf_kv *kv;
    uint64_t n_tensors;
    gguf_tensor *tensors;
} gguf_file;

/* Open and validate a file. On failure *out is NULL and nothing leaks. */
int gguf_open(const char *path, gguf_file **out, qc_error *err);
/* Parse an in-memory buffer (not copied; must outlive the result). Used by tests/fuzzing. */
int gguf_open_buffer(const void *buf, size_t size, gguf_file **out, qc_error *err);
void gguf_close(gguf_file *f);   /* NULL is fine */

const gguf_kv *gguf_find_kv(const gguf_file *f, const char *key);
const gguf_tensor *gguf_find_tensor(const gguf_file *f, const char *name);

/* Typed scalar getters: integer getters accept any integer type whose value fits;
 * gguf_get_f32 accepts float32/float64 and integers. Fail with QC_ERR_MODEL naming the key if
 * it is missing or has another type. */
int gguf_get_u32(const gguf_file *f, const char *key, uint32_t *out, qc_error *err);
int gguf_get_f32(const gguf_file *f, const char *key, float *out, qc_error *err);
int gguf_get_str(const gguf_file *f, const char *key, gguf_str *out, qc_error *err);

const char *gguf_type_name(uint32_t value_type);

#ifdef __cplusplus
}
#endif
#endif /* QC_GGUF_H */
