/* model.c: a Qwen2 / Qwen2.5 model from a GGUF file: the config from metadata, every tensor
 * checked (presence, shape, type) before anything is allocated, then the weights placed on the
 * backend. Norms and biases become float32 backend buffers; matrices stay in their stored
 * block format (the backend's matmul reads them as they are). */
#include "model.h"

#include <stddef.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "quants.h"
#ifdef QC_HAVE_CUDA
#include "../../kernels/qc_cuda_api.h"
#endif

/* Metadata defaults, as llama.cpp applies them for qwen2 files that lack the key. */
#define QC_DEFAULT_ROPE_THETA 10000.0f
/* The range of rope.freq_base accepted as a real model's (see qc_config_from_gguf). */
#define QC_MIN_ROPE_THETA 1.0f
#define QC_MAX_ROPE_THETA 1e9f

/* ---------------------------------------------------------------------------------------- */
/* config */

static int get_dim(const gguf_file *f, const char *arch, const char *suffix, int64_t *out,
                   qc_error *err) {
    char key[96];
    uint32_t v = 0;
    snprintf(key, sizeof key, "%s.%s", arch, suffix);
    if (gguf_get_u32(f, key, &v, err) < 0) return -1;
    if (v == 0) return qc_fail(err, QC_ERR_MODEL, "%s is 0", key);
    *out = (int64_t)v;
    return 0;
}

