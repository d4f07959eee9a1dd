"""Docstrings, comments and the root Markdown files cite modules and files that exist.

A dotted reference that starts with ``torchlike`` or ``adapters`` (``adapters/`` installs as ``torchlike.adapters``)
must name a module of the package and then attributes reachable from it; a path under ``torchlike/``, ``adapters/``,
``benchmarks/``, ``examples/`` or ``tests/`` must exist (``adapters/losses/grpo.sampler_importance_ratio``, a file and
an attribute, is checked as both). Both are read from the source with ``ast`` and regular expressions, never
imported, so the test compiles nothing. Code is left to Python: the ``.py`` files are read for their comments,
docstrings and (outside ``tests/``, whose strings are test data) the string literals with a space in them (messages,
the upstream workarounds); the root Markdown files whole.
"""

from __future__ import annotations

import ast
import functools
import re
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
SCANNED_FOLDERS = ("torchlike", "adapters", "benchmarks", "examples", "tests")
SCANNED_MARKDOWN = ("README.md", "MIGRATION.md", "ARCHITECTURE.md")
#: Folders whose string literals are test data (made-up module names), not prose: only their docstrings are read.
TEST_DATA_FOLDERS = ("tests",)
#: Paths of TRL's repository that the docs cite as TRL's (``TRL's examples/scripts/<name>.py``).
UPSTREAM_PATHS = ("examples/scripts/",)

#: A dotted name from ``torchlike`` or ``adapters`` on, not part of a longer dotted name, a path or a hyphenated word.
DOTTED_REFERENCE = re.compile(r"(?<![\w./-])(?:torchlike|adapters)(?:\.[A-Za-z_]\w*)+(?![\w/-])")
#: A repository path from one of the scanned folders on (not part of a longer path); it may end in ``.attribute``.
FILE_PATH = re.compile(r"(?<![\w./-])(?:torchlike|adapters|benchmarks|examples|tests)/[\w./-]*\w/?")
#: Characters after a path that make it a pattern or a template (``tests/test_{a,b}.py``, ``adapters/families/*``).
PATTERN_CONTINUATIONS = "{*<[$"
#: Last parts that make a dotted match a file name rather than a module reference.
FILE_SUFFIXES = {"py", "md", "txt", "json", "toml", "cfg", "yaml", "yml", "ini", "lock", "parquet"}
#: Python source as runs of code (whose brackets tell a docstring, a string outside brackets, from an argument),
#: string literals (single or triple quotes; a prefix such as ``r`` ends the code run before it) and comments. A
#: regular expression rather than ``tokenize``, which is several times slower on the whole tree.
PYTHON_TEXT = re.compile(r"""
      (?P<code>[^"'\#]+)
    | (?P<string>\"\"\"(?:[^"\\]|\\.|"(?!""))*\"\"\"
        | '''(?:[^'\\]|\\.|'(?!''))*'''
        | "(?:[^"\\\n]|\\.)*"
        | '(?:[^'\\\n]|\\.)*')
    | (?P<comment>\#[^\n]*)
""", re.VERBOSE | re.DOTALL)
#: What may stand before a docstring on its line: nothing, or a string prefix.
STRING_PREFIXES = {"", "r", "u", "b", "f", "rb", "br", "fr", "rf"}


@dataclass(frozen=True)
class Citation:
    """One reference found in the text: where (``file:line``) and what."""

    path: Path
    line: int
    text: str

    def where(self) -> str:
        return f"{self.path.relative_to(ROOT)}:{self.line}"


# ---------------------------------------------------------------------------------------------- the module index
@functools.cache
def module_files() -> dict[str, Path]:
    """Every module of the package by its installed name (``adapters/rollout/engine.py`` is
    ``torchlike.adapters.rollout.engine``)."""
    modules = {}
    for folder, package in (("torchlike", "torchlike"), ("adapters", "torchlike.adapters")):
        for path in (ROOT / folder).rglob("*.py"):
            parts = [part for part in path.relative_to(ROOT / folder).with_suffix("").parts if part != "__init__"]
            modules[".".join([package, *parts])] = path
    return modules


