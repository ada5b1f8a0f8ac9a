// qlora.h - tensor graphs, autodiff, a static memory planner and backends for QLoRA training.
//
// One prefix (ql_), one arena per context, graphs recorded first and computed later. The
// example is C99 and C++ alike (make test-dropin builds it both ways, inside a main, and runs it):
//
//     ql_init_params ip = {64u << 20, NULL, false, false};             // mem_size, mem_buffer, no_alloc, measure
//     ql_context *ctx = ql_init(ip);                                   // mallocs its 64 MiB arena
//     ql_tensor  *w   = ql_new_tensor_2d(ctx, QL_TYPE_F32, 64, 32);    // [in=64, out=32]
//     ql_tensor  *x   = ql_new_tensor_2d(ctx, QL_TYPE_F32, 64, 8);     // [in=64, tokens=8]
//     ql_tensor_fill_f32(w, 0.01f);                                    // data in the arena
//     ql_tensor_fill_f32(x, 1.0f);
//     ql_set_param(w);                                                 // trainable: gets w->grad
//     ql_tensor  *y   = ql_mul_mat(ctx, w, x);                         // [32, 8]  (records only)
//     ql_tensor  *l   = ql_sum(ctx, ql_mul(ctx, y, y));                // [1]
//     ql_graph   *g   = ql_graph_new(ctx);
//     ql_graph_build_forward(g, l);
//     ql_graph   *gb  = ql_graph_backward(ctx, g, l);                  // forward + backward nodes
//     ql_backend *cpu = ql_backend_cpu_init(0);                        // 0 = all cores
//     ql_plan_stats st;
//     if (ql_graph_plan(gb, cpu, &st) || ql_graph_alloc(gb, cpu)) { puts(ql_ctx_error(ctx)); return 1; }
//     ql_graph_zero_grads(gb);
//     ql_backend_graph_compute(cpu, gb);                               // no allocation here
//     // w->grad now holds dl/dw = 2 sum_t y x = 10.24; computing again accumulates into it.
//     printf("dl/dw[0] = %g\n", ql_get_f32_1d(w->grad, 0));
//     ql_graph_free(gb);
//     ql_graph_free(g);
//     ql_backend_free(cpu);
//     ql_free(ctx);                                                    // every tensor with it
//
// Conventions
// - Shapes are ne[0..3] with ne[0] the fastest (contiguous) dimension; nb[] are byte strides.
//   A weight W of PyTorch shape [out, in] is ne = [in, out]. Shape comments read [ne0, ne1, ...].
// - ql_mul_mat(a, b) contracts over ne[0]: a [K, M, A2, A3], b [K, N, B2, B3] -> [M, N, B2, B3],
//   c[m, n] = sum_k a[k, m] * b[k, n]; a is broadcast over b's batch (B2 % A2 == 0, B3 % A3 == 0;
//   batch i2 of b uses i2 / (B2 / A2) of a, so consecutive query heads share a kv head).
//   b is f32, f16 or bf16; a 16-bit b makes a 16-bit multiply (mixed precision): a's values are
//   rounded to b's type as they are read, products are summed in f32 (the result is f32), and
//   backward rounds dc to b's type before its two multiplies - fp16 gradients can overflow.
// - Op constructors only record; nothing is computed until ql_backend_graph_compute.
// - Errors: a constructor given bad input returns NULL and stores a message (op, shapes,
//   file:line) in its context, first error wins; constructors given a NULL source return NULL
//   without a new message, so a chain of ops fails once and the cause is kept. Functions that
//   can fail return ql_status (0 = QL_OK) and leave the message in the context: ql_ctx_error().
// - Nothing here calls exit(); internal invariant failures (bugs, not input) abort with file:line.
#ifndef QLORA_H
#define QLORA_H

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

#ifdef __cplusplus
extern "C" {
#endif

#define QL_MAX_DIMS      4
#define QL_MAX_SRC       6
#define QL_MAX_OP_PARAMS 16   // int32 slots
#define QL_MAX_NAME      64
#define QL_ALIGN         64   // bytes; every tensor in an arena or a planned buffer starts aligned

// ============================================================================================
// status codes
// ============================================================================================

typedef enum ql_status {
    QL_OK = 0,
    QL_ERR_SHAPE,        // shapes that do not fit the op
    QL_ERR_TYPE,         // a type the op (or backend) does not take
    QL_ERR_NOMEM,        // arena or buffer exhausted
    QL_ERR_UNSUPPORTED,  // an op no backend implements, or second-order differentiation
    QL_ERR_INVALID,      // bad argument (NULL, out of range, wrong state)
    QL_ERR_IO,
    QL_STATUS_COUNT
} ql_status;

const char *ql_status_name(ql_status s);

// ============================================================================================
// types: a table of traits, indexed by ql_type. Ids equal ggml's so GGUF files map 1:1;
// values that reach a file are append-only. Quantized types (NF4, Q4_K, ...) enter through
// the same table: op constructors and autodiff never switch on the type.
// ============================================================================================

typedef enum ql_type {
    QL_TYPE_F32  = 0,
    QL_TYPE_F16  = 1,
    QL_TYPE_Q4_0 = 2,
    QL_TYPE_Q4_1 = 3,
    QL_TYPE_Q5_0 = 6,
    QL_TYPE_Q5_1 = 7,
    QL_TYPE_Q8_0 = 8,
    QL_TYPE_Q2_K = 10,
    QL_TYPE_Q3_K = 11,
    QL_TYPE_Q4_K = 12,
    QL_TYPE_Q5_K = 13,
    QL_TYPE_Q6_K = 14,
    QL_TYPE_IQ4_NL = 20,
    QL_TYPE_IQ4_XS = 23,
    QL_TYPE_I8   = 24,  // raw bytes (8-bit optimizer state codes)
    QL_TYPE_I32  = 26,
    QL_TYPE_BF16 = 30,
    // qlora's own, outside ggml's id range (llama.cpp cannot load files holding them):
    QL_TYPE_NF4      = 100,  // NF4, blocks of 64, double-quantised absmax (QLoRA's default)
    QL_TYPE_NF4_NODQ = 101,  // NF4, blocks of 64, fp32 absmax per block
    QL_TYPE_COUNT
} ql_type;

typedef void (*ql_to_float_fn)(const void *src, float *dst, int64_t n);   // n: multiple of blck_size
typedef void (*ql_from_float_fn)(const float *src, void *dst, int64_t n);
// For types with tensor-wide side data: `row` is the block data of n elements starting at flat
// element index `first` of the tensor, `aux` the tensor's side data (see ql_tensor.aux_size).
typedef void (*ql_to_float_aux_fn)(const void *row, const void *aux, int64_t first, float *dst, int64_t n);

typedef struct ql_type_traits {
    const char      *name;        // NULL: no such type
    int64_t          blck_size;   // elements per block (1 for plain types)
    size_t           type_size;   // bytes per block
    bool             is_float;    // holds real numbers convertible to float
    ql_to_float_fn   to_float;    // NULL for types with side data (use to_float_aux)
    ql_from_float_fn from_float;  // NULL when the type cannot be produced block by block (use ql_quantize)
    // Side data some types keep after their rows (NF4: the double-quantised absmax of every
    // block). NULL: none. A tensor of such a type has aux_size = aux_bytes(nelements).
    size_t             (*aux_bytes)(int64_t n_elements);
    ql_to_float_aux_fn to_float_aux;
    // side data from outside (a file) must describe a tensor of n_elements: false if not
    bool               (*aux_check)(const void *aux, int64_t n_elements);
} ql_type_traits;

const ql_type_traits *ql_type_traits_get(ql_type t);  // NULL for an unknown id
const char *ql_type_name(ql_type t);                  // "?" for an unknown id
size_t      ql_row_size(ql_type t, int64_t ne0);      // bytes of ne0 elements (ne0 % blck == 0)

// bytes of a whole tensor of this type: rows + side data
size_t      ql_type_data_size(ql_type t, int64_t n_rows, int64_t ne0);

// scalar conversions (round to nearest even)
uint16_t ql_fp32_to_fp16(float f);
float    ql_fp16_to_fp32(uint16_t h);
uint16_t ql_fp32_to_bf16(float f);
float    ql_bf16_to_fp32(uint16_t h);

// ============================================================================================
// quantisation: NF4's layout, bitsandbytes' maps, whole tensors both ways (the block structs
// of every type, which the C++ and CUDA code share, are in the implementer part at the end)
// ============================================================================================

// NF4 (bitsandbytes-exact codes, blocks of 64 over the weight flattened row-major as
// [out, in] = rows of ne0). The rows hold exactly bitsandbytes' packed `weight` bytes: element
// 2j in the high nibble, 2j+1 in the low nibble. Everything per block lives in the side data
// after the rows (n_blocks = nelements / 64, n_groups = ceil(n_blocks / 256)):
//   QL_TYPE_NF4:      uint32_t n_blocks; float offset; float map[256]; float group_scale[n_groups];
//                     uint8_t absmax_code[n_blocks];
//                     absmax = map[code] * group_scale[block / 256] + offset  (two f32 roundings)
//                     The 8-bit map travels with the tensor: bitsandbytes computes it with torch,
//                     whose last bits depend on the CPU build, so an imported checkpoint keeps its own.
//   QL_TYPE_NF4_NODQ: float absmax[n_blocks];
// and an element is nf4_value[q] * absmax, in f32.
#define QL_NF4_BLOCK 64
#define QL_NF4_GROUP 256   // blocks per double-quantisation group
#define QL_NF4_VALUES {                                                                           \
    -1.0f, -0.6961928009986877f, -0.5250730514526367f, -0.39491748809814453f,                     \
    -0.28444138169288635f, -0.18477343022823334f, -0.09105003625154495f, 0.0f,                    \
    0.07958029955625534f, 0.16093020141124725f, 0.24611230194568634f, 0.33791524171829224f,       \
    0.44070982933044434f, 0.5626170039176941f, 0.7229568362236023f, 1.0f }
// the 16 values as int8, round(127 v): what the 8-bit activations' integer dot products multiply
// (ql_mul_mat_set_prec; the CPU's and the CUDA backend's decode alike)
#define QL_NF4_I8_VALUES {-127, -88, -67, -50, -36, -23, -12, 0, 10, 20, 31, 43, 56, 71, 92, 127}

// bitsandbytes' quantize_4bit(nf4, blocksize=64) of n flat elements (the last block may be
// partial; an odd tail pads with 0.0's code): packed [ceil(n/2)], absmax [ceil(n/64)].
// Inputs must be finite (see ql_quantize for the checked, whole-tensor version).
void ql_nf4_quantize_flat(const float *x, int64_t n, uint8_t *packed, float *absmax);

// bitsandbytes' 8-bit dynamic maps (create_dynamic_map(signed, 7, 8)): 256 sorted f32 each;
// signed: map[0] = -0.99296875, map[127] = 0, map[255] = 1; unsigned: map[0] = 0, map[255] = 1
const float *ql_dynamic_map_signed(void);
const float *ql_dynamic_map_unsigned(void);  // the second Adam moment's (v >= 0)
// its 8-bit quantiser: the 7-step binary search with midpoint rounding (dQuantize)
uint8_t      ql_dynamic_quantize(const float *map, float x);

// Whole-tensor quantisation of n_rows rows of ne0 floats into `type`: dst receives
// ql_type_data_size(type, n_rows, ne0) bytes (rows, then side data). NF4 follows bitsandbytes
// (all-zero blocks guarded: absmax 0, codes of 0.0) and QLoRA's double quantisation (offset =
// mean of the absmax, computed in double). Non-finite input is refused: QL_ERR_INVALID with
// the element's index in err. QL_ERR_TYPE for types that cannot be produced.
ql_status ql_quantize(ql_type type, const float *src, int64_t n_rows, int64_t ne0, void *dst, char *err, size_t err_size);
// The inverse for any numeric type (f32 out).
ql_status ql_dequantize(ql_type type, const void *src, int64_t n_rows, int64_t ne0, float *dst);

// bitsandbytes' serialised 4-bit tensors (the `weight` of a "*-bnb-4bit" checkpoint and the
// entries of its quant_state), for lossless import and export. Only nf4 with blocksize 64 (and
// nested blocksize 256) is accepted.
typedef struct ql_bnb_nf4 {
    int64_t  n;                 // elements of the weight
    bool     nested;            // compress_statistics: absmax stored as 8-bit codes
    uint8_t *packed;            // [ceil(n/2)]: bitsandbytes' `weight` bytes
    uint8_t *absmax_codes;      // nested:     [ceil(n/64)] `absmax` (uint8)
    float   *absmax;            // not nested: [ceil(n/64)] `absmax` (fp32)
    float   *nested_absmax;     // nested:     [ceil(n_blocks/256)] `nested_absmax`
    float    nested_offset;     // nested:     quant_state's "nested_offset"
    float   *quant_map;         // [16]  `quant_map`        (checked on import, filled on export)
    float   *nested_quant_map;  // [256] `nested_quant_map` (nested; checked / filled likewise)
} ql_bnb_nf4;
// bnb -> qlora: dst gets ql_type_data_size(QL_TYPE_NF4 or _NODQ, n / ne0, ne0) bytes.
ql_status ql_nf4_from_bnb(const ql_bnb_nf4 *in, ql_type type, int64_t ne0, void *dst, char *err, size_t err_size);
// qlora -> bnb: fills the arrays `out` points to (sized as above).
ql_status ql_nf4_to_bnb(ql_type type, const void *src, int64_t n_rows, int64_t ne0, ql_bnb_nf4 *out);

// ============================================================================================
// context: an arena holding tensor headers and (unless no_alloc) tensor data
// ============================================================================================

typedef struct ql_context ql_context;
typedef struct ql_graph   ql_graph;
typedef struct ql_backend ql_backend;
typedef struct ql_tensor  ql_tensor;

typedef struct ql_init_params {
    size_t mem_size;    // arena bytes: headers + data. See ql_tensor_overhead() and measure.
    void  *mem_buffer;  // NULL: the context mallocs mem_size once and frees it in ql_free
    bool   no_alloc;    // headers only; data pointers stay NULL (set later: mmap, a backend)
    bool   measure;     // nothing is allocated: mem_size is ignored, ql_used_mem() then says how
                        // big an arena with the same tensors (and the same no_alloc) must be
} ql_init_params;

ql_context *ql_init(ql_init_params params);
void        ql_free(ql_context *ctx);
size_t      ql_used_mem(const ql_context *ctx);      // arena bytes in use (or needed, measuring)
size_t      ql_ctx_data_size(const ql_context *ctx); // data bytes of its tensors (even if no_alloc)
size_t      ql_tensor_overhead(void);                // arena bytes of one tensor header
bool        ql_ctx_is_measure(const ql_context *ctx);

const char *ql_ctx_error(const ql_context *ctx);     // "" when there is none
ql_status   ql_ctx_status(const ql_context *ctx);
void        ql_ctx_clear_error(ql_context *ctx);
// for modules built on the library (model loaders, tools): record an error the same way
void        ql_ctx_set_error(ql_context *ctx, ql_status st, const char *fmt, ...)
#if defined(__GNUC__)
    __attribute__((format(printf, 3, 4)))
