/* py_tokenizer.c: qwencuda._core._Tokenizer over tokenizer.c (qwencuda/tokenizer.py wraps it
 * into the public Tokenizer: normalisation, stream decoding), and _core._pretokenize.
 *
 *   _Tokenizer(path)                                   a GGUF file's tokenizer
 *   _Tokenizer.from_vocab(tokens, types, merges, bos_id, eos_id, pad_id, chat_template)
 *   t.encode(text, special) -> list[int]               special: 0 none, 1 user-defined, 2 all
 *   t.split_special(text, special) -> list[str | int]  plain text pieces and matched token ids
 *   t.decode_bytes(ids) -> bytes, t.token(id) -> str, t.token_type(id) -> int
 *   t.n_vocab, t.n_merges, t.bos_id, t.eos_id, t.pad_id (None when absent), t.special_ids,
 *   t.chat_template (str or None)
 * Encoding and loading run without the GIL.
 */
#include "py_common.h"

#include <string.h>

#include "gguf.h"
#include "tokenizer.h"
#include "unicode_data.h"

typedef struct {
    PyObject_HEAD
    qc_tokenizer *tok;
    PyObject *chat_template;   /* str or None */
} TokObject;

/* The UTF-8 bytes of text: a str (its cached UTF-8, owned by the str) or an immutable bytes
 * object. Other buffers (bytearray, memoryview) are copied first, so that nobody can change
 * them while encoding runs without the GIL. *owner receives the object that keeps the bytes
 * alive (a new reference). */
static int text_bytes(PyObject *text, const char **s, Py_ssize_t *len, PyObject **owner) {
    *owner = NULL;
    if (PyUnicode_Check(text)) {
        *s = PyUnicode_AsUTF8AndSize(text, len);   /* fails on lone surrogates */
        if (*s == NULL) return -1;
        Py_INCREF(text);
        *owner = text;
        return 0;
    }
    PyObject *b = PyBytes_Check(text) ? (Py_INCREF(text), text) : PyBytes_FromObject(text);
    if (b == NULL) {
        PyErr_Format(PyExc_TypeError, "text must be str or UTF-8 bytes, not %s",
                     Py_TYPE(text)->tp_name);
        return -1;
    }
    *s = PyBytes_AS_STRING(b);
    *len = PyBytes_GET_SIZE(b);
    *owner = b;
    return 0;
}

/* Bytes that are not UTF-8: UnicodeDecodeError (a ValueError) at the offending offset. */
static int check_utf8(const char *s, Py_ssize_t len) {
    size_t bad = qc_utf8_check(s, (size_t)len);
    if (bad == (size_t)len) return 0;
    PyObject *exc = PyUnicodeDecodeError_Create("utf-8", s, len, (Py_ssize_t)bad,
                                                (Py_ssize_t)bad + 1, "invalid UTF-8 in the text");
    if (exc != NULL) {
        PyErr_SetObject(PyExc_UnicodeDecodeError, exc);
        Py_DECREF(exc);
    }
    return -1;
}

static int parse_mode(int special, qc_special_mode *mode) {
    if (special < QC_SPECIAL_NONE || special > QC_SPECIAL_ALL) {
        PyErr_Format(PyExc_ValueError, "special must be 0, 1 or 2, not %d", special);
        return -1;
    }
    *mode = (qc_special_mode)special;
    return 0;
}

static PyObject *ids_to_list(const int32_t *ids, size_t n) {
    PyObject *list = PyList_New((Py_ssize_t)n);
    if (list == NULL) return NULL;
    for (size_t i = 0; i < n; i++) {
        PyObject *v = PyLong_FromLong(ids[i]);
        if (v == NULL) {
            Py_DECREF(list);
            return NULL;
        }
        PyList_SET_ITEM(list, (Py_ssize_t)i, v);
    }
    return list;
}

/* A token id argument: an integer in [0, n_vocab), else ValueError naming it. */
static int token_id(TokObject *self, PyObject *obj, int32_t *out) {
    long long v = PyLong_AsLongLong(obj);
    if (v == -1 && PyErr_Occurred()) {
        if (PyErr_ExceptionMatches(PyExc_OverflowError)) {
            PyErr_Clear();
            PyErr_Format(PyExc_ValueError, "token id %R is outside the vocabulary [0, %lld)", obj,
                         (long long)qc_tokenizer_n_vocab(self->tok));
        }
        return -1;
    }
    if (v < 0 || v >= qc_tokenizer_n_vocab(self->tok)) {
        PyErr_Format(PyExc_ValueError, "token id %lld is outside the vocabulary [0, %lld)", v,
                     (long long)qc_tokenizer_n_vocab(self->tok));
        return -1;
    }
    *out = (int32_t)v;
    return 0;
}