def installed_name(reference: str) -> str:
    """A reference as it installs (``adapters.rollout`` is ``torchlike.adapters.rollout``)."""
    return "torchlike." + reference if reference.startswith("adapters.") else reference


def cited_form(module: str, like: str) -> str:
    """``module`` (an installed name) written as ``like`` writes its package: ``adapters.<room>`` or
    ``torchlike.adapters.<room>``."""
    if like.startswith("adapters.") and module.startswith("torchlike.adapters."):
        return module.removeprefix("torchlike.")
    return module


@dataclass(frozen=True)
class Binding:
    """What a top-level name of a module is: a class (its node), an import (the module and name it comes from;
    ``source_name`` None when the module itself is bound) or anything else (``kind`` ``"value"``)."""

    kind: str
    node: ast.ClassDef | None = None
    source_module: str | None = None
    source_name: str | None = None


@dataclass(frozen=True)
class ModuleNames:
    """The names a module binds at its top level (inside ``if``/``try`` blocks too) and whether it has a module
    ``__getattr__`` (lazy exports)."""

    names: dict[str, Binding]
    lazy: bool


def absolute_import(module: str, path: Path, node: ast.ImportFrom) -> str:
    """The absolute module a ``from ... import`` in ``module`` reads from."""
    if not node.level:
        return node.module or ""
    package = module.split(".") if path.name == "__init__.py" else module.split(".")[:-1]
    base = package[:len(package) - (node.level - 1)]
    return ".".join(base + ([node.module] if node.module else []))


def top_level_statements(body: list[ast.stmt]) -> Iterator[ast.stmt]:
    """The statements of a module body, those inside ``if``/``try``/``with`` blocks included."""
    for statement in body:
        yield statement
        for block in ("body", "orelse", "finalbody"):
            if not isinstance(statement, ast.FunctionDef | ast.AsyncFunctionDef | ast.ClassDef):
                yield from top_level_statements(getattr(statement, block, []))
        for handler in getattr(statement, "handlers", []):
            yield from top_level_statements(handler.body)


def assigned_names(target: ast.expr) -> Iterator[str]:
    """The names an assignment target binds (``a``, ``a, b``; not ``a.b`` or ``a[0]``)."""
    if isinstance(target, ast.Name):
        yield target.id
    elif isinstance(target, ast.Tuple | ast.List):
        for element in target.elts:
            yield from assigned_names(element)


@functools.cache
def module_names(module: str) -> ModuleNames:
    """The top-level names of ``module`` (an installed name), read from its source."""
    path = module_files()[module]
    names: dict[str, Binding] = {}
    for statement in top_level_statements(ast.parse(path.read_text()).body):
        if isinstance(statement, ast.ClassDef):
            names[statement.name] = Binding("class", node=statement)
        elif isinstance(statement, ast.FunctionDef | ast.AsyncFunctionDef):
            names[statement.name] = Binding("value")
        elif isinstance(statement, ast.Assign | ast.AnnAssign | ast.AugAssign):
            targets = statement.targets if isinstance(statement, ast.Assign) else [statement.target]
            for target in targets:
                names.update((name, Binding("value")) for name in assigned_names(target))
        elif isinstance(statement, ast.Import):
            for alias in statement.names:
                if alias.asname:
                    names[alias.asname] = Binding("import", source_module=alias.name)
                else:
                    top = alias.name.split(".")[0]
                    names[top] = Binding("import", source_module=top)
        elif isinstance(statement, ast.ImportFrom):
            source = absolute_import(module, path, statement)
            for alias in statement.names:
                if alias.name != "*":
                    names[alias.asname or alias.name] = Binding("import", source_module=source,
                                                                source_name=alias.name)
    return ModuleNames(names, lazy="__getattr__" in names)