#endif
    ;

// ============================================================================================
// tensors
// ============================================================================================

typedef enum ql_op {
    QL_OP_NONE = 0,          // a leaf: data set by the user, a file or a backend
    QL_OP_FILL,              // every element = value
    QL_OP_CONT,              // contiguous copy, optionally converting the type
    QL_OP_VIEW,              // the four view ops alias their source's data
    QL_OP_RESHAPE,
    QL_OP_PERMUTE,
    QL_OP_TRANSPOSE,
    QL_OP_ADD,               // a + b, b broadcast by repetition
    QL_OP_MUL,               // a * b, b broadcast by repetition
    QL_OP_SCALE,             // a * s
    QL_OP_SUM,               // sum of all elements -> [1]
    QL_OP_REDUCE_TO,         // sum a down to a smaller broadcast shape (the adjoint of broadcast)
    QL_OP_MUL_MAT,
    QL_OP_GET_ROWS,
    QL_OP_GET_ROWS_BACK,
    QL_OP_RMS_NORM,
    QL_OP_RMS_NORM_BACK,
    QL_OP_ROPE,
    QL_OP_ROPE_BACK,
    QL_OP_SILU,
    QL_OP_SILU_BACK,
    QL_OP_SWIGLU,
    QL_OP_SWIGLU_BACK,
    QL_OP_FLASH_ATTN,
    QL_OP_FLASH_ATTN_BACK,
    QL_OP_CROSS_ENTROPY,
    QL_OP_CROSS_ENTROPY_BACK,
    QL_OP_DROPOUT,
    QL_OP_VIEW_BACK,         // zeros of the viewed tensor's shape with the gradient placed in the view
    QL_OP_ACC_GRAD,          // param->grad += contribution (in place; the result aliases the grad)
    QL_OP_CACHE_STORE,       // rows written into a persistent cache at a run-time position
    QL_OP_TO_HOST,           // a copy of src[0] in the graph's host memory (activation offload; ql_graph_offload)
    QL_OP_TO_DEVICE,         // a TO_HOST copy, or a host-memory leaf (ql_to_device), copied into the planned buffer
    QL_OP_ADD_ROWS,          // a with b added to a range of its rows (a result made in pieces of rows)
    QL_OP_WITH_GRAD,         // a scalar itself (a view) with its gradient w.r.t. a tensor made in forward (ql_with_grad)
    QL_OP_MUL_MAT_ROWS,      // a product written over a range of rows of c (in place; the result aliases c)
    QL_OP_MUL_MAT_DROPOUT,   // a product with one operand dropped out as it is read (ql_mul_mat_dropout)
    QL_OP_COUNT
} ql_op;

const char *ql_op_name(ql_op op);

enum ql_tensor_flag {
    QL_FLAG_PARAM  = 1 << 0,  // trainable leaf (fp32 master weight): gets a gradient buffer
    QL_FLAG_INPUT  = 1 << 1,  // leaf written by the caller before each run (tokens, targets, ...)
    QL_FLAG_OUTPUT = 1 << 2,  // its value must survive the run (never reused by the planner)
    QL_FLAG_GRAD   = 1 << 3,  // a parameter's gradient accumulator
    QL_FLAG_RECOMPUTED = 1 << 4,  // a forward result computed again in backward (ql_graph_recompute)
    // a forward result backward recomputes rather than keeps, whatever the segment's level (the
    // output head's logits: big, cheap to remake from the small hidden state); honoured by
    // ql_graph_recompute, which must then run even with no levels (level NULL)
    QL_FLAG_RECOMPUTE  = 1 << 5,
    // a leaf whose data is host memory even on a device backend: its context's placement leaves
    // it (the embedding with --embd-on-host: only the step's rows travel, gathered on the host;
    // paged optimizer state, in pinned memory the GPU reads directly), and set/get copy plainly
    QL_FLAG_HOST       = 1 << 6,
    // a leaf whose data is a read-only file mapping (a tensor of a GGUF opened by path): once a
    // device placement has copied it, its pages are given back to the kernel (read again from the
    // file should the host need them), so that a GPU run does not hold the model in host RAM too
    QL_FLAG_MAPPED     = 1 << 7,
    // a frozen weight whose products on a device read a copy of it in their compute type instead
    // of dequantising tiles (ql_weight_cache_mark, ql_backend_cache_weights: --cache-weights)
    QL_FLAG_CACHED     = 1 << 8,
};

struct ql_tensor {
    ql_type    type;
    int64_t    ne[QL_MAX_DIMS];          // elements per dimension, ne[0] fastest
    size_t     nb[QL_MAX_DIMS];          // bytes between consecutive elements of each dimension
    ql_op      op;
    int32_t    op_params[QL_MAX_OP_PARAMS];
    int32_t    flags;                    // ql_tensor_flag bits
    ql_tensor *src[QL_MAX_SRC];
    ql_tensor *grad;                     // QL_FLAG_PARAM leafs: the accumulator, after ql_graph_backward
    ql_tensor *view_src;                 // views: the tensor whose data this one aliases
    size_t     view_offs;                // byte offset into view_src's data
    size_t     aux_size;                 // bytes an op keeps right after the data (e.g. softmax stats)
    void      *data;
    void      *extra;                    // backend-private (a QL_FLAG_CACHED weight's: its ql_weight_copy)
    char       name[QL_MAX_NAME];
};

ql_tensor *ql_new_tensor(ql_context *ctx, ql_type type, int n_dims, const int64_t *ne);
ql_tensor *ql_new_tensor_1d(ql_context *ctx, ql_type type, int64_t ne0);
ql_tensor *ql_new_tensor_2d(ql_context *ctx, ql_type type, int64_t ne0, int64_t ne1);
ql_tensor *ql_new_tensor_3d(ql_context *ctx, ql_type type, int64_t ne0, int64_t ne1, int64_t ne2);
ql_tensor *ql_new_tensor_4d(ql_context *ctx, ql_type type, int64_t ne0, int64_t ne1, int64_t ne2, int64_t ne3);

ql_tensor  *ql_set_name(ql_tensor *t, const char *name);   // returns t (NULL-safe)
ql_tensor  *ql_format_name(ql_tensor *t, const char *fmt, ...);
ql_tensor  *ql_set_param(ql_tensor *t);                    // mark trainable (must be an F32 leaf)
ql_tensor  *ql_set_input(ql_tensor *t);
ql_tensor  *ql_set_output(ql_tensor *t);

int64_t ql_nelements(const ql_tensor *t);
int64_t ql_nrows(const ql_tensor *t);                       // ne1*ne2*ne3
// Row r of a leaf with host data and dense rows (a 2-D weight of any float or quantized type,
// side data found after its rows) as ne[0] floats. QL_ERR_INVALID otherwise.
ql_status ql_tensor_row_to_float(const ql_tensor *t, int64_t r, float *dst);
size_t  ql_nbytes(const ql_tensor *t);                      // bytes spanned by the data (not aux)
int     ql_n_dims(const ql_tensor *t);                      // highest dimension with ne > 1, plus one
bool    ql_is_contiguous(const ql_tensor *t);
bool    ql_rows_contiguous(const ql_tensor *t);             // nb[0] == element size (rows are dense)
bool    ql_same_shape(const ql_tensor *a, const ql_tensor *b);
void   *ql_aux_data(const ql_tensor *t);                    // data + ql_aux_offset(nbytes), or NULL
// where side data starts after `row_bytes` of rows: the next multiple of 4 (it holds floats; NF4
// rows of an even but not block-multiple length can end mid-word). A type's aux_bytes count the pad.
size_t  ql_aux_offset(size_t row_bytes);

// element access for tests and tools (f32 view of any float type; i32 for I32)
float   ql_get_f32_1d(const ql_tensor *t, int64_t i);       // i: logical flat index
void    ql_set_f32_1d(ql_tensor *t, int64_t i, float v);
void    ql_tensor_fill_f32(ql_tensor *t, float v);

// ============================================================================================
// op constructors: record an op, return its (data-less) result. Shapes in comments.
// ============================================================================================

// every element = value; a leaf-like node computed at run time (no data needed before)
ql_tensor *ql_fill(ql_context *ctx, ql_type type, int n_dims, const int64_t *ne, float value);

// views alias a's data: no copy. Strides nb1..nb3 in bytes, offset in bytes.
ql_tensor *ql_view_1d(ql_context *ctx, ql_tensor *a, int64_t ne0, size_t offset);
ql_tensor *ql_view_2d(ql_context *ctx, ql_tensor *a, int64_t ne0, int64_t ne1, size_t nb1, size_t offset);
ql_tensor *ql_view_3d(ql_context *ctx, ql_tensor *a, int64_t ne0, int64_t ne1, int64_t ne2,
                      size_t nb1, size_t nb2, size_t offset);
ql_tensor *ql_view_4d(ql_context *ctx, ql_tensor *a, int64_t ne0, int64_t ne1, int64_t ne2, int64_t ne3,
                      size_t nb1, size_t nb2, size_t nb3, size_t offset);
// reshape needs a contiguous a; same element count
ql_tensor *ql_reshape_1d(ql_context *ctx, ql_tensor *a, int64_t ne0);
ql_tensor *ql_reshape_2d(ql_context *ctx, ql_tensor *a, int64_t ne0, int64_t ne1);
ql_tensor *ql_reshape_3d(ql_context *ctx, ql_tensor *a, int64_t ne0, int64_t ne1, int64_t ne2);
ql_tensor *ql_reshape_4d(ql_context *ctx, ql_tensor *a, int64_t ne0, int64_t ne1, int64_t ne2, int64_t ne3);
// ql_reshape_4d that the graph also places after `after` (a source the walk visits first; nothing
// of it is read): q's rotation after k's projection, so that the two rotations are neighbours
// and a device makes them in one launch (ql_cuda_rope_pair)
ql_tensor *ql_reshape_4d_after(ql_context *ctx, ql_tensor *a, int64_t ne0, int64_t ne1, int64_t ne2, int64_t ne3, ql_tensor *after);
// source dimension i becomes result dimension axis_i (ggml semantics)
ql_tensor *ql_permute(ql_context *ctx, ql_tensor *a, int axis0, int axis1, int axis2, int axis3);
ql_tensor *ql_transpose(ql_context *ctx, ql_tensor *a);             // swap ne0 and ne1
ql_tensor *ql_cont(ql_context *ctx, ql_tensor *a);                  // contiguous copy
ql_tensor *ql_cast(ql_context *ctx, ql_tensor *a, ql_type type);    // contiguous copy in `type`
// host: a contiguous leaf in host memory (QL_FLAG_HOST; pinned on a GPU: ql_backend_place_tensors_pinned)
// copied into the planned buffer where the graph reaches it (on a GPU on the copy stream). Its
// bytes live on the device only from there to the copy's last reader, and ql_graph_recompute
// copies it again rather than keep it (an input the caller writes on the host each run: the
// embedding's rows with --embd-on-host). The host must not write it while a run is in flight.
ql_tensor *ql_to_device(ql_context *ctx, ql_tensor *host);

// elementwise, f32. b is broadcast to a's shape by repetition: a.ne[i] % b.ne[i] == 0.
ql_tensor *ql_add(ql_context *ctx, ql_tensor *a, ql_tensor *b);
ql_tensor *ql_mul(ql_context *ctx, ql_tensor *a, ql_tensor *b);
ql_tensor *ql_scale(ql_context *ctx, ql_tensor *a, float s);
// a * s with the result in `type` (F32, BF16 or F16): the product in f32, rounded once on store -
// the bits of ql_cast(ql_scale(a, s), type) in one node (LoRA's s A x as B's multiply reads it;
// autodiff makes it for a scaled gradient that a 16-bit multiply reads). Backward: ql_scale's (f32).
ql_tensor *ql_scale_to(ql_context *ctx, ql_tensor *a, float s, ql_type type);
ql_tensor *ql_sum(ql_context *ctx, ql_tensor *a);                   // -> [1]
// sum a over the repetitions that broadcast `like` to a's shape: result has like's shape.
// grouped=false: repetition by modulo (as ql_add); true: by blocks (as ql_mul_mat's batch).
ql_tensor *ql_reduce_to(ql_context *ctx, ql_tensor *a, const ql_tensor *like, bool grouped);

// a [K, M, A2, A3] (any float type), b [K, N, B2, B3] f32 -> [M, N, B2, B3] f32.
// a and b may be views with any strides (e.g. transposed); the result is contiguous.
ql_tensor *ql_mul_mat(ql_context *ctx, ql_tensor *a, ql_tensor *b);
// The same with the result in `type`: F32 (ql_mul_mat), or b's type where b is F16 or BF16 (a
// 16-bit multiply whose result a 16-bit op reads: half the bytes saved for backward). Products
// are summed in f32 and rounded once on store: the bits of ql_cast(ql_mul_mat(a, b), type).
// Backward is ql_mul_mat's (dy arrives f32).
ql_tensor *ql_mul_mat_to(ql_context *ctx, ql_tensor *a, ql_tensor *b, ql_type type);
// c + ql_mul_mat(a, b), c contiguous of the result's shape: the multiply adds its products onto
// c as it writes them (and may write over c's storage where c dies here) instead of a separate
// pass - LoRA's W x + B(s A x). The result has c's type: F32, or b's 16-bit type.
// c f32: the same bits as ql_add(c, ql_mul_mat(a, b)) for K <= 256; beyond that c joins the
// sum after the first 256 of K (rounding differs).
// c 16-bit (a ql_mul_mat_to result): the products summed in f32, c widened and added, the sum
// rounded once on store - the bits of ql_cast(ql_add(ql_cast(c, F32), ql_mul_mat(a, b)), c's
// type) for any K. (So a LoRA'd 16-bit linear is rounded twice: W x on its store, then W x + B(.).)
ql_tensor *ql_mul_mat_acc(ql_context *ctx, ql_tensor *a, ql_tensor *b, ql_tensor *c);
// s (a b) in `type` (f32, or b's 16-bit type), each sum times s in f32 and then rounded once on
// store: the bits of ql_scale_to(ql_mul_mat(a, b), s, type) without the f32 product or a second
// pass (LoRA's scale on A's product; on a GPU the GEMM's alpha). s == 1: ql_mul_mat_to.
ql_tensor *ql_mul_mat_scaled_to(ql_context *ctx, ql_tensor *a, ql_tensor *b, float s, ql_type type);
float ql_mul_mat_alpha(const ql_tensor *mm);  // a product's s (ql_mul_mat_scaled_to), else (or not a product) 1
// Asks for a multiply's activations in 8 bits (prec QL_TYPE_Q8_0; QL_TYPE_F32, the default, is
// exact): b's rows rounded per block to int8 with an f32 scale, dotted in integers with a's
// packed blocks - llama.cpp's way of running a quantised model. For inference only: the result
// moves within the bound README's generate section states (training is exact and must not ask).
// The CPU backend honours it where a is Q4_0, Q8_0, Q4_K, Q6_K or NF4 (rows of whole 64-blocks),
// b f32 with dense rows and at most 8 of them, one batch; every other multiply stays exact. The
// CUDA backend honours it for the same weight types in its decode products (ql_cuda_mm_q8: the
// same codes and integer sums). QL_ERR_INVALID if mm is not a ql_mul_mat(_acc) result, QL_ERR_TYPE
// for another prec.
ql_status ql_mul_mat_set_prec(ql_tensor *mm, ql_type prec);

