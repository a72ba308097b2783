#!/usr/bin/env python3
"""Module-level import graph of a Rust library crate, and its circles.

    python3 .ci/import_graph.py cudnn-ops --room ops [--edges] [--dot]
    python3 .ci/import_graph.py llama

Reads the crate's sources from `<crate>/src/lib.rs` down its `mod` declarations (no cargo, no rustc;
well under a second) and prints the strongly connected components of the graph whose nodes are the
crate's *units* and whose edges are "a file of unit A names an item of unit B". It exits 1 when a
component holds more than one unit (an import circle), 0 otherwise.

What counts as a reference: every path in code that starts with `crate::` (or `$crate::` in a
macro), `super::` or `self::`, with a child module of the current module (`engine::knob_ranges` in
`plan/mod.rs`), or with a name an earlier `use` bound (`use crate::raw;` ... `raw::driver::x`);
and every leaf of every `use` tree (`use crate::{a::B, c::{D, E}}`). Comments (doc comments
included, so intra-doc links do not count) and string and char literals are blanked first; paths
into other crates (`std::`, `cudarc::`, `cudnn_llm_sys::`) are ignored. Test code (`#[cfg(test)]`
modules) counts like any other code: it is part of the crate, and a test that reaches up a layer
ties the layers together as much as a function does. `include_str!` of another room's `.cu` file is
a string, not an import, and does not count.

How a path is resolved: from the module it appears in, segment by segment down the module tree.
A segment that names a `use` binding of the module reached so far (a re-export such as lib.rs's
`pub use context::Cudnn`, or `plan/mod.rs`'s `pub use autotune::L2Flush`) is followed to where
that binding points, so `crate::Cudnn` lands on `context`, the module that defines `Cudnn`, not on
the crate root. A glob (`pub use x::*`) is searched when the name is not defined in the module. The
first segment that is neither a module nor a binding is an item of the module reached: that module
is the target.

The unit is the top-level module, with everything under it folded in: `plan/{lifecycle, binding,
autotune, engine}.rs` are one unit `plan`, `raw/*` is `raw`, `graph/*` is `graph`; inline modules
(`mod tests { .. }`) belong to their file's unit. References inside a unit are not edges: a
module's halves may import each other, the unit is what must layer. The exception is a *room*
parent given with `--room` (cudnn-ops: `ops`): each child directory of it is a unit of its own,
`ops/rmsnorm/{mod, fused, naive, backward}.rs` → `ops::rmsnorm`, so that rooms must not import
each other in a circle either, while a room's `mod.rs` and its `fused.rs` importing each other (the
`Op`/`Fused` traits are implemented in the halves, the key is declared in `mod.rs`) is fine. The
room parent's own `mod.rs` (the `Op` traits and `ops::run`) is the unit `ops`, below the rooms.
llama runs without rooms: `modules/` is one unit, the decoder's layer of modules, whose `mod.rs`
holds the pass state every module takes and re-exports what the model names (`EMBED_RANGE`).

The crate root (lib.rs) is the unit `crate` for the items it defines (`Backend`, `HEADER_VERSION`);
its `use` declarations are the crate's facade, followed when resolving but not edges of their own
(otherwise every module that names a root item would sit in one circle with the whole crate).
"""

import argparse
import os
import re
import sys
from collections import defaultdict

IDENT = r"[A-Za-z_][A-Za-z0-9_]*"