def class_members(node: ast.ClassDef) -> set[str]:
    """The names a class body binds, and the ``self.x`` its methods assign."""
    members = set()
    for statement in node.body:
        if isinstance(statement, ast.FunctionDef | ast.AsyncFunctionDef | ast.ClassDef):
            members.add(statement.name)
        elif isinstance(statement, ast.Assign | ast.AnnAssign):
            for target in statement.targets if isinstance(statement, ast.Assign) else [statement.target]:
                members.update(assigned_names(target))
    for inner in ast.walk(node):
        if isinstance(inner, ast.Attribute) and isinstance(inner.ctx, ast.Store):
            if isinstance(inner.value, ast.Name) and inner.value.id == "self":
                members.add(inner.attr)
    return members


# ---------------------------------------------------------------------------------------------- resolving
#: What resolving returns: None when every part is reachable, else the parts from the first one that is not on.
Unreached = list[str] | None


def resolve_in_module(module: str, parts: list[str], depth: int = 0) -> Unreached:
    """None when ``parts`` are reachable from ``module`` as submodules and attributes, else the parts from the first
    unreachable one on. What the project cannot see into (a third-party import, a function's or a constant's
    attributes, dunders) is taken as reachable."""
    if not parts or depth > 20:
        return None
    head, rest = parts[0], parts[1:]
    if head.startswith("__") and head.endswith("__"):
        return None
    if f"{module}.{head}" in module_files():
        return resolve_in_module(f"{module}.{head}", rest, depth + 1)
    names = module_names(module)
    binding = names.names.get(head)
    if binding is None:
        exported = lazily_exported(module, head) if names.lazy else None
        return parts if exported is None else resolve_in_class(*exported, rest, depth + 1)
    if binding.kind == "class":
        return resolve_in_class(module, binding.node, rest, depth + 1)
    if binding.kind == "import":
        if binding.source_name and f"{binding.source_module}.{binding.source_name}" in module_files():
            return resolve_in_module(f"{binding.source_module}.{binding.source_name}", rest, depth + 1)
        if binding.source_module in module_files():
            unreached = resolve_in_module(binding.source_module, [binding.source_name or head, *rest], depth + 1)
            return None if unreached is None else parts[len(parts) - len(unreached):]
    return None


def lazily_exported(package: str, name: str) -> tuple[str, ast.ClassDef | None] | None:
    """A package with a module ``__getattr__`` exports names its modules define: the module defining ``name`` and
    its class node (None for a function or a value)."""
    for module in module_files():
        if module == package or module.startswith(package + "."):
            binding = module_names(module).names.get(name)
            if binding is not None and binding.kind != "import":
                return module, binding.node
    return None


def resolve_in_class(module: str, node: ast.ClassDef | None, parts: list[str], depth: int) -> Unreached:
    """None when ``parts[0]`` is a member of the class or of a base class (anything past a member is taken as
    reachable, and so is anything on a class with a base outside the project, or on a function or value); else
    ``parts``."""
    if not parts or node is None or parts[0] in class_members(node):
        return None
    for base in node.bases:
        base_class = project_class(module, base)
        if base_class is None or resolve_in_class(*base_class, parts, depth + 1) is None:
            return None
    return parts


def project_class(module: str, base: ast.expr) -> tuple[str, ast.ClassDef] | None:
    """The project class a base-class expression names (module and node), or None (third-party, or not a name)."""
    if not isinstance(base, ast.Name):
        return None
    binding = module_names(module).names.get(base.id)
    for _ in range(10):
        if binding is None:
            return None
        if binding.kind == "class":
            return module, binding.node
        if binding.kind != "import" or binding.source_module not in module_files() or not binding.source_name:
            return None
        module = binding.source_module
        binding = module_names(module).names.get(binding.source_name)
    return None