// a [n_embd, n_rows] (any float type), ids I32 [n, n2, n3] -> [n_embd, n, n2, n3] f32
ql_tensor *ql_get_rows(ql_context *ctx, ql_tensor *a, ql_tensor *ids);

// y = x / sqrt(mean(x^2) + eps) over each row (ne0)
ql_tensor *ql_rms_norm(ql_context *ctx, ql_tensor *a, float eps);
// y = ql_rms_norm(a, eps) * w, w f32 [ne0] (a norm's weight) multiplied into each row as the row
// is written: one node (QL_OP_RMS_NORM with w as src[1]), the bits of ql_mul(ql_rms_norm(a, eps), w).
// Backward: da = rms_norm_back(a, dy * w) in one node; a trainable w gets reduce(dy * rms_norm(a)).
ql_tensor *ql_rms_norm_mul(ql_context *ctx, ql_tensor *a, ql_tensor *w, float eps);
// The same with the result in `type` (F32, BF16 or F16): the f32 value rounded once on store, the
// bits of ql_cast(ql_rms_norm_mul(a, w, eps), type) - a norm whose only reader is a 16-bit multiply.
ql_tensor *ql_rms_norm_mul_to(ql_context *ctx, ql_tensor *a, ql_tensor *w, float eps, ql_type type);

enum ql_rope_mode {
    QL_ROPE_NORMAL = 0,  // rotate adjacent pairs (2i, 2i+1): llama, llama2.c
    QL_ROPE_NEOX   = 2,  // rotate (i, i + n_dims/2): qwen2, gpt-neox (value as in ggml)
};
// a [head_dim, n_head, T, B] f32 or 16-bit (the result in a's type: computed in f32 and rounded
// once on store; the gradient f32), pos I32 [T, B] (position of each token),
// freq_factors: NULL or f32 [n_dims/2] (divisors of each frequency: Llama-3.1 rope_freqs).
// Rotates the first n_dims of each head by pos * freq_base^(-2i/n_dims) / factor_i.
ql_tensor *ql_rope(ql_context *ctx, ql_tensor *a, ql_tensor *pos, ql_tensor *freq_factors,
                   int n_dims, int mode, float freq_base);

ql_tensor *ql_silu(ql_context *ctx, ql_tensor *a);                  // a * sigmoid(a)
// silu(a) * b, same shapes and one type: F32, F16 or BF16 (the result's type; a 16-bit result is
// the f32 value rounded once). Backward reads a and b as they are and gives f32 gradients.
ql_tensor *ql_swiglu(ql_context *ctx, ql_tensor *a, ql_tensor *b);

// Fused causal attention, computed tile by tile with an online softmax: memory O(T), the
// [Tq, Tk] score matrix is never stored. Keeps only the per-row logsumexp for backward.
//   q [d, Tq, H, B], k [d, Tk, Hkv, B], v [dv, Tk, Hkv, B] of one type, f32 or 16-bit (bf16, f16:
//   a 16-bit compute type's q, k, v, widened as they are read), any strides with dense rows
//   -> [dv, H, Tq, B] in that type (16-bit: each f32 result rounded once on store; what backward
//   keeps of attention is then 16-bit, and backward reads the output's gradient rounded to that
//   type too; the logsumexp and the gradients of q, k, v stay f32); reshapes to [dv*H, Tq, B] directly
// H % Hkv == 0 (query head h reads kv head h / (H/Hkv)). Query i may attend key j when
// j <= i + (Tk - Tq) (so a KV cache works) and, if seg (I32 [Tk, B], Tq == Tk) is given,
// seg[i] == seg[j]: packed documents never see each other.
ql_tensor *ql_flash_attn(ql_context *ctx, ql_tensor *q, ql_tensor *k, ql_tensor *v,
                         ql_tensor *seg, float scale);
// The same over a KV cache (f32 only): k, v are views of the whole cache [d, n_ctx, Hkv, B], of which
// only the first n_kv[0] keys (I32 [1], read at run time) are used; the Tq queries sit at
// positions n_kv - Tq .. n_kv - 1. So one graph serves every decoding step. No backward.
ql_tensor *ql_flash_attn_kv(ql_context *ctx, ql_tensor *q, ql_tensor *k, ql_tensor *v, ql_tensor *n_kv, float scale);
// Asks for an attention's products in bf16 (prec QL_TYPE_BF16; QL_TYPE_F32 is the default): q,
// k, v and the probabilities - in backward also dO and dS - rounded to bf16, products summed in
// f32, softmax f32. A request for speed: the CPU backend honours it where it is built for
// AVX512-BF16's pair dots (which AMX processors have too) and computes in f32 elsewhere, as the
// CUDA backend does. Its backward inherits it. QL_ERR_INVALID if attn is not a
// ql_flash_attn(_kv) result, QL_ERR_TYPE for another prec.
ql_status ql_flash_attn_set_prec(ql_tensor *attn, ql_type prec);
// Sizes the query chunks where a backend runs this attention as products over chunks of queries
// (the CUDA backend's backward, and its forward where no fused kernel takes the shape): a chunk's
// scores, f32 [Tk, chunk, H, B], fit `bytes` (their gradient takes as much again; chunks are a
// power of two from 16 to 256 queries, or all of Tq). 0: QL_FLASH_ATTN_SCORE_BYTES. Larger chunks
// are fewer, larger products for more workspace; dk and dv are summed over the chunks in f32, so
// their last bits follow the chunking. Its backward inherits it. QL_ERR_INVALID if attn is not a
// ql_flash_attn(_kv) result or bytes is not a whole number of MiB below 2^31 MiB.
ql_status ql_flash_attn_set_score_bytes(ql_tensor *attn, size_t bytes);
#define QL_FLASH_ATTN_SCORE_BYTES ((size_t)32 << 20)
// The queries a chunk then holds, for q [d, Tq, H, B] over Tk keys and a budget (0: the default;
// QLORA_CUDA_FA_SCORE_MB in the environment, for measuring, overrides every budget)
int64_t ql_flash_attn_chunk_rows(int64_t Tq, int64_t Tk, int64_t H, int64_t B, size_t score_bytes);

// Writes src's rows into `cache` starting at row pos[0] of dimension 1 (I32 [1], read at run
// time): cache [ne0, n_ctx, ne2, ne3] (a leaf that persists across runs), src [ne0, n, ne2,
// ne3] with dense rows. The result aliases the whole cache: read the cache through it (views
// of the result), so readers run after the write. No backward.
ql_tensor *ql_cache_store(ql_context *ctx, ql_tensor *cache, ql_tensor *src, ql_tensor *pos);

// logits [V, N, ...] f32, targets I32 [N, ...] (target < 0: ignored), count f32 [1]
// -> [1] = sum over kept rows of -log softmax(logits)[target] / count[0].
// count is read at run time, so accumulation can normalise by a whole optimizer step's tokens.
ql_tensor *ql_cross_entropy(ql_context *ctx, ql_tensor *logits, ql_tensor *targets, ql_tensor *count);
// The gradient of ce = ql_cross_entropy(logits, targets, count) w.r.t. its logits for an
// incoming gradient dy (f32 [1], read at run time): (softmax(logits) - onehot(target)) dy /
// count, zero on ignored rows; f32 shaped like the logits. Written over the logits where they
// die here (the fused head + loss makes it in forward, ql_llama_loss; backward makes it too).
ql_tensor *ql_cross_entropy_back(ql_context *ctx, ql_tensor *ce, ql_tensor *dy);
// ... in `type`: F32, or BF16 / F16 where only a 16-bit multiply reads it (the fused head's Wᵀ
// dlogits): each element made in f32 and rounded once as it is stored, ql_cast's bits of the f32
// result, without the f32 tensor or the cast's pass
ql_tensor *ql_cross_entropy_back_to(ql_context *ctx, ql_tensor *ce, ql_tensor *dy, ql_type type);
// y itself (a view: nothing runs) with its gradient w.r.t. x made already: dx (f32, x's shape),
// the gradient for dy = 1. Backward adds dx * dy to x's gradient and gives y's own sources
// nothing - what made y is not differentiated again. y: a single f32 that depends on x (a loss
// whose gradient was computed in forward: the fused head + loss of ql_llama_loss). dy multiplies
// dx after the fact: a loss scale meant to keep 16-bit intermediates of dx from underflowing
// must be inside it already (the trainer's fp16 scaling divides the loss's count by it).
// Recompute leaves dx alone: what makes it reads x, which y's view reads to the end of forward,
// so it lies in no segment (ql_graph_recompute).
ql_tensor *ql_with_grad(ql_context *ctx, ql_tensor *y, ql_tensor *x, ql_tensor *dx);

// Inverted dropout: y = keep ? x/(1-p) : 0, keep decided by a counter-based hash of
// (seed[0], stream, element index) - never stored, regenerated in backward and on recompute.
// seed: I32 [1] input the caller changes per step; stream: distinct per call site. a: f32, bf16
// or f16 with dense rows (a 16-bit a is widened as it is read).
ql_tensor *ql_dropout(ql_context *ctx, ql_tensor *a, float p, ql_tensor *seed, uint32_t stream);
// The same with the result in `type` (F32, BF16 or F16): ql_cast of ql_dropout's result, bit for
// bit, without the f32 pass between (what a 16-bit matmul's input wants). Gradients stay f32.
ql_tensor *ql_dropout_to(ql_context *ctx, ql_tensor *a, float p, ql_tensor *seed, uint32_t stream, ql_type type);
// The same over rows [first_row, first_row + a's rows) of a tensor a is a piece of: each element
// draws the whole's mask (a tensor processed in pieces of rows - the FFN in token chunks - drops
// what the whole would).
ql_tensor *ql_dropout_rows_to(ql_context *ctx, ql_tensor *a, float p, ql_tensor *seed, uint32_t stream, ql_type type,
                              int64_t first_row);

// ql_mul_mat(a, ql_dropout_rows_to(x, p, seed, stream, type, first_row)) bit for bit, without
// the dropped-out copy of x: the mask is regenerated from its hash as x is read, in forward and in
// backward (where da's product reads x again, and dx = dropout(a^T dy)). LoRA's y = s B(A(dropout(x)))
// keeps x (which other products read anyway) instead of one 16-bit copy per adapted linear.
// a: a plain 2-D matrix [K, M] (f32, bf16, f16), x [K, N, B2, B3] f32 / bf16 / f16 with dense rows,
// type: F32, BF16 or F16 (what the product multiplies in) -> f32 [M, N, B2, B3].
ql_tensor *ql_mul_mat_dropout(ql_context *ctx, ql_tensor *a, ql_tensor *x, float p, ql_tensor *seed, uint32_t stream,
                              ql_type type, int64_t first_row);
// For backends: a QL_OP_MUL_MAT_DROPOUT node as a MUL_MAT node `mm` over `d`, the header of the
// dropped-out operand materialised at d_data (contiguous, x's rows, in the product's type: x's
// shape, or [rows, ne0] transposed for the operand on the a side, which backward's da uses) - how
// the CPU backend runs it, and the CUDA backend where no fused kernel takes it
void ql_mul_mat_dropout_product(const ql_tensor *node, ql_tensor *mm, ql_tensor *d, void *d_data);

// a (f32, contiguous) with b (f32 [a->ne[0], n], dense rows) added to a's rows [row0, row0 + n),
// rows counted over ne[1..3]: a result made in pieces of rows (the FFN in token chunks). It
// writes over a's storage where a dies here, so a chain of them costs only the rows added. The
// same bits as ql_add for those rows.
ql_tensor *ql_add_rows(ql_context *ctx, ql_tensor *a, ql_tensor *b, int64_t row0);
// c (f32 [M, N] contiguous) with ql_mul_mat(a, b)'s [M, n] written over its rows [row0, row0 +
// n): a 2-D product straight into its rows of a whole made in pieces (the fused loss's dh), no
// [M, n] result and no add. a, b: as ql_mul_mat takes them (a may be a transposed quantized
// weight), 2-D, f32 result. The result aliases c - read c through it, so readers follow the
// write; chain them for several pieces. No backward.
ql_tensor *ql_mul_mat_rows(ql_context *ctx, ql_tensor *a, ql_tensor *b, ql_tensor *c, int64_t row0);
// For backends: the MUL_MAT node a MUL_MAT_ROWS node runs - its product over the rows it writes
// (data, when bound, at those rows) - so both run, size and count it as that product. A node
// that adds (autodiff's form for a parameter's gradient that is one product: grad += a^T b) gives
// the product with src[2] = mm itself: ql_mul_mat_acc in place over those rows
void ql_mul_mat_rows_product(const ql_tensor *node, ql_tensor *mm);

// ============================================================================================
// graphs and autodiff
// ============================================================================================

ql_graph  *ql_graph_new(ql_context *ctx);
void       ql_graph_free(ql_graph *g);
ql_status  ql_graph_build_forward(ql_graph *g, ql_tensor *out);   // may be called for several outputs
int        ql_graph_n_nodes(const ql_graph *g);
ql_tensor *ql_graph_node(const ql_graph *g, int i);               // negative i counts from the end
int        ql_graph_n_forward(const ql_graph *g);                 // nodes before the backward part
ql_context *ql_graph_ctx(const ql_graph *g);
// The heap a graph's own bookkeeping holds (its node lists, the set its walk marks nodes in, its
// plan's entries), allocator overhead counted at 16 bytes per block: what a memory plan adds for
// each graph a run keeps (not its tensors: those are in the context's arena).
size_t     ql_graph_heap_bytes(const ql_graph *g);

// A new graph: gf's nodes, then the backward of the scalar `loss` (f32 [1]) with respect to
// every QL_FLAG_PARAM leaf it depends on. Each such param gets param->grad (allocated in ctx,
// F32, same shape) and the graph ends with param->grad += dloss/dparam, so runs accumulate;
// zero them with ql_graph_zero_grads. Frozen leafs get no gradient buffer, and no gradient is
// computed for anything that does not lead to a param. Returns NULL on error (see ctx).
ql_graph *ql_graph_backward(ql_context *ctx, const ql_graph *gf, ql_tensor *loss);
void      ql_graph_zero_grads(ql_graph *g);
int       ql_graph_n_params(const ql_graph *g);
ql_tensor *ql_graph_param(const ql_graph *g, int i);