/* ---------------------------------------------------------------------------------------- */
/* Construction                                                                               */

static TokObject *tok_alloc(PyTypeObject *type, qc_tokenizer *tok, PyObject *chat_template) {
    TokObject *self = (TokObject *)type->tp_alloc(type, 0);
    if (self == NULL) {
        qc_tokenizer_free(tok);
        return NULL;
    }
    self->tok = tok;
    self->chat_template = chat_template ? chat_template : Py_None;
    Py_INCREF(self->chat_template);
    return self;
}

static PyObject *Tok_new(PyTypeObject *type, PyObject *args, PyObject *kwargs) {
    static char *kwlist[] = {"path", NULL};
    PyObject *path_bytes = NULL, *template = NULL, *result = NULL;
    gguf_file *f = NULL;
    qc_tokenizer *tok = NULL;
    qc_error err = {0};
    int rc;
    if (!PyArg_ParseTupleAndKeywords(args, kwargs, "O&:_Tokenizer", kwlist, PyUnicode_FSConverter,
                                     &path_bytes))
        return NULL;
    const char *path = PyBytes_AS_STRING(path_bytes);
    if ((size_t)PyBytes_GET_SIZE(path_bytes) != strlen(path)) {
        PyErr_SetString(PyExc_ValueError, "GGUF path contains a NUL character");
        goto fail;
    }
    Py_BEGIN_ALLOW_THREADS
    rc = gguf_open(path, &f, &err);
    if (rc == 0) rc = qc_tokenizer_load(f, &tok, &err);
    Py_END_ALLOW_THREADS
    if (rc < 0) {
        qc_py_raise(&err);
        goto fail;
    }
    const gguf_kv *kv = gguf_find_kv(f, "tokenizer.chat_template");
    if (kv != NULL && kv->type == GGUF_TYPE_STRING) {
        template = PyUnicode_DecodeUTF8(kv->str.ptr, (Py_ssize_t)kv->str.len, "replace");
        if (template == NULL) goto fail;
    }
    result = (PyObject *)tok_alloc(type, tok, template);
    tok = NULL;   /* owned by the object now, or freed by tok_alloc */
fail:
    qc_tokenizer_free(tok);
    gguf_close(f);
    Py_XDECREF(template);
    Py_XDECREF(path_bytes);
    return result;
}

/* A sequence of str (or bytes) -> gguf_str views into the objects (kept alive by `seq`). */
static gguf_str *string_views(PyObject *seq, const char *what, Py_ssize_t *n_out) {
    Py_ssize_t n = PySequence_Fast_GET_SIZE(seq);
    gguf_str *v = PyMem_Malloc((size_t)(n ? n : 1) * sizeof *v);
    if (v == NULL) {
        PyErr_NoMemory();
        return NULL;
    }
    for (Py_ssize_t i = 0; i < n; i++) {
        PyObject *o = PySequence_Fast_GET_ITEM(seq, i);
        Py_ssize_t len;
        const char *p;
        if (PyUnicode_Check(o)) {
            p = PyUnicode_AsUTF8AndSize(o, &len);
            if (p == NULL) goto fail;
        } else if (PyBytes_Check(o)) {
            p = PyBytes_AS_STRING(o);
            len = PyBytes_GET_SIZE(o);
        } else {
            PyErr_Format(PyExc_TypeError, "%s[%zd] must be str or bytes, not %s", what, i,
                         Py_TYPE(o)->tp_name);
            goto fail;
        }
        v[i].ptr = p;
        v[i].len = (uint64_t)len;
    }
    *n_out = n;
    return v;
fail:
    PyMem_Free(v);
    return NULL;
}

static int optional_int(PyObject *o, const char *what, int32_t *out) {
    *out = -1;
    if (o == NULL || o == Py_None) return 0;
    long v = PyLong_AsLong(o);
    if (v == -1 && PyErr_Occurred()) return -1;
    if (v < 0 || v > INT32_MAX) {
        PyErr_Format(PyExc_ValueError, "%s %ld is not a token id", what, v);
        return -1;
    }
    *out = (int32_t)v;
    return 0;
}