def blank(src):
    """`src` with comments and string/char literals replaced by spaces (newlines kept), so offsets
    and line numbers still match the file."""
    out = list(src)
    n = len(src)
    i = 0

    def wipe(a, b):
        for k in range(a, b):
            if out[k] != "\n":
                out[k] = " "

    while i < n:
        c = src[i]
        nxt = src[i + 1] if i + 1 < n else ""
        if c == "/" and nxt == "/":
            j = src.find("\n", i)
            j = n if j < 0 else j
            wipe(i, j)
            i = j
        elif c == "/" and nxt == "*":
            depth, j = 1, i + 2
            while j < n and depth:
                if src.startswith("/*", j):
                    depth, j = depth + 1, j + 2
                elif src.startswith("*/", j):
                    depth, j = depth - 1, j + 2
                else:
                    j += 1
            wipe(i, j)
            i = j
        elif c in "rb" and (i == 0 or not (src[i - 1].isalnum() or src[i - 1] == "_")):
            m = re.match(r'b?r(#*)"', src[i:])
            if m:
                end = src.find('"' + m.group(1), i + m.end())
                end = n if end < 0 else end + 1 + len(m.group(1))
                wipe(i, end)
                i = end
            elif src.startswith('b"', i) or src.startswith("b'", i):
                i += 1  # the literal itself is handled at the quote
            else:
                i += 1
        elif c == '"':
            j = i + 1
            while j < n and src[j] != '"':
                j += 2 if src[j] == "\\" else 1
            wipe(i, j + 1)
            i = j + 1
        elif c == "'":
            # A char literal ('x', '\n', '\u{..}') or a lifetime ('a): a lifetime has no closing quote
            # right after its first character.
            if nxt == "\\":
                j = i + 2
                while j < n and src[j] != "'":
                    j += 1
                wipe(i, j + 1)
                i = j + 1
            elif i + 2 < n and src[i + 2] == "'":
                wipe(i, i + 3)
                i += 3
            else:
                i += 1
        else:
            i += 1
    return "".join(out)


def matching_brace(code, open_at):
    depth = 0
    for k in range(open_at, len(code)):
        if code[k] == "{":
            depth += 1
        elif code[k] == "}":
            depth -= 1
            if depth == 0:
                return k
    return len(code)


def parse_use_tree(text):
    """Leaves of a use tree as (segments, bound name); the name is '*' for a glob."""
    toks = re.findall(r"\$?r#" + IDENT + r"|\$?" + IDENT + r"|::|[{},*]", text)
    pos = 0

    def tree(prefix):
        nonlocal pos
        out = []
        segs = list(prefix)
        while pos < len(toks):
            t = toks[pos]
            if t == "::":
                pos += 1
            elif t == "{":
                pos += 1
                while pos < len(toks) and toks[pos] != "}":
                    out += tree(segs)
                    if pos < len(toks) and toks[pos] == ",":
                        pos += 1
                pos += 1
                return out
            elif t == "*":
                pos += 1
                out.append((segs, "*"))
                return out
            elif t in (",", "}"):
                break
            elif t == "as":
                pos += 1
                alias = toks[pos]
                pos += 1
                out.append((strip_self(segs), alias))
                return out
            else:
                segs = segs + [t.replace("r#", "")]
                pos += 1
        if segs and len(segs) > len(prefix):
            path = strip_self(segs)
            out.append((path, path[-1] if path else "self"))
        return out

    leaves = []
    while pos < len(toks):
        leaves += tree([])
        if pos < len(toks) and toks[pos] == ",":
            pos += 1
        elif pos < len(toks):
            pos += 1
    return leaves


def strip_self(segs):
    return segs[:-1] if len(segs) > 1 and segs[-1] == "self" else segs


class Module:
    def __init__(self, path, file, start, end, file_module):
        self.path = path  # tuple of segments below the crate root
        self.file = file
        self.span = (start, end)  # its body in the file's blanked code
        self.file_module = file_module  # the path of the file-backed module it lives in
        self.children = set()
        self.uses = []  # (segments, bound name, line, is the crate root's facade)
        self.bindings = {}  # name -> segments, as written
        self.globs = []  # segments of `use x::*`
        self.defined = set()  # items defined (for glob lookups)