int qc_config_from_gguf(const gguf_file *f, qc_config *cfg, qc_error *err) {
    gguf_str arch;
    memset(cfg, 0, sizeof *cfg);
    if (gguf_get_str(f, "general.architecture", &arch, err) < 0) return -1;
    if (arch.len != 5 || memcmp(arch.ptr, "qwen2", 5) != 0) {
        /* The name comes from the file: printable ASCII as is, other bytes as \xNN. */
        char q[64 * 4 + 4];
        size_t o = 0;
        for (uint64_t i = 0; i < arch.len && i < 64; i++) {
            const unsigned char ch = (unsigned char)arch.ptr[i];
            if (ch >= 0x20 && ch < 0x7f && ch != '\\') q[o++] = (char)ch;
            else o += (size_t)snprintf(q + o, sizeof q - o, "\\x%02x", ch);
        }
        q[o] = '\0';
        return qc_fail(err, QC_ERR_MODEL,
                       "architecture '%s'%s is not supported: qwencuda runs qwen2 (Qwen2, Qwen2.5)",
                       q, arch.len > 64 ? "..." : "");
    }
    memcpy(cfg->arch, "qwen2", 6);

    if (get_dim(f, "qwen2", "embedding_length", &cfg->dim, err) < 0 ||
        get_dim(f, "qwen2", "block_count", &cfg->n_layer, err) < 0 ||
        get_dim(f, "qwen2", "feed_forward_length", &cfg->ffn_dim, err) < 0 ||
        get_dim(f, "qwen2", "attention.head_count", &cfg->n_head, err) < 0 ||
        get_dim(f, "qwen2", "context_length", &cfg->n_ctx_train, err) < 0 ||
        gguf_get_f32(f, "qwen2.attention.layer_norm_rms_epsilon", &cfg->norm_eps, err) < 0)
        return -1;
    /* head_count_kv absent means plain multi-head attention (llama.cpp does the same). */
    if (gguf_find_kv(f, "qwen2.attention.head_count_kv")) {
        if (get_dim(f, "qwen2", "attention.head_count_kv", &cfg->n_head_kv, err) < 0) return -1;
    } else {
        cfg->n_head_kv = cfg->n_head;
    }
    /* rope.freq_base absent: 10000, llama.cpp's default (Qwen2 files always carry 1e6); the
     * binding warns about it (py_model.c), since a Qwen2 file without it is most likely cut. */
    cfg->rope_theta = QC_DEFAULT_ROPE_THETA;
    if (gguf_find_kv(f, "qwen2.rope.freq_base") &&
        gguf_get_f32(f, "qwen2.rope.freq_base", &cfg->rope_theta, err) < 0)
        return -1;

    if (!(cfg->norm_eps > 0.0f) || cfg->norm_eps > 1.0f)
        return qc_fail(err, QC_ERR_MODEL, "qwen2.attention.layer_norm_rms_epsilon = %g: expected in (0, 1]",
                       (double)cfg->norm_eps);
    /* RoPE bases in use run from 1e4 (LLaMA) to 1e6 (Qwen2) and 1e7 (long-context variants);
     * below 1 the "frequencies" grow with the pair index, far above 1e9 every pair of a
     * 64-wide head turns by less than 1e-4 rad per token: such a value is a corrupted file. */
    if (!(cfg->rope_theta >= QC_MIN_ROPE_THETA && cfg->rope_theta <= QC_MAX_ROPE_THETA))
        return qc_fail(err, QC_ERR_MODEL, "qwen2.rope.freq_base = %g: expected a RoPE base in "
                       "[%g, %g] (Qwen2 uses 1e6)", (double)cfg->rope_theta,
                       (double)QC_MIN_ROPE_THETA, (double)QC_MAX_ROPE_THETA);
    if (cfg->dim % cfg->n_head != 0)
        return qc_fail(err, QC_ERR_MODEL, "embedding_length %lld is not a multiple of head_count %lld",
                       (long long)cfg->dim, (long long)cfg->n_head);
    if (cfg->n_head % cfg->n_head_kv != 0)
        return qc_fail(err, QC_ERR_MODEL, "head_count %lld is not a multiple of head_count_kv %lld",
                       (long long)cfg->n_head, (long long)cfg->n_head_kv);
    cfg->head_dim = cfg->dim / cfg->n_head;
    if (cfg->head_dim % 2 != 0)
        return qc_fail(err, QC_ERR_MODEL, "head_dim %lld (embedding_length / head_count) is odd: RoPE needs pairs",
                       (long long)cfg->head_dim);
    /* The ops take int sizes: keep every dimension (and a row of scores) well inside int. */
    if (cfg->dim > (1 << 20) || cfg->ffn_dim > (1 << 22) || cfg->n_layer > 4096 ||
        cfg->n_head > 4096)
        return qc_fail(err, QC_ERR_MODEL, "implausible dimensions (dim %lld, ffn %lld, layers %lld, heads %lld)",
                       (long long)cfg->dim, (long long)cfg->ffn_dim, (long long)cfg->n_layer,
                       (long long)cfg->n_head);

    /* The vocabulary is the embedding's row count, never the tokenizer's token count. */
    const gguf_tensor *emb = gguf_find_tensor(f, "token_embd.weight");
    if (emb == NULL) return qc_fail(err, QC_ERR_MODEL, "token_embd.weight: missing");
    if (emb->n_dims != 2 || emb->ne[1] <= 0 || emb->ne[1] > INT32_MAX)
        return qc_fail(err, QC_ERR_MODEL, "token_embd.weight: expected 2 dimensions (n_vocab, %lld)",
                       (long long)cfg->dim);
    cfg->n_vocab = emb->ne[1];
    cfg->tied = gguf_find_tensor(f, "output.weight") == NULL;
    return 0;
}

/* ---------------------------------------------------------------------------------------- */
/* tensor checks */

static void shape_str(char *buf, size_t size, const int64_t *np_shape, int ndim) {
    size_t len = 0;
    len += (size_t)snprintf(buf + len, size - len, "(");
    for (int i = 0; i < ndim && len < size; i++)
        len += (size_t)snprintf(buf + len, size - len, i ? ", %lld" : "%lld", (long long)np_shape[i]);
    if (ndim == 1 && len < size) len += (size_t)snprintf(buf + len, size - len, ",");
    if (len < size) snprintf(buf + len, size - len, ")");
}

/* Find name and check its shape (given in NumPy order: rows first) and that the engine can read
 * its type. Messages name the tensor and both shapes in NumPy order. */
