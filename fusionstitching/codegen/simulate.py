"""CPU simulation of Kernel IR with NumPy (DESIGN.md "Kernel IR, CUDA C, simulation").

``simulate(kernel, buffers)`` runs all ``kernel.blocks * kernel.threads`` threads in lockstep and
writes into the given arrays in place. Thread ``t`` of block ``b`` is lane ``b * threads + t`` of a
flat thread axis; every register is an array over all lanes.

[Note: lockstep with predication]
Control flow is an active mask; ``If`` runs both branches under complementary masks. ``For`` keeps
C semantics per thread (``start`` once, ``stop`` before and ``step`` after each iteration; ``kind``
is ignored) and runs while any active thread's ``var < stop``; a non-positive step is an error.
Registers are scoped like C blocks: a ``Let`` lives to the end of its statement list (a loop body
is a new list each iteration) and may shadow an outer name. Expressions are computed on every lane,
garbage included, under ``np.errstate(all="ignore")``; memory accesses and shuffles look at the
mask (``Select``'s operands get the lanes that take them, like C's ``?:``), so an inactive lane's
wild index never raises.

[Note: what lockstep would hide]
Lockstep makes every race come out in one benign order, so owners of memory cells are tracked and
races reported. Global memory: per element of a writable buffer, the block that wrote it and the
block(s) that read it in this launch (params given one array, as an in-place output and its input,
share one history); a read of another block's write, a write over another block's write or read,
and two lanes storing to one element in one statement are errors.
Shared memory (one copy per block, filled with NaN / 0xA5 bytes so that unwritten cells show): the
same per thread since the last ``Barrier`` (RAW, WAW and WAR races). A ``Barrier`` reached by part
of a block and a full-mask ``Shuffle`` reached by part of a warp are errors. Every error names the
statement (``describe``), the buffer and index, and the block and thread.

Numbers follow ``graph/reference.py`` (its operator table): arithmetic in the expression's dtype
(half types in f32, rounded once), C integer division with ``x / 0 == -1`` and ``x % 0 == x``, float
-> int casts truncate, saturate and send NaN to 0, bf16 rounds to nearest even from f32, max/min
propagate NaN. Operands of another type are first converted to it (C conversion rules).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping

import ml_dtypes
import numpy as np

from fusionstitching.codegen import kernel_ir as K
from fusionstitching.graph.reference import _ELEMENTWISE, _f64_to_bf16, philox4x32_10

NUMPY_TYPES: dict[str, np.dtype] = {name: np.dtype(t) for name, t in (
    ("f32", np.float32), ("f64", np.float64), ("f16", np.float16), ("bf16", ml_dtypes.bfloat16),
    ("i32", np.int32), ("i64", np.int64), ("u32", np.uint32), ("u64", np.uint64), ("u8", np.uint8), ("i8", np.int8),
    ("i16", np.int16), ("bool", np.bool_),
)}
_HALF = (np.dtype(np.float16), np.dtype(ml_dtypes.bfloat16))
_COMPUTE = {"f16": "f32", "bf16": "f32"}  # half types are storage only: math on them runs in f32


class SimulationError(RuntimeError):
    """A kernel doing something undefined on a GPU; names the statement, buffer, index and thread."""


def simulate(kernel: K.Kernel, buffers: Mapping[str, np.ndarray]) -> None:
    """Run ``kernel`` on the CPU, writing into ``buffers`` (one 1-D array per global param) in place."""
    machine = _Machine(kernel, _check_buffers(kernel, buffers))
    with np.errstate(all="ignore"):
        machine.run_block(kernel.body, np.ones(machine.n, dtype=bool))


def _check_buffers(kernel: K.Kernel, buffers: Mapping[str, np.ndarray]) -> dict[str, np.ndarray]:
    where = f"kernel {kernel.name}"
    unknown = sorted(set(buffers) - {b.name for b in kernel.params})
    if unknown:
        raise SimulationError(f"{where}: arrays given for unknown buffers {unknown}")
    arrays = {}
    for buf in kernel.params:
        if buf.name not in buffers:
            raise SimulationError(f"{where}: no array given for buffer {buf.name}")
        array = buffers[buf.name]
        expected = f"1-D {NUMPY_TYPES[buf.dtype]} array of >= {buf.extent} elements"
        if not isinstance(array, np.ndarray) or array.ndim != 1 or array.dtype != NUMPY_TYPES[buf.dtype]:
            found = f"{array.dtype}{list(array.shape)}" if isinstance(array, np.ndarray) else type(array).__name__
            raise SimulationError(f"{where}: buffer {buf.name} needs a {expected}, found {found}")
        if array.size < buf.extent:
            raise SimulationError(f"{where}: buffer {buf.name} needs a {expected}, found {array.size}")
        if not buf.readonly and not array.flags.writeable:
            raise SimulationError(f"{where}: buffer {buf.name} is written by the kernel, array is read-only")
        arrays[buf.name] = array
    names = list(arrays)
    for i, first in enumerate(names):  # aliases (an in-place output) must start at the same element
        for second in names[i + 1:]:
            x, y = arrays[first], arrays[second]
            if _alias_key(x) != _alias_key(y) and np.shares_memory(x, y):
                raise SimulationError(f"{where}: buffers {first} and {second} overlap at different offsets")
    return arrays


def _alias_key(array: np.ndarray) -> tuple:
    return array.__array_interface__["data"][0], array.strides, array.dtype.str


# ----------------------------------------------------------------------------------------------
# Values: constants, conversions, operators
# ----------------------------------------------------------------------------------------------


def _const(value: float | bool, dtype: str) -> np.ndarray:
    target = NUMPY_TYPES[dtype]
    if dtype == "bool":
        return np.asarray(bool(value))
    if dtype in K.INT_TYPES and not isinstance(value, float):
        bits = int(value) & ((1 << (8 * target.itemsize)) - 1)  # two's complement wrap
        return np.asarray(bits, dtype=f"u{target.itemsize}").astype(target)
    return _convert(np.asarray(float(value), dtype=np.float64), dtype)


def _convert(x: np.ndarray, dtype: str) -> np.ndarray:
    """C conversion of ``x`` to ``dtype``; floats round once, float -> int truncates and saturates."""
    x = np.asarray(x)
    target = NUMPY_TYPES[dtype]
    if x.dtype == target:
        return x
    if dtype == "bool":
        return x != 0
    if x.dtype == NUMPY_TYPES["bf16"]:
        x = x.astype(np.float32)  # exact
    if x.dtype == np.bool_ or (x.dtype.kind in "iu" and target.kind in "iu"):
        return x.astype(target)  # integers wrap
    if target.kind == "f" or target == NUMPY_TYPES["bf16"]:
        if dtype == "bf16" and x.dtype not in (np.float32, np.float16):
            return _f64_to_bf16(x.astype(np.float64))
        return x.astype(target)
    if target.itemsize < 4:  # a narrow integer: through i64, then wrapped (``graph/reference.py``)
        return _float_to_int(x.astype(np.float64), np.dtype(np.int64)).astype(target)
    return _float_to_int(x.astype(np.float64), target)


def _float_to_int(x: np.ndarray, target: np.dtype) -> np.ndarray:
    """Truncate toward zero, saturate at the type's bounds, NaN -> 0 (``cvt.rzi.sat``)."""
    info = np.iinfo(target)
    low, high = float(info.min), float(info.max) + 1.0  # both exact powers of two (or 0) in f64
    t = np.trunc(np.where(np.isnan(x), 0.0, x))
    result = np.where((t >= low) & (t < high), t, 0.0).astype(target)
    result = np.where(t >= high, info.max, result)
    return np.where(t < low, info.min, result).astype(target)