def unresolved_reason(reference: str) -> str | None:
    """None when ``reference`` resolves; else what is missing and what to write instead."""
    parts = installed_name(reference).split(".")
    length = max(index for index in range(1, len(parts) + 1) if ".".join(parts[:index]) in module_files())
    unreached = resolve_in_module(".".join(parts[:length]), parts[length:])
    if unreached is None:
        return None
    found = reference.split(".")[:len(reference.split(".")) - len(unreached)]
    candidates = replacements(reference, unreached)
    hint = f"write {' or '.join(candidates[:3])}" if candidates else "cite the module that defines it"
    return f"{'.'.join(found)} has no {unreached[0]!r}; {hint}"


def replacements(reference: str, unreached: list[str]) -> list[str]:
    """Where the unreached parts live now: a module of that name (moved into a subpackage), else the modules that
    define the first of them that some module defines (a module renamed)."""
    missing, after = unreached[0], unreached[1:]
    moved = sorted(".".join([cited_form(module, reference), *after]) for module in module_files()
                   if module.endswith("." + missing))
    if moved:
        return moved
    for index, name in enumerate(unreached):
        defined = sorted(".".join([cited_form(module, reference), *unreached[index:]]) for module in module_files()
                         if module_names(module).names.get(name, Binding("import")).kind != "import")
        if defined:
            return defined
    return []


def unresolved_path_reason(cited: str) -> str | None:
    """None when the repository has ``cited`` (``torchlike/adapters/...`` is ``adapters/...``; a file may be followed by
    ``.attribute``), or when it lies in a git-ignored output folder or is TRL's; else what to write instead."""
    relative = cited.rstrip("/")
    if relative.startswith("torchlike/adapters/") or relative == "torchlike/adapters":
        relative = relative.removeprefix("torchlike/")
    if (ROOT / relative).exists() or (relative + "/").startswith(UPSTREAM_PATHS + ignored_folders()):
        return None
    folder, _, name = relative.rpartition("/")
    stem, _, attribute = name.partition(".")
    if attribute and attribute.split(".")[0] not in FILE_SUFFIXES and (ROOT / folder / f"{stem}.py").exists():
        return unresolved_reason(f"{folder}/{stem}".replace("/", ".") + "." + attribute)
    top = relative.split("/")[0]
    matches = sorted(str(path.relative_to(ROOT)) for path in (ROOT / top).rglob(name)
                     if "__pycache__" not in path.parts)
    hint = f"; write {' or '.join(matches[:3])}" if matches else "; cite a path that exists"
    return f"no such file or folder{hint}"


@functools.cache
def ignored_folders() -> tuple[str, ...]:
    """The folders ``.gitignore`` names by path, each ending in ``/``: outputs a run writes (the benchmarks' results),
    cited before they exist."""
    folders = [line.rstrip("/") for line in (ROOT / ".gitignore").read_text().splitlines()]
    return tuple(folder + "/" for folder in folders if "/" in folder and not folder.startswith(("#", "*")))


# ---------------------------------------------------------------------------------------------- reading the text
def text_lines(path: Path) -> Iterator[tuple[int, str]]:
    """``(line number, text)``: every line of a Markdown file; the comment, docstring and (outside
    :data:`TEST_DATA_FOLDERS`) prose string-literal lines of a ``.py``."""
    source = path.read_text()
    if path.suffix == ".md":
        yield from enumerate(source.splitlines(), start=1)
        return
    docstrings_only = path.relative_to(ROOT).parts[0] in TEST_DATA_FOLDERS
    depth = 0
    for match in PYTHON_TEXT.finditer(source):
        kind = match.lastgroup
        if kind == "code":
            code = match.group()
            depth += sum(map(code.count, "([{")) - sum(map(code.count, ")]}"))
            continue
        # A literal without a space is a name code uses (a barrier's, a logger's), not prose.
        is_prose = not docstrings_only and any(char.isspace() for char in match.group())
        if kind == "comment" or is_docstring(source, match.start(), depth) or is_prose:
            yield from enumerate(match.group().splitlines(), start=source.count("\n", 0, match.start()) + 1)