class Crate:
    def __init__(self, root, rooms):
        self.src_root = root
        self.rooms = [tuple(r.split("::")) for r in rooms]
        self.modules = {}
        self.code = {}  # file -> blanked code
        self.refs = []  # (module path, segments, file, line)
        self.load((), os.path.join(root, "lib.rs"), is_root=True)

    def load(self, path, file, is_root=False):
        with open(file, encoding="utf-8") as f:
            code = blank(f.read())
        self.code[file] = code
        self.scan(path, file, code, 0, len(code), path, is_root)

    def scan(self, path, file, code, start, end, file_module, is_root):
        mod = Module(path, file, start, end, file_module)
        self.modules[path] = mod
        body = code[start:end]
        # Inline modules first: their text belongs to them, not to this module.
        inner = []
        for m in re.finditer(r"\bmod\s+(?:r#)?(" + IDENT + r")\s*([;{])", body):
            at = start + m.start()
            if any(a <= at < b for a, b in inner):
                continue
            name = m.group(1)
            mod.children.add(name)
            mod.defined.add(name)
            if m.group(2) == "{":
                open_at = start + m.end() - 1
                close = matching_brace(code, open_at)
                inner.append((at, close + 1))
                self.scan(path + (name,), file, code, open_at + 1, close, file_module, False)
            else:
                self.load(path + (name,), self.child_file(file, name, is_root))
        own = list(body)
        for a, b in inner:
            for k in range(a - start, b - start):
                if own[k] != "\n":
                    own[k] = " "
        own = "".join(own)
        item = r"\b(?:fn|struct|enum|trait|type|const|static|union|macro_rules!)\s+(" + IDENT + ")"
        for m in re.finditer(item, own):
            mod.defined.add(m.group(1))
        # `use` declarations: bindings, and leaves to resolve.
        for m in re.finditer(r"\buse\s+([^;]*);", own):
            line = code.count("\n", 0, start + m.start()) + 1
            for segs, name in parse_use_tree(m.group(1)):
                if not segs:
                    continue
                if name == "*":
                    mod.globs.append(segs)
                else:
                    mod.bindings[name] = segs
                mod.uses.append((segs, name, line, is_root))
            own = own[: m.start()] + re.sub(r"[^\n]", " ", m.group(0)) + own[m.end() :]
        # Paths in code.
        for m in re.finditer(r"(?<![\w$:])(\$?" + IDENT + r"(?:\s*::\s*" + IDENT + r")+)", own):
            segs = re.split(r"\s*::\s*", m.group(1))
            line = code.count("\n", 0, start + m.start()) + 1
            self.refs.append((path, segs, file, line))

    def child_file(self, parent_file, name, parent_is_dir_owner):
        d = os.path.dirname(parent_file)
        base = os.path.basename(parent_file)
        if not (parent_is_dir_owner or base == "mod.rs"):
            d = os.path.join(d, base[:-3])
        for cand in (os.path.join(d, name + ".rs"), os.path.join(d, name, "mod.rs")):
            if os.path.exists(cand):
                return cand
        sys.exit(f"import_graph: module `{name}` declared in {parent_file} has no file")

    def absolute(self, module, segs):
        """`segs` as written in `module`, as a path from the crate root; None outside the crate."""
        first = segs[0]
        if first in ("crate", "$crate"):
            return list(segs[1:])
        if first == "super" or first == "self":
            cur = list(module)
            k = 0
            while k < len(segs) and segs[k] in ("super", "self"):
                if segs[k] == "super":
                    cur = cur[:-1]
                k += 1
            return cur + list(segs[k:])
        mod = self.modules[module]
        if first in mod.children:
            return list(module) + list(segs)
        if first in mod.bindings and mod.bindings[first] != segs:
            base = self.absolute(module, mod.bindings[first])
            return None if base is None else base + list(segs[1:])
        return None

    def resolve(self, abspath, depth=0):
        """The module that defines what `abspath` names."""
        if depth > 20:
            return None
        cur = ()
        for k, seg in enumerate(abspath):
            mod = self.modules[cur]
            if seg in mod.children:
                cur = cur + (seg,)
                continue
            if seg in mod.bindings:
                target = self.absolute(cur, mod.bindings[seg])
                if target is None:
                    return None  # re-export of another crate's item
                return self.resolve(target + list(abspath[k + 1 :]), depth + 1)
            if mod.globs and seg not in mod.defined:
                for g in mod.globs:
                    base = self.absolute(cur, g)
                    if base is None:
                        continue
                    hit = self.resolve(base + [seg] + list(abspath[k + 1 :]), depth + 1)
                    if hit is not None and hit != tuple(base):
                        return hit
            return cur
        return cur

    def unit(self, path):
        path = self.modules[path].file_module
        for r in self.rooms:
            if path[: len(r)] == r and len(path) > len(r):
                return "::".join(path[: len(r) + 1])
        return path[0] if path else "crate"

    def graph(self):
        edges = defaultdict(list)  # (from unit, to unit) -> [(file, line, path)]
        units = {self.unit(p) for p in self.modules}

        def add(module, segs, file, line):
            absp = self.absolute(module, segs)
            if absp is None:
                return
            target = self.resolve(absp)
            if target is None:
                return
            a, b = self.unit(module), self.unit(target)
            if a != b:
                edges[(a, b)].append((file, line, "::".join(segs)))

        for path, mod in self.modules.items():
            for segs, _name, line, facade in mod.uses:
                if not facade:
                    add(path, segs, mod.file, line)
        for module, segs, file, line in self.refs:
            add(module, segs, file, line)
        return units, edges


