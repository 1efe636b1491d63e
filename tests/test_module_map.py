"""The module's map stays true: interactiond.py reads top to bottom, each section (a `# Name ####`
banner) using only names defined in itself or in the sections above it, and the docstring lists
the sections in the order they stand."""
from __future__ import annotations

import ast
import re
import symtable
from pathlib import Path

MODULE = Path(__file__).resolve().parent.parent / "interactiond.py"
BANNER = re.compile(r"^# (.+?) #{10,}$")


def banners(source: str) -> list[tuple[int, str]]:
    """(line, name) of each section's banner, in order."""
    return [(i, m.group(1)) for i, line in enumerate(source.splitlines(), 1) if (m := BANNER.match(line))]


def top_level_names(tree: ast.Module) -> list[tuple[int, str]]:
    """(line, name) of each name a top-level statement binds: def, class, assignment."""
    out = []
    for node in tree.body:
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            out.append((node.lineno, node.name))
        elif isinstance(node, (ast.Assign, ast.AnnAssign)):
            for target in node.targets if isinstance(node, ast.Assign) else [node.target]:
                out += [(node.lineno, n.id) for n in ast.walk(target) if isinstance(n, ast.Name)]
    return out


class _AtDefinition(ast.NodeVisitor):
    """The names a top-level statement reads as the module runs (a function's body and annotations
    are read later, or never: those are symtable's)."""

    def __init__(self) -> None:
        self.read: list[tuple[int, str]] = []

    def visit_FunctionDef(self, node: ast.FunctionDef | ast.AsyncFunctionDef) -> None:
        for expr in (*node.decorator_list, *node.args.defaults, *(d for d in node.args.kw_defaults if d)):
            self.visit(expr)

    visit_AsyncFunctionDef = visit_FunctionDef  # type: ignore[assignment]

    def visit_Lambda(self, node: ast.Lambda) -> None:
        for expr in node.args.defaults:
            self.visit(expr)

    def visit_AnnAssign(self, node: ast.AnnAssign) -> None:
        if node.value is not None:
            self.visit(node.value)

    def visit_Name(self, node: ast.Name) -> None:
        if isinstance(node.ctx, ast.Load):
            self.read.append((node.lineno, node.id))


def names_read(source: str, tree: ast.Module) -> list[tuple[int, str]]:
    """(line, name) of every module-level name the module reads: at definition time (by the AST),
    and inside every function and class body (by symtable: its global names), at the line of the
    scope that reads it."""
    read: list[tuple[int, str]] = []
    for node in tree.body:
        visitor = _AtDefinition()
        visitor.visit(node)
        read += visitor.read

    def walk(table: symtable.SymbolTable) -> None:
        for child in table.get_children():
            read.extend((child.get_lineno(), s.get_name()) for s in child.get_symbols()
                        if s.is_referenced() and s.is_global())
            walk(child)
    walk(symtable.symtable(source, str(MODULE), "exec"))
    return read


def test_no_section_uses_a_name_defined_below_it():
    source = MODULE.read_text()
    sections = banners(source)
    assert len(sections) >= 15, sections

    def section_of(line: int) -> int:
        return max((i for i, (start, _) in enumerate(sections) if start <= line), default=-1)

    tree = ast.parse(source)
    home: dict[str, int] = {}
    for line, name in top_level_names(tree):
        home.setdefault(name, section_of(line))
    backwards = sorted({f"{sections[section_of(line)][1]} uses {name}, which {sections[home[name]][1]} defines"
                        for line, name in names_read(source, tree) if home.get(name, -1) > section_of(line)})
    assert backwards == []


def test_the_check_sees_a_name_used_above_its_section():
    source = "# One ######################\ndef f():\n    return g()\n# Two ######################\ndef g():\n    pass\n"
    tree = ast.parse(source)
    sections = banners(source)
    assert [name for _, name in sections] == ["One", "Two"]
    assert (2, "g") in names_read(source, tree) and (5, "g") in top_level_names(tree)   # f (line 2) reads g


def test_the_docstring_lists_the_sections_in_order():
    source = MODULE.read_text()
    doc = ast.get_docstring(ast.parse(source)) or ""
    names = [name for _, name in banners(source)]
    listed = [line[4:30].strip() for line in doc.splitlines()
              if line.startswith("    ") and not line.startswith("     ") and line[4:30].strip() in names]
    assert listed == names
