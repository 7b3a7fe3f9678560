/* unicode_data.h: the character classes of the Qwen2 pre-tokenizer (letter \p{L}, number \p{N},
 * white space \s = Unicode White_Space), generated into unicode_data.c by
 * scripts/gen_unicode_tables.py from a Unicode database whose version qc_unicode_version names. */
#ifndef QC_UNICODE_DATA_H
#define QC_UNICODE_DATA_H

#include <stddef.h>
#include <stdint.h>

#ifdef __cplusplus
extern "C" {
#endif

enum { QC_UC_LETTER = 1, QC_UC_NUMBER = 2, QC_UC_SPACE = 4 };

extern const char qc_unicode_version[];
/* Runs covering U+0000..U+10FFFF in order: (first code point << 8) | class. */
extern const uint32_t qc_unicode_runs[];
extern const size_t qc_unicode_n_runs;
/* The class of U+0000..U+00FF, the common case, without a search. */
extern const uint8_t qc_unicode_latin1[256];

/* Class of a code point (0: none of the three). */
static inline unsigned qc_unicode_class(uint32_t cp) {
    if (cp < 256) return qc_unicode_latin1[cp];
    /* last run whose start is <= cp; run 0 starts at U+0000, so one always exists */
    size_t lo = 0, hi = qc_unicode_n_runs;
    uint32_t key = (cp << 8) | 0xFFu;
    while (hi - lo > 1) {
        size_t mid = lo + (hi - lo) / 2;
        if (qc_unicode_runs[mid] <= key) lo = mid; else hi = mid;
    }
    return qc_unicode_runs[lo] & 0xFFu;
}

#ifdef __cplusplus
}
#endif
#endif /* QC_UNICODE_DATA_H */