static PyObject *Tok_from_vocab(PyObject *cls, PyObject *args, PyObject *kwargs) {
    static char *kwlist[] = {"tokens", "types", "merges", "bos_id", "eos_id", "pad_id",
                             "chat_template", NULL};
    PyObject *tokens_obj, *types_obj = Py_None, *merges_obj = NULL, *bos = NULL, *eos = NULL,
             *pad = NULL, *template = Py_None, *result = NULL;
    PyObject *tokens = NULL, *types = NULL, *merges = NULL, *empty = NULL;
    gguf_str *tv = NULL, *mv = NULL;
    int32_t *ty = NULL;
    qc_tokenizer *tok = NULL;
    qc_error err = {0};
    if (!PyArg_ParseTupleAndKeywords(args, kwargs, "O|OOOOOO:from_vocab", kwlist, &tokens_obj,
                                     &types_obj, &merges_obj, &bos, &eos, &pad, &template))
        return NULL;
    if (template != Py_None && !PyUnicode_Check(template)) {
        PyErr_SetString(PyExc_TypeError, "chat_template must be str or None");
        return NULL;
    }
    qc_tokenizer_vocab v = {0};
    Py_ssize_t n_tokens = 0, n_merges = 0;
    if (merges_obj == NULL || merges_obj == Py_None) {
        if ((empty = PyTuple_New(0)) == NULL) return NULL;
        merges_obj = empty;
    }
    if ((tokens = PySequence_Fast(tokens_obj, "tokens must be a sequence of str")) == NULL ||
        (merges = PySequence_Fast(merges_obj, "merges must be a sequence of str")) == NULL)
        goto fail;
    if ((tv = string_views(tokens, "tokens", &n_tokens)) == NULL ||
        (mv = string_views(merges, "merges", &n_merges)) == NULL)
        goto fail;
    if (types_obj != Py_None) {
        types = PySequence_Fast(types_obj, "types must be a sequence of int");
        if (types == NULL) goto fail;
        if (PySequence_Fast_GET_SIZE(types) != n_tokens) {
            PyErr_Format(PyExc_ValueError, "%zd token types for %zd tokens",
                         PySequence_Fast_GET_SIZE(types), n_tokens);
            goto fail;
        }
        ty = PyMem_Malloc((size_t)(n_tokens ? n_tokens : 1) * sizeof *ty);
        if (ty == NULL) {
            PyErr_NoMemory();
            goto fail;
        }
        for (Py_ssize_t i = 0; i < n_tokens; i++) {
            long t = PyLong_AsLong(PySequence_Fast_GET_ITEM(types, i));
            if (t == -1 && PyErr_Occurred()) goto fail;
            ty[i] = t >= 0 && t <= QC_TOKEN_BYTE ? (int32_t)t : QC_TOKEN_NORMAL;
        }
    }
    v.tokens = tv;
    v.n_tokens = n_tokens;
    v.types = ty;
    v.merges = mv;
    v.n_merges = n_merges;
    if (optional_int(bos, "bos_id", &v.bos_id) < 0 || optional_int(eos, "eos_id", &v.eos_id) < 0 ||
        optional_int(pad, "pad_id", &v.pad_id) < 0)
        goto fail;
    if (qc_tokenizer_build(&v, &tok, &err) < 0) {
        qc_py_raise(&err);
        goto fail;
    }
    result = (PyObject *)tok_alloc((PyTypeObject *)cls, tok, template);
    tok = NULL;
fail:
    qc_tokenizer_free(tok);
    PyMem_Free(ty);
    PyMem_Free(mv);
    PyMem_Free(tv);
    Py_XDECREF(types);
    Py_XDECREF(merges);
    Py_XDECREF(tokens);
    Py_XDECREF(empty);
    return result;
}

static void Tok_dealloc(TokObject *self) {
    PyTypeObject *tp = Py_TYPE(self);
    qc_tokenizer_free(self->tok);
    Py_XDECREF(self->chat_template);
    tp->tp_free((PyObject *)self);
    Py_DECREF(tp);
}

/* ---------------------------------------------------------------------------------------- */
/* Methods                                                                                    */

