/* The MXFP8 quantizer's inner loop in C: an optional accelerator for quantize.py.
 *
 * One pass over a row chunk of bf16, fp16 or fp32 values does what quantize.py's torch path
 * does in separate passes: widen to float32, each 1x32 block's amax, its UE8M0 code
 * (`_ue8m0_ceil_codes` of `amax * fl32(1/448)`), the e4m3 bytes (round to nearest even,
 * saturating, as torch's float32 -> float8_e4m3fn cast after the clamp to +-448) and, when the
 * error is measured, the two float64 vectors `_quantize_rows` feeds to torch.dot: the float32
 * residual `q * 2^(code-127) - x` widened, and the values themselves widened. The dot products
 * stay in torch (their summation order is MKL's), so the sums are the same to the last bit.
 *
 * Plain C99 on the buffer protocol (numpy views of the tensors), no torch headers; the GIL is
 * released for the loop, so two threads quantize side by side. Where gcc or clang can build
 * function clones (x86-64, glibc), the loop is compiled for AVX2 as well and picked at load
 * time. Every float operation is a single IEEE float32 operation in the default rounding mode
 * (setup.py compiles with -ffp-contract=off, so no multiply-add is fused).
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>

#include <stdint.h>
#include <string.h>

#define MX_BLOCK 32
#define E4M3_MAX 448.0f
#define E4M3_MAX_BITS 0x43e00000u /* 448.0f */
#define UE8M0_MAX_CODE 254u
#define F32_HALF_MANTISSA (1u << 22) /* mantissa of 2^-127, an fp32 subnormal */
#define NON_FINITE 0x7f800000u      /* |x| bits at or above: Inf or NaN */

/* The interface's version, checked by quantize.py: a stale build of older source is ignored. */
#define CQUANT_VERSION 2

enum { SRC_BF16 = 0, SRC_F16 = 1, SRC_F32 = 2, SRC_E4M3 = 3 };

#if defined(__x86_64__) && defined(__GLIBC__) && defined(__has_attribute)
#if __has_attribute(target_clones)
#define CLONES __attribute__((target_clones("avx2", "default")))
#endif
#endif
#ifndef CLONES
#define CLONES
#endif

static inline float f32(uint32_t b) {
    float f;
    memcpy(&f, &b, sizeof f);
    return f;
}

static inline uint32_t bits(float f) {
    uint32_t b;
    memcpy(&b, &f, sizeof b);
    return b;
}

/* Exact float32 bits of an IEEE binary16 value (subnormals, Inf and NaN included). */
static inline uint32_t f16_bits(uint16_t h) {
    uint32_t sign = (uint32_t)(h & 0x8000u) << 16;
    uint32_t e = (h >> 10) & 0x1fu, m = h & 0x3ffu;
    uint32_t tiny = bits((float)m * 0x1p-24f);         /* e == 0: m * 2^-24, exact */
    uint32_t special = NON_FINITE | (m << 13);         /* e == 31: Inf or NaN */
    uint32_t normal = ((e + 112u) << 23) | (m << 13);  /* rebias 15 -> 127 */
    uint32_t is_tiny = 0u - (uint32_t)(e == 0), is_special = 0u - (uint32_t)(e == 31);
    return sign | (tiny & is_tiny) | (special & is_special) | (normal & ~(is_tiny | is_special));
}

/* Exact float32 bits of a float8_e4m3fn byte other than its NaNs (0x7f, 0xff). */
static inline uint32_t e4m3_bits(uint8_t b) {
    uint32_t sign = (uint32_t)(b & 0x80u) << 24;
    uint32_t e = (b >> 3) & 0xfu, m = b & 7u;
    uint32_t tiny = bits((float)m * 0x1p-9f);        /* e == 0: m * 2^-9, exact */
    uint32_t normal = ((e + 120u) << 23) | (m << 20); /* rebias 7 -> 127 */
    uint32_t is_tiny = 0u - (uint32_t)(e == 0);
    return sign | (tiny & is_tiny) | (normal & ~is_tiny);
}

/* `_ue8m0_ceil_codes` for one non-negative finite float32. */
static inline uint32_t ue8m0_ceil(float scaled) {
    uint32_t b = bits(scaled);
    uint32_t exponent = (b >> 23) & 0xffu, mantissa = b & 0x7fffffu;
    int up = mantissa > 0 && exponent != UE8M0_MAX_CODE;
    if (exponent == 0 && mantissa <= F32_HALF_MANTISSA)
        up = 0;
    return exponent + (uint32_t)up;
}

