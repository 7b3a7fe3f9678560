/* common.c: error formatting and float -> half conversion. */
#include "common.h"

#include <math.h>
#include <stdarg.h>
#include <stdio.h>
#include <string.h>

int qc_fail(qc_error *err, qc_errkind kind, const char *fmt, ...) {
    if (err) {
        va_list ap;
        va_start(ap, fmt);
        vsnprintf(err->msg, sizeof err->msg, fmt, ap);
        va_end(ap);
        err->kind = kind;
    }
    return -1;
}

uint16_t qc_fp32_to_fp16(float f) {
    /* Round to nearest even, like numpy's float16 cast. */
    union { float f; uint32_t u; } v;
    v.f = f;
    uint32_t x = v.u;
    uint32_t sign = (x >> 16) & 0x8000;
    uint32_t absx = x & 0x7fffffff;
    if (absx >= 0x7f800000) {                              /* inf or nan */
        return (uint16_t)(sign | 0x7c00 | (absx > 0x7f800000 ? 0x200 : 0));
    }
    if (absx >= 0x477ff000) return (uint16_t)(sign | 0x7c00);     /* overflows to inf */
    if (absx < 0x38800000) {                               /* subnormal half or zero */
        if (absx < 0x33000000) return (uint16_t)sign;
        uint32_t e = absx >> 23;
        uint32_t m = (absx & 0x7fffff) | 0x800000;
        /* value = m * 2^(e-150); the half subnormal unit is 2^-24, so q = m * 2^(e-126) */
        uint32_t s = 126 - e;                              /* right shift, 14..24 */
        uint32_t q = m >> s;
        uint32_t rem = m & ((1u << s) - 1);
        uint32_t halfway = 1u << (s - 1);
        if (rem > halfway || (rem == halfway && (q & 1))) q++;
        return (uint16_t)(sign | q);
    }
    uint32_t e = ((absx >> 23) - 127 + 15);
    uint32_t m = absx & 0x7fffff;
    uint32_t h = (e << 10) | (m >> 13);
    uint32_t rem = m & 0x1fff;
    if (rem > 0x1000 || (rem == 0x1000 && (h & 1))) h++;   /* carry may bump exponent: fine */
    return (uint16_t)(sign | h);
}
