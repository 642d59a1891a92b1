"""The static reading behind the records' rule of ``tests/test_architecture.py``: where each
attribute of the project's classes is written, found by the TYPE of what is written to, never
by its name.

Everything is read with ``ast`` from the sources it is given (the real tree, or a copy with
something planted), never imported. A receiver's type comes from annotations (parameters,
variables, the attributes a class declares in its body or assigns in its methods), from
constructors (``x = Replica(...)``), from the return annotations of functions, methods and
properties (``least_busy(runtime)``), from subscripts of annotated containers
(``list[Replica]``, ``dict[str, ModelRuntime]``), from loop variables over those, and from
``docs/architecture.toml``'s ``[types]`` for the few fields the code must type ``Any``. Names
are resolved through each module's imports to the project's classes. What cannot be resolved
does not count.

A write (``Write``) is: an attribute assigned (plain, annotated, augmented), deleted or set
with ``setattr``/``delattr``/``object.__setattr__``, at any depth (``a.b[0].c += 1`` writes
``c`` of the type of ``a.b[0]``); and a field changed in place: assigned through
(``x.f[k] = v``) or by a mutating method on it, one of the builtin containers' or one of the
project's own classes' (a method is mutating when it writes ``self``'s fields, through any
path or local alias, or calls another mutating method on them: computed from the classes'
source). A mutating call on a field (``replica.prefixes.record(...)``) writes that field of
its holder (``Replica.prefixes``) where the holder is a record; on anything else it writes
the fields the method writes, of the receiver's class (``counts.waited(...)`` writes
``Counts.displace_wait_s`` and ``Counts.recent_waits``).

Not a write: a method writing its own instance through ``self`` (the class's own code; its
callers' mutating calls count instead), and a write to an object the same function made
(``x = Replica(...)`` then ``x.prefixes.record(...)``: construction, before anything else
holds it).
"""

from __future__ import annotations

import ast
from collections.abc import Callable, Iterable, Iterator, Mapping
from dataclasses import dataclass, field
from functools import cache

Sources = dict[str, str]  # "router/x/y.py" -> its text

# The mutating methods of list, dict, set and deque: a call of one changes its receiver.
MUTATORS = frozenset({"add", "discard", "remove", "pop", "popitem", "clear", "update",
                      "setdefault", "append", "extend", "insert", "appendleft", "extendleft",
                      "popleft", "sort", "reverse", "difference_update",
                      "intersection_update", "symmetric_difference_update", "rotate",
                      "__setitem__", "__delitem__"})
# Calls that hand back what a container holds (not a copy): a write through their result
# writes the container.
HOLDING = frozenset({"get", "setdefault", "__getitem__"})

# A type is a set of atoms (a union; empty: unknown). An atom is one of
#   ("cls", "router.x.C")          an instance of a project class
#   ("classobj", "router.x.C")     the class itself
#   ("module", "router.x")         a module
#   ("func", "router.x", "f")      a module-level function
#   ("method", "router.x.C", "m")  a method of a project class, bound or not
#   ("lfunc", id)                  a function defined in a function (``local_functions``)
#   ("gen", origin, args)          a builtin or typing container, args each a type
#   ("bmethod", atom, "m")         a method of such a container
Atom = tuple[object, ...]
Type = frozenset[Atom]
NOTHING: Type = frozenset()

SEQUENCES = frozenset({
    "list", "set", "frozenset", "deque", "Sequence", "MutableSequence", "Iterable", "Iterator",
    "Collection", "AbstractSet", "Set", "MutableSet", "Generator", "AsyncIterator",
    "AsyncIterable", "AsyncGenerator", "KeysView", "ValuesView", "Reversible", "Container",
    "tuple*", "List", "FrozenSet", "Deque"})
MAPPINGS = frozenset({"dict", "Mapping", "MutableMapping", "defaultdict", "OrderedDict",
                      "MappingProxyType", "ChainMap", "Counter", "Dict", "DefaultDict"})
UNWRAP = frozenset({"Final", "ClassVar", "Annotated", "Required", "NotRequired", "ReadOnly",
                    "Awaitable", "Coroutine"})
BUILTIN_ITERS = frozenset({"list", "tuple", "sorted", "reversed", "set", "frozenset", "iter"})
BUILTIN_PICKS = frozenset({"max", "min", "next"})


def module_name(path: str) -> str:
    return path.removesuffix(".py").removesuffix("/__init__").replace("/", ".")


def gen(origin: str, *args: Type) -> Type:
    return frozenset({("gen", origin, tuple(args))})


def cls_names(t: Type) -> list[str]:
    return [str(a[1]) for a in t if a[0] == "cls"]


def element(t: Type) -> Type:
    """What iterating a value of type ``t`` yields."""
    out: set[Atom] = set()
    for atom in t:
        if atom[0] != "gen":
            continue
        origin, args = atom[1], atom[2]
        assert isinstance(args, tuple)
        if origin == "tuple":
            for arg in args:
                out |= arg
        elif (origin in SEQUENCES or origin in MAPPINGS) and args:
            out |= args[0]
    return frozenset(out)