static int find_checked(const gguf_file *f, const char *name, int ndim, int64_t d0, int64_t d1,
                        const gguf_tensor **out, qc_error *err) {
    const gguf_tensor *t = gguf_find_tensor(f, name);
    int64_t want[2] = {d0, d1};
    *out = NULL;
    if (t == NULL) return qc_fail(err, QC_ERR_MODEL, "%s: missing from the file", name);
    int same = (int)t->n_dims == ndim;
    int64_t got[GGUF_MAX_DIMS];
    for (uint32_t i = 0; i < t->n_dims && i < GGUF_MAX_DIMS; i++) got[i] = t->ne[t->n_dims - 1 - i];
    for (int i = 0; same && i < ndim; i++) same = got[i] == want[i];
    if (!same) {
        char a[64], b[96];
        shape_str(a, sizeof a, want, ndim);
        shape_str(b, sizeof b, got, (int)(t->n_dims < GGUF_MAX_DIMS ? t->n_dims : GGUF_MAX_DIMS));
        return qc_fail(err, QC_ERR_MODEL, "%s: expected %s got %s", name, a, b);
    }
    const qc_type_traits *tr = qc_type_get(t->type);
    if (tr == NULL || tr->dequantize == NULL)
        return qc_fail(err, QC_ERR_MODEL, "%s: type %s is not supported by qwencuda", name,
                       tr && tr->name ? tr->name : "unknown");
    if (qc_row_bytes(t->type, t->ne[0]) < 0)
        return qc_fail(err, QC_ERR_MODEL, "%s: rows of %lld elements are not whole %s blocks",
                       name, (long long)t->ne[0], tr->name);
    *out = t;
    return 0;
}

#define LT(suffix, field, kind, rows, cols) {suffix, offsetof(qc_layer, field), kind, rows, cols}
const qc_layer_tensor qc_layer_tensors[] = {
    LT("attn_norm.weight",   attn_norm, QC_LT_NORM,   QC_D_DIM, QC_D_NONE),
    LT("attn_q.weight",      wq,        QC_LT_MATRIX, QC_D_Q,   QC_D_DIM),
    LT("attn_k.weight",      wk,        QC_LT_MATRIX, QC_D_KV,  QC_D_DIM),
    LT("attn_v.weight",      wv,        QC_LT_MATRIX, QC_D_KV,  QC_D_DIM),
    LT("attn_q.bias",        bq,        QC_LT_BIAS,   QC_D_Q,   QC_D_NONE),
    LT("attn_k.bias",        bk,        QC_LT_BIAS,   QC_D_KV,  QC_D_NONE),
    LT("attn_v.bias",        bv,        QC_LT_BIAS,   QC_D_KV,  QC_D_NONE),
    LT("attn_output.weight", wo,        QC_LT_MATRIX, QC_D_DIM, QC_D_Q),
    LT("ffn_norm.weight",    ffn_norm,  QC_LT_NORM,   QC_D_DIM, QC_D_NONE),
    LT("ffn_gate.weight",    w_gate,    QC_LT_MATRIX, QC_D_FFN, QC_D_DIM),
    LT("ffn_up.weight",      w_up,      QC_LT_MATRIX, QC_D_FFN, QC_D_DIM),
    LT("ffn_down.weight",    w_down,    QC_LT_MATRIX, QC_D_DIM, QC_D_FFN),
};
#undef LT
const size_t qc_n_layer_tensors = sizeof qc_layer_tensors / sizeof qc_layer_tensors[0];

int64_t qc_dim_value(const qc_config *c, qc_dim_id d) {
    switch (d) {
    case QC_D_DIM: return c->dim;
    case QC_D_Q: return c->n_head * c->head_dim;
    case QC_D_KV: return c->n_head_kv * c->head_dim;
    case QC_D_FFN: return c->ffn_dim;
    default: return 0;
    }
}