// ---- recompute (gradient checkpointing), decided on the graph, not in the model ----
// The forward part of a backward graph is cut where every later node reaches earlier results
// only through one tensor (a transformer's residual stream between the halves of its blocks);
// a segment is the run of nodes between two cuts, its input the first cut; a run with no op
// inside (one node between two cuts) joins the segment before it, or the first segment. Nodes
// after the last segment (the output head) always stay as they are.
typedef enum ql_keep {
    QL_KEEP_ALL,    // every forward result backward reads stays alive (no recompute)
    QL_KEEP_HEAVY,  // matmul and attention results stay; cheaper ones are recomputed from them
    QL_KEEP_INPUT,  // only the segment's input stays; backward recomputes what it reads from it
    QL_KEEP_NONE,   // not even the input: it is recomputed from an earlier segment's
} ql_keep;

typedef struct ql_recompute_stats {
    int    n_segments;       // segments found
    int    n_recomputed;     // forward ops computed again in backward
    double forward_flops;    // estimated cost of the forward part (multiply-adds count 2)
    double recompute_flops;  // of the recomputed ops
} ql_recompute_stats;

// Segments of gb's forward part; inputs[i] (i < max, when not NULL) gets segment i's input.
int       ql_graph_segments(const ql_graph *gb, ql_tensor **inputs, int max);
// Rewrites backward graph gb (before planning) so that of segment i's forward results only
// those level[i] keeps are read by backward; every other one it reads is recomputed by a copy
// of its forward op (flagged QL_FLAG_RECOMPUTED) placed just before its first use, and so are
// the results that copy needs, back to kept tensors. The copies run the same kernels on the
// same inputs (dropout masks come from seeds), so gradients are bit for bit those of the
// graph without recompute. n must equal ql_graph_segments(gb, NULL, 0); stats may be NULL.
// level NULL (n ignored): keep every segment; only QL_FLAG_RECOMPUTE results are recomputed.
ql_status ql_graph_recompute(ql_graph *gb, const ql_keep *level, int n, ql_recompute_stats *stats);

// Activation offload: rewrites backward graph gb (after ql_graph_recompute, before planning) so
// that each of the n forward results given (segment checkpoints) is copied into host memory
// right after it is made (QL_OP_TO_HOST) and its backward readers read a copy brought back
// (QL_OP_TO_DEVICE) placed one checkpoint ahead of its first use, so that on a GPU the copies
// run on a copy stream while the neighbouring segment computes. The device buffer then holds
// only the checkpoints in flight; the copies are exact, so are the gradients.
ql_status ql_graph_offload(ql_graph *gb, ql_tensor *const *tensors, int n);
// flags QL_OFFLOAD_LATE: where a checkpoint's backward readers fall in two groups far apart (block
// recompute: the recompute at the block's start, its first norm's backward at its end) the later
// group reads a second copy brought back just before it, and the next checkpoint comes back
// there too (not one checkpoint ahead): no checkpoint is on the device through the block's
// backward, at the price of copies the compute may wait for (two a block).
#define QL_OFFLOAD_LATE 1
// QL_OFFLOAD_GRADS: backward's own large results (a quarter of attention's f32 result or more) that
// wait across an attention's backward for their next reader - a block's residual gradient, its
// attention norm's 16-bit output - go to host memory after their last reader before it and come
// back once attention's result is read; their host bytes are reused block after block. With
// QL_OFFLOAD_LATE each checkpoint then comes back after the previous one's last reader, not beside
// it. Less device memory at attention backward's peak; the compute waits for these copies.
#define QL_OFFLOAD_GRADS 2
ql_status ql_graph_offload_ex(ql_graph *gb, ql_tensor *const *tensors, int n, int flags);

// ============================================================================================
// static memory plan: every op result gets an offset in one buffer, reused after its last
// consumer (in place where the op allows), all decided before anything runs.
// ============================================================================================

typedef enum ql_mem_category {
    QL_MEM_WEIGHTS,   // frozen leaf tensors (the base model)
    QL_MEM_PARAMS,    // trainable leafs (fp32 master weights)
    QL_MEM_GRADS,     // their gradient accumulators
    QL_MEM_INPUTS,    // QL_FLAG_INPUT leafs
    QL_MEM_SAVED,     // forward results still alive when backward starts
    QL_MEM_SCRATCH,   // the rest of the planned buffer (temporaries)
    QL_MEM_WORK,      // per-thread kernel workspace (matmul packing, attention tiles)
    QL_MEM_COUNT
} ql_mem_category;

const char *ql_mem_category_name(ql_mem_category c);

typedef struct ql_plan_stats {
    size_t bytes[QL_MEM_COUNT];
    size_t buffer_size;    // planned buffer = SAVED + SCRATCH + WORK
    size_t total;          // everything: the sum of bytes[]
    size_t sum_of_sizes;   // what the planned tensors would need without reuse
    int    n_planned;      // tensors placed in the buffer
    int    n_inplace;      // of them, results written over a dying source
    size_t recompute_peak; // most bytes of recomputed tensors alive at once (part of SCRATCH)
    size_t host_size;      // TO_HOST copies: the graph's host memory (pinned on a GPU), not in buffer_size
    size_t host_back;      // of it backward's own copies (QL_OFFLOAD_GRADS): short-lived, their bytes reused
} ql_plan_stats;

typedef struct ql_plan_entry {
    const ql_tensor *tensor;
    size_t offset;         // in the planned buffer
    size_t size;           // nbytes + aux, aligned
    int    first, last;    // node indices: produced at first, last read at last
    bool   inplace;        // took over its source's block
    bool   host;           // a TO_HOST copy: offset is in the graph's host memory
} ql_plan_entry;

ql_status ql_graph_plan(ql_graph *g, ql_backend *backend, ql_plan_stats *stats);
int       ql_graph_plan_entries(const ql_graph *g, const ql_plan_entry **entries);
// A number no other plan in this process has (0: not planned): what a backend's per-plan caches key on.
uint64_t  ql_graph_plan_id(const ql_graph *g);
// the statistics of the current plan (QL_ERR_INVALID if the graph is not planned)
ql_status ql_graph_get_stats(const ql_graph *g, ql_plan_stats *stats);

// What one run of a planned graph costs on the backend it was planned for, counted from the
// graph and the backend's rules - no device needed (a stand-in from ql_backend_init_planned
// counts as its card would). The unit of "launches": a kernel, a library call (cuBLAS) or an
// asynchronous copy or memset, as the CUDA backend issues them without CUDA graphs (with them:
// one graph launch per run); on the CPU, a node. Bytes are each computing node's sources and
// result as stored (a view's bytes where it is read), summed by class.
enum { QL_CENSUS_MATMUL, QL_CENSUS_ATTENTION, QL_CENSUS_LOSS, QL_CENSUS_OTHER, QL_CENSUS_CLASSES };
typedef struct ql_census {
    int64_t nodes;                     // nodes that compute (views, reshapes and leafs not counted)
    int64_t launches;                  // see above
    double  flops;                     // executed, multiply-adds counting 2 (the planner's node costs)
    double  recompute_flops;           // of them, in recomputed copies of forward ops
    double  bytes[QL_CENSUS_CLASSES];  // moved by class: multiplies, attention, loss, the rest (element-wise, norms, copies)
} ql_census;
ql_status ql_graph_census(const ql_graph *g, ql_backend *backend, ql_census *census);
// Allocates the planned buffer once from the backend and points every op result into it.
// Graphs may share tensors (a backward graph contains its forward graph's nodes): a run
// points the shared tensors into its own buffer first, so after a run, tensor data refers
// to the graph that ran last.
ql_status ql_graph_alloc(ql_graph *g, ql_backend *backend);
// Points g into host's buffer (allocated, same backend) instead of a buffer of its own, for
// graphs that never run at the same time - an evaluation graph between training steps. A run
// of g overwrites what host keeps in the buffer (activations, gradients), so host's gradients
// must not be needed across it; host must outlive g's runs. QL_ERR_INVALID when g's plan needs
// more than host's buffer (then ql_graph_alloc it).
ql_status ql_graph_alloc_shared(ql_graph *g, ql_backend *backend, ql_graph *host);
// Debug: before each node runs, fill the bytes of blocks freed by earlier nodes with NaN
// (0xFF) so a reader of a dead tensor cannot go unnoticed.
void      ql_graph_set_poison(ql_graph *g, bool on);
// Debug: after each node runs, scan its result; the first nan or inf stops the run with an
// error naming the node, its op and the names (or nodes) of its sources. For diagnosing a
// non-finite loss: a second run of the same inputs with this on finds where it began.
void      ql_graph_set_check_finite(ql_graph *g, bool on);
// Debug: give every tensor its own block (no reuse) - the reference the planner is tested against.
void      ql_graph_set_no_reuse(ql_graph *g, bool on);
// Profiling: when on, each run adds every node's wall time (seconds) to a per-node total.
void      ql_graph_set_profile(ql_graph *g, bool on);
double    ql_graph_node_seconds(const ql_graph *g, int i);

// ============================================================================================
// backends
// ============================================================================================

ql_backend *ql_backend_cpu_init(int n_threads);   // n_threads <= 0: ql_cpu_default_threads(); NULL: threads not started
// Physical cores of the CPUs this process may use (affinity mask; hyper-threads counted once).
int         ql_cpu_physical_cores(void);
// The CPU backend's default: physical cores less the other tasks running right now (/proc/loadavg),
// at least 1 - a thread sharing its core with a busy process stalls every barrier of the pool.
int         ql_cpu_default_threads(void);
// For the tools' -t: a warning line on stderr when n is more than the physical cores ("tool: warning: ...").
void        ql_cpu_warn_threads(const char *tool, int n);
void        ql_backend_free(ql_backend *be);
const char *ql_backend_name(const ql_backend *be);
bool        ql_backend_supports_op(ql_backend *be, const ql_tensor *node);
ql_status   ql_backend_graph_compute(ql_backend *be, ql_graph *g);
// Nodes [first, last) of g only (last < 0: to its end), on its buffer as the run before left it:
// a graph run in parts - its forward part [0, ql_graph_n_forward), then, once the caller has set
// what its backward part reads (a pipeline stage's incoming gradient: a model split over
// devices), the rest. The planner's buffer is not touched between the parts (nor poisoned, but
// by a part that starts at node 0).
ql_status   ql_backend_graph_compute_range(ql_backend *be, ql_graph *g, int first, int last);
int         ql_backend_cpu_n_threads(const ql_backend *be);
// Runs fn(arg, ith, nth) on each of the CPU backend's nth threads and returns when all are
// done: work between graph runs (the optimizer's update) on the same threads, nothing spawned.
void        ql_backend_cpu_parallel(ql_backend *be, void (*fn)(void *arg, int ith, int nth), void *arg);
// Whether the CPU backend multiplies bf16 natively: AMX-BF16 tiles, compiled in (-march with
// amx-bf16) and granted by the kernel, or AVX512-BF16's pair dot products (vdpbf16ps, compiled
// in). Then a bf16 mul_mat (b bf16; AMX: K % 32 == 0, N >= 16; AVX512-BF16: K even) runs on them;
// elsewhere bf16 inputs are widened to f32 and multiplied as f32 (the same products, summed in
// f32 in another order; the native paths flush subnormal inputs and results to zero).
bool        ql_cpu_bf16_native(void);
// whether this build's CPU backend keeps weights of this type repacked for 8-bit-activation
// inference (ql_backend_cache_weights(cpu, w, n, type, ...)): Q4_0, Q4_K, Q6_K and NF4 (and NF4_NODQ), in
// AVX-512 VNNI builds
bool        ql_cpu_repacks(ql_type type);
const char *ql_cpu_bf16_kind(void);                // "AMX tiles", "AVX512-BF16 pair dot products", or NULL
const char *ql_cpu_features(void);                 // e.g. "AVX512F AVX2 FMA F16C" as compiled in

typedef struct ql_adamw_params {
    float lr;            // e.g. 2e-4
    float beta1, beta2;  // 0.9, 0.999
    float eps;           // 1e-8
    float weight_decay;  // decoupled (AdamW); 0 disables
} ql_adamw_params;

// ---- memory a backend owns: a GPU's memory is not the host's ----
// Tensor data pointers always point into the memory of the backend that runs the graph: host
// memory for the CPU backend, device memory for CUDA. The host reads and writes tensors of a
// device only through ql_backend_tensor_set/get. The CPU backend implements all of this with
// memcpy, and placing a context's tensors moves nothing, so code written against these calls
// runs on either backend unchanged.
typedef enum ql_buffer_kind {
    QL_BUFFER_DEVICE,       // the backend's own memory (CPU backend: host memory)
    QL_BUFFER_HOST_PINNED,  // host memory the device reaches by DMA (offload, paged state; CPU: host memory)
    QL_BUFFER_KIND_COUNT
} ql_buffer_kind;

const char *ql_buffer_kind_name(ql_buffer_kind k);

typedef struct ql_backend_buffer ql_backend_buffer;
// One allocation of `size` bytes (QL_ALIGN-aligned); NULL when it cannot be had.
ql_backend_buffer *ql_backend_buffer_alloc(ql_backend *be, ql_buffer_kind kind, size_t size);
// NULL-safe; needs no backend. Tensors it placed (ql_backend_place_ctx_tensors) point at their host
// data again, so free a placement before the context it placed.
void        ql_backend_buffer_free(ql_backend_buffer *buf);
void       *ql_backend_buffer_base(const ql_backend_buffer *buf);
size_t      ql_backend_buffer_size(const ql_backend_buffer *buf);
ql_buffer_kind ql_backend_buffer_kind(const ql_backend_buffer *buf);