def item(t: Type, index: ast.expr) -> Type:
    """What ``value[index]`` is, for a value of type ``t``."""
    out: set[Atom] = set()
    for atom in t:
        if atom[0] != "gen":
            continue
        origin, args = atom[1], atom[2]
        assert isinstance(args, tuple)
        if isinstance(index, ast.Slice):
            out.add(atom)
        elif origin == "tuple":
            if isinstance(index, ast.Constant) and isinstance(index.value, int) \
                    and -len(args) <= index.value < len(args):
                out |= args[index.value]
            else:
                for arg in args:
                    out |= arg
        elif origin in MAPPINGS and len(args) == 2:
            out |= args[1]
        elif origin in SEQUENCES and args:
            out |= args[0]
    return frozenset(out)


@dataclass
class Module:
    name: str
    path: str
    tree: ast.Module
    imports: dict[str, str] = field(default_factory=dict)  # local name -> dotted target
    classes: dict[str, ast.ClassDef] = field(default_factory=dict)
    functions: dict[str, ast.FunctionDef | ast.AsyncFunctionDef] = field(default_factory=dict)
    globals: dict[str, list[tuple[ast.expr | None, ast.expr | None]]] = field(
        default_factory=dict)  # name -> [(annotation, value)]


@dataclass
class Klass:
    name: str  # dotted
    module: Module
    node: ast.ClassDef
    bases: list[str] = field(default_factory=list)
    annotated: dict[str, ast.expr] = field(default_factory=dict)  # class body annotations
    assigned: dict[str, list[tuple[str, ast.expr | None, ast.expr | None]]] = field(
        default_factory=dict)  # field -> [(method, annotation, value)] of self.f = ...
    slots: set[str] = field(default_factory=set)
    methods: dict[str, ast.FunctionDef | ast.AsyncFunctionDef] = field(default_factory=dict)
    properties: set[str] = field(default_factory=set)

    def fields(self) -> set[str]:
        return set(self.annotated) | set(self.assigned) | self.slots


@dataclass(frozen=True)
class Write:
    """One write of ``cls.field`` (``cls`` dotted) in ``path``, in function ``scope``."""

    path: str
    scope: str  # the function's qualified name in its module; "<module>" at the top
    line: int
    cls: str
    field: str
    code: str
    # "set": the attribute assigned or deleted; "field": the field changed in place (assigned
    # through, or by a mutating call on it); "method": a mutating method called on the
    # receiver, writing the fields that method writes
    kind: str = "set"
    via: str = ""  # the mutating method, for a write by a call
    within: str = ""  # the class whose method (or a function in it) writes, if any

    @property
    def short(self) -> str:
        return f"{self.cls.rpartition('.')[2]}.{self.field}"

    @property
    def where(self) -> str:
        return f"{self.path}:{self.scope}"


@cache
def parse(text: str) -> ast.Module:
    return ast.parse(text)


def _flatten(targets: Iterable[ast.expr]) -> Iterator[ast.expr]:
    for target in targets:
        if isinstance(target, ast.Tuple | ast.List):
            yield from _flatten(target.elts)
        elif isinstance(target, ast.Starred):
            yield from _flatten([target.value])
        else:
            yield target


def _own_nodes(body: Iterable[ast.AST]) -> Iterator[ast.AST]:
    """Every node of ``body`` but those of nested functions and classes (whose own scopes
    are read on their own; a lambda's body is read with its function's); the nested
    definitions themselves are yielded."""
    stack = list(body)[::-1]
    while stack:
        node = stack.pop()
        yield node
        if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef | ast.ClassDef):
            continue
        stack.extend(list(ast.iter_child_nodes(node))[::-1])


def _decorators(fn: ast.FunctionDef | ast.AsyncFunctionDef) -> set[str]:
    names = set()
    for d in fn.decorator_list:
        d = d.func if isinstance(d, ast.Call) else d
        names.add(d.attr if isinstance(d, ast.Attribute) else getattr(d, "id", ""))
    return names


@dataclass
class Effect:
    """What a node does to some object, before types: ``set`` writes ``obj.<name>``;
    ``call`` calls method ``name`` on ``obj`` (a write if that method mutates)."""

    node: ast.AST
    kind: str  # "set" | "call"
    obj: ast.expr
    name: str


def effects(nodes: Iterable[ast.AST]) -> Iterator[Effect]:
    for node in nodes:
        targets: list[ast.expr] = []
        if isinstance(node, ast.Assign | ast.Delete):
            targets = list(node.targets)
        elif isinstance(node, ast.AugAssign) or (isinstance(node, ast.AnnAssign)
                                                 and node.value is not None):
            targets = [node.target]
        for target in _flatten(targets):
            if isinstance(target, ast.Attribute):
                yield Effect(node, "set", target.value, target.attr)
            elif isinstance(target, ast.Subscript):
                yield Effect(node, "call", target.value,
                             "__delitem__" if isinstance(node, ast.Delete) else "__setitem__")
        if not isinstance(node, ast.Call):
            continue
        func = node.func
        name = func.id if isinstance(func, ast.Name) else None
        if isinstance(func, ast.Attribute) and func.attr == "__setattr__" \
                and isinstance(func.value, ast.Name) and func.value.id == "object":
            name = "setattr"
        if name in ("setattr", "delattr") and len(node.args) >= 2:
            key = node.args[1]
            attr = key.value if isinstance(key, ast.Constant) and isinstance(key.value, str) \
                else "<any>"
            yield Effect(node, "set", node.args[0], attr)
        elif isinstance(func, ast.Attribute):
            yield Effect(node, "call", func.value, func.attr)