/* Quantize `blocks` 1x32 blocks whose float32 bits the caller's widening gives. Returns the
 * largest code, or -1 at the first block holding a NaN or Inf (outputs then incomplete). */
CLONES static long quantize_blocks(const void *restrict src, int kind, Py_ssize_t blocks,
                                   const float *restrict mult, uint8_t *restrict q,
                                   uint8_t *restrict s, double *restrict diff,
                                   double *restrict ref) {
    const float inv_e4m3_max = 1.0f / E4M3_MAX; /* fl32(1/448), correctly rounded */
    uint32_t top = 0;
    for (Py_ssize_t blk = 0; blk < blocks; blk++) {
        Py_ssize_t base = blk * MX_BLOCK;
        uint32_t u[MX_BLOCK];
        if (kind == SRC_BF16) {
            const uint16_t *p = (const uint16_t *)src + base;
            for (int i = 0; i < MX_BLOCK; i++)
                u[i] = (uint32_t)p[i] << 16;
        } else if (kind == SRC_F16) {
            const uint16_t *p = (const uint16_t *)src + base;
            for (int i = 0; i < MX_BLOCK; i++)
                u[i] = f16_bits(p[i]);
        } else if (kind == SRC_E4M3) { /* an FP8 source's own math: fl32(w) * its scale */
            const uint8_t *p = (const uint8_t *)src + base;
            float m = mult[blk];
            for (int i = 0; i < MX_BLOCK; i++)
                u[i] = bits(f32(e4m3_bits(p[i])) * m);
        } else {
            memcpy(u, (const uint32_t *)src + base, sizeof u);
        }
        /* |x| as bits: for finite values their order is the floats' order */
        uint32_t amax = 0;
        for (int i = 0; i < MX_BLOCK; i++) {
            uint32_t a = u[i] & 0x7fffffffu;
            amax = a > amax ? a : amax;
        }
        if (amax >= NON_FINITE)
            return -1;
        uint32_t code = ue8m0_ceil(f32(amax) * inv_e4m3_max);
        top = code > top ? code : top;
        s[blk] = (uint8_t)code;
        /* the reference's inv_scale: 1 for code 0, else 2^(127-code) (2^-127 a subnormal) */
        float inv = code == 0 ? 1.0f : f32(code == UE8M0_MAX_CODE ? F32_HALF_MANTISSA
                                                                  : (254u - code) << 23);
        /* the dequantizing scale 2^(code-127), as quantize._exp2_f32 builds it */
        float scale = f32(code == 0 ? F32_HALF_MANTISSA : code << 23);
        uint8_t *qb = q + base;
        uint32_t deq_bits[MX_BLOCK]; /* the e4m3 values as float32 bits, sign included */
        for (int i = 0; i < MX_BLOCK; i++) {
            uint32_t vb = bits(f32(u[i]) * inv), sign = vb & 0x80000000u, a = vb ^ sign;
            /* the torch path's clamp to +-448 (it never binds), on the magnitude's bits */
            a = a < E4M3_MAX_BITS ? a : E4M3_MAX_BITS;
            /* below 2^-6 (e4m3's smallest normal): add 2^14, whose ulp is e4m3's 2^-9 step,
             * and let the FPU round to nearest even; above: round 20 mantissa bits away */
            float t = f32(a) + 16384.0f;
            uint32_t sub_code = bits(t) - (141u << 23);
            uint32_t sub_abs = bits(t - 16384.0f);
            uint32_t rounded = a + 0x7ffffu + ((a >> 20) & 1u);
            uint32_t norm_code = (rounded - (120u << 23)) >> 20;
            uint32_t norm_abs = rounded & 0xfff00000u;
            uint32_t sub = 0u - (uint32_t)(a < (121u << 23)); /* all ones below 2^-6 */
            qb[i] = (uint8_t)(((sub_code & sub) | (norm_code & ~sub)) | (sign >> 24));
            deq_bits[i] = ((sub_abs & sub) | (norm_abs & ~sub)) | sign;
        }
        if (diff) {
            for (int i = 0; i < MX_BLOCK; i++) {
                float x = f32(u[i]);
                diff[base + i] = (double)(f32(deq_bits[i]) * scale - x);
                ref[base + i] = (double)x;
            }
        }
    }
    return (long)top;
}