/* Every tensor the forward pass reads, checked before any allocation; and no layer tensor
 * beyond block_count (a lowered block_count would otherwise run fewer layers silently). */
static int check_tensors(const gguf_file *f, const qc_config *c, qc_error *err) {
    const gguf_tensor *t;
    char name[96];
    /* Every tensor of the file must be one the model reads, as llama.cpp demands: a renamed
     * output.weight would otherwise make the model tied without a word. */
    for (uint64_t i = 0; i < f->n_tensors; i++) {
        const char *nm = f->tensors[i].name;
        if (strcmp(nm, "token_embd.weight") == 0 || strcmp(nm, "output_norm.weight") == 0 ||
            strcmp(nm, "output.weight") == 0)
            continue;
        char *end = NULL;
        const long long layer = strncmp(nm, "blk.", 4) == 0 ? strtoll(nm + 4, &end, 10) : -1;
        if (end != NULL && end != nm + 4 && *end == '.' && nm[4] >= '0' && nm[4] <= '9' &&
            layer >= c->n_layer)
            return qc_fail(err, QC_ERR_MODEL, "%.80s: layer %lld is beyond qwen2.block_count = "
                           "%lld (the file holds more layers than its metadata says)", nm, layer,
                           (long long)c->n_layer);
        int known = 0;
        if (end != NULL && end != nm + 4 && *end == '.' && nm[4] >= '0' && nm[4] <= '9') {
            snprintf(name, sizeof name, "blk.%lld.", layer);
            const size_t pre = strlen(name);
            for (size_t k = 0; k < qc_n_layer_tensors && !known; k++)
                known = strncmp(nm, name, pre) == 0 && strcmp(nm + pre, qc_layer_tensors[k].suffix) == 0;
        }
        if (!known) {
            char q[96];
            size_t o = 0;
            for (size_t k = 0; nm[k] != '\0' && k < 64; k++) {
                const unsigned char ch = (unsigned char)nm[k];
                if (ch >= 0x20 && ch < 0x7f && ch != '\\') q[o++] = (char)ch;
                else o += (size_t)snprintf(q + o, sizeof q - o, "\\x%02x", ch);
                if (o > sizeof q - 5) break;
            }
            q[o] = '\0';
            return qc_fail(err, QC_ERR_MODEL, "tensor '%s' is not part of a qwen2 model (a renamed "
                           "or foreign tensor; llama.cpp refuses the file too)", q);
        }
    }
    if (find_checked(f, "token_embd.weight", 2, c->n_vocab, c->dim, &t, err) < 0 ||
        find_checked(f, "output_norm.weight", 1, c->dim, 0, &t, err) < 0)
        return -1;
    if (!c->tied && find_checked(f, "output.weight", 2, c->n_vocab, c->dim, &t, err) < 0) return -1;
    for (int64_t l = 0; l < c->n_layer; l++) {
        for (size_t i = 0; i < qc_n_layer_tensors; i++) {
            const qc_layer_tensor *lt = &qc_layer_tensors[i];
            const int ndim = lt->kind == QC_LT_MATRIX ? 2 : 1;
            snprintf(name, sizeof name, "blk.%lld.%s", (long long)l, lt->suffix);
            if (find_checked(f, name, ndim, qc_dim_value(c, lt->rows), qc_dim_value(c, lt->cols),
                             &t, err) < 0)
                return -1;
        }
    }
    return 0;
}

/* ---------------------------------------------------------------------------------------- */
/* memory: a model that does not fit is refused before anything is placed */

#define QC_GIB (1024.0 * 1024.0 * 1024.0)

/* A backend that copies the matrices into its own memory (CUDA) rather than reading them from the
 * file mapping (the CPU: weight_load aliases w->data = w->host). */
static int copies_matrices(const qc_backend *be) { return strcmp(be->name, "cpu") != 0; }

/* The bytes qc_model_load places in be's memory: every matrix as stored (the lm_head once when
 * tied) where the backend copies matrices, and every norm and bias as float32 (load_vector). */