// Every leaf of ctx (op NONE, not a view) that has no data yet gets it, in ONE new buffer of
// `kind` (data + side data, each QL_ALIGN-aligned). For a no_alloc context built for a backend.
// NULL (and an error in ctx) when it does not fit; the tensors are then left without data.
ql_backend_buffer *ql_backend_alloc_ctx_tensors(ql_backend *be, ql_context *ctx, ql_buffer_kind kind);
// Weights placed once: every leaf of ctx that has host data (an arena, a GGUF mapping), unless
// flagged QL_FLAG_HOST, is copied, side data included, into ONE new device buffer and its data pointer moved there; views are
// re-pointed. Quantized types travel as they are (no f32 copy of a base weight ever exists on
// the device). The host bytes are not freed (they belong to the arena or the file); those of a
// QL_FLAG_MAPPED tensor leave the process's resident set as soon as they are copied. The CPU
// backend moves nothing and returns an empty buffer. NULL with an error in ctx when the device
// is out of memory (the message says how much it needed).
ql_backend_buffer *ql_backend_place_ctx_tensors(ql_backend *be, ql_context *ctx);
// The same for the listed leaves of ctx only (the rest stay where they are): a model split over
// devices places each device's blocks on it. ql_tensors_placed_bytes: what that allocates.
ql_backend_buffer *ql_backend_place_tensors(ql_backend *be, ql_context *ctx, ql_tensor *const *tensors, int n);
size_t      ql_tensors_placed_bytes(const ql_tensor *const *tensors, int n);
// The bytes that placement allocates on a device (a measuring context: as if every leaf had data),
// for plans made before anything is placed.
size_t      ql_ctx_placed_bytes(const ql_context *ctx);
// Frozen weights in the compute type (finetune's --cache-weights). A device multiplies a
// block-quantized (or otherwise typed) frozen weight by dequantising tiles of it into the
// multiply's type before every product - forward, recompute and backward. With memory to spare
// it keeps one copy of each weight in that type instead, made once after placement; the products
// then read the copy: the same values the tiles hold, so the GEMMs get the same inputs. Weights:
// placed 2-D leaves (not views, not QL_FLAG_HOST) of another type than `type`. An f32 parameter
// (a LoRA factor) may have a copy too: every write through this API keeps it equal to the
// parameter's values in `type` (ql_backend_tensor_set and _memset, ql_backend_copy_peer, both
// optimizer steps - a list made after the copies writes them in its update kernel), so the
// factor's products skip their conversion. Writing a parameter's bytes any other way while it
// is flagged leaves its copy stale.
// The bytes ql_backend_cache_weights allocates for them (one buffer: each copy QL_ALIGN-aligned):
size_t      ql_weight_cache_bytes(ql_tensor *const *w, int n, ql_type type);
// Sets (on) or clears QL_FLAG_CACHED on the weights without making copies: a plan made before they
// exist then sizes the multiplies' workspace without tiles (ql_backend_cache_weights sets it too).
void        ql_weight_cache_mark(ql_tensor *const *w, int n, bool on);
// The copies, in ONE new device buffer; each weight flagged and its `extra` pointed at its copy.
// Freeing the buffer clears both. A weight's products must then be in `type`, or in the weight's
// own (those read it in place). NULL with the
// reason in err when a weight is not one of the above, memory is short, or the backend keeps no
// such copies. The CPU converts weights while packing its panels, so a copy in a compute type would
// save nothing; it keeps only Q4_0, Q4_K, Q6_K and NF4 weights (type = the weight's own; 2-D, rows a
// multiple of 8; NF4's rows whole blocks of 64) repacked in groups of 8 rows, which its 8-bit-activation products (decode, prompts) read
// instead of the rows (AVX-512 VNNI builds: ql_cpu_repacks).
ql_backend_buffer *ql_backend_cache_weights(ql_backend *be, ql_tensor *const *w, int n, ql_type type, char *err, size_t err_size);
// Leaves flagged QL_FLAG_HOST (so that the placement above leaves them) moved into ONE buffer of
// pinned host memory, which a GPU's kernels read and write directly over the bus: paged optimizer
// state. The CPU backend moves nothing. NULL when a tensor is not such a leaf or memory is short.
ql_backend_buffer *ql_backend_place_tensors_pinned(ql_backend *be, ql_tensor *const *tensors, int n);
// The host bytes a placed tensor came from (a checkpoint is written from there after a get);
// NULL for a tensor this buffer did not place (and for everything on the CPU backend).
void       *ql_backend_buffer_host_data(const ql_backend_buffer *buf, const ql_tensor *t);

// Host <-> tensor copies of bytes [offset, offset + size) of t's data (side data follows the rows:
// size up to ql_nbytes(t) + t->aux_size). t must be contiguous over that range. QL_OK, or
// QL_ERR_INVALID for a range outside the tensor, QL_ERR_IO when the device reports an error.
ql_status   ql_backend_tensor_set(ql_backend *be, ql_tensor *t, const void *data, size_t offset, size_t size);
ql_status   ql_backend_tensor_get(ql_backend *be, const ql_tensor *t, void *data, size_t offset, size_t size);
ql_status   ql_backend_tensor_memset(ql_backend *be, ql_tensor *t, int value, size_t offset, size_t size);
// dst's bytes (on `to`) from src's (on `from`), the same size, card to card: both CUDA backends
// (a peer copy, direct where the cards have peer access, else staged through host memory by the
// driver; after from's queued work, before to's next). QL_ERR_UNSUPPORTED for any other pair
// (copy through the host: ql_backend_tensor_get then _set).
ql_status   ql_backend_copy_peer(ql_backend *to, ql_tensor *dst, ql_backend *from, const ql_tensor *src);
// The same, queued on the backend's stream behind the graph runs already queued: `data` must stay
// valid (and for get, unread) until ql_backend_synchronize. Pinned host memory makes them truly
// asynchronous on a GPU. The CPU backend copies at once.
ql_status   ql_backend_tensor_set_async(ql_backend *be, ql_tensor *t, const void *data, size_t offset, size_t size);
ql_status   ql_backend_tensor_get_async(ql_backend *be, const ql_tensor *t, void *data, size_t offset, size_t size);
ql_status   ql_backend_synchronize(ql_backend *be);
// Zeroes g's gradient accumulators where they live (ql_graph_zero_grads is the host-only form).
ql_status   ql_backend_graph_zero_grads(ql_backend *be, ql_graph *g);
// true when tensor data of this backend is host memory the caller may touch directly (CPU)
bool        ql_backend_is_host(const ql_backend *be);
// The optimizer's step where the tensors live: AdamW (m_absmax, v_absmax NULL; m, v f32) or
// 8-bit AdamW (m, v I8 codes with their absmax), with the semantics of ql_adamw_update and
// ql_adamw8bit_update below, which the CPU backend runs.
ql_status   ql_backend_adamw_update(ql_backend *be, ql_tensor *param, ql_tensor *m, ql_tensor *v, ql_tensor *m_absmax,
                                    ql_tensor *v_absmax, int64_t step, const ql_adamw_params *p, float grad_scale);
// Sum of squares (accumulated in double) of an f32 tensor's finite elements, and whether every element is finite:
// the global gradient norm and the fp16 loss scaler's inf/nan check, where the gradient lives.
ql_status   ql_backend_grad_stats(ql_backend *be, const ql_tensor *t, double *sumsq, bool *finite);

// The same over every parameter at once (multi-tensor): one launch for the statistics, one for
// the update, one read back, whatever the number of parameters. A list describes the groups once,
// after their tensors are placed (tensors moved later need a new list), for one backend.
typedef struct ql_optim_group {
    ql_tensor *param;                // f32 [n], contiguous, with its f32 gradient param->grad
    ql_tensor *m, *v;                // f32 [n] moments, or I8 [n] codes (8-bit AdamW) with
    ql_tensor *m_absmax, *v_absmax;  // f32 [ceil(n / QL_OPT8_BLOCK)]; NULL for f32 moments
} ql_optim_group;
typedef struct ql_optim_list ql_optim_list;
// The bytes of `store` a list of n groups needs on a device backend (its descriptors, the
// statistics' partial sums and result): an I8 tensor of the caller's, planned and placed with the
// rest of its state, written once here. A host backend (CPU) needs none: store may be NULL there.
size_t      ql_optim_list_bytes(int n_groups);
// NULL (and a message on stderr) for a group that ql_backend_adamw_update would refuse, or a
// store that is missing or too small on a device backend.
ql_optim_list *ql_optim_list_new(ql_backend *be, const ql_optim_group *groups, int n_groups, ql_tensor *store);
void        ql_optim_list_free(ql_optim_list *l);  // NULL-safe; the tensors stay
// Sum of squares (double) of every gradient's finite elements, and whether all are finite, as
// ql_backend_grad_stats summed over the list (CPU: one running sum in group order, element
// order; a device: another order, the same to a double's rounding).
ql_status   ql_backend_grad_stats_multi(ql_backend *be, ql_optim_list *l, double *sumsq, bool *finite);
// One optimizer step of every group, the gradient norm taken where the gradients live: with
// norm = sqrt(sumsq) / loss_scale (the unscaled norm), every gradient is multiplied by
// 1 / loss_scale, and by max_norm / (norm + 1e-6) when max_norm > 0 and norm > max_norm (torch's
// clip_grad_norm_), the factor computed on the device. When an element is not finite nothing is
// updated (the step is skipped: the caller's loss scaler backs off, or it reports the error).
// *sumsq and *finite: the statistics the step used - the one read back to the host.
ql_status   ql_backend_adamw_update_multi(ql_backend *be, ql_optim_list *l, int64_t step, const ql_adamw_params *p,
                                          double loss_scale, float max_norm, double *sumsq, bool *finite);
// The factor that update multiplies every gradient by, from the statistics it took (the unscale
// and the clip, as the backends compute it). A model split over devices sums its stages' sumsq
// and gives each stage's update 1 / this as its loss scale and max_norm 0: one clip for all.
float       ql_optim_step_factor(double sumsq, double loss_scale, float max_norm);

// ---- choosing a backend: the tools' --device, parsed once ----
typedef enum ql_device_kind {
    QL_DEVICE_CPU,   // "cpu"
    QL_DEVICE_GPU,   // "cuda" (GPU 0), "cuda:N"
    QL_DEVICE_AUTO,  // "auto": GPU 0 when this build has a GPU backend and a device is present, else the CPU
} ql_device_kind;
typedef struct ql_device {
    ql_device_kind kind;
    int            index;  // the GPU's (QL_DEVICE_GPU)
} ql_device;
// QL_ERR_INVALID with "'x' is not a device (cpu, cuda, cuda:N, auto)" in err for anything else.
ql_status   ql_device_parse(const char *s, ql_device *d, char *err, size_t err_size);
// The backend d names. n_threads: the CPU backend's (<= 0: ql_cpu_default_threads()). NULL + one
// line in err: no such GPU, a build without one, threads that would not start.
ql_backend *ql_backend_init_device(ql_device d, int n_threads, char *err, size_t err_size);
// ql_device_parse + ql_backend_init_device (device NULL: "auto").
ql_backend *ql_backend_init_by_name(const char *device, int n_threads, char *err, size_t err_size);
// A stand-in for a GPU this machine lacks, of compute capability cc (86 = 8.6): it plans graphs
// as that device's backend would (ql_graph_plan works) and runs and allocates nothing. NULL (and
// err) for QL_DEVICE_CPU, which needs no stand-in.
ql_backend *ql_backend_init_planned(ql_device d, int cc, char *err, size_t err_size);
// One line about a backend for the tools' start: "cpu (2 threads, AVX512F ...)" or
// "cuda: NVIDIA H100 (cc 9.0, 79.1 GiB free of 79.6 GiB)".
void        ql_backend_describe(const ql_backend *be, char *buf, size_t size);

// ---- what a backend is and has: the questions the tools and the trainer ask of any backend ----
typedef struct ql_backend_caps {
    char   name[256];          // "cpu", a device's name, or the card a stand-in plans for
    bool   host;               // tensor data is host memory (ql_backend_is_host)
    bool   plan_only;          // a stand-in (ql_backend_init_planned): plans, runs nothing
    bool   bf16_gemm;          // multiplies bf16 natively (a GPU from cc 8.0; the CPU: ql_cpu_bf16_native)
    int    cc;                 // a GPU's compute capability x 10 (86 = 8.6); 0 for the CPU
    size_t mem_total, mem_free;  // a GPU's memory as of this call; 0 for the CPU and for a stand-in
    // device memory a run holds besides its allocations (a GPU: the context and the GEMM
    // library's workspace); and whether that number is an estimate for this cc, not measured
    size_t context_bytes;
    bool   context_estimated;
    size_t alloc_granularity;  // allocations of a buffer are whole multiples of this (1: exact)
    // device memory a captured CUDA graph holds for its executable, per kernel launch (measured
    // once, on an H200); 0 for the CPU
    size_t graph_launch_bytes;
} ql_backend_caps;
ql_status   ql_backend_get_caps(const ql_backend *be, ql_backend_caps *caps);
// Device memory qlora holds on this backend now and at most so far (its own allocations, not the
// context). false where that is not tracked: the CPU, whose measure is the process's RSS.
bool        ql_backend_memory_used(const ql_backend *be, size_t *in_use, size_t *peak);

// ---- CUDA (qlora-cuda.cu, built with make CUDA=1 / -DQLORA_CUDA=ON) ----
// A build without it still has these: no devices, and ql_backend_cuda_init says why.
typedef struct ql_cuda_device_info {
    char   name[256];
    int    major, minor;       // compute capability (7.5 = T4, 8.0 = A100, 8.6/8.9 = RTX 30xx/40xx, 9.0 = H100)
    size_t total_mem, free_mem;
    int    n_sm;
} ql_cuda_device_info;
int         ql_cuda_device_count(void);   // 0 without a device, or without CUDA built in
ql_status   ql_cuda_device_get_info(int device, ql_cuda_device_info *info, char *err, size_t err_size);
// NULL with one line in err: built without CUDA, no such device, or the device failed to start
ql_backend *ql_backend_cuda_init(int device, char *err, size_t err_size);
bool        ql_backend_is_cuda(const ql_backend *be);
// the device a CUDA backend runs on (QL_ERR_INVALID for any other backend)
ql_status   ql_backend_cuda_info(const ql_backend *be, ql_cuda_device_info *info);
// Training attention (no KV cache) on a device, process-wide: cuBLAS products over chunks of
// queries; the fused forward (FlashAttention-2 on tensor cores) with those products backward; both
// fused; the default: the fused forward and the backward the trainer times on the card
// (ql_train_options.attn_backward), the products until then. The fused kernels where they take
// the shape (bf16 attention, head dim 64, 80, 96 or 128), the products elsewhere.
enum { QL_CUDA_FA_CHUNKED, QL_CUDA_FA_FORWARD, QL_CUDA_FA_FUSED, QL_CUDA_FA_AUTO };
void        ql_cuda_fa_set_mode(int mode);  // (also read once from QLORA_CUDA_FA=chunked|forward|fused|auto)
int         ql_cuda_fa_get_mode(void);
bool        ql_cuda_fa_fused_takes(int64_t head_dim);  // the fused kernels' head dims: 64, 80, 96, 128
// Times one layer's bf16 attention, forward and backward, at [D, T, H] (Hkv key/value heads,
// batch 1, T capped at QL_CUDA_FA_CHOOSE_SEQ) on a CUDA backend with each backward - the fused
// kernels, the products - and returns the faster one's mode (QL_CUDA_FA_FUSED or QL_CUDA_FA_FORWARD)
// with the medians of QL_CUDA_FA_CHOOSE_REPS runs in ms; the mode is left as it was. -1 with err:
// not a CUDA backend, a shape the fused backward does not take, or the device failed (its memory).
#define QL_CUDA_FA_CHOOSE_SEQ  4096
#define QL_CUDA_FA_CHOOSE_REPS 3
int         ql_cuda_fa_choose(ql_backend *be, int64_t D, int64_t H, int64_t Hkv, int64_t T, double *ms_fused,
                              double *ms_products, char *err, size_t err_size);

// Direct matrix multiply on the CPU, for tools and benchmarks: c[M,N] (ldc floats between rows
// n) = sum_k a[k + m*lda] * b[k + n*ldb] (both row-major with K contiguous), using the backend's
// threads and kernels. Equivalent to ql_mul_mat on contiguous f32 tensors.
void ql_cpu_sgemm(ql_backend *cpu, int64_t M, int64_t N, int64_t K,
                  const float *a, int64_t lda, const float *b, int64_t ldb, float *c, int64_t ldc);

