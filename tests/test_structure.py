"""The structure the design holds to (docs/architecture.md), checked on the source itself.

- no import cycle among ``hybrid`` and ``launch`` modules, function-level imports included;
- the planning package (``hybrid/planning``) imports no torch and nothing of the runtime,
  neither at module level nor inside functions, and importing all of it loads no torch;
- ``hybrid`` never imports ``launch``;
- nothing outside the tests sets or deletes an attribute of a torch class, module or object;
- every error class a person can fix derives from ``hybrid.errors.UserError``.
"""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
PACKAGES = ("hybrid", "launch")
PLANNING = "hybrid.planning"
PLANNING_MAY_IMPORT = (PLANNING, "hybrid.errors", "hybrid.files")
"""Besides the standard library: the planning package and two pure utilities."""


def module_files() -> dict[str, Path]:
    """Dotted module name -> file, for every module of ``hybrid`` and ``launch``."""
    out = {}
    for package in PACKAGES:
        for path in sorted((ROOT / package).rglob("*.py")):
            parts = path.relative_to(ROOT).with_suffix("").parts
            name = ".".join(parts[:-1] if parts[-1] == "__init__" else parts)
            out[name] = path
    return out


def imported_names(path: Path, module: str) -> list[tuple[str, int]]:
    """Every module ``path`` imports, anywhere in the file, as (dotted name, line)."""
    tree = ast.parse(path.read_text(), filename=str(path))
    package = module if path.name == "__init__.py" else module.rpartition(".")[0]
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            found += [(alias.name, node.lineno) for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = package.split(".")
                anchor = anchor[:len(anchor) - node.level + 1]
                base = ".".join(anchor + ([base] if base else []))
            found.append((base, node.lineno))
            # ``from package import module`` imports the module too
            found += [(f"{base}.{alias.name}", node.lineno) for alias in node.names]
    return found


def import_graph() -> dict[str, set[str]]:
    """Module -> the project modules it imports (a name that is a module, or the closest
    enclosing one: ``from hybrid.dp import GradSync`` is an edge to ``hybrid.dp``)."""
    files = module_files()
    graph: dict[str, set[str]] = {name: set() for name in files}
    for name, path in files.items():
        for target, _ in imported_names(path, name):
            while target and target not in files:
                target = target.rpartition(".")[0]
            if target and target != name and not name.startswith(target + "."):
                graph[name].add(target)
    return graph


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components with more than one module (Tarjan)."""
    index, low, stack, on_stack, found = {}, {}, [], set(), []

    def visit(node: str) -> None:
        index[node] = low[node] = len(index)
        stack.append(node)
        on_stack.add(node)
        for nxt in sorted(graph[node]):
            if nxt not in index:
                visit(nxt)
                low[node] = min(low[node], low[nxt])
            elif nxt in on_stack:
                low[node] = min(low[node], index[nxt])
        if low[node] == index[node]:
            component = []
            while True:
                member = stack.pop()
                on_stack.discard(member)
                component.append(member)
                if member == node:
                    break
            if len(component) > 1:
                found.append(sorted(component))

    sys.setrecursionlimit(10_000)
    for node in sorted(graph):
        if node not in index:
            visit(node)
    return found


def test_no_import_cycles_counting_function_level_imports():
    assert cycles(import_graph()) == []


def test_the_cycle_finder_finds_a_cycle():
    assert cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]


def test_planning_imports_no_torch_and_nothing_of_the_runtime():
    files = module_files()
    bad = []
    for name, path in files.items():
        if name != PLANNING and not name.startswith(PLANNING + "."):
            continue
        for target, line in imported_names(path, name):
            top = target.split(".")[0]
            if top in ("torch", "megatron", "numpy", "launch") or (
                    top == "hybrid" and not target.startswith(PLANNING_MAY_IMPORT)):
                bad.append(f"{path.relative_to(ROOT)}:{line} imports {target}")
    assert bad == []


def test_importing_all_of_planning_loads_no_torch():
    planning = [name for name in module_files() if name.startswith(PLANNING)]
    code = ("import sys\n" + "".join(f"import {name}\n" for name in planning)
            + "print(sorted(m for m in sys.modules if m.split('.')[0] in "
              "('torch', 'numpy', 'megatron')))")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          cwd=ROOT, timeout=60)
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == "[]"


PURE_OUTSIDE_PLANNING = ("hybrid.pipeline.timeline", "hybrid.checkpoint.store", "hybrid.diagnosis.stall",
                         "hybrid.diagnosis.stragglers", "hybrid.files", "hybrid.data", "hybrid.data.prepare",
                         "hybrid.data.megatron", "launch.commands.data", "launch.commands.run_data")
"""Runtime-side modules the launcher uses before any worker starts: no torch either."""


def test_pure_helpers_outside_planning_load_no_torch():
    code = ("import sys\n" + "".join(f"import {name}\n" for name in PURE_OUTSIDE_PLANNING)
            + "print('torch' in sys.modules)")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          cwd=ROOT, timeout=60)
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == "False"


def test_hybrid_never_imports_launch():
    graph = import_graph()
    assert [(a, b) for a, bs in graph.items() for b in bs
            if a.startswith("hybrid") and b.startswith("launch")] == []


def torch_names(tree: ast.AST) -> set[str]:
    """Names in a module that stand for torch objects: imported from torch, or assigned from
    an expression rooted at such a name (``cls = dist.ProcessGroup``), to a fixed point."""
    names = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            names |= {(a.asname or a.name).split(".")[0] for a in node.names
                      if a.name.split(".")[0] == "torch"}
        elif isinstance(node, ast.ImportFrom) and (node.module or "").split(".")[0] == "torch":
            names |= {a.asname or a.name for a in node.names}
    assigns = [node for node in ast.walk(tree) if isinstance(node, ast.Assign)]
    while True:
        grown = {t.id for node in assigns if _root(node.value) in names
                 for t in node.targets if isinstance(t, ast.Name)} - names
        if not grown:
            return names
        names |= grown


def _root(node: ast.AST):
    while isinstance(node, (ast.Attribute, ast.Subscript, ast.Call)):
        node = node.func if isinstance(node, ast.Call) else node.value
    return node.id if isinstance(node, ast.Name) else None


def patches(source: str) -> list[int]:
    """Lines that set or delete an attribute of a torch object."""
    tree = ast.parse(source)
    torch_objects = torch_names(tree)
    lines = []
    for node in ast.walk(tree):
        targets = []
        if isinstance(node, ast.Call) and getattr(node.func, "id", None) in (
                "setattr", "delattr") and node.args:
            targets = [node.args[0]]
        elif isinstance(node, (ast.Assign, ast.AugAssign, ast.Delete)):
            assigned = node.targets if isinstance(node, (ast.Assign, ast.Delete)) \
                else [node.target]
            targets = [t.value for t in assigned if isinstance(t, ast.Attribute)]
        if any(_root(t) in torch_objects for t in targets):
            lines.append(node.lineno)
    return lines


def test_the_patch_finder_sees_aliases():
    assert patches("import torch.distributed as dist\ncls = dist.ProcessGroup\n"
                   "setattr(cls, 'allreduce', None)\n") == [3]
    assert patches("from torch.distributed import ProcessGroup as P\nP.send = 1\n") == [2]
    assert patches("import torch\nx = torch.zeros(1)\ny = {}\ny['a'] = x\n") == []


PATCH_ALLOWED = {"hybrid/megatron_import.py": 2}
"""The one exception, by file and count: ``torch.compile`` stood in for while megatron-core
is imported, and put back (its own tests hold it restored, even when the import fails)."""


def test_nothing_patches_torch_classes_or_modules():
    """No attribute of a torch class, module or object is set or deleted outside the tests
    (``dist.ProcessGroup.allreduce = ...``): counting and fault injection go through hybrid's
    own group wrapper (``hybrid.comm``)."""
    found = {str(path.relative_to(ROOT)): patches(path.read_text())
             for path in module_files().values()}
    bad = [f"{path}:{line}" for path, lines in found.items() for line in lines
           if len(lines) != PATCH_ALLOWED.get(path, 0)]
    assert bad == []
    assert all(len(found[path]) == count for path, count in PATCH_ALLOWED.items())


NOT_USER_ERRORS = {
    "StallError": "a diagnosis: its line names the ranks that waited (hybrid.diagnosis.watch)",
    "PipelineTimeout": "a failed wait, turned into a StallError",
    "SpawnError": "a test helper's failure",
    "WorkerFailure": "a worker that raised or died; its line is the worker's",
    "LaunchFailed": "the launch failed outside any worker (nodes that never met)",
    "RendezvousFailure": "a LaunchFailed",
    "WorkerInterrupted": "a signal",
    "LaunchInterrupted": "a signal",
    "Stopped": "a signal (SIGTERM, SIGHUP) raised as Ctrl-C's KeyboardInterrupt is",
    "RunFailed": "the launcher's carrier of a failure line and exit status",
    "OrderViolation": "internal to the schedule replay, turned into a ScheduleError",
    "Deadlock": "internal to the schedule replay, turned into a ScheduleError",
}
"""Exception classes that are not the user's to fix, and why; every other one must be."""


def test_every_error_class_a_person_can_fix_is_a_user_error():
    import importlib
    import inspect

    from hybrid.errors import UserError

    defined = {}
    for name in module_files():
        module = importlib.import_module(name)
        for cls_name, cls in vars(module).items():
            if inspect.isclass(cls) and issubclass(cls, BaseException) \
                    and cls.__module__ == name:
                defined[cls_name] = cls
    assert {name for name in NOT_USER_ERRORS if name not in defined} == set()
    assert sorted(name for name, cls in defined.items()
                  if name not in NOT_USER_ERRORS and not issubclass(cls, UserError)) == []