static int get_buffer(PyObject *obj, Py_buffer *view, int writable, const char *what) {
    int flags = PyBUF_C_CONTIGUOUS | (writable ? PyBUF_WRITABLE : 0);
    if (PyObject_GetBuffer(obj, view, flags) < 0) {
        PyErr_Format(PyExc_TypeError, "_cquant.quantize: %s must be a C-contiguous%s buffer",
                     what, writable ? " writable" : "");
        return -1;
    }
    return 0;
}

static PyObject *quantize(PyObject *self, PyObject *args) {
    PyObject *src_o, *q_o, *s_o, *diff_o = Py_None, *ref_o = Py_None, *mult_o = Py_None;
    int kind;
    if (!PyArg_ParseTuple(args, "OiOO|OOO:quantize", &src_o, &kind, &q_o, &s_o, &diff_o, &ref_o,
                          &mult_o))
        return NULL;
    if (kind < SRC_BF16 || kind > SRC_E4M3)
        return PyErr_Format(PyExc_ValueError, "_cquant.quantize: unknown source kind %d", kind);
    if ((kind == SRC_E4M3) != (mult_o != Py_None))
        return PyErr_Format(PyExc_ValueError,
                            "_cquant.quantize: multipliers go with e4m3 sources (kind 3) only");
    int measure = diff_o != Py_None;
    if (measure != (ref_o != Py_None))
        return PyErr_Format(PyExc_ValueError, "_cquant.quantize: diff and ref go together");
    Py_buffer src, q, s, diff = {0}, ref = {0}, mult = {0};
    long top = -2;
    if (get_buffer(src_o, &src, 0, "src") < 0)
        return NULL;
    if (get_buffer(q_o, &q, 1, "q") < 0)
        goto release_src;
    if (get_buffer(s_o, &s, 1, "s") < 0)
        goto release_q;
    if (measure && get_buffer(diff_o, &diff, 1, "diff") < 0)
        goto release_s;
    if (measure && get_buffer(ref_o, &ref, 1, "ref") < 0)
        goto release_diff;
    if (kind == SRC_E4M3 && get_buffer(mult_o, &mult, 0, "mult") < 0)
        goto release_ref;
    Py_ssize_t n = q.len, width = kind == SRC_F32 ? 4 : kind == SRC_E4M3 ? 1 : 2;
    if (n % MX_BLOCK || src.len != n * width || s.len != n / MX_BLOCK ||
        (measure && (diff.len != n * 8 || ref.len != n * 8)) ||
        (kind == SRC_E4M3 && mult.len != n / MX_BLOCK * 4)) {
        PyErr_Format(PyExc_ValueError,
                     "_cquant.quantize: sizes do not fit (src %zd, q %zd, s %zd, diff %zd, "
                     "ref %zd, mult %zd bytes)", src.len, q.len, s.len, diff.len, ref.len,
                     mult.len);
        goto release_mult;
    }
    Py_BEGIN_ALLOW_THREADS
    top = quantize_blocks(src.buf, kind, n / MX_BLOCK, kind == SRC_E4M3 ? mult.buf : NULL, q.buf,
                          s.buf, measure ? diff.buf : NULL, measure ? ref.buf : NULL);
    Py_END_ALLOW_THREADS
release_mult:
    if (kind == SRC_E4M3)
        PyBuffer_Release(&mult);
release_ref:
    if (measure)
        PyBuffer_Release(&ref);
release_diff:
    if (measure)
        PyBuffer_Release(&diff);
release_s:
    PyBuffer_Release(&s);
release_q:
    PyBuffer_Release(&q);
release_src:
    PyBuffer_Release(&src);
    return top == -2 ? NULL : PyLong_FromLong(top);
}

static PyMethodDef methods[] = {
    {"quantize", quantize, METH_VARARGS,
     "quantize(src, kind, q, s[, diff, ref[, mult]]) -> largest code, or -1 at a NaN/Inf.\n\n"
     "src: the values (kind 0 bf16, 1 fp16, 2 fp32; 3 e4m3 bytes, each block's values\n"
     "fl32(byte) * mult[block], mult float32), q: e4m3 bytes out, s: one UE8M0 code per 32\n"
     "values out; diff, ref: float64 out, the residual and the values (error measured, or\n"
     "None)."},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module = {
    PyModuleDef_HEAD_INIT, "_cquant", "The MXFP8 quantizer's inner loop (see quantize.py).", -1,
    methods,
};

PyMODINIT_FUNC PyInit__cquant(void) {
    PyObject *m = PyModule_Create(&module);
    if (m && PyModule_AddIntConstant(m, "VERSION", CQUANT_VERSION) < 0) {
        Py_DECREF(m);
        return NULL;
    }
    return m;
}
