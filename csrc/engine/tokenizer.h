/* tokenizer.h: Qwen2's tokenizer: byte-level BPE (GPT-2 byte mapping) behind the Qwen2
 * pre-tokenizer regex, with control and user-defined tokens matched as whole tokens.
 *
 * A qc_tokenizer is built from plain arrays (qc_tokenizer_build) or from a GGUF file's
 * tokenizer.ggml.* keys (qc_tokenizer_load). It copies what it needs: the arrays or the file may
 * go away afterwards. Once built it is read-only, so any number of threads may encode and decode
 * with one tokenizer at once. Text is UTF-8 with explicit lengths (NUL is an ordinary character);
 * no normalisation happens here (HF's NFC is the Python layer's job).
 */
#ifndef QC_TOKENIZER_H
#define QC_TOKENIZER_H

#include <stddef.h>
#include <stdint.h>
#include "common.h"
#include "gguf.h"

#ifdef __cplusplus
extern "C" {
#endif

/* tokenizer.ggml.token_type values (llama.cpp's). The file format: never renumber. */
enum {
    QC_TOKEN_UNDEFINED = 0,
    QC_TOKEN_NORMAL = 1,
    QC_TOKEN_UNKNOWN = 2,
    QC_TOKEN_CONTROL = 3,       /* <|im_start|>, <|endoftext|>: matched only when asked */
    QC_TOKEN_USER_DEFINED = 4,  /* <tool_call>: always matched, like HF and llama.cpp */
    QC_TOKEN_UNUSED = 5,
    QC_TOKEN_BYTE = 6,
};

/* Which whole-token texts encode recognises in the input. */
typedef enum {
    QC_SPECIAL_NONE = 0,   /* none: everything is plain text                          */
    QC_SPECIAL_USER = 1,   /* user-defined tokens only (HF/llama.cpp without specials) */
    QC_SPECIAL_ALL = 2,    /* control and user-defined tokens                         */
} qc_special_mode;

typedef struct qc_tokenizer qc_tokenizer;

/* The inputs of qc_tokenizer_build; strings are not NUL-terminated. */
typedef struct {
    const gguf_str *tokens;    /* (n_tokens) byte-level strings; control/user-defined: raw text */
    int64_t n_tokens;
    const int32_t *types;      /* (n_tokens) QC_TOKEN_*, or NULL: all normal */
    const gguf_str *merges;    /* (n_merges) "left right"; rank = index */
    int64_t n_merges;
    int32_t bos_id, eos_id, pad_id;   /* -1 when absent */
} qc_tokenizer_vocab;

int qc_tokenizer_build(const qc_tokenizer_vocab *v, qc_tokenizer **out, qc_error *err);
/* From tokenizer.ggml.{model,pre,tokens,token_type,merges,bos/eos/padding_token_id}. Needs
 * model "gpt2" and pre-tokenizer "qwen2" (or none) or fails with QC_ERR_MODEL. */
int qc_tokenizer_load(const gguf_file *f, qc_tokenizer **out, qc_error *err);
void qc_tokenizer_free(qc_tokenizer *t);   /* NULL is fine */

int64_t qc_tokenizer_n_vocab(const qc_tokenizer *t);
int64_t qc_tokenizer_n_merges(const qc_tokenizer *t);   /* merges in use (after skipping bad ones) */
int32_t qc_tokenizer_bos(const qc_tokenizer *t);        /* -1 when absent */
int32_t qc_tokenizer_eos(const qc_tokenizer *t);
int32_t qc_tokenizer_pad(const qc_tokenizer *t);
/* For 0 <= id < n_vocab: its type, its vocabulary string, the bytes it decodes to. */
int32_t qc_tokenizer_type(const qc_tokenizer *t, int32_t id);
gguf_str qc_tokenizer_text(const qc_tokenizer *t, int32_t id);
gguf_str qc_tokenizer_bytes(const qc_tokenizer *t, int32_t id);
/* The control and user-defined tokens, in id order. */
int64_t qc_tokenizer_n_special(const qc_tokenizer *t);
int32_t qc_tokenizer_special(const qc_tokenizer *t, int64_t i);

/* A growable id array; encode appends to it. free(ids) when done. */
typedef struct {
    int32_t *ids;
    size_t n, cap;
} qc_ids;

/* Encode UTF-8 text; QC_ERR_VALUE naming the byte offset if it is not valid UTF-8. */
int qc_tokenizer_encode(const qc_tokenizer *t, const char *text, size_t len, qc_special_mode mode,
                        qc_ids *out, qc_error *err);
/* The bytes of ids, concatenated into a malloc'd buffer (*out, *out_len; *out may be NULL when
 * empty). QC_ERR_RANGE naming an id outside [0, n_vocab). */
int qc_tokenizer_decode(const qc_tokenizer *t, const int32_t *ids, size_t n, char **out,
                        size_t *out_len, qc_error *err);

/* The pieces between whole-token matches: [start, end) byte ranges, id >= 0 for a matched token,
 * -1 for plain text. A malloc'd array in *out (NULL when text is empty). */
typedef struct {
    size_t start, end;
    int32_t id;
} qc_segment;
int qc_tokenizer_split_special(const qc_tokenizer *t, const char *text, size_t len,
                               qc_special_mode mode, qc_segment **out, size_t *n_out,
                               qc_error *err);

/* The Qwen2 pre-tokenizer alone: the end offsets of the pieces of valid UTF-8 text, in order
 * (malloc'd, NULL when text is empty). For tests against the regex. */
int qc_pretokenize(const char *text, size_t len, size_t **ends, size_t *n_out, qc_error *err);

/* Offset of the first byte that makes text invalid (strict UTF-8: no overlongs, surrogates or
 * code points above U+10FFFF), or len if it is all valid. */
size_t qc_utf8_check(const char *text, size_t len);

#ifdef __cplusplus
}
#endif
#endif /* QC_TOKENIZER_H */