static PyObject *Tok_encode(TokObject *self, PyObject *args, PyObject *kwargs) {
    static char *kwlist[] = {"text", "special", NULL};
    PyObject *text, *owner = NULL, *result = NULL;
    int special = QC_SPECIAL_USER;
    qc_special_mode mode;
    const char *s;
    Py_ssize_t len;
    qc_ids ids = {0};
    qc_error err = {0};
    int rc;
    if (!PyArg_ParseTupleAndKeywords(args, kwargs, "O|i:encode", kwlist, &text, &special) ||
        parse_mode(special, &mode) < 0 || text_bytes(text, &s, &len, &owner) < 0)
        return NULL;
    if (check_utf8(s, len) < 0) goto fail;
    Py_BEGIN_ALLOW_THREADS
    rc = qc_tokenizer_encode(self->tok, s, (size_t)len, mode, &ids, &err);
    Py_END_ALLOW_THREADS
    if (rc < 0) {
        qc_py_raise(&err);
        goto fail;
    }
    result = ids_to_list(ids.ids, ids.n);
fail:
    free(ids.ids);
    Py_XDECREF(owner);
    return result;
}

static PyObject *Tok_split_special(TokObject *self, PyObject *args, PyObject *kwargs) {
    static char *kwlist[] = {"text", "special", NULL};
    PyObject *text, *owner = NULL, *list = NULL, *result = NULL;
    int special = QC_SPECIAL_ALL;
    qc_special_mode mode;
    const char *s;
    Py_ssize_t len;
    qc_segment *seg = NULL;
    size_t n = 0;
    qc_error err = {0};
    if (!PyArg_ParseTupleAndKeywords(args, kwargs, "O|i:split_special", kwlist, &text, &special) ||
        parse_mode(special, &mode) < 0 || text_bytes(text, &s, &len, &owner) < 0)
        return NULL;
    if (check_utf8(s, len) < 0) goto fail;
    if (qc_tokenizer_split_special(self->tok, s, (size_t)len, mode, &seg, &n, &err) < 0) {
        qc_py_raise(&err);
        goto fail;
    }
    if ((list = PyList_New((Py_ssize_t)n)) == NULL) goto fail;
    for (size_t i = 0; i < n; i++) {
        PyObject *item = seg[i].id >= 0
            ? PyLong_FromLong(seg[i].id)
            : PyUnicode_DecodeUTF8(s + seg[i].start, (Py_ssize_t)(seg[i].end - seg[i].start),
                                   "strict");
        if (item == NULL) goto fail;
        PyList_SET_ITEM(list, (Py_ssize_t)i, item);
    }
    result = list;
    list = NULL;
fail:
    Py_XDECREF(list);
    free(seg);
    Py_XDECREF(owner);
    return result;
}

/* ids (a sequence of ints or an integer NumPy array) -> a malloc'd int32 array. */
static int32_t *ids_from(TokObject *self, PyObject *obj, size_t *n_out) {
    PyObject *seq = NULL;
    int32_t *ids = NULL;
    if (PyArray_Check(obj)) {
        PyArrayObject *a = (PyArrayObject *)obj;
        if (!PyArray_ISINTEGER(a) || PyArray_NDIM(a) > 1) {
            PyErr_SetString(PyExc_TypeError, "ids must be a 1-D array of integers");
            return NULL;
        }
        seq = PyArray_FROMANY(obj, NPY_INT64, 0, 1, NPY_ARRAY_IN_ARRAY | NPY_ARRAY_FORCECAST);
        if (seq == NULL) return NULL;
        npy_intp n = PyArray_SIZE((PyArrayObject *)seq);
        const int64_t *v = (const int64_t *)PyArray_DATA((PyArrayObject *)seq);
        ids = malloc((size_t)(n ? n : 1) * sizeof *ids);
        if (ids == NULL) {
            PyErr_NoMemory();
            goto fail;
        }
        for (npy_intp i = 0; i < n; i++) {
            if (v[i] < 0 || v[i] >= qc_tokenizer_n_vocab(self->tok)) {
                PyErr_Format(PyExc_ValueError, "token id %lld (at index %zd) is outside the "
                             "vocabulary [0, %lld)", (long long)v[i], (Py_ssize_t)i,
                             (long long)qc_tokenizer_n_vocab(self->tok));
                goto fail;
            }
            ids[i] = (int32_t)v[i];
        }
        *n_out = (size_t)n;
        Py_DECREF(seq);
        return ids;
    }
    seq = PySequence_Fast(obj, "ids must be a sequence of ints");
    if (seq == NULL) return NULL;
    Py_ssize_t n = PySequence_Fast_GET_SIZE(seq);
    ids = malloc((size_t)(n ? n : 1) * sizeof *ids);
    if (ids == NULL) {
        PyErr_NoMemory();
        goto fail;
    }
    for (Py_ssize_t i = 0; i < n; i++)
        if (token_id(self, PySequence_Fast_GET_ITEM(seq, i), &ids[i]) < 0) goto fail;
    *n_out = (size_t)n;
    Py_DECREF(seq);
    return ids;
fail:
    free(ids);
    Py_XDECREF(seq);
    return NULL;
}

