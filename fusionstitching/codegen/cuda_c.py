"""CUDA C printer for Kernel IR: one small function or table entry per IR construct.

The source needs no headers: f16 and bf16 are stored as ``unsigned short`` and converted with
PTX ``cvt`` instructions (round to nearest even), the math is the CUDA built-ins NVRTC knows.
Semantics follow ``graph/reference.py`` and ``simulate.py``: max/min propagate NaN, integer
division by zero gives -1 (remainder: the dividend), float → integer truncates and saturates
(NaN → 0, the ``cvt.rzi`` rules), to a narrow integer through i64 and wrapped. Index arithmetic with a positive constant divisor prints as a
plain ``/`` and ``%``, since it never meets those corner cases.
"""

from __future__ import annotations

import math
import struct

from fusionstitching.codegen import kernel_ir as K
from fusionstitching.schedule.packing import LOADS_IN_FLIGHT

C_TYPES = {
    "f32": "float", "f64": "double", "f16": "unsigned short", "bf16": "unsigned short",
    "i32": "int", "i64": "long long", "u32": "unsigned int", "u64": "unsigned long long",
    "u8": "unsigned char", "i8": "signed char", "i16": "short", "bool": "bool",
}

PRELUDE = r"""
__device__ __forceinline__ float fs_h2f(unsigned short h) { float f; asm("cvt.f32.f16 %0, %1;" : "=f"(f) : "h"(h)); return f; }
__device__ __forceinline__ unsigned short fs_f2h(float f) { unsigned short h; asm("cvt.rn.f16.f32 %0, %1;" : "=h"(h) : "f"(f)); return h; }
__device__ __forceinline__ float fs_b2f(unsigned short h) { return __uint_as_float(((unsigned int)h) << 16); }
__device__ __forceinline__ unsigned short fs_f2b(float f) { unsigned short h; asm("cvt.rn.bf16.f32 %0, %1;" : "=h"(h) : "f"(f)); return h; }
// NaN-propagating min/max: one instruction from sm_80 on (the branchy form costs a quarter of a softmax)
#if __CUDA_ARCH__ >= 800
__device__ __forceinline__ float fs_maxf(float a, float b) { float r; asm("max.NaN.f32 %0, %1, %2;" : "=f"(r) : "f"(a), "f"(b)); return r; }
__device__ __forceinline__ float fs_minf(float a, float b) { float r; asm("min.NaN.f32 %0, %1, %2;" : "=f"(r) : "f"(a), "f"(b)); return r; }
#else
__device__ __forceinline__ float fs_maxf(float a, float b) { return a != a ? a : (b != b ? b : fmaxf(a, b)); }
__device__ __forceinline__ float fs_minf(float a, float b) { return a != a ? a : (b != b ? b : fminf(a, b)); }
#endif
__device__ __forceinline__ double fs_maxd(double a, double b) { return a != a ? a : (b != b ? b : fmax(a, b)); }
__device__ __forceinline__ double fs_mind(double a, double b) { return a != a ? a : (b != b ? b : fmin(a, b)); }
// 32-bit integer max/min as a compare and a masked xor: ptxas 13.0 for sm_90 fuses a chain of three
// max/min into VIMNMX3 and drops the negation of an operand (max(a, -b, c) came out as max(a, b, c)),
// and it recognizes a compare-and-select (even one in inline PTX) as max/min; this form it does not
__device__ __forceinline__ int fs_imax(int a, int b) { return b ^ ((a ^ b) & -(int)(a > b)); }
__device__ __forceinline__ int fs_imin(int a, int b) { return b ^ ((a ^ b) & -(int)(a < b)); }
__device__ __forceinline__ unsigned int fs_umax(unsigned int a, unsigned int b) { return b ^ ((a ^ b) & (0u - (unsigned int)(a > b))); }
__device__ __forceinline__ unsigned int fs_umin(unsigned int a, unsigned int b) { return b ^ ((a ^ b) & (0u - (unsigned int)(a < b))); }
template <typename T> __device__ __forceinline__ T fs_idiv(T a, T b) { return b == 0 ? (T)-1 : (b == (T)-1 ? (T)(0 - a) : a / b); }
template <typename T> __device__ __forceinline__ T fs_irem(T a, T b) { return b == 0 ? a : (b == (T)-1 ? (T)0 : a % b); }
template <typename T> __device__ __forceinline__ T fs_ipow(T a, T b) {
  if (b < 0) return a == 1 ? (T)1 : (a == -1 ? ((b & 1) ? (T)-1 : (T)1) : (T)0);
  unsigned long long r = 1, x = (unsigned long long)a;  // wraps without signed overflow
  while (b > 0) { if (b & 1) r *= x; x *= x; b >>= 1; } return (T)r;
}
struct fs_u4 { unsigned int x, y, z, w; };
__device__ __forceinline__ fs_u4 fs_philox(unsigned int c0, unsigned int c1, unsigned int c2, unsigned int c3,
                                           unsigned int k0, unsigned int k1) {
  #pragma unroll
  for (int round = 0; round < 10; ++round) {
    unsigned int hi0 = __umulhi(0xD2511F53u, c0), lo0 = 0xD2511F53u * c0;
    unsigned int hi1 = __umulhi(0xCD9E8D57u, c2), lo1 = 0xCD9E8D57u * c2;
    unsigned int n0 = hi1 ^ c1 ^ k0, n2 = hi0 ^ c3 ^ k1;
    c0 = n0; c1 = lo1; c2 = n2; c3 = lo0;
    k0 += 0x9E3779B9u; k1 += 0xBB67AE85u;
  }
  fs_u4 r = {c0, c1, c2, c3};
  return r;
}
"""