static void backend_bytes(const gguf_file *f, const qc_config *c, int matrices, size_t *mat_bytes,
                          size_t *vec_bytes) {
    char name[96];
    size_t mb = 0, vb = 0;
    const gguf_tensor *t = gguf_find_tensor(f, "token_embd.weight");
    mb += t->nbytes;
    if (!c->tied) mb += gguf_find_tensor(f, "output.weight")->nbytes;
    vb += (size_t)c->dim * sizeof(float);   /* output_norm */
    for (int64_t l = 0; l < c->n_layer; l++) {
        for (size_t i = 0; i < qc_n_layer_tensors; i++) {
            const qc_layer_tensor *lt = &qc_layer_tensors[i];
            snprintf(name, sizeof name, "blk.%lld.%s", (long long)l, lt->suffix);
            t = gguf_find_tensor(f, name);
            if (lt->kind == QC_LT_MATRIX) mb += t->nbytes;
            else vb += (size_t)t->ne[0] * sizeof(float);
        }
    }
    *mat_bytes = matrices ? mb : 0;
    *vec_bytes = vb;
}

/* The bytes a model may place on be: the device's free memory on CUDA, and no more than
 * QWENCUDA_MEMORY_LIMIT (bytes) when that is set (to share a GPU, or to try the refusal below on
 * any machine). *limit_name says which bound it is; SIZE_MAX: no bound (the CPU without the
 * variable). */
static int backend_room(const qc_backend *be, size_t *room, size_t *total, const char **limit_name,
                        qc_error *err) {
    *room = SIZE_MAX;
    *total = 0;
    *limit_name = NULL;
    (void)be;   /* used in CUDA builds only */
#ifdef QC_HAVE_CUDA
    if (copies_matrices(be)) {
        if (qc_cuda_mem_info(be->device, room, total, err) < 0) return -1;
        *limit_name = "free";
    }
#endif
    const char *env = getenv("QWENCUDA_MEMORY_LIMIT");
    if (env != NULL && *env != '\0') {
        char *end = NULL;
        const unsigned long long v = strtoull(env, &end, 10);
        if (end == env || *end != '\0' || env[0] == '-')
            return qc_fail(err, QC_ERR_VALUE, "QWENCUDA_MEMORY_LIMIT='%.40s': expected a number of bytes", env);
        if ((size_t)v < *room) {
            *room = (size_t)v;
            *limit_name = "QWENCUDA_MEMORY_LIMIT";
        }
    }
    return 0;
}

/* "cuda:N" for a device with an ordinal, "cpu" */
static const char *where(const qc_backend *be, char *buf, size_t size) {
    if (copies_matrices(be)) snprintf(buf, size, "%s:%d", be->name, be->device);
    else snprintf(buf, size, "%s", be->name);
    return buf;
}

/* bytes as "1.23 GiB", "4.5 MiB" or "6.7 KiB" in buf */
static const char *human(char *buf, size_t size, size_t bytes) {
    if ((double)bytes >= QC_GIB) snprintf(buf, size, "%.2f GiB", (double)bytes / QC_GIB);
    else if (bytes >= ((size_t)1 << 20)) snprintf(buf, size, "%.1f MiB", (double)bytes / (1 << 20));
    else snprintf(buf, size, "%.1f KiB", (double)bytes / 1024.0);
    return buf;
}

/* 0 when the weights fit in the room the backend has; else QC_ERR_NOMEM (MemoryError) stating the
 * model's size and the room. */