static PyObject *Tok_decode_bytes(TokObject *self, PyObject *ids_obj) {
    size_t n = 0, len = 0;
    char *buf = NULL;
    qc_error err = {0};
    PyObject *result = NULL;
    int32_t *ids = ids_from(self, ids_obj, &n);
    if (ids == NULL) return NULL;
    if (qc_tokenizer_decode(self->tok, ids, n, &buf, &len, &err) < 0) qc_py_raise(&err);
    else result = PyBytes_FromStringAndSize(buf ? buf : "", (Py_ssize_t)len);
    free(buf);
    free(ids);
    return result;
}

static PyObject *Tok_token(TokObject *self, PyObject *arg) {
    int32_t id;
    if (token_id(self, arg, &id) < 0) return NULL;
    gguf_str s = qc_tokenizer_text(self->tok, id);
    return PyUnicode_DecodeUTF8(s.ptr, (Py_ssize_t)s.len, "replace");
}

static PyObject *Tok_token_type(TokObject *self, PyObject *arg) {
    int32_t id;
    if (token_id(self, arg, &id) < 0) return NULL;
    return PyLong_FromLong(qc_tokenizer_type(self->tok, id));
}

static PyObject *optional_id(int32_t id) {
    if (id < 0) Py_RETURN_NONE;
    return PyLong_FromLong(id);
}

static PyObject *Tok_get_n_vocab(TokObject *self, void *c) {
    (void)c;
    return PyLong_FromLongLong(qc_tokenizer_n_vocab(self->tok));
}
static PyObject *Tok_get_n_merges(TokObject *self, void *c) {
    (void)c;
    return PyLong_FromLongLong(qc_tokenizer_n_merges(self->tok));
}
static PyObject *Tok_get_bos(TokObject *self, void *c) { (void)c; return optional_id(qc_tokenizer_bos(self->tok)); }
static PyObject *Tok_get_eos(TokObject *self, void *c) { (void)c; return optional_id(qc_tokenizer_eos(self->tok)); }
static PyObject *Tok_get_pad(TokObject *self, void *c) { (void)c; return optional_id(qc_tokenizer_pad(self->tok)); }
static PyObject *Tok_get_template(TokObject *self, void *c) {
    (void)c;
    Py_INCREF(self->chat_template);
    return self->chat_template;
}

static PyObject *Tok_get_special_ids(TokObject *self, void *c) {
    (void)c;
    PyObject *d = PyDict_New();
    if (d == NULL) return NULL;
    for (int64_t i = 0; i < qc_tokenizer_n_special(self->tok); i++) {
        int32_t id = qc_tokenizer_special(self->tok, i);
        gguf_str s = qc_tokenizer_text(self->tok, id);
        PyObject *k = PyUnicode_DecodeUTF8(s.ptr, (Py_ssize_t)s.len, "replace");
        PyObject *v = PyLong_FromLong(id);
        int rc = (k && v) ? PyDict_SetItem(d, k, v) : -1;
        Py_XDECREF(k);
        Py_XDECREF(v);
        if (rc < 0) {
            Py_DECREF(d);
            return NULL;
        }
    }
    return d;
}

static PyMethodDef Tok_methods[] = {
    {"from_vocab", (PyCFunction)(void (*)(void))Tok_from_vocab, METH_VARARGS | METH_KEYWORDS | METH_CLASS,
     "from_vocab(tokens, types=None, merges=(), bos_id=None, eos_id=None, pad_id=None, "
     "chat_template=None): a tokenizer from the arrays of a GGUF file's tokenizer.ggml.* keys."},
    {"encode", (PyCFunction)(void (*)(void))Tok_encode, METH_VARARGS | METH_KEYWORDS,
     "encode(text, special=1) -> list[int]: text str or UTF-8 bytes; special 0: no whole-token "
     "matching, 1: user-defined tokens, 2: control and user-defined tokens. No normalisation."},
    {"split_special", (PyCFunction)(void (*)(void))Tok_split_special, METH_VARARGS | METH_KEYWORDS,
     "split_special(text, special=2) -> list: plain text pieces (str) and matched token ids (int)."},
    {"decode_bytes", (PyCFunction)Tok_decode_bytes, METH_O,
     "decode_bytes(ids) -> bytes: the concatenated bytes of the tokens."},
    {"token", (PyCFunction)Tok_token, METH_O, "token(id) -> str: the vocabulary string of a token."},
    {"token_type", (PyCFunction)Tok_token_type, METH_O,
     "token_type(id) -> int: tokenizer.ggml.token_type of a token (1 normal, 3 control, 4 user-defined, ...)."},
    {NULL, NULL, 0, NULL},
};