def holder(expr: ast.expr) -> ast.Attribute | None:
    """The field whose content ``expr`` is (``x.f``, ``x.f[k]``, ``x.f.get(k)``), if any."""
    while True:
        if isinstance(expr, ast.Subscript):
            expr = expr.value
        elif isinstance(expr, ast.Call) and isinstance(expr.func, ast.Attribute) \
                and expr.func.attr in HOLDING:
            expr = expr.func.value
        else:
            return expr if isinstance(expr, ast.Attribute) else None


def root(expr: ast.expr) -> tuple[str | None, str | None]:
    """The name a path starts from and the first attribute after it: ``self.a.b[0]`` ->
    ("self", "a")."""
    first = None
    while True:
        if isinstance(expr, ast.Attribute):
            first = expr.attr
            expr = expr.value
        elif isinstance(expr, ast.Subscript):
            expr = expr.value
        elif isinstance(expr, ast.Call) and isinstance(expr.func, ast.Attribute) \
                and expr.func.attr in HOLDING:
            first = None
            expr = expr.func.value
        else:
            break
    return (expr.id, first) if isinstance(expr, ast.Name) else (None, None)


class Scope:
    """One function (or a module's top level) with the types of its names."""

    def __init__(self, project: Project, module: Module, qualname: str,
                 body: list[ast.stmt], args: ast.arguments | None = None,
                 klass: Klass | None = None, outer: dict[str, Type] | None = None,
                 static: bool = False) -> None:
        self.project, self.module, self.qualname = project, module, qualname
        self.body, self.klass = body, klass
        self.env: dict[str, Type] = dict(outer or {})
        self.made: set[str] = set()  # names bound only to a constructor call here
        self.nodes = list(_own_nodes(body))
        self.effects = list(effects(self.nodes))
        self._aliases: dict[str, str] | None = None
        if args is not None:
            self._parameters(args, static)
        self._bind()

    def _parameters(self, args: ast.arguments, static: bool) -> None:
        positional = [*args.posonlyargs, *args.args]
        for index, arg in enumerate([*positional, *args.kwonlyargs]):
            if index == 0 and self.klass is not None and not static \
                    and arg.arg in ("self", "cls") and arg.annotation is None:
                kind = "cls" if arg.arg == "self" else "classobj"
                self.env[arg.arg] = frozenset({(kind, self.klass.name)})
            elif arg.annotation is not None:
                self.env[arg.arg] = self.project.annotation(arg.annotation, self.module)
        if args.vararg is not None and args.vararg.annotation is not None:
            self.env[args.vararg.arg] = gen(
                "tuple*", self.project.annotation(args.vararg.annotation, self.module))
        if args.kwarg is not None and args.kwarg.annotation is not None:
            self.env[args.kwarg.arg] = gen(
                "dict", NOTHING, self.project.annotation(args.kwarg.annotation, self.module))

    def _bindings(self) -> Iterator[tuple[ast.expr, str, ast.expr]]:
        """(target, how, expression): "value" assigns the expression's type, "annotation" the
        annotation's, "iter" an element of the expression's."""
        for node in self.nodes:
            if isinstance(node, ast.Assign):
                for target in node.targets:
                    yield target, "value", node.value
            elif isinstance(node, ast.AnnAssign):
                yield node.target, "annotation", node.annotation
            elif isinstance(node, ast.NamedExpr):
                yield node.target, "value", node.value
            elif isinstance(node, ast.For | ast.AsyncFor | ast.comprehension):
                yield node.target, "iter", node.iter
            elif isinstance(node, ast.withitem) and node.optional_vars is not None:
                yield node.optional_vars, "value", node.context_expr

    def _bind(self) -> None:
        for node in self.nodes:  # functions defined here: their calls give their returns
            if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef):
                self.project.local_functions[id(node)] = (node, self.module)
                self.env[node.name] = frozenset({("lfunc", id(node))})
        bindings = list(self._bindings())
        annotated = {t.id for t, how, _ in bindings if how == "annotation"
                     and isinstance(t, ast.Name)}
        made: dict[str, bool] = {name: False for name in self.env}  # parameters, outer
        for target, how, expr in bindings:
            if isinstance(target, ast.Name):
                fresh = how == "value" and isinstance(expr, ast.Call) \
                    and any(a[0] == "classobj" for a in self.type_of(expr.func))
                made[target.id] = made.get(target.id, True) and fresh
        self.made = {name for name, fresh in made.items() if fresh}
        for _ in range(3):  # a name's type may depend on another's, bound later
            before = dict(self.env)
            for target, how, expr in bindings:
                if how == "annotation":
                    if isinstance(target, ast.Name):
                        self.env[target.id] = self.project.annotation(expr, self.module)
                    continue
                if isinstance(target, ast.Name) and target.id in annotated:
                    continue
                found = self.type_of(expr)
                self._assign(target, element(found) if how == "iter" else found)
            if self.env == before:
                break

    def _assign(self, target: ast.expr, t: Type) -> None:
        if isinstance(target, ast.Name):
            if t:
                self.env[target.id] = self.env.get(target.id, NOTHING) | t
        elif isinstance(target, ast.Tuple | ast.List):
            for index, sub in enumerate(target.elts):
                if isinstance(sub, ast.Starred):
                    continue
                part: set[Atom] = set()
                for atom in t:
                    args = atom[2] if atom[0] == "gen" else ()
                    assert isinstance(args, tuple)
                    if atom[:2] == ("gen", "tuple") and len(args) == len(target.elts):
                        part |= args[index]
                    elif atom[0] == "gen" and atom[1] != "tuple":
                        part |= element(frozenset({atom}))
                self._assign(sub, frozenset(part))

    # ------------------------------------------------------------------ expressions

    def type_of(self, expr: ast.expr | None) -> Type:
        project = self.project
        if expr is None:
            return NOTHING
        if isinstance(expr, ast.Name):
            if expr.id in self.env:
                return self.env[expr.id]
            return project.global_type(self.module, expr.id)
        if isinstance(expr, ast.Attribute):
            return project.attribute(self.type_of(expr.value), expr.attr)
        if isinstance(expr, ast.Subscript):
            return item(self.type_of(expr.value), expr.slice)
        if isinstance(expr, ast.Call):
            return self._call(expr)
        if isinstance(expr, ast.Await | ast.NamedExpr | ast.Starred):
            return self.type_of(expr.value)
        if isinstance(expr, ast.IfExp):
            return self.type_of(expr.body) | self.type_of(expr.orelse)
        if isinstance(expr, ast.BoolOp):
            return frozenset().union(*(self.type_of(v) for v in expr.values))
        if isinstance(expr, ast.Tuple):
            return gen("tuple", *(self.type_of(e) for e in expr.elts))
        if isinstance(expr, ast.List | ast.Set):
            kind = "list" if isinstance(expr, ast.List) else "set"
            return gen(kind, frozenset().union(*(self.type_of(e) for e in expr.elts)))
        if isinstance(expr, ast.ListComp | ast.SetComp | ast.GeneratorExp):
            kind = {ast.ListComp: "list", ast.SetComp: "set"}.get(type(expr), "Iterator")
            return gen(kind, self.type_of(expr.elt))
        if isinstance(expr, ast.Dict):
            return gen("dict", frozenset().union(*(self.type_of(k) for k in expr.keys if k)),
                       frozenset().union(*(self.type_of(v) for v in expr.values)))
        if isinstance(expr, ast.DictComp):
            return gen("dict", self.type_of(expr.key), self.type_of(expr.value))
        return NOTHING

    def _call(self, call: ast.Call) -> Type:
        func, args = call.func, call.args
        if isinstance(func, ast.Name) and func.id not in self.env \
                and self.project.global_type(self.module, func.id) == NOTHING:
            name = func.id
            first = self.type_of(args[0]) if args else NOTHING
            if name in BUILTIN_ITERS and args:
                return gen("tuple*" if name == "tuple" else "list", element(first))
            if name in BUILTIN_PICKS and args:
                return element(first) if len(args) == 1 or name == "next" \
                    else frozenset().union(*(self.type_of(a) for a in args))
            if name == "enumerate" and args:
                return gen("Iterator", gen("tuple", NOTHING, element(first)))
            if name == "zip":
                return gen("Iterator", gen("tuple", *(element(self.type_of(a))
                                                      for a in args)))
            if name == "cast" and args:
                return self.project.annotation(args[0], self.module)
            if name == "getattr" and len(args) >= 2 and isinstance(args[1], ast.Constant):
                return self.project.attribute(first, str(args[1].value))
            return NOTHING
        out: set[Atom] = set()
        for atom in self.type_of(func):
            if atom[0] == "classobj":
                out.add(("cls", atom[1]))
            elif atom[0] in ("func", "method", "lfunc"):
                out |= self.project.returns(atom)
            elif atom[0] == "bmethod":
                out |= _container_call(atom)
        return frozenset(out)


