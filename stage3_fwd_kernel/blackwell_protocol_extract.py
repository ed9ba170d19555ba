"""The extraction half of the Blackwell barrier-protocol checker (``blackwell_protocol.py``): an
abstract interpreter over the Python AST of a kernel class that records, per warp role and in program
order, the operations that matter to its barrier protocol. See ``blackwell_protocol`` for the model
and what it can and cannot prove.
"""
from __future__ import annotations

import ast
import importlib
import inspect
import textwrap
from dataclasses import dataclass, field


class ExtractionError(RuntimeError):
    pass


# ------------------------------------------------------------------------------------------------
# abstract values
# ------------------------------------------------------------------------------------------------
class _Unknown:
    def __repr__(self):
        return "?"


UNKNOWN = _Unknown()
ELECT = "<one thread>"   # the value of `tidx == 0`: a branch one thread takes


@dataclass(frozen=True)
class Thread:            # a thread index: the role's first thread, `local` after `% 128`
    base: int


@dataclass(frozen=True)
class BarPtr:            # an mbarrier: offset into the kernel's barrier array
    off: int

    def __add__(self, k):
        return BarPtr(self.off + k)


@dataclass(frozen=True)
class Region:            # a buffer: ("smem", name, idx...) or ("tmem", lo, hi); cta None = own
    key: tuple
    cta: object = None
    sub: bool = True     # subscripts refine it (ring slot, chunk)


@dataclass(frozen=True)
class RegionPtr:         # `region.iterator + off`
    region: Region
    off: int = 0


@dataclass(frozen=True)
class Layout:
    shape: tuple


@dataclass
class Closure:           # a lambda with its defining environment
    node: ast.Lambda
    env: dict
    fn: object           # the _Func it was defined in


@dataclass
class Bound:             # self.<method>, possibly partially applied
    name: str
    args: tuple = ()
    kwargs: dict = field(default_factory=dict)


@dataclass
class _Func:
    node: ast.FunctionDef
    file: str
    line0: int
    module: object


class _Return(Exception):
    def __init__(self, value):
        self.value = value


def smem(name, *idx, cta=None, sub=True):
    return Region(("smem", name) + tuple(idx), cta, sub)


def tmem(lo, hi, cta=None):
    return Region(("tmem", lo, hi), cta)


# ------------------------------------------------------------------------------------------------
# per-kernel mapping
# ------------------------------------------------------------------------------------------------
@dataclass
class Role:
    name: str
    warp: int            # first warp
    threads: int
    cta: int = 0


@dataclass
class KernelSpec:
    """Which class, which roles, the loop counts, and the few tensor variables that name buffers."""
    name: str
    kernel: object                   # an instance of the kernel class (built from its config)
    roles: list
    overrides: dict                  # variable -> value at every assignment (loop trip counts)
    names: dict                      # "method:var" or "var" -> Region | list | callable(env)
    chunks: dict                     # var -> parts a subscript splits a TMEM region into
    num_threads: int
    ctas: int = 1
    pair_mma: bool = False           # 2-CTA: MMAs touch both CTAs, TMA completes on CTA 0
    smem_alias: dict = field(default_factory=dict)
    bar_names: dict = field(default_factory=dict)   # barrier offset -> name (for traces)
    # a persistent kernel's tile loop (a `while` whose condition the interpreter cannot decide): one
    # dict of overrides per trip, applied on top of `overrides` while that trip is interpreted
    tile_loop: list = field(default_factory=list)


# ------------------------------------------------------------------------------------------------
# the abstract interpreter
# ------------------------------------------------------------------------------------------------
_SYNC_KINDS = ("wait", "arrive", "expect", "commit", "narrive", "nwait")


def _collect_methods(cls) -> dict:
    """name -> _Func for every method of cls and its bases defined in project source."""
    out = {}
    for klass in reversed(cls.__mro__):
        if klass is object:
            continue
        module = importlib.import_module(klass.__module__)
        try:
            src, line0 = inspect.getsourcelines(klass)
        except (OSError, TypeError):
            continue
        tree = ast.parse(textwrap.dedent("".join(src)))
        for node in tree.body[0].body:
            if isinstance(node, ast.FunctionDef):
                out[node.name] = _Func(node, inspect.getsourcefile(klass), line0 - 1, module)
    return out