_SPECIALS = {
    "tid": "((int)threadIdx.x)", "bid": "((int)blockIdx.x)", "ntid": "((int)blockDim.x)",
    "nbid": "((int)gridDim.x)", "lane": "((int)threadIdx.x & 31)", "warp": "((int)threadIdx.x >> 5)",
    "nwarp": "((int)blockDim.x >> 5)",
}
_INFIX = {"add": "+", "sub": "-", "mul": "*", "shl": "<<", "shr": ">>", "eq": "==", "ne": "!=", "lt": "<",
          "le": "<=", "gt": ">", "ge": ">="}
_F32_UNARY = {"exp": "expf", "log": "logf", "log1p": "log1pf", "expm1": "expm1f", "tanh": "tanhf", "erf": "erff",
              "sqrt": "sqrtf", "rsqrt": "rsqrtf", "sin": "sinf", "cos": "cosf", "abs": "fabsf", "floor": "floorf",
              "ceil": "ceilf", "rcp": "__frcp_rn"}
_F64_UNARY = {"exp": "exp", "log": "log", "log1p": "log1p", "expm1": "expm1", "tanh": "tanh", "erf": "erf",
              "sqrt": "sqrt", "rsqrt": "rsqrt", "sin": "sin", "cos": "cos", "abs": "fabs", "floor": "floor",
              "ceil": "ceil", "rcp": "__drcp_rn"}
_VECTOR_TYPES = {("f32", 4): "float4", ("f64", 2): "double2", ("i32", 4): "int4", ("i64", 2): "longlong2",
                 ("u32", 4): "uint4", ("f16", 8): "uint4", ("bf16", 8): "uint4", ("bool", 16): "uint4",
                 # 8-byte accesses (``vectorize._chunk``)
                 ("f32", 2): "float2", ("i32", 2): "int2", ("u32", 2): "uint2", ("f16", 4): "uint2",
                 ("bf16", 4): "uint2", ("bool", 8): "uint2",
                 # a 32-bit word of narrow lanes
                 ("f16", 2): "uint1", ("bf16", 2): "uint1", ("bool", 4): "uint1"}