def sccs(nodes, succ):
    """Tarjan's strongly connected components, each sorted, in reverse topological order."""
    index, low, on, stack, out = {}, {}, set(), [], []
    counter = [0]

    def visit(v):
        index[v] = low[v] = counter[0]
        counter[0] += 1
        stack.append(v)
        on.add(v)
        for w in sorted(succ[v]):
            if w not in index:
                visit(w)
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
            out.append(sorted(comp))

    sys.setrecursionlimit(10000)
    for v in sorted(nodes):
        if v not in index:
            visit(v)
    return out


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("crate", help="crate directory (holding src/lib.rs)")
    ap.add_argument("--room", action="append", default=[], help="module whose children are units (e.g. ops)")
    ap.add_argument("--edges", action="store_true", help="print every edge with its first reference")
    ap.add_argument("--dot", action="store_true", help="print the graph in Graphviz dot instead")
    args = ap.parse_args()
    crate = Crate(os.path.join(args.crate, "src"), args.room)
    units, edges = crate.graph()
    succ = defaultdict(set)
    for a, b in edges:
        succ[a].add(b)
    rel = lambda f: os.path.relpath(f, args.crate)
    if args.dot:
        print("digraph imports {")
        for a, b in sorted(edges):
            print(f'  "{a}" -> "{b}";')
        print("}")
        return 0
    comps = sccs(units, succ)
    circles = [c for c in comps if len(c) > 1]
    name = os.path.basename(os.path.abspath(args.crate))
    manifest = os.path.join(args.crate, "Cargo.toml")
    if os.path.exists(manifest):
        m = re.search(r'^name\s*=\s*"([^"]+)"', open(manifest, encoding="utf-8").read(), re.M)
        name = m.group(1) if m else name
    print(f"{name}: {len(units)} units, {len(edges)} edges, {len(circles)} circle(s)")
    if args.edges:
        for (a, b), refs in sorted(edges.items()):
            f, line, p = refs[0]
            print(f"  {a} -> {b}  ({len(refs)}x, e.g. {rel(f)}:{line} {p})")
    for c in circles:
        print(f"circle: {{{', '.join(c)}}}")
        inside = set(c)
        for (a, b), refs in sorted(edges.items()):
            if a in inside and b in inside:
                shown = ", ".join(f"{rel(f)}:{line} {p}" for f, line, p in refs[:3])
                more = f" (+{len(refs) - 3})" if len(refs) > 3 else ""
                print(f"  {a} -> {b}: {shown}{more}")
    return 1 if circles else 0


if __name__ == "__main__":
    sys.exit(main())