def _dotted(node) -> str:
    if isinstance(node, ast.Name):
        return node.id
    if isinstance(node, ast.Attribute):
        return _dotted(node.value) + "." + node.attr
    return ""


class Extractor:
    """Interprets the kernel's AST for one role and records its protocol operations."""

    def __init__(self, spec: KernelSpec, role: Role, methods: dict, inits: dict):
        self.spec, self.role, self.methods, self.inits = spec, role, methods, inits
        self.ops: list = []
        self.mult = [role.threads]
        self.stack: list = []        # (_Func) being interpreted, for names and lines

    # --------------------------------------------------------------------------- entry points
    def run(self, method="kernel"):
        fn = self.methods[method]
        env = {p.arg: self._bind(fn, p.arg, UNKNOWN) for p in fn.node.args.args[1:]}
        self._call_func(fn, env)
        return self.ops

    def _where(self, node) -> str:
        fn = self.stack[-1]
        return f"{fn.file.rsplit('/', 1)[-1]}:{fn.line0 + node.lineno} ({fn.node.name})"

    def emit(self, node, kind, *args):
        self.ops.append((kind,) + args + (self._where(node),))

    def _bind(self, fn, name, value, env=None):
        """A variable's value, unless the mapping names it (a buffer) or binds it (a trip count)."""
        spec = self.spec
        if name in spec.overrides:
            return spec.overrides[name]
        mapped = spec.names.get(f"{fn.node.name}:{name}", spec.names.get(name))
        if mapped is None:
            return value
        return mapped(env if env is not None else {}) if callable(mapped) else mapped

    def _call_func(self, fn: _Func, env: dict):
        self.stack.append(fn)
        try:
            self.exec_block(fn.node.body, env)
        except _Return as r:
            return r.value
        finally:
            self.stack.pop()
        return None

    def call_method(self, name, args, kwargs):
        fn = self.methods[name]
        params = [p.arg for p in fn.node.args.args[1:]]
        defaults = fn.node.args.defaults
        env = {}
        for p, d in zip(params[len(params) - len(defaults):], defaults):
            env[p] = self.eval(d, {})
        for p in fn.node.args.kwonlyargs:
            env[p.arg] = UNKNOWN
        for p, v in zip(params, args):
            env[p] = v
        env.update(kwargs)
        for p in list(env):
            env[p] = self._bind(fn, p, env[p], env)
        return self._call_func(fn, env)

    # --------------------------------------------------------------------------- statements
    def exec_block(self, body, env):
        for st in body:
            self.exec_stmt(st, env)

    def exec_stmt(self, st, env):
        if isinstance(st, ast.Assign):
            value = self.eval(st.value, env)
            for t in st.targets:
                self.assign(t, value, env)
        elif isinstance(st, (ast.AnnAssign, ast.AugAssign)):
            if isinstance(st, ast.AugAssign):
                cur = self.eval(st.target, env) if isinstance(st.target, ast.Name) else UNKNOWN
                value = self._binop(st.op, cur, self.eval(st.value, env))
            else:
                value = self.eval(st.value, env) if st.value is not None else UNKNOWN
            self.assign(st.target, value, env)
        elif isinstance(st, ast.Expr):
            self.eval(st.value, env)
        elif isinstance(st, ast.If):
            self.exec_if(st, env)
        elif isinstance(st, ast.For):
            self.exec_for(st, env)
        elif isinstance(st, ast.While):
            self.exec_while(st, env)
        elif isinstance(st, ast.With):
            self.exec_with(st, env)
        elif isinstance(st, ast.Return):
            raise _Return(self.eval(st.value, env) if st.value is not None else None)
        elif isinstance(st, ast.Raise):
            raise ExtractionError(f"{self._where(st)}: reached a raise")
        elif isinstance(st, (ast.Pass, ast.Assert, ast.FunctionDef, ast.ClassDef, ast.Import,
                             ast.ImportFrom)):
            return
        else:
            raise ExtractionError(f"{self._where(st)}: unsupported statement {type(st).__name__}")

    def assign(self, target, value, env):
        if isinstance(target, ast.Name):
            env[target.id] = self._bind(self.stack[-1], target.id, value, env)
        elif isinstance(target, (ast.Tuple, ast.List)):
            vals = value if isinstance(value, (tuple, list)) and len(value) == len(target.elts) else \
                [UNKNOWN] * len(target.elts)
            for t, v in zip(target.elts, vals):
                self.assign(t, v, env)
        # subscript / attribute stores change no protocol state

    def exec_if(self, st, env):
        cond = self.eval(st.test, env)
        if cond is ELECT:
            self.mult.append(1)
            try:
                self.exec_block(st.body, env)
            finally:
                self.mult.pop()
            return
        if cond is UNKNOWN or isinstance(cond, (Region, RegionPtr, Thread)):
            # a data-dependent branch: allowed only if neither side synchronises; its accesses are
            # kept (a superset of what one run does)
            for body in (st.body, st.orelse):
                n = len(self.ops)
                self.exec_block(body, dict(env))
                if any(op[0] in _SYNC_KINDS for op in self.ops[n:]):
                    raise ExtractionError(f"{self._where(st)}: a barrier operation under a condition "
                                          f"the checker cannot decide: {ast.unparse(st.test)}")
            return
        self.exec_block(st.body if cond else st.orelse, env)

    def exec_for(self, st, env):
        it = self.eval(st.iter, env)
        if not isinstance(it, (range, tuple, list)):
            # e.g. the K-steps of one MMA: run once with an unknown index (whole buffers touched)
            n = len(self.ops)
            local = dict(env)
            self.assign(st.target, UNKNOWN, local)
            self.exec_block(st.body, local)
            if any(op[0] in _SYNC_KINDS for op in self.ops[n:]):
                raise ExtractionError(f"{self._where(st)}: a loop with an unknown trip count holds "
                                      f"barrier operations: {ast.unparse(st.iter)}")
            return
        for v in it:
            self.assign(st.target, v, env)
            self.exec_block(st.body, env)

    def exec_while(self, st, env):
        """A persistent tile loop: one trip per entry of spec.tile_loop, each with its overrides (the
        key blocks of that tile). Without them, a while that synchronises is an ExtractionError."""
        trips = self.spec.tile_loop
        if not trips:
            n = len(self.ops)
            self.exec_block(st.body, dict(env))
            if any(op[0] in _SYNC_KINDS for op in self.ops[n:]):
                raise ExtractionError(f"{self._where(st)}: a while loop holds barrier operations and the "
                                      f"mapping gives no trips (KernelSpec.tile_loop): {ast.unparse(st.test)}")
            return
        saved = self.spec.overrides
        for trip in trips:
            self.spec.overrides = {**saved, **trip}
            try:
                self.exec_block(st.body, env)
            finally:
                self.spec.overrides = saved

    def exec_with(self, st, env):
        names = [_dotted(item.context_expr.func) for item in st.items if isinstance(item.context_expr, ast.Call)]
        elect = any(n.endswith("elect_one") for n in names)
        self.mult.append(1 if elect else self.mult[-1])
        try:
            self.exec_block(st.body, env)
        finally:
            self.mult.pop()

    # --------------------------------------------------------------------------- expressions
    def eval(self, node, env):
        meth = getattr(self, "_e_" + type(node).__name__, None)
        if meth is None:
            return UNKNOWN
        return meth(node, env)

    def _e_Constant(self, node, env):
        return node.value

    def _e_Name(self, node, env):
        if node.id in env:
            return env[node.id]
        g = self.stack[-1].module.__dict__.get(node.id, UNKNOWN)
        return g if isinstance(g, (int, float, str, tuple, bool)) else UNKNOWN

    def _e_Tuple(self, node, env):
        return tuple(self.eval(e, env) for e in node.elts)

    _e_List = _e_Tuple

    def _e_Lambda(self, node, env):
        return Closure(node, env, self.stack[-1])

    def _e_Attribute(self, node, env):
        if isinstance(node.value, ast.Name) and node.value.id == "self":
            if node.attr in self.methods:
                return Bound(node.attr)
            v = getattr(self.spec.kernel, node.attr, UNKNOWN)
            return UNKNOWN if v is None and node.attr.startswith("bytes") else v
        base = self.eval(node.value, env)
        if isinstance(base, Region) and node.attr == "iterator":
            return RegionPtr(base)
        if isinstance(base, (Region, RegionPtr)):
            return UNKNOWN
        if base is UNKNOWN or isinstance(base, (Thread, BarPtr, Layout, Closure, Bound)):
            return UNKNOWN
        return getattr(base, node.attr, UNKNOWN)

    def _e_Subscript(self, node, env):
        base = self.eval(node.value, env)
        idx = self.eval(node.slice, env)
        if isinstance(base, Region):
            return self._refine(base, idx, node.value)
        if isinstance(base, (tuple, list, str, dict)) and isinstance(idx, (int, str)):
            return base[idx]
        return UNKNOWN

    def _refine(self, region, idx, value_node):
        """region[..., i]: the ring slot / tile of an SMEM buffer, the chunk of a TMEM range."""
        last = idx[-1] if isinstance(idx, tuple) and idx else idx
        if not region.sub or not isinstance(last, int) or isinstance(last, bool):
            return region
        if region.key[0] == "tmem":
            parts = self.spec.chunks.get(_dotted(value_node))
            if parts is None:
                return region
            lo, hi = region.key[1:]
            w = (hi - lo) // parts
            return Region(("tmem", lo + last * w, lo + (last + 1) * w), region.cta, False)
        return Region(region.key + (last,), region.cta, region.sub)

    def _e_BinOp(self, node, env):
        return self._binop(node.op, self.eval(node.left, env), self.eval(node.right, env))

    def _binop(self, op, a, b):
        conc = (int, float, bool)
        if isinstance(a, conc) and isinstance(b, conc):
            return _PYOPS[type(op)](a, b)
        if isinstance(op, ast.Add) and isinstance(a, str) and isinstance(b, str):
            return a + b
        if isinstance(op, ast.Add) and isinstance(b, int):
            if isinstance(a, BarPtr):
                return BarPtr(a.off + b)
            if isinstance(a, RegionPtr):
                return RegionPtr(a.region, a.off + b)
        if isinstance(a, Region):
            return a
        if isinstance(a, Thread) and isinstance(b, int):
            if isinstance(op, ast.Mod) and b == 128:
                return Thread(a.base % 128)
            if isinstance(op, ast.FloorDiv) and b >= 128 and a.base % b + 127 < b:
                return a.base // b        # uniform across the warpgroup
        return UNKNOWN

    def _e_UnaryOp(self, node, env):
        v = self.eval(node.operand, env)
        if isinstance(v, (int, float, bool)):
            return {ast.Not: lambda x: not x, ast.USub: lambda x: -x, ast.UAdd: lambda x: x,
                    ast.Invert: lambda x: ~x}[type(node.op)](v)
        return UNKNOWN

    def _e_BoolOp(self, node, env):
        vals = [self.eval(v, env) for v in node.values]
        if all(isinstance(v, (int, float, bool)) for v in vals):
            return all(vals) if isinstance(node.op, ast.And) else any(vals)
        return UNKNOWN

    def _e_Compare(self, node, env):
        left = self.eval(node.left, env)
        out = True
        for op, right_node in zip(node.ops, node.comparators):
            right = self.eval(right_node, env)
            if isinstance(left, Thread) and isinstance(op, ast.Eq) and isinstance(right, int):
                return ELECT
            conc = (int, float, bool, str, type(None))
            if isinstance(op, (ast.In, ast.NotIn)) and isinstance(left, conc) and isinstance(right, (tuple, str)):
                out = out and ((left in right) == isinstance(op, ast.In))
                left = right
                continue
            if not (isinstance(left, conc) and isinstance(right, conc)):
                return UNKNOWN
            if isinstance(op, (ast.Is, ast.IsNot, ast.In, ast.NotIn)):
                return UNKNOWN
            out = out and _CMPOPS[type(op)](left, right)
            left = right
        return out

    def _e_IfExp(self, node, env):
        c = self.eval(node.test, env)
        if isinstance(c, (int, bool)):
            return self.eval(node.body if c else node.orelse, env)
        return UNKNOWN

    def _e_ListComp(self, node, env):
        if len(node.generators) != 1:
            return UNKNOWN
        gen = node.generators[0]
        it = self.eval(gen.iter, env)
        if not isinstance(it, (range, tuple, list)):
            return UNKNOWN
        out = []
        for v in it:
            local = dict(env)
            self.assign(gen.target, v, local)
            out.append(self.eval(node.elt, local))
        return out

    def _e_Call(self, node, env):
        return _call(self, node, env)