// ============================================================================================
// GGUF files (v3; v2 read too): a validating reader over an mmap, and a writer
// ============================================================================================
// The reader checks everything before returning: magic, version, counts against the file size,
// string lengths, key uniqueness, n_dims <= 4, element products that overflow, known type ids
// (qlora's trait table, NF4 included), ne[0] a multiple of the block size, tensor offsets
// aligned and in bounds, tensors not overlapping. Errors are one line naming the file and what
// is wrong. Tensor data is zero-copy (points into the mapping) until ql_gguf_close.

typedef enum ql_gguf_type {
    QL_GGUF_U8 = 0, QL_GGUF_I8 = 1, QL_GGUF_U16 = 2, QL_GGUF_I16 = 3, QL_GGUF_U32 = 4, QL_GGUF_I32 = 5,
    QL_GGUF_F32 = 6, QL_GGUF_BOOL = 7, QL_GGUF_STRING = 8, QL_GGUF_ARRAY = 9, QL_GGUF_U64 = 10,
    QL_GGUF_I64 = 11, QL_GGUF_F64 = 12,
    QL_GGUF_TYPE_COUNT
} ql_gguf_type;

typedef struct ql_gguf ql_gguf;

ql_gguf    *ql_gguf_open(const char *path, char *err, size_t err_size);
// the same checks over a buffer the caller keeps alive (tests, fuzzing)
ql_gguf    *ql_gguf_open_memory(const void *data, size_t size, char *err, size_t err_size);
void        ql_gguf_close(ql_gguf *g);
uint32_t    ql_gguf_version(const ql_gguf *g);
size_t      ql_gguf_alignment(const ql_gguf *g);
size_t      ql_gguf_data_offset(const ql_gguf *g);           // where the tensor data section starts
// true when the tensors' bytes are a read-only mapping of the file (ql_gguf_open), whose pages
// may be dropped and are read again on use (QL_FLAG_MAPPED); false for caller memory
bool        ql_gguf_is_mapped(const ql_gguf *g);

int64_t     ql_gguf_n_kv(const ql_gguf *g);
int64_t     ql_gguf_find_kv(const ql_gguf *g, const char *key);  // -1: absent
const char *ql_gguf_kv_key(const ql_gguf *g, int64_t i);
ql_gguf_type ql_gguf_kv_type(const ql_gguf *g, int64_t i);
// Scalar getters: true on success. Integer getters accept any integer KV type whose value
// fits; ql_gguf_get_f64 accepts f32/f64 (and integers); strings are not NUL-terminated in
// the file: *len gives the length (the returned pointer is NUL-terminated by the reader).
bool        ql_gguf_get_i64(const ql_gguf *g, int64_t i, int64_t *v);
bool        ql_gguf_get_u64(const ql_gguf *g, int64_t i, uint64_t *v);
bool        ql_gguf_get_f64(const ql_gguf *g, int64_t i, double *v);
bool        ql_gguf_get_bool(const ql_gguf *g, int64_t i, bool *v);
const char *ql_gguf_get_str(const ql_gguf *g, int64_t i, size_t *len);   // NULL if not a string
// arrays
ql_gguf_type ql_gguf_arr_type(const ql_gguf *g, int64_t i);              // element type
uint64_t    ql_gguf_arr_n(const ql_gguf *g, int64_t i);
const void *ql_gguf_arr_data(const ql_gguf *g, int64_t i);               // numeric arrays: packed elements
const char *ql_gguf_arr_str(const ql_gguf *g, int64_t i, uint64_t j, size_t *len);  // string arrays

int64_t     ql_gguf_n_tensors(const ql_gguf *g);
int64_t     ql_gguf_find_tensor(const ql_gguf *g, const char *name);    // -1: absent
const char *ql_gguf_tensor_name(const ql_gguf *g, int64_t i);
ql_type     ql_gguf_tensor_type(const ql_gguf *g, int64_t i);
int         ql_gguf_tensor_ne(const ql_gguf *g, int64_t i, int64_t ne[4]); // returns n_dims; unused ne = 1
const void *ql_gguf_tensor_data(const ql_gguf *g, int64_t i);
size_t      ql_gguf_tensor_size(const ql_gguf *g, int64_t i);            // rows + side data

// Writer: KVs keep insertion order (setting an existing key replaces its value in place);
// tensor data is referenced, not copied - it must stay valid until ql_gguf_write returns.
typedef struct ql_gguf_writer ql_gguf_writer;
ql_gguf_writer *ql_gguf_writer_new(void);
void        ql_gguf_writer_free(ql_gguf_writer *w);
void        ql_gguf_set_u32(ql_gguf_writer *w, const char *key, uint32_t v);
void        ql_gguf_set_i32(ql_gguf_writer *w, const char *key, int32_t v);
void        ql_gguf_set_u64(ql_gguf_writer *w, const char *key, uint64_t v);
void        ql_gguf_set_f32(ql_gguf_writer *w, const char *key, float v);
void        ql_gguf_set_bool(ql_gguf_writer *w, const char *key, bool v);
void        ql_gguf_set_str(ql_gguf_writer *w, const char *key, const char *v);
void        ql_gguf_set_arr(ql_gguf_writer *w, const char *key, ql_gguf_type elem, const void *data, uint64_t n);
void        ql_gguf_set_arr_str(ql_gguf_writer *w, const char *key, const char *const *v, uint64_t n);
void        ql_gguf_copy_kv(ql_gguf_writer *w, const ql_gguf *src, int64_t i);   // any type, arrays too
void        ql_gguf_remove_kv(ql_gguf_writer *w, const char *key);
// size must equal ql_type_data_size(type, rows, ne[0]); returns QL_ERR_INVALID (duplicate name,
// name >= 64 bytes, n_dims outside 1..4, bad size) and keeps nothing
ql_status   ql_gguf_add_tensor(ql_gguf_writer *w, const char *name, ql_type type, int n_dims, const int64_t *ne,
                               const void *data, size_t size);
// The same, with data made at write time: fill(arg, dst, size) writes the tensor's size bytes
// into a buffer the writer owns (one, as big as the largest such tensor) and returns false to
// abandon the write. Tensors are made in the order added: a model bigger than memory streams
// from generator to disk, each byte written once.
typedef bool (*ql_gguf_fill_fn)(void *arg, void *dst, size_t size);
ql_status   ql_gguf_add_tensor_gen(ql_gguf_writer *w, const char *name, ql_type type, int n_dims, const int64_t *ne,
                                   size_t size, ql_gguf_fill_fn fill, void *arg);
// Writes to path + ".tmp", fsyncs, renames over path: a crash never leaves half a file.
ql_status   ql_gguf_write(const ql_gguf_writer *w, const char *path, char *err, size_t err_size);

// ============================================================================================
// optimizer math (host memory, f32): the building block the trainers' optimizers use
// ============================================================================================

// ql_adamw_params: see the backends section (the device update takes it too)

// One AdamW step for one parameter: m, v are f32 state of param's shape (zero before step 1),
// step counts from 1, grad = param->grad * grad_scale (e.g. 1 / loss scale).
void ql_adamw_update(ql_tensor *param, ql_tensor *m, ql_tensor *v, int64_t step, const ql_adamw_params *p,
                     float grad_scale);

// 8-bit AdamW, bitsandbytes' blockwise form (its optim/adamw.py, functional.py create_dynamic_map): m and v kept as one byte
// per element, an index into a 256-value dynamic map (signed for m, unsigned for v), scaled by
// an f32 absmax per block of QL_OPT8_BLOCK elements; codes from ql_dynamic_quantize. Tensors under QL_OPT8_MIN_SIZE elements
// keep f32 state (the caller decides; ql_adamw_update then).
#define QL_OPT8_BLOCK    256
#define QL_OPT8_MIN_SIZE 4096
// One step: m, v: QL_TYPE_I8 [n] codes (0 before step 1: the caller zeroes absmax, which makes
// every state 0); m_absmax, v_absmax: f32 [ceil(n / QL_OPT8_BLOCK)]. The state is dequantised,
// updated, the block's new absmax taken, and requantised to the nearest code; the parameter
// moves by -lr sqrt(1 - b2^t) / (1 - b1^t) m / (sqrt(v) + sqrt(1 - b2^t) eps), then decays.
// A non-finite gradient element resets that element's state and leaves it unchanged.
void ql_adamw8bit_update(ql_tensor *param, ql_tensor *m, ql_tensor *m_absmax, ql_tensor *v, ql_tensor *v_absmax,
                         int64_t step, const ql_adamw_params *p, float grad_scale);

// ============================================================================================
// several processes: data parallel over MPI (qlora-mpi.cpp, built with make MPI=1 / -DQLORA_MPI=ON)
// ============================================================================================
// A build without it still has these: one process (rank 0 of 1), every collective a no-op that
// returns QL_OK. With it, `mpirun -np N prog` starts N processes that call ql_dist_init first;
// buffers are host memory and every rank passes the same count in the same order.
//
//     if (ql_dist_init(&argc, &argv, err, sizeof(err)) != QL_OK) { puts(err); return 1; }
//     ...                                               // each rank: its share of the batch
//     ql_dist_allreduce_f32(grads, n);                  // [n] summed over the ranks, on every rank
//     if (ql_dist_rank() == 0) save(...);               // one writer
//     ql_dist_free();
ql_status   ql_dist_init(int *argc, char ***argv, char *err, size_t err_size);  // once, before any other ql_dist_
void        ql_dist_free(void);          // after the last collective (MPI_Finalize); a no-op without MPI
int         ql_dist_rank(void);          // 0 .. size-1
int         ql_dist_size(void);          // the processes of the job (1 without MPI)
int         ql_dist_local_rank(void);    // this process's rank among those on its machine: the GPU it picks
const char *ql_dist_name(void);          // "one process", "Open MPI v4.1.4"
// Sums in place over every rank: after the call each rank holds the same sums.
ql_status   ql_dist_allreduce_f32(float *buf, size_t n);
ql_status   ql_dist_allreduce_f64(double *buf, size_t n);
ql_status   ql_dist_allreduce_i64(int64_t *buf, size_t n);
// The same sum over `count` f32 buffers in the memory of be's device, where they are: one grouped
// NCCL all-reduce (a build with CUDA and MPI: make MPI=1 CUDA=1; the NCCL id broadcast over MPI at
// the first call), after be's queued work. QL_ERR_UNSUPPORTED in any other build or for a host
// backend: the caller stages the buffers through host memory instead.
ql_status   ql_dist_allreduce_device_f32(ql_backend *be, float *const *bufs, const size_t *n, int count);
ql_status   ql_dist_broadcast(void *buf, size_t bytes, int root);  // root's bytes to every rank
ql_status   ql_dist_barrier(void);
// Stops every rank of the job (MPI_Abort) after printing "rank R of N: msg" to stderr; exit code
// `code`. A program's last resort when one rank cannot go on and the others would wait for it in
// a collective forever. Without MPI: prints msg, exits with code.
void        ql_dist_abort(int code, const char *msg);
#ifdef __cplusplus
}
#endif

#endif  // QLORA_H

// ============================================================================================
// implementer part: for backends (qlora-cuda.cu), the library itself and its tests
// ============================================================================================
// NOT a stable API: these names change with the implementation. A program that uses the library
// needs none of them. They are compiled only where QL_INTERNALS is defined before the include,
//     #define QL_INTERNALS
//     #include "qlora.h"
// and a file that included qlora.h before (through another header) may include it again after
// the define. Here: the quantized block formats (defined once, for the C++ and the CUDA code
// alike), host-device helpers, the backend interface a backend fills and the graph state it
// runs on, and the CUDA backend's workspace rules, which the planner in qlora.cpp applies. (A
// guarded tail rather than a second header: the library stays two files.)
#if defined(QL_INTERNALS) && !defined(QLORA_H_INTERNALS)
#define QLORA_H_INTERNALS
#include <math.h>  // sqrt (ql_optim_grad_factor), pow (ql_rope_inv_freq)

#ifdef __cplusplus
extern "C" {
#endif

// ---- quantized block formats ----

#define QL_STATIC_ASSERT(cond, name) typedef char ql_static_assert_##name[(cond) ? 1 : -1]

// ggml's formats (byte for byte as in GGUF files). d, dmin: fp16 bits.
#define QL_QK4_0 32
typedef struct { uint16_t d; uint8_t qs[QL_QK4_0 / 2]; } ql_block_q4_0;  // x = d (q - 8); element j: low nibble of qs[j], j+16: high
QL_STATIC_ASSERT(sizeof(ql_block_q4_0) == 18, q4_0);
typedef struct { uint16_t d, m; uint8_t qs[QL_QK4_0 / 2]; } ql_block_q4_1;  // x = d q + m; nibbles as q4_0
QL_STATIC_ASSERT(sizeof(ql_block_q4_1) == 20, q4_1);
// x = d (q - 16); q: the nibble as q4_0, its fifth bit bit j of qh (little-endian u32) for element j
typedef struct { uint16_t d; uint8_t qh[4]; uint8_t qs[QL_QK4_0 / 2]; } ql_block_q5_0;
QL_STATIC_ASSERT(sizeof(ql_block_q5_0) == 22, q5_0);
typedef struct { uint16_t d, m; uint8_t qh[4]; uint8_t qs[QL_QK4_0 / 2]; } ql_block_q5_1;  // x = d q + m; q as q5_0
QL_STATIC_ASSERT(sizeof(ql_block_q5_1) == 24, q5_1);
#define QL_QK8_0 32
typedef struct { uint16_t d; int8_t qs[QL_QK8_0]; } ql_block_q8_0;       // x = d q
QL_STATIC_ASSERT(sizeof(ql_block_q8_0) == 34, q8_0);
// IQ4_NL: x = d kvalue[q], q: the nibble as q4_0, kvalue the non-linear table below
typedef struct { uint16_t d; uint8_t qs[QL_QK4_0 / 2]; } ql_block_iq4_nl;
QL_STATIC_ASSERT(sizeof(ql_block_iq4_nl) == 18, iq4_nl);
#define QL_IQ4_VALUES {-127, -104, -83, -65, -49, -35, -22, -10, 1, 13, 25, 38, 53, 69, 89, 113}
#define QL_QK_K 256
#define QL_K_SCALE_SIZE 12
typedef struct {  // 8 sub-blocks of 32: x = d sc q - dmin m, 6-bit sc/m packed in scales
    uint16_t d, dmin;
    uint8_t  scales[QL_K_SCALE_SIZE];
    uint8_t  qs[QL_QK_K / 2];
} ql_block_q4_K;
QL_STATIC_ASSERT(sizeof(ql_block_q4_K) == 144, q4_K);
typedef struct {  // as q4_K plus a fifth bit per element in qh
    uint16_t d, dmin;
    uint8_t  scales[QL_K_SCALE_SIZE];
    uint8_t  qh[QL_QK_K / 8];
    uint8_t  qs[QL_QK_K / 2];
} ql_block_q5_K;
QL_STATIC_ASSERT(sizeof(ql_block_q5_K) == 176, q5_K);
typedef struct {  // 16 sub-blocks of 16: x = d sc (q - 32), q = 4 low bits (ql) + 2 high bits (qh)
    uint8_t  ql[QL_QK_K / 2];
    uint8_t  qh[QL_QK_K / 4];
    int8_t   scales[QL_QK_K / 16];
    uint16_t d;
} ql_block_q6_K;
QL_STATIC_ASSERT(sizeof(ql_block_q6_K) == 210, q6_K);
typedef struct {  // 16 sub-blocks of 16: x = d (sc & 15) q - dmin (sc >> 4), q 2 bits
    uint8_t  scales[QL_QK_K / 16];
    uint8_t  qs[QL_QK_K / 4];
    uint16_t d, dmin;
} ql_block_q2_K;
QL_STATIC_ASSERT(sizeof(ql_block_q2_K) == 84, q2_K);
typedef struct {  // 16 sub-blocks of 16: x = d (sc - 32) (q - 4 unless the hmask bit), q 2 bits, 6-bit sc
    uint8_t  hmask[QL_QK_K / 8];
    uint8_t  qs[QL_QK_K / 4];
    uint8_t  scales[12];
    uint16_t d;
} ql_block_q3_K;
QL_STATIC_ASSERT(sizeof(ql_block_q3_K) == 110, q3_K);
typedef struct {  // 8 sub-blocks of 32: x = d (ls - 32) kvalue[q], ls 6 bits: 4 in scales_l, 2 in scales_h
    uint16_t d;
    uint16_t scales_h;
    uint8_t  scales_l[QL_QK_K / 64];
    uint8_t  qs[QL_QK_K / 2];
} ql_block_iq4_xs;
QL_STATIC_ASSERT(sizeof(ql_block_iq4_xs) == 136, iq4_xs);

// NF4 (its layout, values and side data: the quantisation section above)
typedef struct { uint8_t qs[QL_NF4_BLOCK / 2]; } ql_block_nf4;
QL_STATIC_ASSERT(sizeof(ql_block_nf4) == 32, nf4);
// bitsandbytes' decision thresholds (midpoints between neighbouring values, as f32); a
// normalised x gets the number of thresholds it is strictly greater than (ties: lower code)
#define QL_NF4_THRESHOLDS {                                                                       \
    -0.8480964004993439f, -0.6106329262256622f, -0.4599952697753906f, -0.33967943489551544f,      \
    -0.23460740596055984f, -0.13791173323988914f, -0.045525018125772476f, 0.03979014977812767f,   \
    0.1202552504837513f, 0.2035212516784668f, 0.2920137718319893f, 0.3893125355243683f,           \
    0.5016634166240692f, 0.6427869200706482f, 0.8614784181118011f }