def is_docstring(source: str, start: int, depth: int) -> bool:
    """Whether the string literal at ``start`` is a statement of its own: outside brackets, first on its line (after
    its prefix), the line before not continued with a backslash."""
    line_start = source.rfind("\n", 0, start) + 1
    return (depth == 0 and source[line_start:start].strip().lower() in STRING_PREFIXES
            and not source[:line_start].rstrip().endswith("\\"))


def citations(path: Path) -> Iterator[tuple[str, Citation]]:
    """``("module", citation)`` for each dotted reference, ``("path", citation)`` for each repository path."""
    for line, text in text_lines(path):
        for match in DOTTED_REFERENCE.finditer(text):
            if match.group().rsplit(".", 1)[-1] not in FILE_SUFFIXES:
                yield "module", Citation(path, line, match.group())
        for match in FILE_PATH.finditer(text):
            if match.end() == len(text) or text[match.end()] not in PATTERN_CONTINUATIONS:
                yield "path", Citation(path, line, match.group())


def scanned_files() -> list[Path]:
    """Every ``.py`` file of :data:`SCANNED_FOLDERS` and the :data:`SCANNED_MARKDOWN` files."""
    files = [path for folder in SCANNED_FOLDERS for path in sorted((ROOT / folder).rglob("*.py"))]
    return files + [ROOT / name for name in SCANNED_MARKDOWN]


def stale_citations(files: list[Path]) -> list[str]:
    """``file:line: `reference`: what is wrong and what to write`` for each citation in ``files`` that resolves to
    nothing."""
    problems = []
    for path in files:
        for kind, citation in citations(path):
            reason = unresolved_reason(citation.text) if kind == "module" else unresolved_path_reason(citation.text)
            if reason:
                problems.append(f"{citation.where()}: `{citation.text}`: {reason}")
    return problems


# ---------------------------------------------------------------------------------------------- the tests
def test_every_cited_module_and_file_exists():
    problems = stale_citations(scanned_files())
    assert not problems, ("These references name a module, attribute or file that does not exist (modules moved "
                          "into adapters/<room>/ subpackages); change each as its hint says:\n" + "\n".join(problems))


def test_resolver_accepts_modules_attributes_and_class_members():
    for reference in ("torchlike.save", "torchlike.adapters", "adapters.rollout.engine.StaticEngine",
                      "torchlike.adapters.rollout.PagedEngine", "torchlike.trl.GRPOConfig.rollout_engine",
                      "adapters.losses.grpo.POLICY_LOSSES"):
        assert unresolved_reason(reference) is None, reference


def test_resolver_names_the_moved_module_of_a_stale_reference():
    assert unresolved_reason("adapters.sampling.init_cache") == (
        "adapters has no 'sampling'; write adapters.rollout.sampling.init_cache")
    assert unresolved_reason("adapters.grpo_losses.grpo_step_loss") == (
        "adapters has no 'grpo_losses'; write adapters.losses.grpo.grpo_step_loss")


def test_resolver_names_the_missing_member_of_a_class():
    assert unresolved_reason("torchlike.trl.GRPOConfig.no_such_field") == (
        "torchlike.trl.GRPOConfig has no 'no_such_field'; cite the module that defines it")


def test_resolver_names_the_moved_file_of_a_stale_path():
    assert unresolved_path_reason("adapters/sampling.py") == (
        "no such file or folder; write adapters/rollout/sampling.py")
    assert unresolved_path_reason("torchlike/adapters/rollout/engine.py") is None
    assert unresolved_path_reason("adapters/losses/grpo.no_such_function") == (
        "adapters.losses.grpo has no 'no_such_function'; cite the module that defines it")