_PYOPS = {ast.Add: lambda a, b: a + b, ast.Sub: lambda a, b: a - b, ast.Mult: lambda a, b: a * b,
          ast.FloorDiv: lambda a, b: a // b, ast.Mod: lambda a, b: a % b, ast.Div: lambda a, b: a / b,
          ast.BitXor: lambda a, b: a ^ b, ast.BitAnd: lambda a, b: a & b, ast.BitOr: lambda a, b: a | b,
          ast.LShift: lambda a, b: a << b, ast.RShift: lambda a, b: a >> b, ast.Pow: lambda a, b: a ** b}
_CMPOPS = {ast.Eq: lambda a, b: a == b, ast.NotEq: lambda a, b: a != b, ast.Lt: lambda a, b: a < b,
           ast.LtE: lambda a, b: a <= b, ast.Gt: lambda a, b: a > b, ast.GtE: lambda a, b: a >= b}


# ------------------------------------------------------------------------------------------------
# calls: the protocol operations, and how values flow through everything else
# ------------------------------------------------------------------------------------------------
def _regions_in(vals):
    return [v.region if isinstance(v, RegionPtr) else v for v in vals if isinstance(v, (Region, RegionPtr))]


def _target_cta(ex, v):
    """An explicit CTA argument (remote arrive / expect): a known rank, or UNKNOWN."""
    return v if isinstance(v, int) and not isinstance(v, bool) else UNKNOWN