// ---- host-device code ----

// Code both the host and CUDA kernels run is written once, here (QL_HD: host and device under nvcc).
#if defined(__CUDACC__)
#define QL_HD __host__ __device__
#else
#define QL_HD
#endif
// ql_dynamic_quantize's body: 7 halving steps from the middle, then the nearer neighbour; at an
// exact midpoint the search path decides (it returns the pivot)
static inline QL_HD uint8_t ql_dynamic_quantize_inline(const float *map, float x) {
    int pivot = 127, upper_pivot = 255, lower_pivot = 0, i;
    float lower = -1.0f, upper = 1.0f, val = map[pivot];
    for (i = 64; i > 0; i >>= 1) {
        if (x > val) {
            lower_pivot = pivot;
            lower = val;
            pivot += i;
        } else {
            upper_pivot = pivot;
            upper = val;
            pivot -= i;
        }
        val = map[pivot];
    }
    if (upper_pivot == 255) upper = map[upper_pivot];
    if (lower_pivot == 0) lower = map[lower_pivot];
    if (x > val) return (uint8_t)(x > (upper + val) * 0.5f ? upper_pivot : pivot);
    return (uint8_t)(x < (lower + val) * 0.5f ? lower_pivot : pivot);
}

// ---- what every backend must compute alike, bit for bit: written once ----

// Dropout's mask (ql_dropout*): element e of the tensor survives where ql_dropout_hash(key, e) >=
// ql_dropout_threshold(p), key = ql_dropout_key(seed, stream). Counter-based (splitmix64's
// finaliser): backward and recompute regenerate it, nothing is stored, and every backend draws
// the same elements.
static inline QL_HD uint64_t ql_mix64(uint64_t z) {
    z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ull;
    z = (z ^ (z >> 27)) * 0x94D049BB133111EBull;
    return z ^ (z >> 31);
}
#define QL_DROPOUT_STEP 0x9E3779B97F4A7C15ull  // the counter's increment per element
static inline QL_HD uint64_t ql_dropout_key(int32_t seed, uint32_t stream) {
    return ql_mix64(((uint64_t)(uint32_t)seed << 32) | stream);
}
static inline QL_HD uint32_t ql_dropout_hash(uint64_t key, uint64_t e) {
    return (uint32_t)(ql_mix64(key + QL_DROPOUT_STEP * (e + 1)) >> 32);
}
static inline QL_HD uint32_t ql_dropout_threshold(float p) { return (uint32_t)((double)p * 4294967296.0); }
// Bytes of one element of a plain type (f32, i32: 4; f16, bf16: 2; i8: 1) - the multiply's and
// the copies' unit on every backend and in the device plans.
static inline QL_HD size_t ql_plain_size(int type) {
    return type == QL_TYPE_F32 || type == QL_TYPE_I32 ? 4 : type == QL_TYPE_I8 ? 1 : 2;
}
// RoPE's inverse frequency of pair i (of n_dims / 2), divided by its frequency factor (1: none).
// One expression for every backend; the bits agree where the two math libraries' pow agree
// (each within an ulp in double, far below the f32 results' rounding).
static inline QL_HD double ql_rope_inv_freq(int i, int n_dims, double base, double ff) { return pow(base, -2.0 * i / n_dims) / ff; }
// A CUDA device multiplies bf16 (cuBLAS, tensor cores) from compute capability 8.0 (cc as 10 major + minor).
static inline QL_HD bool ql_cuda_bf16_gemm(int cc) { return cc >= 80; }

// ---- the CPU backend ----

// ql_cpu_default_threads' rule: cores less the others running, at least 1 (for tests)
int ql_cpu_threads_for(int cores, int others_running);

// ---- the multi-tensor optimizer (ql_optim_list) ----

// The gradient factor of a multi-tensor step, written once for the host and the device:
// 1 / loss_scale, times max_norm / (norm + 1e-6) when max_norm > 0 and the unscaled norm exceeds it
static inline QL_HD float ql_optim_grad_factor(double sumsq, double loss_scale, float max_norm) {
    const double norm = sqrt(sumsq) / loss_scale;
    const float clip = (max_norm > 0 && norm > max_norm) ? (float)(max_norm / (norm + 1e-6)) : 1.0f;
    return (float)(clip / loss_scale);
}
// One group as a device's kernels read it from the list's store (pointers where the tensors live).
typedef struct ql_optim_desc {
    float       *w;                  // [n] the parameter
    const float *g;                  // [n] its gradient
    void        *m, *v;              // [n] f32 moments, or uint8 codes with:
    float       *m_absmax, *v_absmax;  // [ceil(n / QL_OPT8_BLOCK)] (NULL: f32 moments)
    int64_t      n;
    int64_t      chunk0;             // its first chunk of QL_OPT8_BLOCK elements among all groups'
    void        *w16;                // [n] the parameter's copy (ql_backend_cache_weights), rewritten
    int64_t      w16_type;           // with each update; NULL: none
} ql_optim_desc;
QL_STATIC_ASSERT(sizeof(ql_optim_desc) == 80, optim_desc);  // the host writes what the device reads
#define QL_OPT_STATS_BLOCKS 1024  // most blocks of the statistics' launch (min(this, chunks): a fixed summation order per list)
// The store: ql_optim_desc [n], then per statistics block {sum of squares, non-finite count}
// (double [2 * QL_OPT_STATS_BLOCKS]), the result {sumsq, non-finite count} (double [2]), and
// the count of blocks done (uint32, 16 bytes kept).
static inline size_t ql_optim_store_partials(int n) { return (size_t)n * sizeof(ql_optim_desc); }
static inline size_t ql_optim_store_result(int n) { return ql_optim_store_partials(n) + 2 * QL_OPT_STATS_BLOCKS * sizeof(double); }
static inline size_t ql_optim_store_counter(int n) { return ql_optim_store_result(n) + 2 * sizeof(double); }
struct ql_optim_list {
    uint64_t        backend;    // the id of the backend it was made for (the only one it runs on)
    int             n;          // groups
    ql_optim_group *groups;     // [n]
    int64_t         n_chunks;   // chunks of QL_OPT8_BLOCK elements over all groups (each group's last one partial)
    uint8_t        *store;      // the store's data (device memory on a device; NULL on the host)
    int             n_threads;  // the CPU backend's threads, and
    int            *owner;      // [n] the thread that updates group i (largest next to the least loaded)
    void          **w16;        // [n] each parameter's copy (ql_backend_cache_weights) when the list was
    int            *w16_type;   // made (NULL: none), and its type: an update refuses a list whose copies have changed since
};

// ---- the backend interface ----

// What a backend implements (CUDA lives in qlora-cuda.cu and fills this table).
typedef struct ql_backend_i {
    const char *name;
    bool   (*supports_op)(ql_backend *be, const ql_tensor *node);
    size_t (*work_size)(ql_backend *be, const ql_tensor *node);     // per-node workspace bytes
    void  *(*buffer_alloc)(ql_backend *be, size_t size);            // device memory, QL_ALIGN-aligned or NULL
    void   (*buffer_free)(void *ptr);   // needs no backend: a graph may outlive the backend object
    // run nodes [0, n) of g; the planned buffer is bound; return QL_OK or set an error in ctx
    ql_status (*graph_compute)(ql_backend *be, ql_graph *g);
    void   (*free)(ql_backend *be);
    // memory of its own (NULL for the CPU backend: host memory, memcpy). Copies return false on
    // a device error, with the message in err.
    void  *(*host_alloc)(ql_backend *be, size_t size);              // pinned host memory
    void   (*host_free)(void *ptr);
    bool   (*copy)(ql_backend *be, void *dst, const void *src, size_t size, int dir, bool async, char *err, size_t n);
    bool   (*memset)(ql_backend *be, void *dst, int value, size_t size, char *err, size_t n);
    bool   (*synchronize)(ql_backend *be, char *err, size_t n);
    ql_status (*adamw_update)(ql_backend *be, ql_tensor *param, ql_tensor *m, ql_tensor *v, ql_tensor *m_absmax,
                              ql_tensor *v_absmax, int64_t step, const ql_adamw_params *p, float grad_scale);
    ql_status (*grad_stats)(ql_backend *be, const ql_tensor *t, double *sumsq, bool *finite);
    // the multi-tensor forms (NULL: the host's math); their list's store already holds its descriptors
    ql_status (*grad_stats_multi)(ql_backend *be, ql_optim_list *l, double *sumsq, bool *finite);
    ql_status (*adamw_update_multi)(ql_backend *be, ql_optim_list *l, int64_t step, const ql_adamw_params *p,
                                    double loss_scale, float max_norm, double *sumsq, bool *finite);
    // w's elements as `type` into dst ([ne0, ne1] contiguous), the values its products' tiles
    // would hold (ql_backend_cache_weights; NULL: the backend keeps no such copies)
    bool (*weight_copy)(ql_backend *be, const ql_tensor *w, void *dst, ql_type type, char *err, size_t n);
} ql_backend_i;
// a QL_FLAG_CACHED weight's copy (its `extra`, owned by the buffer ql_backend_cache_weights made)
typedef struct ql_weight_copy {
    void   *data;  // [ne0, ne1] in type, device memory
    ql_type type;
} ql_weight_copy;
#define QL_COPY_TO_DEVICE   0   // ql_backend_i.copy directions
#define QL_COPY_TO_HOST     1
#define QL_COPY_ON_DEVICE   2

struct ql_backend {
    ql_backend_i iface;
    void        *impl;
    uint64_t     id;    // unique per backend created in this process (plans remember it)
};
uint64_t ql_backend_new_id(void);  // the id a new backend must carry

// ---- the CUDA backend's workspace rules ----

