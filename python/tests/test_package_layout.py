"""The package's module graph, checked from its source (``ast``, nothing imported): the Python
side's counterpart of tests/tests/crate_graph.rs.

- No import cycle between vovp's modules, counting every import: module level, inside
  functions, and type-only ones (``if TYPE_CHECKING:``). A cycle means two modules are one.
- No module uses another module's private names (a leading underscore, not a dunder): not by
  ``from .m import _x``, not by ``m._x`` of an imported module, and not by ``obj._x`` of an
  attribute that only another vovp module defines. What one module offers another is public
  within the package (no underscore; a module whose own name starts with one, ``vovp._core``,
  is still the package's to use). The native extension's names are what its stub
  (``_native.pyi``) exports.
- No public function or method takes a parameter named with a leading underscore.

Attribute names are matched by name, without types: ``obj._x`` counts as the module's own when
the module defines ``_x`` itself (``def``/class attribute/``__slots__``/``self._x = ...``, not
in an ``if TYPE_CHECKING:`` block, where a declaration alone is no definition). A name both
this module and another define is taken to be this module's.
"""

from __future__ import annotations

import ast
from pathlib import Path
from typing import Dict, Iterator, List, Optional, Set, Tuple

PACKAGE_DIR = Path(__file__).resolve().parents[1] / "vovp"
PACKAGE = "vovp"


def _private(name: str) -> bool:
    return name.startswith("_") and not (name.startswith("__") and name.endswith("__"))