def _bar(ex, node, v):
    if not isinstance(v, BarPtr):
        raise ExtractionError(f"{ex._where(node)}: cannot tell which mbarrier {ast.unparse(node)} is")
    return v.off


def _call(ex: Extractor, node: ast.Call, env):
    name = _dotted(node.func)
    short = name.rsplit(".", 1)[-1]
    # a callable value: lambda, self method, partial
    fval = None
    if isinstance(node.func, ast.Name) and node.func.id in env:
        fval = env[node.func.id]
    elif isinstance(node.func, ast.Attribute) and isinstance(node.func.value, ast.Name) \
            and node.func.value.id == "self" and node.func.attr in ex.methods:
        fval = Bound(node.func.attr)
    args = [ex.eval(a, env) for a in node.args if not isinstance(a, ast.Starred)]
    kwargs = {k.arg: ex.eval(k.value, env) for k in node.keywords if k.arg}
    if isinstance(fval, Closure):
        local = dict(fval.env)
        for p, v in zip(fval.node.args.args, args):
            local[p.arg] = v
        ex.stack.append(fval.fn)
        try:
            return ex.eval(fval.node.body, local)
        finally:
            ex.stack.pop()
    if isinstance(fval, Bound):
        return ex.call_method(fval.name, tuple(fval.args) + tuple(args), {**fval.kwargs, **kwargs})
    if name == "functools.partial" and args and isinstance(args[0], Bound):
        return Bound(args[0].name, tuple(args[1:]), kwargs)
    handler = _HANDLERS.get(short) if name.startswith(("cute.", "cutlass.", "tcgen05.", "common.", "tmem.")) \
        else None
    if handler is not None:
        return handler(ex, node, args, kwargs)
    if name in ("range", "len", "max", "min", "tuple", "list", "int", "isinstance"):
        if all(not isinstance(a, (_Unknown, Region, RegionPtr, Thread)) for a in args):
            return {"range": range, "len": len, "max": max, "min": min, "tuple": tuple, "list": list,
                    "int": int, "isinstance": lambda *a: UNKNOWN}[name](*args)
        return UNKNOWN
    if name in ("const_expr", "cutlass.const_expr", "Int32", "Float32", "Boolean"):
        return args[0] if args else UNKNOWN
    # a method of a concrete Python value (tuple.index, str methods)
    if isinstance(node.func, ast.Attribute):
        recv = ex.eval(node.func.value, env)
        if isinstance(recv, (tuple, list, str, dict)) and not any(a is UNKNOWN for a in args):
            try:
                return getattr(recv, node.func.attr)(*args, **kwargs)
            except (ValueError, KeyError, IndexError, TypeError, AttributeError):
                return UNKNOWN
        if isinstance(recv, (Region, RegionPtr)):
            return UNKNOWN       # region.load(), .store(): values, not buffers
    if short in _OPAQUE:
        return UNKNOWN
    regs = _regions_in(args)
    return regs[0] if regs else UNKNOWN


