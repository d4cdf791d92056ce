"""Print the shape of the hyperacc package: modules per package, import cycles, imports inside
functions, and imports that climb against the layer order given in .importlinter.

Run: python .ci/architecture_report.py   (no imports of hyperacc; it reads the source with ast)
"""
from __future__ import annotations

import ast
import configparser
import pathlib
import sys

ROOT = pathlib.Path(__file__).resolve().parents[1]


def module_name(path: pathlib.Path, root: pathlib.Path) -> str:
    rel = path.relative_to(root).with_suffix("")
    parts = list(rel.parts)
    if parts[-1] == "__init__":
        parts = parts[:-1]
    return ".".join(parts)


def resolve(mod: str, is_pkg: bool, node: ast.ImportFrom) -> str:
    if node.level == 0:
        return node.module or ""
    base = mod.split(".") if is_pkg else mod.split(".")[:-1]
    base = base[: len(base) - (node.level - 1)]
    return ".".join(base + ([node.module] if node.module else []))


def collect(root: pathlib.Path = ROOT):
    modules = {}
    for path in sorted((root / "hyperacc").rglob("*.py")):
        modules[module_name(path, root)] = path
    edges = {}  # (src, dst) -> "top" | "func"
    for mod, path in modules.items():
        tree = ast.parse(path.read_text())
        is_pkg = path.name == "__init__.py"

        def visit(node, depth):
            for child in ast.iter_child_nodes(node):
                d = depth + (1 if isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef)) else 0)
                targets = []
                if isinstance(child, ast.Import):
                    targets = [a.name for a in child.names]
                elif isinstance(child, ast.ImportFrom):
                    base = resolve(mod, is_pkg, child)
                    subs = [f"{base}.{a.name}" for a in child.names if f"{base}.{a.name}" in modules]
                    # `from pkg import submodule` imports the submodule; names import the package
                    targets = subs + ([base] if len(subs) < len(child.names) else [])
                if isinstance(child, ast.If) and "TYPE_CHECKING" in ast.unparse(child.test):
                    continue
                for t in targets:
                    if t.startswith("hyperacc") and t in modules and t != mod:
                        kind = "func" if d else "top"
                        if edges.get((mod, t)) != "top":
                            edges[(mod, t)] = kind
                visit(child, d)

        visit(tree, 0)
    return modules, edges


def cycles(modules, edges):
    graph = {m: set() for m in modules}
    for (a, b) in edges:
        graph[a].add(b)
    index, low, stack, on, out, counter = {}, {}, [], set(), [], [0]
    sys.setrecursionlimit(10000)

    def strong(v):
        index[v] = low[v] = counter[0]
        counter[0] += 1
        stack.append(v)
        on.add(v)
        for w in graph[v]:
            if w not in index:
                strong(w)
                low[v] = min(low[v], low[w])
            elif w in on:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                on.discard(w)
                comp.append(w)
                if w == v:
                    break
            if len(comp) > 1:
                out.append(sorted(comp))

    for v in graph:
        if v not in index:
            strong(v)
    return out


def layers(root: pathlib.Path = ROOT):
    cfg = configparser.ConfigParser()
    cfg.read(root / ".importlinter")
    for section in cfg.sections():
        if cfg[section].get("type") == "layers":
            rows = [r.strip() for r in cfg[section]["layers"].splitlines() if r.strip()]
            # import-linter lists the highest layer first
            return [[f"hyperacc.{x.strip()}" for x in r.replace("|", ":").split(":")] for r in reversed(rows)]
    return []


def layer_of(mod, order):
    for i, row in enumerate(order):
        for name in row:
            if mod == name or mod.startswith(name + "."):
                return i
    return None


def shape(root: pathlib.Path = ROOT, order=None, renamed=None) -> dict:
    """The numbers of the package at ``root``; ``order``: the layers to count climbs against;
    ``renamed``: old module name -> its name in the layers (to place an older, flat package)."""
    modules, edges = collect(root)
    lines = {m: len(p.read_text().splitlines()) for m, p in modules.items()}
    where = lambda m: layer_of((renamed or {}).get(m, m), order)  # noqa: E731
    up = [(a, b) for (a, b) in sorted(edges) if order and where(a) is not None
          and where(b) is not None and where(b) > where(a)]
    return {"modules": len(modules), "lines": sum(lines.values()),
            "root_modules": len([m for m, p in modules.items() if p.parent == root / "hyperacc"]),
            "over_400": {m: n for m, n in lines.items() if n > 400},
            "imports_in_functions": len([1 for k in edges.values() if k == "func"]),
            "cycles": cycles(modules, edges), "against_layers": up}


def main():
    modules, edges = collect()
    numbers = shape(ROOT, layers())
    print(f"modules: {numbers['modules']}, lines: {numbers['lines']}, at the package root: {numbers['root_modules']}")
    print(f"modules over 400 lines: {numbers['over_400'] or 'none'}")
    print(f"hyperacc imports inside functions: {numbers['imports_in_functions']}")
    print(f"import cycles: {len(numbers['cycles'])}")
    for c in numbers["cycles"]:
        print("  " + " <-> ".join(c))
    order = layers()
    if order:
        counts = {}
        up = []
        for m in modules:
            counts.setdefault(layer_of(m, order), []).append(m)
        for (a, b) in sorted(edges):
            la, lb = layer_of(a, order), layer_of(b, order)
            if la is not None and lb is not None and lb > la:
                up.append((a, b))
        for i, row in enumerate(order):
            print(f"layer {i + 1} {' | '.join(n.split('.', 1)[1] for n in row)}: {len(counts.get(i, []))} modules")
        print(f"unlayered modules: {sorted(counts.get(None, []))}")
        print(f"imports against the layers: {len(up)}")
        for a, b in up:
            print(f"  {a} -> {b}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