static PyGetSetDef Tok_getset[] = {
    {"n_vocab", (getter)Tok_get_n_vocab, NULL, "number of tokens in the vocabulary", NULL},
    {"n_merges", (getter)Tok_get_n_merges, NULL, "number of merges in use", NULL},
    {"bos_id", (getter)Tok_get_bos, NULL, "tokenizer.ggml.bos_token_id or None", NULL},
    {"eos_id", (getter)Tok_get_eos, NULL, "tokenizer.ggml.eos_token_id or None", NULL},
    {"pad_id", (getter)Tok_get_pad, NULL, "tokenizer.ggml.padding_token_id or None", NULL},
    {"special_ids", (getter)Tok_get_special_ids, NULL,
     "dict text -> id of the control and user-defined tokens", NULL},
    {"chat_template", (getter)Tok_get_template, NULL, "tokenizer.chat_template or None", NULL},
    {NULL, NULL, NULL, NULL, NULL},
};

static PyType_Slot Tok_slots[] = {
    {Py_tp_new, Tok_new},
    {Py_tp_dealloc, Tok_dealloc},
    {Py_tp_methods, Tok_methods},
    {Py_tp_getset, Tok_getset},
    {Py_tp_doc, "_Tokenizer(path): the byte-level BPE tokenizer of a GGUF file (see qwencuda.Tokenizer)."},
    {0, NULL},
};

static PyType_Spec Tok_spec = {
    "qwencuda._core._Tokenizer", sizeof(TokObject), 0, Py_TPFLAGS_DEFAULT, Tok_slots,
};

/* ---------------------------------------------------------------------------------------- */

static PyObject *py_pretokenize(PyObject *mod, PyObject *text) {
    (void)mod;
    PyObject *owner = NULL, *list = NULL, *result = NULL;
    const char *s;
    Py_ssize_t len;
    size_t *ends = NULL, n = 0;
    qc_error err = {0};
    int want_str = PyUnicode_Check(text);
    if (text_bytes(text, &s, &len, &owner) < 0) return NULL;
    if (check_utf8(s, len) < 0) goto fail;
    if (qc_pretokenize(s, (size_t)len, &ends, &n, &err) < 0) {
        qc_py_raise(&err);
        goto fail;
    }
    if ((list = PyList_New((Py_ssize_t)n)) == NULL) goto fail;
    for (size_t i = 0, start = 0; i < n; start = ends[i], i++) {
        Py_ssize_t l = (Py_ssize_t)(ends[i] - start);
        PyObject *item = want_str ? PyUnicode_DecodeUTF8(s + start, l, "strict")
                                  : PyBytes_FromStringAndSize(s + start, l);
        if (item == NULL) goto fail;
        PyList_SET_ITEM(list, (Py_ssize_t)i, item);
    }
    result = list;
    list = NULL;
fail:
    Py_XDECREF(list);
    free(ends);
    Py_XDECREF(owner);
    return result;
}

static PyMethodDef tokenizer_functions[] = {
    {"_pretokenize", py_pretokenize, METH_O,
     "_pretokenize(text) -> list: the Qwen2 pre-tokenizer's pieces (str for str, bytes for bytes)."},
    {NULL, NULL, 0, NULL},
};

int qc_py_add_tokenizer(PyObject *m) {
    PyObject *type = PyType_FromSpec(&Tok_spec);
    if (type == NULL) return -1;
    int rc = PyModule_AddObjectRef(m, "_Tokenizer", type);
    Py_DECREF(type);
    if (rc < 0) return -1;
    if (PyModule_AddStringConstant(m, "tokenizer_unicode_version", qc_unicode_version) < 0) return -1;
    return PyModule_AddFunctions(m, tokenizer_functions);
}