def _modules(root: Path = PACKAGE_DIR, package: str = PACKAGE) -> Dict[str, Path]:
    """Dotted module name -> source path, for every .py file of the package."""
    out = {}
    for path in sorted(root.rglob("*.py")):
        parts = list(path.relative_to(root).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts.pop()
        out[".".join([package, *parts])] = path
    return out


def _native_exports(root: Path = PACKAGE_DIR) -> Set[str]:
    """The names the native extension's stub exports (its ``__all__``)."""
    tree = ast.parse((root / "_native.pyi").read_text())
    for node in tree.body:
        if isinstance(node, ast.Assign) and any(
                isinstance(t, ast.Name) and t.id == "__all__" for t in node.targets):
            return {ast.literal_eval(e) for e in node.value.elts}  # type: ignore[attr-defined]
    return set()


def _is_type_checking(test: ast.expr) -> bool:
    return (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or (
        isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING")


def _type_checking_nodes(tree: ast.AST) -> Set[int]:
    """ids of every node inside an ``if TYPE_CHECKING:`` block."""
    inside: Set[int] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.If) and _is_type_checking(node.test):
            for stmt in node.body:
                inside.update(id(n) for n in ast.walk(stmt))
    return inside


class Module:
    """One parsed module: what it imports of the package and which private names it defines."""

    def __init__(self, name: str, path: Path, all_modules: Set[str]):
        self.name = name
        self.path = path
        self.is_package = path.name == "__init__.py"
        self.tree = ast.parse(path.read_text(), str(path))
        self.all_modules = all_modules
        self.type_only = _type_checking_nodes(self.tree)
        # local name -> vovp module it is bound to (``from . import tensor as T``)
        self.module_aliases: Dict[str, str] = {}
        # (imported vovp module, line)
        self.imports: List[Tuple[str, int]] = []
        # (line, what) of private names imported from another vovp module
        self.private_imports: List[Tuple[int, str]] = []
        self._read_imports()
        self.defines = self._private_definitions()

    def _base(self, level: int, module: Optional[str]) -> str:
        """The absolute module a relative import's ``from`` names."""
        if level == 0:
            return module or ""
        parts = self.name.split(".")
        if not self.is_package:
            parts = parts[:-1]
        parts = parts[:len(parts) - (level - 1)]
        return ".".join(parts + ([module] if module else []))

    def _read_imports(self) -> None:
        for node in ast.walk(self.tree):
            if isinstance(node, ast.Import):
                for alias in node.names:
                    if alias.name == PACKAGE or alias.name.startswith(PACKAGE + "."):
                        target = alias.name
                        self.imports.append((target, node.lineno))
                        if alias.asname:
                            self.module_aliases[alias.asname] = target
            elif isinstance(node, ast.ImportFrom):
                base = self._base(node.level, node.module)
                if not (base == PACKAGE or base.startswith(PACKAGE + ".")):
                    continue
                for alias in node.names:
                    sub = f"{base}.{alias.name}"
                    local = alias.asname or alias.name
                    if sub in self.all_modules:
                        self.imports.append((sub, node.lineno))
                        self.module_aliases[local] = sub
                        continue
                    # A name of module ``base`` (its package ``__init__`` when it is one).
                    if base != self.name:
                        self.imports.append((base, node.lineno))
                    if _private(alias.name) and base != self.name:
                        self.private_imports.append(
                            (node.lineno, f"from {base} import {alias.name}"))

    def _private_definitions(self) -> Set[str]:
        """Private names this module defines: module-level and class-level names, methods,
        ``__slots__`` entries and ``self._x``/``cls._x`` assignment targets; none inside an
        ``if TYPE_CHECKING:`` block."""
        names: Set[str] = set()

        def add(name: str) -> None:
            if _private(name):
                names.add(name)

        for node in ast.walk(self.tree):
            if id(node) in self.type_only:
                continue
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
                add(node.name)
            elif isinstance(node, ast.Assign):
                for target in node.targets:
                    for t in ast.walk(target):
                        if isinstance(t, ast.Name):
                            add(t.id)
                        elif (isinstance(t, ast.Attribute) and isinstance(t.value, ast.Name)
                              and t.value.id in ("self", "cls")):
                            add(t.attr)
                    if (isinstance(target, ast.Name) and target.id == "__slots__"
                            and isinstance(node.value, (ast.Tuple, ast.List))):
                        for e in node.value.elts:
                            if isinstance(e, ast.Constant) and isinstance(e.value, str):
                                add(e.value)
            elif isinstance(node, (ast.AnnAssign, ast.AugAssign)):
                t = node.target
                if isinstance(t, ast.Name):
                    add(t.id)
                elif (isinstance(t, ast.Attribute) and isinstance(t.value, ast.Name)
                      and t.value.id in ("self", "cls")):
                    add(t.attr)
            elif isinstance(node, (ast.Import, ast.ImportFrom)):
                for alias in node.names:
                    add((alias.asname or alias.name).split(".")[0])
        return names

    def private_attributes(self) -> Iterator[Tuple[int, Optional[str], str]]:
        """(line, module alias or None, attribute) of every ``x._name`` this module reads
        or writes."""
        for node in ast.walk(self.tree):
            if isinstance(node, ast.Attribute) and _private(node.attr):
                alias = None
                if isinstance(node.value, ast.Name):
                    alias = self.module_aliases.get(node.value.id)
                yield node.lineno, alias, node.attr


def _parse(root: Path = PACKAGE_DIR, package: str = PACKAGE) -> Dict[str, Module]:
    paths = _modules(root, package)
    names = set(paths) | {f"{package}._native"}
    return {name: Module(name, path, names) for name, path in paths.items()}


def import_cycles(modules: Dict[str, Module]) -> List[List[str]]:
    """Every strongly connected set of more than one module (or a module importing itself),
    as a sorted list of names."""
    graph = {m: sorted({t for t, _ in mod.imports if t in modules and t != m})
             for m, mod in modules.items()}
    index: Dict[str, int] = {}
    low: Dict[str, int] = {}
    stack: List[str] = []
    on_stack: Set[str] = set()
    cycles: List[List[str]] = []

    def visit(v: str) -> None:  # Tarjan
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in graph[v]:
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                component.append(w)
                if w == v:
                    break
            if len(component) > 1:
                cycles.append(sorted(component))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return cycles


def private_reach_ins(modules: Dict[str, Module], native_exports: Set[str]) -> List[str]:
    """``path:line: what`` for every use of another module's private name."""
    defined_by: Dict[str, Set[str]] = {}
    for name, mod in modules.items():
        for attr in mod.defines:
            defined_by.setdefault(attr, set()).add(name)
    found = []
    for name, mod in sorted(modules.items()):
        where = mod.path.relative_to(PACKAGE_DIR.parent)
        for line, what in mod.private_imports:
            found.append(f"{where}:{line}: {what}")
        for line, alias, attr in mod.private_attributes():
            if alias is not None:
                if f"{alias}.{attr}" in mod.all_modules:
                    continue  # a submodule
                if alias == f"{PACKAGE}._native" and attr in native_exports:
                    continue
                if alias != name:
                    found.append(f"{where}:{line}: {alias}.{attr}")
                continue
            if attr in mod.defines:
                continue
            owners = defined_by.get(attr, set()) - {name}
            if owners:
                found.append(f"{where}:{line}: ._{attr[1:]} (defined in "
                             f"{', '.join(sorted(owners))})")
    return found


def private_parameters(modules: Dict[str, Module]) -> List[str]:
    """``path:line: function(param)`` of public functions and methods (of public classes)
    that take a parameter named with a leading underscore."""
    found = []
    for mod in modules.values():
        where = mod.path.relative_to(PACKAGE_DIR.parent)
        scopes: List[Tuple[ast.AST, bool]] = [(mod.tree, True)]
        while scopes:
            scope, public = scopes.pop()
            for node in ast.iter_child_nodes(scope):
                if isinstance(node, ast.ClassDef):
                    scopes.append((node, public and not _private(node.name)))
                elif isinstance(node, ast.If):
                    scopes.append((node, public))
                elif isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                    if not public or _private(node.name):
                        continue
                    a = node.args
                    for arg in [*a.posonlyargs, *a.args, *a.kwonlyargs]:
                        if _private(arg.arg):
                            found.append(f"{where}:{node.lineno}: {node.name}({arg.arg})")
    return sorted(found)


# --- the tests ------------------------------------------------------------------------------


def test_no_import_cycle_inside_vovp():
    cycles = import_cycles(_parse())
    assert not cycles, f"import cycles between vovp's modules: {cycles}"


def test_no_module_uses_another_modules_privates():
    found = private_reach_ins(_parse(), _native_exports())
    assert not found, "private names used across modules:\n" + "\n".join(found)


def test_no_private_parameters_in_public_signatures():
    found = private_parameters(_parse())
    assert not found, "public signatures with private parameters:\n" + "\n".join(found)


def test_the_checks_can_fail(tmp_path):
    """Each check finds what it is for, in a small package made here."""
    pkg = tmp_path / "vovp"
    (pkg / "sub").mkdir(parents=True)
    (pkg / "__init__.py").write_text("")
    (pkg / "_native.pyi").write_text("__all__ = ['_hook', 'f']\n")
    (pkg / "a.py").write_text(
        "from typing import TYPE_CHECKING\n"
        "from . import b, _native\n"
        "from .b import _helper\n"
        "if TYPE_CHECKING:\n"
        "    from .c import C\n"
        "class A:\n"
        "    if TYPE_CHECKING:\n"
        "        def _stub(self): ...\n"
        "    def run(self, _secret=1):\n"
        "        self._stub()\n"
        "        _native._hook()\n"
        "        return b._hidden, self._mine\n"
        "    def _own(self, x):\n"
        "        self._mine = x\n"
        "        return x._mine\n")
    (pkg / "b.py").write_text(
        "def _helper(): ...\n"
        "_hidden = 1\n"
        "class B:\n"
        "    def _stub(self): ...\n")
    (pkg / "c.py").write_text("from .sub import d\nclass C: ...\n")
    (pkg / "sub" / "__init__.py").write_text("")
    (pkg / "sub" / "d.py").write_text("from .. import a\n")
    modules = _parse(pkg, "vovp")
    assert import_cycles(modules) == [["vovp.a", "vovp.c", "vovp.sub.d"]]
    global PACKAGE_DIR
    saved, PACKAGE_DIR = PACKAGE_DIR, pkg
    try:
        found = private_reach_ins(modules, _native_exports(pkg))
        params = private_parameters(modules)
    finally:
        PACKAGE_DIR = saved
    assert found == [
        "vovp/a.py:3: from vovp.b import _helper",
        "vovp/a.py:10: ._stub (defined in vovp.b)",
        "vovp/a.py:12: vovp.b._hidden",
    ], found
    assert params == ["vovp/a.py:9: run(_secret)"], params