def _container_call(atom: Atom) -> Type:
    """What a builtin container's method gives back."""
    container, name = atom[1], atom[2]
    assert isinstance(container, tuple)
    args = container[2]
    assert isinstance(args, tuple)
    origin = container[1]
    if name in ("copy",):
        return frozenset({container})
    if origin in MAPPINGS and len(args) == 2:
        key, value = args
        if name in ("get", "pop", "setdefault", "__getitem__"):
            return value
        if name == "values":
            return gen("Iterator", value)
        if name == "keys":
            return gen("Iterator", key)
        if name == "items":
            return gen("Iterator", gen("tuple", key, value))
        if name == "popitem":
            return gen("tuple", key, value)
    elif (origin in SEQUENCES or origin == "tuple") and name in ("pop", "popleft"):
        return element(frozenset({container}))
    return NOTHING


class Project:
    """The project's modules and classes, read from ``tree``; ``types``: declared types of
    attributes the code types ``Any`` ("router.x.C.attr" -> an annotation in absolute
    names)."""

    def __init__(self, tree: Sources, types: Mapping[str, str] | None = None,
                 prefix: str = "router/") -> None:
        self.modules: dict[str, Module] = {}
        self.classes: dict[str, Klass] = {}
        self._declared = dict(types or {})
        self._scopes: dict[int, Scope] = {}
        self._field_types: dict[tuple[str, str], Type] = {}
        self._mutating: dict[str, dict[str, frozenset[str]]] | None = None
        self.local_functions: dict[int, tuple[ast.FunctionDef | ast.AsyncFunctionDef,
                                              Module]] = {}
        for path, text in tree.items():
            if path.startswith(prefix) and path.endswith(".py"):
                self._read(path, text)
        for klass in self.classes.values():
            self._read_class(klass)

    # ------------------------------------------------------------------ reading

    def _read(self, path: str, text: str) -> None:
        module = Module(module_name(path), path, parse(text))
        self.modules[module.name] = module
        package = module.name.split(".")
        if not path.endswith("__init__.py"):
            package = package[:-1]
        for node in ast.walk(module.tree):
            if isinstance(node, ast.ImportFrom):
                base = package[:len(package) - node.level + 1] if node.level else []
                stem = ".".join([*base, *(node.module.split(".") if node.module else [])])
                for alias in node.names:
                    module.imports[alias.asname or alias.name] = f"{stem}.{alias.name}"
            elif isinstance(node, ast.Import):
                for alias in node.names:
                    if alias.asname:
                        module.imports[alias.asname] = alias.name
                    else:
                        top = alias.name.split(".")[0]
                        module.imports[top] = top
        for node in module.tree.body:
            self._read_top(module, node)

    def _read_top(self, module: Module, node: ast.stmt, prefix: str = "") -> None:
        if isinstance(node, ast.ClassDef):
            name = f"{module.name}.{prefix}{node.name}"
            module.classes[prefix + node.name] = node
            self.classes[name] = Klass(name, module, node)
            for inner in node.body:
                if isinstance(inner, ast.ClassDef):
                    self._read_top(module, inner, f"{prefix}{node.name}.")
        elif isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef) and not prefix:
            module.functions[node.name] = node
        elif isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name):
            module.globals.setdefault(node.target.id, []).append((node.annotation, node.value))
        elif isinstance(node, ast.Assign):
            for target in _flatten(node.targets):
                if isinstance(target, ast.Name):
                    value = node.value if len(node.targets) == 1 \
                        and isinstance(node.targets[0], ast.Name) else None
                    module.globals.setdefault(target.id, []).append((None, value))
        elif isinstance(node, ast.If | ast.Try):
            for inner in [*node.body, *node.orelse]:
                self._read_top(module, inner, prefix)

    def _read_class(self, klass: Klass) -> None:
        for base in klass.node.bases:
            base = base.value if isinstance(base, ast.Subscript) else base
            for atom in self.annotation(base, klass.module):
                if atom[0] == "cls":
                    klass.bases.append(str(atom[1]))
        for node in klass.node.body:
            if isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name):
                klass.annotated[node.target.id] = node.annotation
            elif isinstance(node, ast.Assign):
                for target in _flatten(node.targets):
                    if isinstance(target, ast.Name) and target.id == "__slots__":
                        klass.slots |= {e.value for e in ast.walk(node.value)
                                        if isinstance(e, ast.Constant)
                                        and isinstance(e.value, str)}
            elif isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef):
                klass.methods[node.name] = node
                if _decorators(node) & {"property", "cached_property"}:
                    klass.properties.add(node.name)
                self._read_self_fields(klass, node)

    @staticmethod
    def _read_self_fields(klass: Klass, method: ast.FunctionDef | ast.AsyncFunctionDef
                          ) -> None:
        for node in _own_nodes(method.body):
            pairs: list[tuple[ast.expr, ast.expr | None, ast.expr | None]] = []
            if isinstance(node, ast.Assign):
                pairs = [(t, None, node.value if len(node.targets) == 1 else None)
                         for t in _flatten(node.targets)]
            elif isinstance(node, ast.AnnAssign):
                pairs = [(node.target, node.annotation, node.value)]
            for target, annotation, value in pairs:
                if isinstance(target, ast.Attribute) and isinstance(target.value, ast.Name) \
                        and target.value.id == "self":
                    klass.assigned.setdefault(target.attr, []).append(
                        (method.name, annotation, value if not isinstance(
                            value, ast.Tuple) else None))

    # ------------------------------------------------------------------ names and types

    def resolve(self, dotted: str, depth: int = 0) -> Type:
        """What an absolute dotted name is in the project."""
        if depth > 20:
            return NOTHING
        if dotted in self.classes:
            return frozenset({("classobj", dotted)})
        if dotted in self.modules:
            return frozenset({("module", dotted)})
        parent, _, attr = dotted.rpartition(".")
        module = self.modules.get(parent)
        if module is None:
            if parent and parent.rpartition(".")[0] in self.modules:
                inside = self.resolve(parent, depth + 1)  # a nested class, re-exported
                return self.attribute(frozenset({("cls", a[1]) for a in inside
                                                 if a[0] == "classobj"}), attr)
            return NOTHING
        if attr in module.imports:
            return self.resolve(module.imports[attr], depth + 1)
        if attr in module.functions:
            return frozenset({("func", module.name, attr)})
        if attr in module.globals:
            return self._global(module, attr)
        return NOTHING

    def global_type(self, module: Module, name: str) -> Type:
        if name in module.classes:
            return frozenset({("classobj", f"{module.name}.{name}")})
        if name in module.functions:
            return frozenset({("func", module.name, name)})
        if name in module.imports:
            return self.resolve(module.imports[name])
        if name in module.globals:
            return self._global(module, name)
        return NOTHING

    def _global(self, module: Module, name: str) -> Type:
        key = (module.name, "<global>." + name)
        if key in self._field_types:
            return self._field_types[key]
        self._field_types[key] = NOTHING  # while computing: not known
        out: set[Atom] = set()
        for annotation, value in module.globals[name]:
            if annotation is not None:
                out |= self.annotation(annotation, module)
            elif value is not None:
                out |= self.module_scope(module).type_of(value)
        self._field_types[key] = frozenset(out)
        return self._field_types[key]

    def external(self, dotted: str) -> str | None:
        """The container origin a name outside the project stands for (``typing.Sequence``
        -> "Sequence"), if it is one."""
        last = dotted.rpartition(".")[2]
        known = SEQUENCES | MAPPINGS | UNWRAP | {"tuple", "Optional", "Union", "Self"}
        return last if last in known else None

    def annotation(self, node: ast.expr | None, module: Module) -> Type:
        """The type an annotation names, in ``module``'s names (absolute dotted names too)."""
        if node is None:
            return NOTHING
        if isinstance(node, ast.Constant) and isinstance(node.value, str):
            try:
                return self.annotation(ast.parse(node.value, mode="eval").body, module)
            except SyntaxError:
                return NOTHING
        if isinstance(node, ast.BinOp) and isinstance(node.op, ast.BitOr):
            return self.annotation(node.left, module) | self.annotation(node.right, module)
        if isinstance(node, ast.Subscript):
            return self._generic(node, module)
        alias = self._alias(node, module)
        if alias is not None:
            return self.annotation(*alias)
        origin = self._origin(node, module)
        if isinstance(origin, frozenset):
            return frozenset({("cls", a[1]) for a in origin if a[0] == "classobj"})
        if origin in ("list", "set", "dict", "frozenset", "deque"):
            return gen(origin)
        return NOTHING

    def _alias(self, node: ast.expr, module: Module, depth: int = 0
               ) -> tuple[ast.expr, Module] | None:
        """The value of a type alias a name stands for (``Sources = dict[str, str]``), with
        the module it is written in."""
        if not isinstance(node, ast.Name) or depth > 10 or node.id in module.classes:
            return None
        if node.id in module.globals:
            values = module.globals[node.id]
            annotation, value = values[0]
            typed = isinstance(value, ast.Subscript | ast.BinOp) or (
                isinstance(annotation, ast.Name) and annotation.id == "TypeAlias")
            return (value, module) if len(values) == 1 and typed and value is not None \
                else None
        target = module.imports.get(node.id, "")
        parent, _, name = target.rpartition(".")
        if parent in self.modules:
            return self._alias(ast.Name(name), self.modules[parent], depth + 1)
        return None

    def _origin(self, node: ast.expr, module: Module) -> Type | str | None:
        """A project class (as its type) or the name of a builtin or typing origin."""
        if isinstance(node, ast.Name):
            found = self.global_type(module, node.id)
            if found:
                return found
            if node.id in module.imports:
                return self.external(module.imports[node.id])
            return node.id if node.id in {"list", "set", "dict", "frozenset", "tuple",
                                          "type"} else None
        if isinstance(node, ast.Attribute):
            dotted = ast.unparse(node)
            head = dotted.split(".")[0]
            absolute = (module.imports[head] + dotted[len(head):]
                        if head in module.imports else dotted)
            return self.resolve(absolute) or self.external(absolute)
        return None

    def _generic(self, node: ast.Subscript, module: Module) -> Type:
        origin = self._origin(node.value, module)
        elts = node.slice.elts if isinstance(node.slice, ast.Tuple) else [node.slice]
        if isinstance(origin, frozenset):  # a generic class of the project's
            return frozenset({("cls", a[1]) for a in origin if a[0] == "classobj"})
        if origin in UNWRAP:
            return self.annotation(elts[-1] if origin in ("Coroutine",) else elts[0], module)
        if origin in ("Optional", "Union"):
            return frozenset().union(*(self.annotation(e, module) for e in elts))
        if origin == "tuple":
            if len(elts) == 2 and isinstance(elts[1], ast.Constant) \
                    and elts[1].value is Ellipsis:
                return gen("tuple*", self.annotation(elts[0], module))
            return gen("tuple", *(self.annotation(e, module) for e in elts))
        if origin in SEQUENCES or origin in MAPPINGS:
            return gen(origin, *(self.annotation(e, module) for e in elts))
        return NOTHING

    def mro(self, name: str) -> Iterator[Klass]:
        seen: set[str] = set()
        stack = [name]
        while stack:
            current = stack.pop(0)
            if current in seen or current not in self.classes:
                continue
            seen.add(current)
            yield self.classes[current]
            stack.extend(self.classes[current].bases)

    def attribute(self, t: Type, attr: str) -> Type:
        out: set[Atom] = set()
        for atom in t:
            kind = atom[0]
            if kind == "cls":
                out |= self._attribute_of(str(atom[1]), attr)
            elif kind == "classobj":
                for klass in self.mro(str(atom[1])):
                    if attr in klass.methods:
                        out.add(("method", klass.name, attr))
                        break
            elif kind == "module":
                out |= self.resolve(f"{atom[1]}.{attr}")
            elif kind == "gen":
                out.add(("bmethod", atom, attr))
        return frozenset(out)

    def _attribute_of(self, cls: str, attr: str) -> Type:
        for klass in self.mro(cls):
            declared = self._declared.get(f"{klass.name}.{attr}")
            if declared is not None:
                return self.annotation(ast.parse(declared, mode="eval").body, klass.module)
            if attr in klass.properties:
                return self.annotation(klass.methods[attr].returns, klass.module)
            if attr in klass.annotated or attr in klass.assigned:
                return self._field_type(klass, attr)
            if attr in klass.methods:
                return frozenset({("method", klass.name, attr)})
        return NOTHING

    def _field_type(self, klass: Klass, attr: str) -> Type:
        key = (klass.name, attr)
        if key in self._field_types:
            return self._field_types[key]
        self._field_types[key] = NOTHING  # while computing: not known
        if attr in klass.annotated:
            found = self.annotation(klass.annotated[attr], klass.module)
        else:
            out: set[Atom] = set()
            assigned = klass.assigned[attr]
            for _, annotation, _ in assigned:
                if annotation is not None:
                    out |= self.annotation(annotation, klass.module)
            if not out:
                for method, _, value in assigned:
                    if value is not None:
                        out |= self.scope_of(klass.methods[method], klass).type_of(value)
            found = frozenset(out)
        self._field_types[key] = found
        return found

    def returns(self, atom: Atom) -> Type:
        if atom[0] == "lfunc":
            fn, module = self.local_functions[int(str(atom[1]))]
            return self.annotation(fn.returns, module)
        if atom[0] == "func":
            module = self.modules[str(atom[1])]
            return self.annotation(module.functions[str(atom[2])].returns, module)
        for klass in self.mro(str(atom[1])):
            method = klass.methods.get(str(atom[2]))
            if method is not None:
                if isinstance(method.returns, ast.Name) and method.returns.id == "Self":
                    return frozenset({("cls", atom[1])})
                return self.annotation(method.returns, klass.module)
        return NOTHING

    # ------------------------------------------------------------------ scopes

    def module_scope(self, module: Module) -> Scope:
        key = id(module.tree)
        if key not in self._scopes:
            body = [n for n in module.tree.body
                    if not isinstance(n, ast.FunctionDef | ast.AsyncFunctionDef | ast.ClassDef)]
            self._scopes[key] = Scope(self, module, "<module>", body)
        return self._scopes[key]

    def scope_of(self, fn: ast.FunctionDef | ast.AsyncFunctionDef, klass: Klass | None,
                 qualname: str | None = None, outer: dict[str, Type] | None = None,
                 module: Module | None = None) -> Scope:
        key = id(fn)
        if key not in self._scopes:
            module = module or (klass.module if klass is not None else self._module_of(fn))
            name = qualname or (f"{klass.name[len(module.name) + 1:]}.{fn.name}"
                                if klass else fn.name)
            self._scopes[key] = Scope(self, module, name, fn.body, fn.args, klass, outer,
                                      static="staticmethod" in _decorators(fn))
        return self._scopes[key]

    def _module_of(self, fn: ast.AST) -> Module:
        for module in self.modules.values():
            if fn in module.functions.values():
                return module
        raise LookupError(fn)

    def scopes(self) -> Iterator[Scope]:
        """Every scope of the project: each module's top level, its functions and methods,
        and the functions nested in those (with their enclosing names' types)."""
        for module in self.modules.values():
            top = self.module_scope(module)
            yield top
            yield from self._nested(top, _own_nodes(module.tree.body), None, "")

    def _nested(self, scope: Scope, nodes: Iterable[ast.AST], klass: Klass | None,
                prefix: str) -> Iterator[Scope]:
        for node in nodes:
            if isinstance(node, ast.ClassDef):
                inner = self.classes.get(f"{scope.module.name}.{prefix}{node.name}")
                yield from self._nested(scope, _own_nodes(node.body), inner,
                                        f"{prefix}{node.name}.")
            elif isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef):
                method = klass is not None and node in klass.node.body
                outer = None if scope.qualname == "<module>" or method else scope.env
                child = self.scope_of(node, klass if method else None, prefix + node.name,
                                      outer, scope.module)
                yield child
                yield from self._nested(child, child.nodes, None, f"{prefix}{node.name}.")

    # ------------------------------------------------------------------ mutating methods

    def mutating(self) -> dict[str, dict[str, frozenset[str]]]:
        """Per class, its mutating methods and the fields of ``self`` each writes (at any
        depth, through local aliases, or by calling mutating methods on them)."""
        if self._mutating is not None:
            return self._mutating
        table: dict[str, dict[str, frozenset[str]]] = {name: {} for name in self.classes}
        self._mutating = table
        read = [(klass, self.scope_of(method, klass))
                for klass in self.classes.values() for method in klass.methods.values()
                if not _decorators(method) & {"staticmethod", "classmethod"}]
        for _ in range(20):
            changed = False
            for klass, scope in read:
                fields = self._self_writes(scope)
                name = scope.qualname.rpartition(".")[2]
                if fields and table[klass.name].get(name) != fields:
                    table[klass.name][name] = fields
                    changed = True
            if not changed:
                break
        return table

    @staticmethod
    def _aliases(scope: Scope) -> dict[str, str]:
        """The local names of a method that hold (part of) a field of ``self``, with that
        field: ``slot = self.slots[i]``, ``for slot in self.slots``."""
        if scope._aliases is not None:
            return scope._aliases
        aliases: dict[str, str] = {}
        for node in scope.nodes:
            pairs: list[tuple[ast.expr, ast.expr]] = []
            if isinstance(node, ast.Assign):
                pairs = [(t, node.value) for t in node.targets]
            elif isinstance(node, ast.For | ast.comprehension | ast.NamedExpr):
                pairs = [(node.target, node.iter if not isinstance(node, ast.NamedExpr)
                          else node.value)]
            for target, value in pairs:
                value = value.func.value if isinstance(value, ast.Call) and isinstance(
                    value.func, ast.Attribute) and value.func.attr in ("values", "items") \
                    else value
                name, first = root(value)
                if name == "self" and first is not None:
                    for sub in _flatten([target]):
                        if isinstance(sub, ast.Name):
                            aliases[sub.id] = first
        scope._aliases = aliases
        return aliases

    def _self_writes(self, scope: Scope) -> frozenset[str]:
        aliases = self._aliases(scope)
        fields: set[str] = set()
        for effect in scope.effects:
            obj = effect.obj
            if effect.kind == "call":
                if not self.mutates(scope.type_of(obj), effect.name):
                    continue
                if isinstance(obj, ast.Name) and obj.id == "self":
                    assert scope.klass is not None
                    fields |= self.fields_written(scope.klass.name, effect.name)
                    continue
            elif isinstance(obj, ast.Name) and obj.id == "self":
                fields.add(effect.name)
                continue
            name, first = root(obj)
            if name == "self" and first is not None:
                fields.add(first)
            elif name in aliases:
                fields.add(aliases[name])
        return frozenset(fields)

    def fields_written(self, cls: str, method: str) -> frozenset[str]:
        table = self.mutating()
        for klass in self.mro(cls):
            if method in klass.methods:
                return table[klass.name].get(method, frozenset())
        return frozenset()

    def mutates(self, t: Type, method: str) -> bool:
        """Whether calling ``method`` on a value of type ``t`` changes it: a mutating method
        of its project class, else (a container, or not known) a builtin container's."""
        classes = cls_names(t)
        if not classes:
            return method in MUTATORS
        return any(self.fields_written(c, method) for c in classes)

    # ------------------------------------------------------------------ writes

    def writes(self, holds: Callable[[str, str], bool]) -> Iterator[Write]:
        """Every write of an attribute of a project class (module docstring).
        ``holds(cls, field)``: whether a mutating call on that field of a ``cls`` writes the
        field (else it writes the fields its method writes, of the receiver's class)."""
        self.mutating()
        for scope in self.scopes():
            for effect in scope.effects:
                yield from self._interpret(scope, effect, holds)

    def _constructed(self, scope: Scope, expr: ast.expr) -> bool:
        name, _ = root(expr)
        return name in scope.made

    def _own(self, scope: Scope, obj: ast.expr) -> bool:
        return isinstance(obj, ast.Name) and obj.id == "self" and scope.klass is not None

    def _interpret(self, scope: Scope, effect: Effect, holds: Callable[[str, str], bool]
                   ) -> Iterator[Write]:
        node, obj = effect.node, effect.obj
        if self._constructed(scope, obj):
            return
        at = (scope.module.path, scope.qualname, getattr(node, "lineno", 0))
        code = ast.unparse(node).splitlines()[0][:80]
        within = self._within(scope)
        if effect.kind == "set":
            if self._own(scope, obj):
                return
            for cls in cls_names(scope.type_of(obj)):
                yield Write(*at, cls, effect.name, code, within=within)
            return
        receiver = scope.type_of(obj)
        if self._own(scope, obj) or not self.mutates(receiver, effect.name):
            return
        field_of = holder(obj)
        if field_of is not None and not self._own(scope, field_of.value):
            holders = [c for c in cls_names(scope.type_of(field_of.value))
                       if holds(c, field_of.attr)]
            for cls in holders:
                yield Write(*at, cls, field_of.attr, code, "field", effect.name, within)
            if holders:
                return
        for cls in cls_names(receiver):
            for written in sorted(self.fields_written(cls, effect.name)):
                yield Write(*at, cls, written, code, "method", effect.name, within)

    def _within(self, scope: Scope) -> str:
        """The innermost class a scope is (or is nested) in."""
        parts = scope.qualname.split(".")
        for end in range(len(parts) - 1, 0, -1):
            name = f"{scope.module.name}.{'.'.join(parts[:end])}"
            if name in self.classes:
                return name
        return ""