// In qlora.cpp, not qlora-cuda.cu: a device plan (ql_backend_init_planned) needs no GPU and no
// CUDA build.
// Device memory a CUDA run holds besides its own allocations: the context and cuBLAS's workspace
// (an estimate per compute capability, measured for 9.0: see qlora.cpp). ql_backend_caps.context_bytes.
size_t  ql_cuda_context_bytes(int cc);
// ql_backend_caps.graph_launch_bytes on a GPU (see qlora.cpp: measured once, on an H200)
size_t  ql_cuda_graph_launch_bytes(void);
// cuBLAS's workspace (NVIDIA's recommendation: 32 MiB on Hopper, 4 MiB before), part of the context
// bytes: the backend allocates it and gives it to cuBLAS (cublasSetWorkspace), so that a CUDA graph
// capture allocates nothing.
size_t  ql_cuda_cublas_workspace_bytes(int cc);
// Device memory qlora holds now and at most so far (ql_backend_memory_used); false without CUDA.
bool    ql_cuda_memory_used(size_t *in_use, size_t *peak);
// The same for be's device alone (a model split over devices: each stage's); false without CUDA
bool    ql_cuda_device_memory_used(const ql_backend *be, size_t *in_use, size_t *peak);
// Both peaks put back (each at least what is held now): a measurement's own allocations, such as
// ql_cuda_fa_choose's, are not the run's
void    ql_cuda_memory_set_peaks(const ql_backend *be, size_t peak, size_t device_peak);
// Seconds (median of reps, after two warm-up runs; -1: not a CUDA backend, or the graph could not be
// made or run) of one layer's bf16 attention at [D, T, H] (Hkv key/value heads, batch 1), forward
// only or forward and backward, planned and run under attention mode `mode` (tools/bench attn)
double  ql_cuda_fa_time(ql_backend *be, int mode, int64_t D, int64_t H, int64_t Hkv, int64_t T, bool backward, int reps);
// size bytes from src on from's device to dst on to's (both CUDA backends): a peer copy, card to
// card (direct where the two have peer access - enabled here once per pair - else the driver
// stages it through host memory), after from's queued work and before to's next. QL_ERR_UNSUPPORTED
// without CUDA or for another kind of backend (the caller then goes through the host);
// QL_ERR_IO on a device error.
ql_status ql_cuda_copy_peer(ql_backend *to, void *dst, ql_backend *from, const void *src, size_t size);
// CUDA graphs: a planned graph run again with the same nodes and buffers is captured once (on its
// second run) and replayed with one launch after; runs that time nodes (profile), look for
// non-finite results or poison the buffer stay node by node, and so does a run whose capture or
// instantiation the device refuses (one line on stderr; tried again when the plan changes). On by default; off with the
// environment's QLORA_CUDA_GRAPHS=0 (read by ql_backend_cuda_init) or here. No-ops without CUDA.
typedef struct ql_cuda_graph_counts {
    int64_t eager;     // runs queued node by node
    int64_t captured;  // captures made
    int64_t launched;  // runs as one graph launch (a capture's first included)
    int64_t refused;   // captures the device would not make or instantiate: those runs go node by node
} ql_cuda_graph_counts;
void    ql_cuda_set_graphs(ql_backend *be, bool on);
bool    ql_cuda_get_graph_counts(const ql_backend *be, ql_cuda_graph_counts *counts);  // false: not a CUDA backend
#define QL_CUDA_MM_TILE_ELEMS ((int64_t)1 << 23)  // dequantised weight elements per matmul tile (16 MiB in bf16)
bool    ql_cuda_operand_ok(size_t elem_size, int64_t nb0, int64_t nb1, int64_t K, int64_t X);  // cuBLAS reads it in place
bool    ql_cuda_mm_trows(const ql_tensor *a);          // a = transpose(block-quantized W): dequantised by rows of W
#define QL_CUDA_GEMV_MAX_N 8                           // a product of at most this many tokens may read the packed weight
bool    ql_cuda_mm_gemv(const ql_tensor *node);        // ... and this one does (decode; no workspace but for ql_cuda_mm_q8)
// ... with 8-bit activations (ql_mul_mat_set_prec Q8_0, a Q4_0/Q8_0/Q4_K/Q6_K/NF4 weight, an f32 b;
// QLORA_CUDA_DECODE_DP4A=0: never): b's columns quantised as the CPU's path does, into the workspace,
// then integer dot products. The activations' block (32, or 256 for the k-quants), or 0: not this path
int     ql_cuda_mm_q8(const ql_tensor *node);
// ... and its weight aligned for the 16-byte loads of Q4_K's, Q5_K's and NF4's units: otherwise
// the f32 decode kernels run (the workspace planned for the codes then unused)
bool    ql_cuda_q8_aligned(const ql_tensor *node);
// decode: a norm or SwiGLU whose next node (mm) is such a product reading it writes mm's codes
// too, in the same launch (mm's own quantisation then not launched) - and attention over a KV cache
// for the o projection reading its one token's output; QLORA_CUDA_PAIRS=0: never. qb, or 0
int     ql_cuda_q8_made_by(const ql_tensor *a, const ql_tensor *mm);
// the quantised columns' workspace, N columns of K in blocks of qb: codes int8 [N, K] at 0, scales
// f32 [N, K/qb] at off[0], code sums int32 [N, K/g] at off[1] (g: 32 for qb 32, 8 for qb 256); the size
size_t  ql_cuda_mm_q8_layout(int64_t N, int64_t K, int qb, size_t off[2]);
#define QL_CUDA_THIN_K 64                              // a product over at most this K of a plain a onto a 16-bit c (LoRA's B u) ...
bool    ql_cuda_mm_thin(const ql_tensor *node);        // ... is one kernel, c added as it writes (no workspace)
// QL_OP_MUL_MAT_DROPOUT: LoRA's A dropout(x) in forward (b dropped, a plain a of at most
// QL_CUDA_DROP_M columns) is one kernel that masks x as it reads it (k_mm_drop: no workspace);
// other such products (backward's da) make the dropped operand in the workspace, then multiply
// Few tokens (the grid's token blocks below QL_CUDA_DROP_BLOCKS): K split over that many blocks
// too, each split's sums in the workspace [splits, N, M] f32, then added in split order (a second
// launch): deterministic
#define QL_CUDA_DROP_M 64
#define QL_CUDA_DROP_TOKENS 32                         // tokens (columns) a block
#define QL_CUDA_DROP_KSTEP 64                          // k a step
#define QL_CUDA_DROP_BLOCKS 512
bool    ql_cuda_mm_drop_fused(const ql_tensor *node);   // ... and backward's dx = c + dropout(Aᵀ dc) by k_mm_thin (K = r)
int64_t ql_cuda_mm_drop_splits(const ql_tensor *node, int64_t *k_per_split);  // 1: no split
void    ql_cuda_mm_drop_fused_for_tests(bool on);      // off: every such product by the workspace's path
// launches one node costs on a CUDA device of compute capability cc (ql_census' unit); inplace:
// the planner gave the node its source's memory (ql_plan_entry.inplace; no longer changes the
// count: a product's addend is read where it lives, cuBLASLt's C != D, in place or not)
int64_t ql_cuda_node_launches(const ql_tensor *node, int cc, bool inplace);
// a and b, two rope (or two rope_back) nodes with only views between them, made by one launch:
// the same positions, frequencies and parameters, every dimension rotated, the same tokens, b not
// reading a. The launch is made unless b's result lies over a's source (a's source may die at a
// and the planner give its bytes to b): the census and the backend apply that test alike
bool    ql_cuda_rope_pair(const ql_tensor *a, const ql_tensor *b);
// a, a norm or a norm's backward (f32), and b, its cast to 16 bits read by the products, with only
// views between them: the norm's kernel writes both (no cast launch), unless b lies over a or a
// source of a's
bool    ql_cuda_norm_cast_pair(const ql_tensor *a, const ql_tensor *b);
// d, an adapter's dropped-out copy of the whole of a, a norm's forward in f32: the norm's kernel
// writes it too (k_dropout's bits), after its cast if it has one; QL_CUDA_NORM_DROPS copies at most
#define QL_CUDA_NORM_DROPS 3
bool    ql_cuda_norm_dropout(const ql_tensor *a, const ql_tensor *d);
// d, an adapter's dropped-out copy of the whole of a, SwiGLU's result: SwiGLU's kernel writes it too
bool    ql_cuda_swiglu_dropout(const ql_tensor *a, const ql_tensor *d);
// a, a cast of an f32 view to 16 bits, and b, a whole rotation of a view of the same result (the
// values' gradient and q's, k's rotations back, after attention's backward): the rotation's launch
// writes a too, and b's rope pair joins it
bool    ql_cuda_cast_rope(const ql_tensor *a, const ql_tensor *b);
// a and b, decode's two cache stores (keys, values) at one position into caches of one type,
// b's rows not a's result: one launch writes both
bool    ql_cuda_cache_store_pair(const ql_tensor *a, const ql_tensor *b);
// a and b, decode products of one b with 8-bit activations (ql_cuda_mm_q8) and weights of one
// type, b not reading a's result: one k_gemv_q8 launch makes both (and a third: q, k and v)
bool    ql_cuda_gemv_group(const ql_tensor *a, const ql_tensor *b);
bool    ql_cuda_gemv_q6s(const ql_tensor *w);        // a Q6_K weight the staged decode kernel reads (not grouped)
// a, such a product alone (M a multiple of 256), and b, the norm of its whole result: the product's
// last block norms it (and writes the next product's codes, as the norm's own launch would)
bool    ql_cuda_gemv_norm(const ql_tensor *a, const ql_tensor *b);
// a and b, such a group (gate and up), and s = SwiGLU of their results (M a multiple of 256): the
// last block of each 256 rows makes s's rows (and the next product's codes, past the group's:
// ql_cuda_q8_codes_at)
bool    ql_cuda_gemv_swiglu(const ql_tensor *a, const ql_tensor *b, const ql_tensor *s);
// ... whose results may lie over the products' (in place: the census and the executor skip their overlap test)
bool    ql_cuda_tail_over_ok(const ql_tensor *first, const ql_tensor *node);
size_t  ql_cuda_q8_codes_at(const ql_tensor *mm);    // where product mm's b's codes lie in its workspace (bytes)
// grp[0..3), decode's q, k and v products by one launch, then (n 3 to 6) q's rotation, k's, k's
// cache store, v's: node joins as the next (the launch's tail rotates each head once its rows are
// made, and stores the keys and values)
bool    ql_cuda_gemv_rope(const ql_tensor *const *grp, int n, const ql_tensor *node);
#define QL_CUDA_Q8_COUNTERS 768                      // the counters decode's cross-block codes use (blocks of 256 rows, or of qb)
bool    ql_cuda_launch_pair(const ql_tensor *a, const ql_tensor *b);  // any of the eight (QLORA_CUDA_PAIRS=0: none)
// decode: rk, the second of a rope pair (k's rotation, f32), and st, the cache store of rk's result
// seen as [D, T, Hkv, B]: the rotating launch writes the cache rows too (then the values' store, a
// store pair with st, as well)
bool    ql_cuda_rope_store(const ql_tensor *rk, const ql_tensor *st);
// whether node joins the launch of grp[0..n) (n nodes so far, no launching node between): a pair's
// second (ql_cuda_launch_pair); after a norm and its cast or copy, more adapter copies
// (ql_cuda_norm_dropout); after a cast and a rotation, the rotation's pair (ql_cuda_cast_rope);
// the third of a group of decode products (QL_CUDA_GEMV_GROUP at
// most), or SwiGLU after two (ql_cuda_gemv_swiglu), or the rotations and stores after three
// (ql_cuda_gemv_rope: QL_CUDA_LAUNCH_MAX); after a rope pair, k's cache store and then v's
// (ql_cuda_rope_store).
// The planner, the census and the executor group nodes by this one rule
#define QL_CUDA_GEMV_GROUP 3
#define QL_CUDA_LAUNCH_MAX 7
bool    ql_cuda_launch_joins(const ql_tensor *const *grp, int n, const ql_tensor *node);
bool    ql_cuda_mm_a_direct(const ql_tensor *a, ql_type compute);
// a = W or transpose(W) of a QL_FLAG_CACHED weight W, in a product whose compute type (b's) is
// not W's own: the product reads W's copy in place (no tile, no workspace for a); W, or NULL
const ql_tensor *ql_cuda_mm_cached(const ql_tensor *a, ql_type compute);
bool    ql_cuda_mm_b_direct(const ql_tensor *b);
size_t  ql_cuda_mm_b_bytes(const ql_tensor *b);        // b's contiguous copy in the workspace (0: read in place)
// a's rows in a dequantised tile (all of its row_len = K each): the budget's rows rounded down to
// a multiple of QL_CUDA_MM_TILE_ALIGN (at least that many even over the budget), or all n_rows
#define QL_CUDA_MM_TILE_ALIGN 128
int64_t ql_cuda_mm_tile_rows(int64_t row_len, int64_t n_rows);
size_t  ql_cuda_mm_tile_bytes(int64_t row_len, int64_t n_rows, ql_type compute);  // one tile buffer, aligned
int     ql_cuda_mm_tile_bufs(int64_t row_len, int64_t n_rows, int64_t batches);   // 2 with more than one tile (the overlap) within the budget, else 1
size_t  ql_cuda_work_size(const ql_tensor *node, int cc);  // per-node workspace bytes on a device of compute capability cc
// Attention without a KV cache runs as cuBLAS products over chunks of `chunk` queries: per chunk the
// scores of every head [keys, chunk] in f32 (QL_FLASH_ATTN_SCORE_BYTES at most, for 16 queries at
// least), q, k, v (backward: dO too) packed in the compute type (bf16 when prec asks and cc >= 80,
// else f32), the probabilities (and dS) beside them in bf16 or over the scores in f32. The byte
// offsets of those buffers in the node's workspace, in this order (the fused kernels: delta, dO in
// the compute type unless it is in that type already, and at QL_CUDA_FA_S dK/dV's slices):
enum { QL_CUDA_FA_DELTA, QL_CUDA_FA_K, QL_CUDA_FA_V, QL_CUDA_FA_Q, QL_CUDA_FA_DO, QL_CUDA_FA_S, QL_CUDA_FA_DP, QL_CUDA_FA_P,
       QL_CUDA_FA_DS, QL_CUDA_FA_OUT, QL_CUDA_FA_NBUF };
bool    ql_cuda_fa_fused(const ql_tensor *node);       // training attention on tensor cores (FlashAttention-2, WMMA):
                                                       // prec bf16, d == dv in {64, 80, 96, 128}; bf16 from cc 8.0, fp16 on 7.5;
                                                       // the forward by default, the backward too under QL_CUDA_FA_FUSED
bool    ql_cuda_fa_gemm(const ql_tensor *node);        // this attention runs as products (else: a fused kernel)
bool    ql_cuda_fa2_register_path(const ql_backend *be); // the fused kernels keep scores in registers on this device (bf16,
                                                       // sm_80's fragment layout found by a probe; QLORA_CUDA_FA2_REG=0: off)
int     ql_cuda_fa2_set_pipe(int on);                  // the register path (forward and backward) streams its tiles in two
                                                       // buffers by asynchronous copies (bf16, aligned); 0: one buffer, loaded
                                                       // between barriers (QLORA_CUDA_FA2_PIPE=0) - the same bits; returns the
                                                       // previous. Set it before a plan's first run (a captured CUDA graph keeps
                                                       // the kernels it was captured with)
int     ql_cuda_fa2_kv_split(const ql_tensor *node);  // the fused backward's dK/dV blocks each take 1/split of the group's
                                                       // query heads (1: all); the partials [split][dk | dv] f32 at the
                                                       // layout's QL_CUDA_FA_S, summed in slice order by the dQ kernel
#define QL_CUDA_FA2_SPLIT_BLOCKS 1024                  // ... until the dK/dV grid has this many blocks (64 keys a block)
int     ql_cuda_fa2_set_split(int on);                 // 0: no split (QLORA_CUDA_FA2_SPLIT=0); returns the previous. Set it
                                                       // before a plan is made: the workspace depends on it
size_t  ql_cuda_fa_layout(const ql_tensor *node, int cc, size_t off[QL_CUDA_FA_NBUF], int64_t *chunk, ql_type *compute);
bool    ql_cuda_fa_kv_direct(const ql_tensor *node, ql_type compute);  // k and v read in place (no K, V buffers): one
                                                       // sequence, in the compute type, permuted views of contiguous [D, Hkv, Tk]

// ---- the graph state a backend runs on ----

// What an allocated graph gives the backend that runs it.
typedef struct ql_graph_exec {
    uint8_t *buffer;       // the planned buffer (device memory for a device backend)
    size_t   buffer_size;
    uint8_t *work;         // the per-node workspace inside it
    size_t   work_size;
    bool     poison, check_finite, profile;  // ql_graph_set_poison, _check_finite, _profile
    int      first, last;  // the nodes this run queues: [first, last) (ql_backend_graph_compute_range)
} ql_graph_exec;
void ql_graph_get_exec(const ql_graph *g, ql_graph_exec *ex);
void ql_graph_add_node_seconds(ql_graph *g, int i, double seconds);
// Records check_finite's error for node i (the same message on every backend): `element` is the
// flat index of the first non-finite value, is_nan whether it is a NaN.
void ql_graph_fail_nonfinite(ql_graph *g, int i, int64_t element, bool is_nan);

#ifdef __cplusplus
}
#endif

#endif  // QL_INTERNALS
