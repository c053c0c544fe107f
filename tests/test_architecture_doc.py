"""docs/architecture.md is checked against the tree, and no docstring names a module that is gone.

- Every module of the package is listed in the file map (the first code block), and every path the
  map lists exists.
- Every path the "Where does X live" table and the concept table cite exists, and every
  `path.py` `name` pair names something defined in that file.
- No source file of the package or the benchmarks names a module path (``core/x/y.py``) or a dotted
  ``hyper_parallel.x`` name that does not exist.
Static: reads files only, imports nothing.
"""
import ast
import pathlib
import re

ROOT = pathlib.Path(__file__).resolve().parents[1]
DOC = ROOT / "docs" / "architecture.md"
_PATH_TOKEN = re.compile(r"^[\w.\-]+(/|\.py|\.md)$")


def _file_map():
    """The paths of the first code block's tree, rebuilt from the indentation."""
    block = DOC.read_text(encoding="utf-8").split("```")[1]
    stack, listed = [], set()
    for line in block.splitlines()[1:]:
        match = re.match(r"^(\s*)(\S+)", line)
        if not match or not _PATH_TOKEN.match(match.group(2)):
            continue
        indent, token = len(match.group(1)), match.group(2)
        while stack and stack[-1][0] >= indent:
            stack.pop()
        path = "/".join([name.rstrip("/") for _, name in stack] + [token.rstrip("/")])
        if token.endswith("/"):
            stack.append((indent, token))
        listed.add(path)
    return listed


def _package_modules():
    return {str(p.relative_to(ROOT)) for p in (ROOT / "hyper_parallel").rglob("*.py")
            if p.name != "__init__.py"}


def test_every_module_is_in_the_file_map():
    listed = _file_map()
    missing = sorted(_package_modules() - listed)
    assert not missing, f"docs/architecture.md does not list: {missing}"


def test_every_listed_path_exists():
    stale = sorted(p for p in _file_map() if not (ROOT / p).exists())
    assert not stale, f"docs/architecture.md lists paths that do not exist: {stale}"


def _resolve(cited):
    """A cited path relative to hyper_parallel/ (or the repository), or None."""
    for base in (ROOT / "hyper_parallel", ROOT):
        if (base / cited).exists():
            return base / cited
    matches = [p for p in (ROOT / "hyper_parallel").rglob(pathlib.Path(cited).name)
               if str(p).endswith("/" + cited)]
    return matches[0] if len(matches) == 1 else None


def _defined_names(path):
    names = set()
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            names.add(node.name)
        elif isinstance(node, ast.Assign):
            names.update(t.id for t in node.targets if isinstance(t, ast.Name))
        elif isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name):
            names.add(node.target.id)
    return names


def test_tables_cite_real_files_and_names():
    text = DOC.read_text(encoding="utf-8").split("```", 2)[2]
    problems = []
    for match in re.finditer(r"`([\w/]+\.py)`(?:\s+`([\w.]+)`)?", text):
        cited, name = match.group(1), match.group(2)
        path = _resolve(cited)
        if path is None:
            problems.append(cited)
        elif name and name.split(".")[0] not in _defined_names(path):
            problems.append(f"{cited} {name}")
    assert not problems, f"docs/architecture.md cites what does not exist: {problems}"


def _module_names():
    names = set()
    for path in (ROOT / "hyper_parallel").rglob("*.py"):
        parts = path.relative_to(ROOT).with_suffix("").parts
        names.add(".".join(parts[:-1] if parts[-1] == "__init__" else parts))
    return names


def _public_names():
    tree = ast.parse((ROOT / "hyper_parallel" / "__init__.py").read_text(encoding="utf-8"))
    for node in tree.body:
        if isinstance(node, ast.Assign) and any(getattr(t, "id", "") == "_EXPORTS" for t in node.targets):
            return {f"hyper_parallel.{key.value}" for key in node.value.keys}
    return set()


_DIRS = ("core|platform|integrations|dtensor|context_parallel|fully_shard|tensor_parallel|ops|aten|"
         "dispatch|masks|ring|auto|overlap|mla|movement|long_sequence|linear_attention|torch|"
         "mindspore|npu|expert_parallel|plan|data_parallel|attention|agreement")
_CITED_PATH = re.compile(rf"\b((?:{_DIRS})/[\w/]+\.py)\b")


def _stale_citations(path, modules, public):
    source = path.read_text(encoding="utf-8")
    for match in re.finditer(r"(?<![\"'\w])hyper_parallel(?:\.\w+)+", source):
        name = match.group(0)
        head = name
        while head not in modules and head not in public and head.count(".") > 1:
            head = head.rpartition(".")[0]
        if head not in modules and head not in public:
            yield name
    for match in _CITED_PATH.finditer(source):
        if _resolve(match.group(1)) is None:
            yield match.group(1)


def test_no_source_names_a_missing_module():
    modules, public = _module_names(), _public_names()
    sources = list((ROOT / "hyper_parallel").rglob("*.py")) + list((ROOT / "benchmarks").rglob("*.py"))
    stale = sorted({f"{p.relative_to(ROOT)}: {name}" for p in sources
                    for name in _stale_citations(p, modules, public)})
    assert not stale, "modules named in sources that do not exist:\n" + "\n".join(stale)