static int check_fits(const qc_model *m, const char *path, qc_error *err) {
    const qc_backend *be = m->be;
    size_t mat, vec, room, total;
    const char *limit;
    char dev[32], h[4][32];
    backend_bytes(m->file, &m->cfg, copies_matrices(be), &mat, &vec);
    if (backend_room(be, &room, &total, &limit, err) < 0) return -1;
    if (mat + vec <= room) return 0;
    where(be, dev, sizeof dev);
    human(h[0], sizeof h[0], mat + vec);
    human(h[1], sizeof h[1], mat);
    human(h[2], sizeof h[2], vec);
    if (limit != NULL && strcmp(limit, "free") == 0)
        return qc_fail(err, QC_ERR_NOMEM,
                       "%.120s does not fit: its weights need %zu bytes (%s: matrices %s as stored, "
                       "norms and biases %s as float32) on %s, which has %zu bytes (%s) free of %.2f "
                       "GiB, and the KV cache comes on top. Use a smaller quantization (Q4_K_M takes "
                       "about 30%% of F16) or free the GPU",
                       path, mat + vec, h[0], h[1], h[2], dev, room, human(h[3], sizeof h[3], room),
                       (double)total / QC_GIB);
    return qc_fail(err, QC_ERR_NOMEM,
                   "%.120s does not fit: its weights need %zu bytes (%s: matrices %s as stored, norms "
                   "and biases %s as float32) on %s, more than QWENCUDA_MEMORY_LIMIT = %zu bytes",
                   path, mat + vec, h[0], h[1], h[2], dev, room);
}

/* A weight that could not be placed: when the device has too little free memory left for it (the
 * model fitted at the check, but another process took memory since), QC_ERR_NOMEM; else the
 * backend's error as it is. */
static int place_failed(const qc_model *m, const char *name, size_t bytes, qc_error *err) {
    const qc_backend *be = m->be;
    size_t free_b = SIZE_MAX, total_b = 0;
#ifdef QC_HAVE_CUDA
    qc_error ignored;
    if (copies_matrices(be) && qc_cuda_mem_info(be->device, &free_b, &total_b, &ignored) < 0)
        free_b = SIZE_MAX;
#endif
    char dev[32];
    size_t mat, vec;
    backend_bytes(m->file, &m->cfg, copies_matrices(be), &mat, &vec);
    if (free_b < bytes)
        return qc_fail(err, QC_ERR_NOMEM, "%s: out of memory placing %zu bytes on %s, which has %zu "
                       "bytes free of %zu now (the model's weights need %zu in all): %s", name, bytes,
                       where(be, dev, sizeof dev), free_b, total_b, mat + vec, be->err.msg);
    if (be->err.kind == QC_ERR_NOMEM)
        return qc_fail(err, QC_ERR_NOMEM, "%s: out of memory placing %zu bytes on %s (the model's "
                       "weights need %zu in all): %s", name, bytes, where(be, dev, sizeof dev),
                       mat + vec, be->err.msg);
    return qc_fail(err, be->err.kind, "%s: %s", name, be->err.msg);
}

/* ---------------------------------------------------------------------------------------- */
/* placing weights on the backend */

static int load_matrix(qc_model *m, const char *name, qc_weight *w, qc_error *err) {
    const gguf_tensor *t = gguf_find_tensor(m->file, name);
    memset(w, 0, sizeof *w);
    w->type = t->type;
    w->cols = t->ne[0];
    w->rows = t->ne[1];
    w->nbytes = (size_t)t->nbytes;
    w->host = t->data;
    if (m->be->ops->weight_load(m->be, w) < 0) {
        w->data = NULL;
        return place_failed(m, name, w->nbytes, err);
    }
    return 0;
}

/* A 1-D tensor of any readable type -> a float32 buffer on the backend. */
static int load_vector(qc_model *m, const char *name, float **out, qc_error *err) {
    const gguf_tensor *t = gguf_find_tensor(m->file, name);
    qc_backend *be = m->be;
    float *host = NULL;
    void *dev = NULL;
    size_t bytes = (size_t)t->ne[0] * sizeof(float);
    *out = NULL;
    host = malloc(bytes);
    if (host == NULL) {
        qc_fail(err, QC_ERR_NOMEM, "%s: out of memory", name);
        goto fail;
    }
    if (qc_dequantize(t->type, t->data, host, 1, t->ne[0], err) < 0) goto fail;
    if (be->ops->alloc(be, bytes, &dev) < 0 || be->ops->upload(be, dev, host, bytes) < 0) {
        place_failed(m, name, bytes, err);
        goto fail;
    }
    free(host);
    *out = dev;
    return 0;
fail:
    free(host);
    if (dev) be->ops->free(be, dev);
    return -1;
}