# the narrow integers as words of lanes, like the halves and bools
_VECTOR_TYPES.update({(t, n * 4 // size): v for t, size in (("u8", 1), ("i8", 1), ("i16", 2))
                      for n, v in ((4, "uint4"), (2, "uint2"), (1, "uint1"))})
_PACKED_BITS = {"f16": 16, "bf16": 16, "bool": 8, "u8": 8, "i8": 8, "i16": 16}  # lanes narrower than a word: bits


def render(kernel: K.Kernel) -> str:
    """The CUDA C source of ``kernel``: prelude, signature, body."""
    params = ",\n    ".join([_param(b) for b in kernel.params] + [f"{C_TYPES[p.dtype]} {p.name}" for p in kernel.scalars])
    lines = [f"// {note}" for note in kernel.notes]
    lines.append(PRELUDE.strip())
    lines.append(f'extern "C" __global__ void __launch_bounds__({kernel.threads}) {kernel.name}(\n    {params}) {{')
    for buf in kernel.shared:  # 16-byte aligned: the vectorizer merges shared accesses as global ones
        lines.append(f"  __shared__ __align__(16) {C_TYPES[buf.dtype]} {buf.name}[{buf.extent}];")
    for stmt in kernel.body:
        lines.extend(_stmt(stmt, 1))
    lines.append("}")
    return "\n".join(lines) + "\n"


def _param(b: K.Buffer) -> str:
    const = "const " if b.readonly else ""
    restrict = " __restrict__" if b.noalias else ""
    return f"{const}{C_TYPES[b.dtype]}*{restrict} {b.name}"


# ----------------------------------------------------------------------------------------------
# Statements
# ----------------------------------------------------------------------------------------------


# The unroll factor of a serial loop inside an unrolled one. NVCC unrolls a short constant-trip
# loop whole, and the enclosing unroll then multiplies the copies: NVRTC's time grows with their
# product (a packed kernel of many column sums, each an unrolled loop around a serial one over the
# rows, has one such nest per sub-kernel). Sixteen loads in flight per thread are what one
# 256-thread block per SM needs to keep its share of bandwidth x latency in flight (Little's law
# with an H100's figures: about 15 KB per SM), the worst case a latency-bound loop meets.
NESTED_SERIAL_UNROLL = LOADS_IN_FLIGHT


def _stmt(s: K.Stmt, depth: int, unrolled: bool = False) -> list[str]:
    """The lines of ``s`` at indentation ``depth``; ``unrolled``: inside a loop unrolled whole."""
    pad = "  " * depth
    if isinstance(s, K.Let):
        return [f"{pad}{C_TYPES[s.var.dtype]} {s.var.name} = {expr(s.value)};"]
    if isinstance(s, K.Assign):
        return [f"{pad}{s.var.name} = {expr(s.value)};"]
    if isinstance(s, K.Store):
        return [f"{pad}{s.buffer}[{expr(s.index)}] = {expr(s.value)};"]
    if isinstance(s, K.For):
        head = []
        if s.kind == "unroll":
            head.append(f"{pad}#pragma unroll")
        elif s.kind == "serial" and unrolled and _trips(s) > NESTED_SERIAL_UNROLL:
            head.append(f"{pad}#pragma unroll {NESTED_SERIAL_UNROLL}")
        v = s.var
        head.append(f"{pad}for ({C_TYPES[v.dtype]} {v.name} = {expr(s.start)}; {v.name} < {expr(s.stop)}; "
                    f"{v.name} += {expr(s.step)}) {{")
        return head + _body(s.body, depth + 1, unrolled or s.kind == "unroll") + [f"{pad}}}"]
    if isinstance(s, K.If):
        out = [f"{pad}if ({expr(s.cond)}) {{"] + _body(s.then, depth + 1, unrolled)
        if s.orelse:
            out += [f"{pad}}} else {{"] + _body(s.orelse, depth + 1, unrolled)
        return out + [f"{pad}}}"]
    if isinstance(s, K.Barrier):
        return [f"{pad}__syncthreads();"]
    if isinstance(s, K.Comment):
        return [f"{pad}// {s.text}"]
    if isinstance(s, K.Trap):
        text = "".join(ch if ch.isascii() and ch.isprintable() and ch not in '"\\%' else "_" for ch in s.message)
        text = text.replace("{}", "%lld")
        values = "".join(f", (long long)({expr(v)})" for v in s.values)
        return [f'{pad}printf("fusionstitching: block %d thread %d: {text}\\n", (int)blockIdx.x, (int)threadIdx.x{values});',
                f"{pad}__trap();"]
    if isinstance(s, K.VecLoad):
        return _vec_load(s, pad)
    if isinstance(s, K.VecStore):
        return _vec_store(s, pad)
    raise TypeError(f"no CUDA C for statement {s!r}")


def _trips(loop: K.For) -> float:
    """The trip count of ``loop`` where its bounds are constants, else infinity."""
    bounds = (loop.start, loop.stop, loop.step)
    if not all(isinstance(b, K.Const) for b in bounds) or loop.step.value <= 0:
        return math.inf
    return max(0, -(-(loop.stop.value - loop.start.value) // loop.step.value))


def _body(stmts, depth: int, unrolled: bool = False) -> list[str]:
    return [line for s in stmts for line in _stmt(s, depth, unrolled)]


def _vec_load(s: K.VecLoad, pad: str) -> list[str]:
    dtype = s.vars[0].dtype
    vtype = _VECTOR_TYPES[(dtype, len(s.vars))]
    tmp = f"{s.vars[0].name}_vec"
    lines = [f"{pad}{vtype} {tmp} = *reinterpret_cast<const {vtype}*>(&{s.buffer}[{expr(s.index)}]);"]
    for k, var in enumerate(s.vars):
        lines.append(f"{pad}{C_TYPES[dtype]} {var.name} = {_lane_of(tmp, dtype, k)};")
    return lines


def _vec_store(s: K.VecStore, pad: str) -> list[str]:
    dtype = _storage_type(s.values[0])
    vtype = _VECTOR_TYPES[(dtype, len(s.values))]
    values = [expr(v) for v in s.values]
    bits = _PACKED_BITS.get(dtype)
    if bits is not None:
        per_word = 32 // bits
        if dtype in ("i8", "i16"):  # a negative lane's sign bits stay out of the other lanes
            values = [f"((unsigned int)({v}) & {hex((1 << bits) - 1)}u)" for v in values]
        words = [" | ".join(f"((unsigned int)({values[per_word * k + j]}) << {bits * j})" if j else
                            f"(unsigned int)({values[per_word * k]})" for j in range(per_word))
                 for k in range(len(values) // per_word)]
        init = ", ".join(f"({w})" for w in words)
    else:
        init = ", ".join(values)
    return [f"{pad}*reinterpret_cast<{vtype}*>(&{s.buffer}[{expr(s.index)}]) = make_{vtype}({init});"]


def _lane_of(tmp: str, dtype: str, k: int) -> str:
    fields = "xyzw"
    if dtype in ("f16", "bf16"):
        word = f"{tmp}.{fields[k // 2]}"
        return f"(unsigned short)({word} >> 16)" if k % 2 else f"(unsigned short)({word} & 0xffffu)"
    if dtype == "bool":  # a byte per lane; any nonzero byte is true, as a bool load reads it
        return f"((({tmp}.{fields[k // 4]} >> {8 * (k % 4)}) & 0xffu) != 0u)"
    if dtype in _NARROW:
        per_word = 32 // _PACKED_BITS[dtype]
        bits = _PACKED_BITS[dtype]
        return f"(({C_TYPES[dtype]})(({tmp}.{fields[k // per_word]} >> {bits * (k % per_word)}) & {hex((1 << bits) - 1)}u))"
    return f"{tmp}.{fields[k]}"


def _storage_type(e: K.Expr) -> str:
    return e.dtype


# ----------------------------------------------------------------------------------------------
# Expressions
# ----------------------------------------------------------------------------------------------


def expr(e: K.Expr) -> str:
    return _EXPRS[type(e)](e)


def _const(e: K.Const) -> str:
    v, t = e.value, e.dtype
    if t == "bool":
        return "true" if v else "false"
    if t in ("f32", "f64"):
        v = float(v)
        if math.isnan(v):
            return "__int_as_float(0x7fc00000)" if t == "f32" else "__longlong_as_double(0x7ff8000000000000LL)"
        if math.isinf(v):
            if t == "f32":
                return f"__int_as_float({'0xff800000' if v < 0 else '0x7f800000'})"
            return f"__longlong_as_double({'0xfff0000000000000LL' if v < 0 else '0x7ff0000000000000LL'})"
        if t == "f32":
            v = struct.unpack("f", struct.pack("f", v))[0]
        text = float.hex(v)
        return f"({text}f)" if t == "f32" else f"({text})"
    if t in ("f16", "bf16"):
        raise TypeError("half constants exist only as f32 registers")
    v = int(v)
    if t == "i64":
        return f"({v}LL)" if v != -(2**63) else "(-9223372036854775807LL - 1)"
    if t == "i32":
        return f"({v})" if v != -(2**31) else "(-2147483647 - 1)"
    return f"{v}u" if t == "u32" else f"{v}ull"


def _var(e: K.Var) -> str:
    return e.name


def _special(e: K.Special) -> str:
    return _SPECIALS[e.name]


def _unary(e: K.Unary) -> str:
    x, t = expr(e.x), e.dtype
    if e.op == "neg":
        return f"(-{x})"
    if e.op == "not":
        return f"(!{x})" if t == "bool" else f"(~{x})"
    if e.op == "isnan":
        return f"({x} != {x})"
    if e.op == "sign":
        return f"(({C_TYPES[t]})(({x} > 0) - ({x} < 0)))"  # torch's sign: 0 for NaN
    if e.op == "exp_approx":  # ex2.approx of x·log2(e): a few ulps (``codegen/precision.py``)
        return f"__expf({x})"
    if e.op == "sigmoid_approx":  # 1 / (1 + e^-x) with the approximate exponential and division
        return f"__fdividef(1.0f, 1.0f + __expf(-{x}))"
    if e.op == "sigmoid":
        one = "1.0f" if t == "f32" else "1.0"
        return f"({one} / ({one} + {'expf' if t == 'f32' else 'exp'}(-{x})))"
    if t in ("f32", "f64"):
        return f"{(_F32_UNARY if t == 'f32' else _F64_UNARY)[e.op]}({x})"
    if e.op == "abs":
        return f"({x} < 0 ? -{x} : {x})"
    if e.op in ("floor", "ceil"):
        return x
    raise TypeError(f"no CUDA C for {e.op} on {t}")


def _binary(e: K.Binary) -> str:
    a, b, op = expr(e.a), expr(e.b), e.op
    t = e.a.dtype
    if op in _INFIX:
        return f"({a} {_INFIX[op]} {b})"
    if op in ("and", "or", "xor"):
        if t == "bool":
            return f"({a} {'&&' if op == 'and' else '||' if op == 'or' else '!='} {b})"
        return f"({a} {'&' if op == 'and' else '|' if op == 'or' else '^'} {b})"
    if op in ("max", "min"):
        if t == "f32":
            return f"fs_{op}f({a}, {b})"
        if t == "f64":
            return f"fs_{op}d({a}, {b})"
        if t in ("i32", "bool"):
            return f"(({C_TYPES[t]})fs_i{op}({a}, {b}))"
        if t == "u32":
            return f"fs_u{op}({a}, {b})"
        return f"({a} {'>' if op == 'max' else '<'} {b} ? {a} : {b})"
    if op in ("div", "rem"):
        if t == "f32":
            return f"({a} / {b})" if op == "div" else f"fmodf({a}, {b})"
        if t == "f64":
            return f"({a} / {b})" if op == "div" else f"fmod({a}, {b})"
        if (isinstance(e.b, K.Const) and int(e.b.value) > 0) or isinstance(e.b, K.Param):  # a Param size is positive
            return f"({a} {'/' if op == 'div' else '%'} {b})"
        return f"fs_i{op}<{C_TYPES[t]}>({a}, {b})"
    if op == "pow":
        if t in ("f32", "f64") and isinstance(e.b, K.Const) and e.b.value in (1, 2, 3):
            # small integral exponents as torch's CUDA pow computes them (x, x·x, x·x·x): a powf
            # call per element is tens of instructions (a norm's gradient has pow(x, 1))
            return {1: a, 2: f"({a} * {a})", 3: f"({a} * {a} * {a})"}[int(e.b.value)]
        if t == "f32":
            return f"powf({a}, {b})"
        if t == "f64":
            return f"pow({a}, {b})"
        return f"fs_ipow<{C_TYPES[t]}>({a}, {b})"
    if op == "mulhi":
        return f"__umulhi({a}, {b})" if t == "u32" else f"__umul64hi({a}, {b})"
    raise TypeError(f"no CUDA C for binary {op} on {t}")


def _select(e: K.Select) -> str:
    return f"({expr(e.cond)} ? {expr(e.a)} : {expr(e.b)})"


_FLOAT_TO_INT = {("f32", "i32"): "__float2int_rz", ("f32", "i64"): "__float2ll_rz",
                 ("f64", "i32"): "__double2int_rz", ("f64", "i64"): "__double2ll_rz",
                 ("f32", "u32"): "__float2uint_rz", ("f32", "u64"): "__float2ull_rz",
                 ("f64", "u32"): "__double2uint_rz", ("f64", "u64"): "__double2ull_rz"}


_NARROW = ("u8", "i8", "i16")


def _cast(e: K.Cast) -> str:
    src, dst, x = e.x.dtype, e.dtype, expr(e.x)
    if src == dst:
        return x
    if src == "f16":
        return _cast(K.Cast(K.Var(f"fs_h2f({x})", "f32"), dst))
    if src == "bf16":
        return _cast(K.Cast(K.Var(f"fs_b2f({x})", "f32"), dst))
    if dst in ("f16", "bf16"):
        as_float = x if src == "f32" else f"((float)({x}))"
        return f"{'fs_f2h' if dst == 'f16' else 'fs_f2b'}({as_float})"
    if (src, dst) in _FLOAT_TO_INT:
        return f"{_FLOAT_TO_INT[(src, dst)]}({x})"
    if src in ("f32", "f64") and dst in _NARROW:  # through i64, then wrapped (``graph/reference.py``)
        return _cast(K.Cast(K.Cast(e.x, "i64"), dst))
    if dst == "bool":
        return f"({x} != 0)"
    return f"(({C_TYPES[dst]})({x}))"


def _load(e: K.Load) -> str:
    return f"{e.buffer}[{expr(e.index)}]"


def _philox(e: K.Philox) -> str:
    args = ", ".join(expr(x) for x in e.counter + e.key)
    return f"fs_philox({args}).{'xyzw'[e.word]}"


def _shuffle(e: K.Shuffle) -> str:
    return f"__shfl_{e.kind}_sync(0xffffffffu, {expr(e.value)}, {expr(e.arg)}, {e.width})"


_EXPRS = {
    K.Const: _const, K.Var: _var, K.Param: _var, K.Special: _special, K.Unary: _unary, K.Binary: _binary, K.Select: _select,
    K.Cast: _cast, K.Load: _load, K.Philox: _philox, K.Shuffle: _shuffle,
}