def _mulhi(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    """High half of the double-width product (``__umulhi``, ``__mulhi``, ``__umul64hi``, ``__mul64hi``)."""
    if a.dtype.itemsize == 4:
        wide = np.int64 if a.dtype.kind == "i" else np.uint64
        return (a.astype(wide) * b.astype(wide) >> 32).astype(a.dtype)
    ua, ub = a.astype(np.uint64), b.astype(np.uint64)  # bit patterns
    mask, shift = np.uint64(0xFFFFFFFF), np.uint64(32)
    a_lo, a_hi, b_lo, b_hi = ua & mask, ua >> shift, ub & mask, ub >> shift
    lo_lo, lo_hi, hi_lo = a_lo * b_lo, a_lo * b_hi, a_hi * b_lo
    middle = (lo_lo >> shift) + (lo_hi & mask) + (hi_lo & mask)
    high = a_hi * b_hi + (lo_hi >> shift) + (hi_lo >> shift) + (middle >> shift)
    if a.dtype.kind == "i":  # signed: subtract the other operand for each negative one (mod 2**64)
        high = high - np.where(a < 0, ub, np.uint64(0)) - np.where(b < 0, ua, np.uint64(0))
    return high.astype(a.dtype)


# Elementwise operators come from the reference (one meaning for both); the rest are kernel-only.
_OPERATORS: dict[str, Callable[..., np.ndarray]] = {**_ELEMENTWISE, "shl": np.left_shift, "shr": np.right_shift,
                                                     "mulhi": _mulhi, "rcp": np.reciprocal,
                                                     # the approximate instructions, as exact as numpy's
                                                     "exp_approx": _ELEMENTWISE["exp"],
                                                     "sigmoid_approx": _ELEMENTWISE["sigmoid"]}
_COMPARE: dict[str, Callable[[np.ndarray, np.ndarray], np.ndarray]] = {
    "eq": np.equal, "ne": np.not_equal, "lt": np.less, "le": np.less_equal, "gt": np.greater, "ge": np.greater_equal,
}


def _compare(op: str, a: np.ndarray, b: np.ndarray) -> np.ndarray:
    a, b = (x.astype(np.float32) if x.dtype in _HALF else x for x in (np.asarray(a), np.asarray(b)))
    if a.dtype != b.dtype:
        common = np.result_type(a.dtype, b.dtype)
        a, b = a.astype(common), b.astype(common)
    return _COMPARE[op](a, b)


def _garbage(dtype: str, size: int) -> np.ndarray:
    """Uninitialised shared memory: NaN for floats, 0xA5 bytes for integers, true for bool."""
    if dtype in K.FLOAT_TYPES or dtype == "bool":
        return np.full(size, np.nan if dtype != "bool" else True, dtype=NUMPY_TYPES[dtype])
    return np.full(size * NUMPY_TYPES[dtype].itemsize, 0xA5, dtype=np.uint8).view(NUMPY_TYPES[dtype])


# ----------------------------------------------------------------------------------------------
# Memory cells: who wrote and who read each element since the last synchronisation
# ----------------------------------------------------------------------------------------------

_NONE, _SEVERAL = -1, -2


class _Cells:
    """Owner (a block for global memory, a thread for shared memory) of each cell's last write and
    reads: ``-1`` none, ``-2`` several readers."""

    def __init__(self, size: int) -> None:
        self.writer = np.full(size, _NONE, dtype=np.int64)
        self.reader = np.full(size, _NONE, dtype=np.int64)
        self._scratch = np.zeros(size, dtype=np.int64)

    def clash(self, cells: np.ndarray, ids: np.ndarray) -> tuple[int, int] | None:
        """``(position, other id)`` of a lane whose cell another of ``ids`` names too, if any."""
        self._scratch[cells] = ids  # one of the duplicates wins; the others see its id
        other = self._scratch[cells]
        j = int(np.argmax(other != ids))
        return (j, int(other[j])) if other[j] != ids[j] else None

    def note_read(self, cells: np.ndarray, owners: np.ndarray) -> None:
        current = self.reader[cells]
        self.reader[cells] = np.where((current == _NONE) | (current == owners), owners, _SEVERAL)
        self._scratch[cells] = owners
        self.reader[cells[self._scratch[cells] != owners]] = _SEVERAL

    def reset(self, rows: np.ndarray, extent: int) -> None:
        """Forget the history of the blocks ``rows`` (a bool mask over blocks) after a barrier."""
        self.writer.reshape(-1, extent)[rows] = _NONE
        self.reader.reshape(-1, extent)[rows] = _NONE


class _Races:
    """The memory model the simulator holds kernels to. Each buffer that is written (a parameter
    written in place or as an output; parameters on one array share one history) and each shared
    array keeps the owner of every cell's last write and reads: a block in global memory, a thread
    in shared memory. A read of a cell another owner wrote, or a write of a cell another owner read
    or wrote, is a race: across blocks within the launch, across threads between two barriers of
    the block. Two lanes storing one cell in one statement is a conflict. Each check returns the
    lane at fault and what it did, or None; the machine raises it with its statement."""

    def __init__(self, kernel: K.Kernel, arrays: dict[str, np.ndarray], ids: np.ndarray, bid: np.ndarray) -> None:
        self.threads, self.blocks = kernel.threads, kernel.blocks
        self.ids, self.bid = ids, bid
        self.shared = kernel.shared
        self.cells: dict[str, _Cells] = {}
        aliases: dict[tuple, list[K.Buffer]] = {}
        for buf in kernel.params:  # params on one array share one history: in-place updates
            aliases.setdefault(_alias_key(arrays[buf.name]), []).append(buf)
        for group in aliases.values():
            if not all(buf.readonly for buf in group):
                if any(buf.readonly for buf in group):  # printed ``const __restrict__``: no alias allowed
                    raise SimulationError(f"kernel {kernel.name}: buffers {[buf.name for buf in group]} share "
                                          f"one array, but the read-only ones promise no aliasing")
                shared_history = _Cells(max(buf.extent for buf in group))
                self.cells.update((buf.name, shared_history) for buf in group)
        for buf in kernel.shared:
            self.cells[buf.name] = _Cells(self.blocks * buf.extent)

    def read(self, buf: K.Buffer, cells: np.ndarray, lanes: np.ndarray) -> tuple[int, str] | None:
        cells_of = self.cells.get(buf.name)
        if cells_of is None:
            return None
        owners = self._owners(buf, lanes)
        writer = cells_of.writer[cells]
        foreign = (writer != _NONE) & (writer != owners)
        if foreign.any():
            j = int(np.argmax(foreign))
            what = f"read of {self._element(buf, cells[j])}, written by {self._who(buf, writer[j])}"
            return lanes[j], self._race(buf, what)
        cells_of.note_read(cells, owners)
        return None

    def write(self, buf: K.Buffer, cells: np.ndarray, lanes: np.ndarray) -> tuple[int, str] | None:
        """The check of a store; with none found, the store's lanes become the cells' writers."""
        cells_of = self.cells[buf.name]
        clash = cells_of.clash(cells, lanes)
        if clash is not None:
            j, other = clash
            block, thread = divmod(other, self.threads)
            scope = "cross-block " if block != self.bid[lanes[j]] else ""
            return lanes[j], (f"{scope}write conflict: {self._element(buf, cells[j])} stored by two threads in "
                              f"one statement (the other is block {block} thread {thread})")
        owners = self._owners(buf, lanes)
        for history, verb in ((cells_of.writer, "written"), (cells_of.reader, "read")):
            seen = history[cells]
            foreign = (seen != _NONE) & (seen != owners)
            if foreign.any():
                j = int(np.argmax(foreign))
                what = f"write of {self._element(buf, cells[j])}, {verb} by {self._who(buf, seen[j])}"
                return lanes[j], self._race(buf, what)
        cells_of.writer[cells] = owners
        return None

    def barrier(self, complete: np.ndarray) -> None:
        """The blocks ``complete`` (a bool mask) passed a barrier: their shared arrays' history ends."""
        for buf in self.shared:
            self.cells[buf.name].reset(complete, buf.extent)

    def _owners(self, buf: K.Buffer, lanes: np.ndarray) -> np.ndarray:
        return self.ids[lanes] if buf.space == "shared" else self.bid[lanes].astype(np.int64)

    def _who(self, buf: K.Buffer, owner: int) -> str:
        if owner == _SEVERAL:
            return "several blocks" if buf.space == "global" else "several threads"
        return f"block {owner}" if buf.space == "global" else f"thread {owner % self.threads}"

    @staticmethod
    def _element(buf: K.Buffer, cell: int) -> str:
        return f"{buf.name}[{cell % buf.extent if buf.space == 'shared' else cell}]"

    @staticmethod
    def _race(buf: K.Buffer, what: str) -> str:
        if buf.space == "global":
            return f"cross-block {what} in this launch"
        return f"shared-memory race: {what} since the last barrier"


# ----------------------------------------------------------------------------------------------
# The machine
# ----------------------------------------------------------------------------------------------


class _Machine:
    def __init__(self, kernel: K.Kernel, arrays: dict[str, np.ndarray]) -> None:
        self.kernel = kernel
        self.threads, self.blocks = kernel.threads, kernel.blocks
        self.n = self.threads * self.blocks
        self.ids = np.arange(self.n, dtype=np.int64)
        tid = (self.ids % self.threads).astype(np.int32)
        self.bid = (self.ids // self.threads).astype(np.int32)
        self.lane = tid % 32
        self.specials = {
            "tid": tid, "bid": self.bid, "ntid": np.int32(self.threads), "nbid": np.int32(self.blocks),
            "lane": self.lane, "warp": tid // 32, "nwarp": np.int32(self.threads // 32),
        }
        self.regs: dict[str, np.ndarray] = {}
        self.memory: dict[str, np.ndarray] = dict(arrays)
        self.races = _Races(kernel, arrays, self.ids, self.bid)
        for buf in kernel.shared:
            self.memory[buf.name] = _garbage(buf.dtype, self.blocks * buf.extent)
        self.stmt: K.Stmt | None = None

    def error(self, what: str, lane: int) -> SimulationError:
        block, thread = divmod(int(lane), self.threads)
        where = f"block {block} thread {thread}; in `{describe(self.stmt)}`"
        return SimulationError(f"kernel {self.kernel.name}: {what}; {where}")

    def full(self, x: np.ndarray) -> np.ndarray:
        return np.broadcast_to(x, (self.n,))

    def buffer(self, name: str) -> K.Buffer:
        try:
            return self.kernel.buffer(name)
        except KeyError as err:
            raise SimulationError(f"{err.args[0]}; in `{describe(self.stmt)}`") from None

    def run_block(self, stmts: tuple[K.Stmt, ...], act: np.ndarray) -> None:
        """Run a statement list for the lanes in ``act``; its ``Let``s end with it."""
        if not act.any():
            return
        scope: dict[str, np.ndarray | None] = {}
        for stmt in stmts:
            self.stmt = stmt
            _STATEMENTS[type(stmt)](self, stmt, act, scope)
        self.restore(scope)

    def declare(self, scope: dict, var: K.Var, value: np.ndarray) -> None:
        if var.name not in scope:
            scope[var.name] = self.regs.get(var.name)
        self.regs[var.name] = self.full(_convert(value, var.dtype))

    def restore(self, scope: dict) -> None:
        for name, previous in scope.items():
            if previous is None:
                self.regs.pop(name, None)
            else:
                self.regs[name] = previous

    def assign(self, var: K.Var, value: np.ndarray, act: np.ndarray) -> None:
        old = self.eval_var(var, act)
        self.regs[var.name] = np.where(act, _convert(value, var.dtype), old)

    def let(self, s: K.Let, act: np.ndarray, scope: dict) -> None:
        self.declare(scope, s.var, self.eval(s.value, act))

    def assign_stmt(self, s: K.Assign, act: np.ndarray, scope: dict) -> None:
        self.assign(s.var, self.eval(s.value, act), act)

    def store(self, s: K.Store, act: np.ndarray, scope: dict) -> None:
        self.write(s.buffer, self.eval(s.index, act), self.eval(s.value, act), act)

    def vec_load(self, s: K.VecLoad, act: np.ndarray, scope: dict) -> None:
        index = self.vector_index(s.buffer, s.index, len(s.vars), act)
        for i, var in enumerate(s.vars):
            value = self.read(s.buffer, index + i, act)
            if var.name in self.regs:
                self.assign(var, value, act)
            else:
                self.declare(scope, var, value)

    def vec_store(self, s: K.VecStore, act: np.ndarray, scope: dict) -> None:
        index = self.vector_index(s.buffer, s.index, len(s.values), act)
        for i, value in enumerate([self.eval(v, act) for v in s.values]):
            self.write(s.buffer, index + i, value, act)

    def for_stmt(self, s: K.For, act: np.ndarray, scope: dict) -> None:
        loop_scope: dict[str, np.ndarray | None] = {}
        self.declare(loop_scope, s.var, self.eval(s.start, act))
        running = act
        while True:
            self.stmt = s
            counter = self.regs[s.var.name]
            running = running & (counter < self.full(_convert(self.eval(s.stop, running), s.var.dtype)))
            if not running.any():
                break
            self.run_block(s.body, running)
            self.stmt = s
            step = _convert(self.eval(s.step, running), s.var.dtype)
            stuck = running & self.full(step <= 0)
            if stuck.any():
                lane = int(np.argmax(stuck))
                raise self.error(f"loop step {self.full(step)[lane]} is not positive", lane)
            counter = self.eval_var(s.var, running)
            self.regs[s.var.name] = np.where(running, counter + step, counter)
        self.restore(loop_scope)

    def if_stmt(self, s: K.If, act: np.ndarray, scope: dict) -> None:
        cond = self.full(_convert(self.eval(s.cond, act), "bool"))
        self.run_block(s.then, act & cond)
        self.run_block(s.orelse, act & ~cond)

    def trap(self, s: K.Trap, act: np.ndarray, scope: dict) -> None:
        if act.any():
            lane = int(np.argmax(act))
            values = [int(np.broadcast_to(self.eval(v, act), act.shape)[lane]) for v in s.values]
            raise IndexError(f"kernel {self.kernel.name}: {s.message.format(*values)} (block {lane // self.threads} thread "
                             f"{lane % self.threads})")

    def barrier(self, s: K.Barrier, act: np.ndarray, scope: dict) -> None:
        per_block = act.reshape(self.blocks, self.threads)
        complete = per_block.all(axis=1)
        partial = per_block.any(axis=1) & ~complete
        if partial.any():
            block = int(np.argmax(partial))
            missing = block * self.threads + int(np.argmin(per_block[block]))
            raise self.error(f"barrier reached by {per_block[block].sum()} of {self.threads} threads of the block "
                             f"(this thread does not reach it)", missing)
        self.races.barrier(complete)

    def vector_index(self, name: str, index: K.Expr, width: int, act: np.ndarray) -> np.ndarray:
        buf = self.buffer(name)
        size = width * NUMPY_TYPES[buf.dtype].itemsize
        if width & (width - 1) or size > 16:
            raise self.error(f"vector of {width} x {buf.dtype} ({size} bytes) on {name} is not a "
                             f"power-of-two width of at most 16 bytes", int(np.argmax(act)))
        if buf.space == "global" and not buf.aligned:
            raise self.error(f"vector access to {name}, which is not declared aligned", int(np.argmax(act)))
        values = self.full(self.eval(index, act)).astype(np.int64)
        misaligned = act & (values % width != 0)
        if misaligned.any():
            lane = int(np.argmax(misaligned))
            raise self.error(f"misaligned vector access {name}[{values[lane]}]: index is not a multiple of "
                             f"{width}", lane)
        return values

    def locate(self, buf: K.Buffer, index: np.ndarray, lanes: np.ndarray) -> np.ndarray:
        """Flat cells of ``buf[index]`` for ``lanes`` (per-block copies for shared), bounds checked."""
        idx = self.full(index)[lanes].astype(np.int64)
        outside = (idx < 0) | (idx >= buf.extent)
        if outside.any():
            j = int(np.argmax(outside))
            raise self.error(f"out-of-bounds {buf.space} access {buf.name}[{idx[j]}] "
                             f"(extent {buf.extent})", lanes[j])
        if buf.space == "shared":
            idx = idx + self.bid[lanes].astype(np.int64) * buf.extent
        return idx

    def read(self, name: str, index: np.ndarray, act: np.ndarray) -> np.ndarray:
        buf = self.buffer(name)
        lanes = np.flatnonzero(act)
        cells = self.locate(buf, index, lanes)
        fault = self.races.read(buf, cells, lanes)
        if fault is not None:
            raise self.error(fault[1], fault[0])
        data = self.memory[name]
        if lanes.size == self.n:
            return data[cells]
        out = np.zeros(self.n, dtype=data.dtype)
        out[lanes] = data[cells]
        return out

    def write(self, name: str, index: np.ndarray, value: np.ndarray, act: np.ndarray) -> None:
        buf = self.buffer(name)
        if buf.readonly:
            raise self.error(f"store to read-only buffer {name}", int(np.argmax(act)))
        lanes = np.flatnonzero(act)
        cells = self.locate(buf, index, lanes)
        fault = self.races.write(buf, cells, lanes)
        if fault is not None:
            raise self.error(fault[1], fault[0])
        self.memory[name][cells] = self.full(_convert(value, buf.dtype))[lanes]

    # -- expressions -----------------------------------------------------------------------------

    def eval(self, e: K.Expr, act: np.ndarray) -> np.ndarray:
        """The value of ``e`` on every lane (or a 0-d array if uniform); ``act`` guards memory."""
        return _EXPRESSIONS[type(e)](self, e, act)

    def eval_const(self, e: K.Const, act: np.ndarray) -> np.ndarray:
        return _const(e.value, e.dtype)

    def eval_var(self, e: K.Var, act: np.ndarray) -> np.ndarray:
        value = self.regs.get(e.name)
        if value is None:
            raise self.error(f"register {e.name} read before its Let", int(np.argmax(act)))
        if value.dtype != NUMPY_TYPES[e.dtype]:
            raise self.error(f"register {e.name} is {value.dtype}, read as {e.dtype}", int(np.argmax(act)))
        return value

    def eval_special(self, e: K.Special, act: np.ndarray) -> np.ndarray:
        return _convert(self.specials[e.name], e.dtype)

    def eval_unary(self, e: K.Unary, act: np.ndarray) -> np.ndarray:
        x = self.eval(e.x, act)
        if e.op == "isnan":
            return np.isnan(_convert(x, "f64"))
        x = _convert(x, _COMPUTE.get(e.dtype, e.dtype))
        return _convert(_OPERATORS[e.op](x), e.dtype)

    def eval_binary(self, e: K.Binary, act: np.ndarray) -> np.ndarray:
        a = self.eval(e.a, act)
        if e.op in ("and", "or") and e.dtype == "bool":  # C's && and ||: b only where it decides
            decided = self.full(_convert(a, "bool"))
            b = self.eval(e.b, act & (decided if e.op == "and" else ~decided))
            return self.full(_convert(_OPERATORS[e.op](decided, self.full(_convert(b, "bool"))), "bool"))
        b = self.eval(e.b, act)
        if e.op in _COMPARE:
            return _compare(e.op, a, b)
        compute = _COMPUTE.get(e.dtype, e.dtype)
        return _convert(_OPERATORS[e.op](_convert(a, compute), _convert(b, compute)), e.dtype)

    def eval_select(self, e: K.Select, act: np.ndarray) -> np.ndarray:
        cond = self.full(_convert(self.eval(e.cond, act), "bool"))  # C's ?: -- loads only where taken
        a, b = self.eval(e.a, act & cond), self.eval(e.b, act & ~cond)
        return np.where(cond, _convert(a, e.dtype), _convert(b, e.dtype))

    def eval_cast(self, e: K.Cast, act: np.ndarray) -> np.ndarray:
        return _convert(self.eval(e.x, act), e.dtype)

    def eval_load(self, e: K.Load, act: np.ndarray) -> np.ndarray:
        return _convert(self.read(e.buffer, self.eval(e.index, act), act), e.dtype)

    def eval_philox(self, e: K.Philox, act: np.ndarray) -> np.ndarray:
        lanes = np.flatnonzero(act)
        words = [self.full(_convert(self.eval(x, act), "u32"))[lanes] for x in e.counter + e.key]
        counters, keys = np.stack(words[:4], axis=-1), np.stack(words[4:], axis=-1)
        result = np.zeros(lanes.size, dtype=np.uint32)
        distinct = keys[:1] if (keys == keys[:1]).all() else np.unique(keys, axis=0)
        for key in distinct:  # the reference takes one key per call; kernels use one seed
            chosen = (keys == key).all(axis=1)
            result[chosen] = philox4x32_10(counters[chosen], (int(key[0]), int(key[1])))[:, e.word]
        out = np.zeros(self.n, dtype=np.uint32)
        out[lanes] = result
        return _convert(out, e.dtype)

    def eval_shuffle(self, e: K.Shuffle, act: np.ndarray) -> np.ndarray:
        width = e.width
        if width <= 0 or width > 32 or width & (width - 1):
            raise self.error(f"shuffle width {width} is not a power of two <= 32", int(np.argmax(act)))
        if self.threads % 32:
            raise self.error(f"shuffle in blocks of {self.threads} threads (partial warps)", int(np.argmax(act)))
        warps = act.reshape(-1, 32)
        partial = warps.any(axis=1) & ~warps.all(axis=1)
        if partial.any():
            w = int(np.argmax(partial))
            lane = w * 32 + int(np.argmin(warps[w]))
            raise self.error(f"shuffle reached by part of the warp ({int(warps[w].sum())} of 32 lanes; "
                             f"this lane is missing)", lane)
        value = self.full(_convert(self.eval(e.value, act), e.dtype))
        arg = self.full(self.eval(e.arg, act)).astype(np.int64)
        lane = self.lane.astype(np.int64)
        segment = lane & ~(width - 1)
        if e.kind == "down":
            source = lane + arg
            valid = (arg >= 0) & (source < segment + width)
        elif e.kind == "xor":
            source = lane ^ (arg & 31)
            valid = source < segment + width  # earlier segments may be read, later ones not
        elif e.kind == "idx":
            source = segment + (arg & (width - 1))
            valid = np.ones(self.n, dtype=bool)
        else:
            raise self.error(f"unknown shuffle kind {e.kind!r}", int(np.argmax(act)))
        return value[self.ids - lane + np.where(valid, source, lane)]


_STATEMENTS: dict[type, Callable[[_Machine, K.Stmt, np.ndarray, dict], None]] = {
    K.Let: _Machine.let, K.Assign: _Machine.assign_stmt, K.Store: _Machine.store,
    K.VecLoad: _Machine.vec_load, K.VecStore: _Machine.vec_store, K.For: _Machine.for_stmt,
    K.If: _Machine.if_stmt, K.Barrier: _Machine.barrier, K.Comment: lambda *args: None, K.Trap: _Machine.trap,
}
_EXPRESSIONS: dict[type, Callable[[_Machine, K.Expr, np.ndarray], np.ndarray]] = {
    K.Const: _Machine.eval_const, K.Var: _Machine.eval_var, K.Special: _Machine.eval_special,
    K.Unary: _Machine.eval_unary, K.Binary: _Machine.eval_binary, K.Select: _Machine.eval_select,
    K.Cast: _Machine.eval_cast, K.Load: _Machine.eval_load, K.Philox: _Machine.eval_philox,
    K.Shuffle: _Machine.eval_shuffle,
}


# ----------------------------------------------------------------------------------------------
# describe: a one-line rendering of a statement or expression, for error messages
# ----------------------------------------------------------------------------------------------

_INFIX = {
    "add": "+", "sub": "-", "mul": "*", "div": "/", "rem": "%", "and": "&", "or": "|", "xor": "^",
    "shl": "<<", "shr": ">>", "eq": "==", "ne": "!=", "lt": "<", "le": "<=", "gt": ">", "ge": ">=",
}


def describe(node: K.Stmt | K.Expr, limit: int = 200) -> str:
    """A short C-like rendering, e.g. ``store out[((bid * 256) + tid)] = x``; bodies are left out."""
    text = _text(node)
    return text if len(text) <= limit else text[: limit - 3] + "..."


def _text(node: K.Stmt | K.Expr) -> str:
    render = _RENDER.get(type(node))
    return render(node) if render is not None else type(node).__name__


def _binary_text(node: K.Binary) -> str:
    if node.op in _INFIX:
        return f"({_text(node.a)} {_INFIX[node.op]} {_text(node.b)})"
    return f"{node.op}({_text(node.a)}, {_text(node.b)})"


def _const_text(node: K.Const) -> str:
    return str(node.value).lower() if isinstance(node.value, bool) else str(node.value)


def _texts(nodes: tuple) -> str:
    return ", ".join(_text(n) for n in nodes)


_RENDER: dict[type, Callable] = {
    K.Const: _const_text,
    K.Var: lambda n: n.name,
    K.Special: lambda n: n.name,
    K.Unary: lambda n: f"{n.op}({_text(n.x)})",
    K.Binary: _binary_text,
    K.Select: lambda n: f"({_text(n.cond)} ? {_text(n.a)} : {_text(n.b)})",
    K.Cast: lambda n: f"({n.dtype}){_text(n.x)}",
    K.Load: lambda n: f"{n.buffer}[{_text(n.index)}]",
    K.Philox: lambda n: f"philox({_texts(n.counter + n.key)})[{n.word}]",
    K.Shuffle: lambda n: f"shfl_{n.kind}({_text(n.value)}, {_text(n.arg)}, {n.width})",
    K.Let: lambda n: f"let {n.var.dtype} {n.var.name} = {_text(n.value)}",
    K.Assign: lambda n: f"{n.var.name} = {_text(n.value)}",
    K.Store: lambda n: f"store {n.buffer}[{_text(n.index)}] = {_text(n.value)}",
    K.VecLoad: lambda n: f"vecload ({_texts(n.vars)}) = {n.buffer}[{_text(n.index)}]",
    K.VecStore: lambda n: f"vecstore {n.buffer}[{_text(n.index)}] = ({_texts(n.values)})",
    K.For: lambda n: f"for {n.var.name} in [{_text(n.start)}, {_text(n.stop)}) step {_text(n.step)}",
    K.If: lambda n: f"if {_text(n.cond)}",
    K.Barrier: lambda n: "barrier",
    K.Comment: lambda n: f"// {n.text}",
    K.Trap: lambda n: f"trap {n.message!r}" + (f" ({_texts(n.values)})" if n.values else ""),
}