int qc_model_load(const char *path, const char *device, int threads, qc_model **out, qc_error *err) {
    qc_model *m = NULL;
    const qc_config *c = NULL;
    char nm[96];
    *out = NULL;
    m = calloc(1, sizeof *m);
    if (m == NULL) return qc_fail(err, QC_ERR_NOMEM, "out of memory");
    if (gguf_open(path, &m->file, err) < 0) goto fail;
    if (qc_config_from_gguf(m->file, &m->cfg, err) < 0) goto fail;
    if (check_tensors(m->file, &m->cfg, err) < 0) goto fail;
    if (qc_backend_create(device, threads, &m->be, err) < 0) goto fail;
    if (check_fits(m, path, err) < 0) goto fail;

    c = &m->cfg;
    m->layers = calloc((size_t)c->n_layer, sizeof *m->layers);
    if (m->layers == NULL) {
        qc_fail(err, QC_ERR_NOMEM, "out of memory");
        goto fail;
    }
    if (load_matrix(m, "token_embd.weight", &m->tok_embd, err) < 0 ||
        load_vector(m, "output_norm.weight", &m->output_norm, err) < 0)
        goto fail;
    /* output.weight wins whenever the file has it (it may differ from the embedding: the real
     * Q4_K_M file stores it as Q8_0 while token_embd is Q5_0). */
    if (c->tied) {
        m->output = m->tok_embd;
    } else if (load_matrix(m, "output.weight", &m->output, err) < 0) {
        goto fail;
    }
    for (int64_t l = 0; l < c->n_layer; l++) {
        char *L = (char *)&m->layers[l];
        for (size_t i = 0; i < qc_n_layer_tensors; i++) {
            const qc_layer_tensor *lt = &qc_layer_tensors[i];
            snprintf(nm, sizeof nm, "blk.%lld.%s", (long long)l, lt->suffix);
            if (lt->kind == QC_LT_MATRIX ? load_matrix(m, nm, (qc_weight *)(L + lt->offset), err) < 0
                                         : load_vector(m, nm, (float **)(L + lt->offset), err) < 0)
                goto fail;
        }
    }
    *out = m;
    return 0;
fail:
    qc_model_free(m);
    return -1;
}

static void weight_free(qc_backend *be, qc_weight *w) {
    if (w->data) be->ops->weight_free(be, w);
    memset(w, 0, sizeof *w);
}

static void vector_free(qc_backend *be, float **p) {
    if (*p) be->ops->free(be, *p);
    *p = NULL;
}

void qc_model_free(qc_model *m) {
    if (m == NULL) return;
    qc_backend *be = m->be;
    if (be) {
        if (m->layers) {
            for (int64_t l = 0; l < m->cfg.n_layer; l++) {
                char *L = (char *)&m->layers[l];
                for (size_t i = qc_n_layer_tensors; i-- > 0;) {   /* reverse of load order */
                    const qc_layer_tensor *lt = &qc_layer_tensors[i];
                    if (lt->kind == QC_LT_MATRIX) weight_free(be, (qc_weight *)(L + lt->offset));
                    else vector_free(be, (float **)(L + lt->offset));
                }
            }
        }
        /* A tied lm_head shares the embedding's memory: free that memory once. */
        if (m->cfg.tied) memset(&m->output, 0, sizeof m->output);
        else weight_free(be, &m->output);
        vector_free(be, &m->output_norm);
        weight_free(be, &m->tok_embd);
        qc_backend_destroy(be);
    }
    free(m->layers);
    gguf_close(m->file);
    free(m);
}