# calls that build copy atoms, register fragments or coordinate tensors from a buffer: not buffers
_OPAQUE = {"make_tmem_copy", "make_copy_atom", "get_slice", "make_rmem_tensor", "make_fragment_A",
           "make_fragment_B", "make_fragment_C", "make_identity_tensor", "make_rmem_tensor_like",
           "make_tiled_copy_tv", "make_tiled_mma", "make_mma_atom", "partition_shape_C"}


def _h_range(ex, node, args, kwargs):
    if all(isinstance(a, int) for a in args):
        return range(*args)
    return UNKNOWN


def _h_minmax(ex, node, args, kwargs):
    if all(isinstance(a, (int, float)) for a in args):
        return (max if node.func.attr == "max" else min)(*args)
    return UNKNOWN


def _h_wait(ex, node, args, kwargs):
    parity = args[1]
    if not isinstance(parity, int):
        raise ExtractionError(f"{ex._where(node)}: unknown wait parity {ast.unparse(node.args[1])}")
    ex.emit(node, "wait", (ex.role.cta, _bar(ex, node.args[0], args[0])), parity % 2)


def _h_arrive(ex, node, args, kwargs):
    cta = _target_cta(ex, args[1]) if len(args) > 1 else ex.role.cta
    ex.emit(node, "arrive", (cta, _bar(ex, node.args[0], args[0])), ex.mult[-1])


def _h_expect(ex, node, args, kwargs):
    cta = _target_cta(ex, args[2]) if len(args) > 2 else ex.role.cta
    ex.emit(node, "expect", (cta, _bar(ex, node.args[0], args[0])), ex.mult[-1])


def _h_init(ex, node, args, kwargs):
    off = _bar(ex, node.args[0], args[0])
    ex.inits[off] = args[1]


def _h_commit(ex, node, args, kwargs):
    off = _bar(ex, node.args[0], args[0])
    mask = args[1] if len(args) > 1 and isinstance(args[1], int) else None
    ctas = tuple(c for c in range(ex.spec.ctas) if mask >> c & 1) if mask else (ex.role.cta,)
    ex.emit(node, "commit", tuple((c, off) for c in ctas), ex.mult[-1])


def _h_named(ex, node, args, kwargs):
    bid = kwargs.get("barrier_id", args[0] if args else None)
    n = kwargs.get("number_of_threads", args[1] if len(args) > 1 else None)
    if not isinstance(bid, int) or not isinstance(n, int):
        raise ExtractionError(f"{ex._where(node)}: named barrier with unknown id / thread count")
    ex.emit(node, "narrive", (ex.role.cta, bid), n, ex.mult[-1])
    if node.func.attr == "barrier":
        ex.emit(node, "nwait", (ex.role.cta, bid))


def _h_sync_threads(ex, node, args, kwargs):
    ex.emit(node, "narrive", (ex.role.cta, 0), ex.spec.num_threads, ex.mult[-1])
    ex.emit(node, "nwait", (ex.role.cta, 0))


def _h_cluster_arrive(ex, node, args, kwargs):
    ex.emit(node, "narrive", ("cluster", 0), ex.spec.num_threads * ex.spec.ctas, ex.mult[-1])


def _h_cluster_wait(ex, node, args, kwargs):
    ex.emit(node, "nwait", ("cluster", 0))


def _h_copy(ex, node, args, kwargs):
    bar = kwargs.get("tma_bar_ptr")
    src, dst = (args[1], args[2]) if len(args) >= 3 else (args[0], args[1])
    src, dst = (_regions_in([src]) or [None])[0], (_regions_in([dst]) or [None])[0]
    if bar is not None:
        if dst is None:
            raise ExtractionError(f"{ex._where(node)}: a TMA load into a buffer the mapping does not name")
        cta = 0 if ex.spec.pair_mma else ex.role.cta
        ex.emit(node, "tma", dst, (cta, _bar(ex, node, bar)))
    elif src is not None or dst is not None:
        ex.emit(node, "access", (src,) if src else (), (dst,) if dst else ())


def _h_autovec(ex, node, args, kwargs):
    src, dst = (_regions_in([args[0]]) or [None])[0], (_regions_in([args[1]]) or [None])[0]
    if src is not None or dst is not None:
        ex.emit(node, "access", (src,) if src else (), (dst,) if dst else ())


def _h_gemm(ex, node, args, kwargs):
    acc, a, b = args[1], args[2], args[3]
    reads = tuple(r for r in _regions_in([a, b]))
    writes = tuple(_regions_in([acc]))
    if not writes:
        raise ExtractionError(f"{ex._where(node)}: an MMA into an accumulator the mapping does not name")
    ex.emit(node, "mma", reads, writes)


def _h_bulk_peer(ex, node, args, kwargs):
    dst, src, bar, peer = args[0], args[1], args[2], args[4]
    dst, src = _regions_in([dst])[0], _regions_in([src])[0]
    peer = _target_cta(ex, peer)
    ex.emit(node, "bulk", Region(dst.key, peer, False), src, (peer, _bar(ex, node, bar)))


def _h_free(ex, node, args, kwargs):
    ex.emit(node, "access", (), (tmem(0, 512),))


def _h_uniform(ex, node, args, kwargs):
    return args[0]


_HANDLERS = {
    "range": _h_range, "range_constexpr": _h_range, "max": _h_minmax, "min": _h_minmax,
    "mbarrier_wait": _h_wait, "mbarrier_arrive": _h_arrive, "mbarrier_arrive_and_expect_tx": _h_expect,
    "mbarrier_init": _h_init, "commit": _h_commit, "barrier": _h_named, "barrier_arrive": _h_named,
    "sync_threads": _h_sync_threads, "cluster_arrive": _h_cluster_arrive,
    "cluster_arrive_relaxed": _h_cluster_arrive, "cluster_wait": _h_cluster_wait, "copy": _h_copy,
    "autovec_copy": _h_autovec, "gemm": _h_gemm, "bulk_copy_to_peer": _h_bulk_peer, "free": _h_free,
    "make_warp_uniform": _h_uniform,
    "warp_idx": lambda ex, n, a, k: ex.role.warp,
    "thread_idx": lambda ex, n, a, k: (Thread(ex.role.warp * 32), 0, 0),
    "block_idx_in_cluster": lambda ex, n, a, k: ex.role.cta,
    "make_layout": lambda ex, n, a, k: Layout(a[0]) if a and isinstance(a[0], tuple) else UNKNOWN,
    "composition": lambda ex, n, a, k: a[1] if len(a) > 1 and isinstance(a[1], Layout) else
    (_regions_in(a) or [UNKNOWN])[0],
    "make_tensor": lambda ex, n, a, k: _make_tensor(a),
    "Int32": lambda ex, n, a, k: a[0] if a else UNKNOWN,
    "const_expr": lambda ex, n, a, k: a[0],
}


def _make_tensor(args):
    """make_tensor(region.iterator + off, layout): a TMEM sub-range when the layout says how wide."""
    ptr = args[0] if args else None
    if isinstance(ptr, Region):
        return ptr
    if not isinstance(ptr, RegionPtr):
        return UNKNOWN
    r = ptr.region
    if r.key[0] != "tmem":
        return r
    lo, hi = r.key[1] + ptr.off, min(512, r.key[2] + ptr.off)   # unknown layout: same width
    lay = args[1] if len(args) > 1 else None
    if isinstance(lay, Layout) and len(lay.shape) == 2 and isinstance(lay.shape[1], int):
        hi = lo + lay.shape[1]
    return Region(("tmem", lo, hi), r.cta, r.sub)


def extract_ops(spec: KernelSpec) -> tuple:
    """Interpret the kernel once per role: ({role: [op, ...]}, {barrier offset: arrival count}).
    Each op is a tuple (kind, ..., "file:line (method)")."""
    methods = _collect_methods(type(spec.kernel))
    spec.names.setdefault("mbar", BarPtr(0))   # the barrier array's base; _bar() adds the offsets
    inits: dict = {}
    progs = {}
    for role in spec.roles:
        progs[role.name] = Extractor(spec, role, methods, inits).run()
    return progs, inits
