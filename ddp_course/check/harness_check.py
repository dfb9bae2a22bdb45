"""Whether a learner's script keeps the exercise's harness as shipped: the syntax-tree comparison
that ``grade`` runs before any job (see the notes in ``ddp_course.check.reference``)."""

from __future__ import annotations

from pathlib import Path

from ddp_course.check.reference import exercise_reference, functions_of, is_stub
from ddp_course.check.registry import parse_source
from ddp_course.check.verdicts import Verdict


def answer_functions(tree) -> list[str]:
    """Qualified names of the functions whose body holds the stub, in the file's order."""
    import ast

    return [name for name, fn in functions_of(tree.body) if any(is_stub(n) for n in ast.walk(fn))]


def _is_region(node) -> bool:
    """A top-level statement of the shipped copy that is (or holds) a stub outside every answer function."""
    import ast

    if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
        return False  # holding a stub makes it an answer function
    if isinstance(node, ast.ClassDef):
        return any(_is_region(child) for child in node.body)
    return any(is_stub(n) for n in ast.walk(node))


def _normalized(node, answers: set[str], editable: set[str]):
    """A copy of top-level statement ``node`` as compared: no docstrings, the answer functions'
    bodies empty, the editable constants' values replaced by a placeholder."""
    import ast
    import copy

    defs = (ast.FunctionDef, ast.AsyncFunctionDef)

    def strip(n, qual: str) -> None:  # qual: n's qualified name as functions_of gives it ("" if it has none)
        if isinstance(n, (*defs, ast.ClassDef)):
            first = n.body[0] if n.body else None
            if isinstance(first, ast.Expr) and isinstance(first.value, ast.Constant) and isinstance(first.value.value, str):
                n.body = n.body[1:]
            if isinstance(n, defs) and qual in answers:
                n.body = []
                return
        for child in ast.iter_child_nodes(n):
            inner = f"{qual}.{child.name}" if isinstance(n, ast.ClassDef) and isinstance(child, (*defs, ast.ClassDef)) else ""
            strip(child, inner)

    node = copy.deepcopy(node)
    strip(node, node.name if isinstance(node, (*defs, ast.ClassDef)) else "")
    if isinstance(node, ast.Assign) and len(node.targets) == 1 and getattr(node.targets[0], "id", None) in editable:
        node.value = ast.Constant(value="<editable>")
    return node


def _statements(tree) -> list:
    """The top-level statements of a module, its docstring left out."""
    import ast

    body = tree.body
    if body and isinstance(body[0], ast.Expr) and isinstance(body[0].value, ast.Constant) \
            and isinstance(body[0].value.value, str):
        body = body[1:]
    return body


def _label(node) -> str:
    """How a message names a top-level statement: ``main()``, ``STEPS``, ``import json``..."""
    import ast

    if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
        return f"{node.name}()"
    if isinstance(node, ast.ClassDef):
        return f"class {node.name}"
    targets = node.targets if isinstance(node, ast.Assign) else \
        [node.target] if isinstance(node, (ast.AnnAssign, ast.AugAssign)) else []
    names = [e.id for t in targets for e in (t.elts if isinstance(t, ast.Tuple) else [t]) if isinstance(e, ast.Name)]
    if names:
        return ", ".join(names)
    if isinstance(node, ast.Import):
        return "import " + ", ".join(a.name for a in node.names)
    if isinstance(node, ast.ImportFrom):
        return f"from {'.' * node.level}{node.module or ''} import " + ", ".join(a.name for a in node.names)
    if isinstance(node, ast.If) and "__name__" in ast.dump(node.test):
        return 'the `if __name__ == "__main__":` block'
    return f"the {type(node).__name__.lower()} statement"


def _diverge(a, b, sa=None, sb=None):
    """Where ``a`` and ``b`` first differ: the innermost nodes with a line number, one of each tree
    (None for a statement one side lacks), or None when they are the same."""
    import ast

    if type(a) is not type(b):
        return (a if hasattr(a, "lineno") else sa), (b if hasattr(b, "lineno") else sb)
    if isinstance(a, ast.AST):
        if hasattr(a, "lineno"):
            sa, sb = a, b
        for field in a._fields:
            found = _diverge(getattr(a, field, None), getattr(b, field, None), sa, sb)
            if found:
                return found
        return None
    if isinstance(a, list):
        for x, y in zip(a, b):
            found = _diverge(x, y, sa, sb)
            if found:
                return found
        if len(a) == len(b):
            return None
        k = min(len(a), len(b))
        x, y = (a[k] if k < len(a) else None), (b[k] if k < len(b) else None)
        statements = isinstance(x if x is not None else y, ast.stmt)  # a statement only one side has
        return (x if hasattr(x, "lineno") else None if statements else sa,
                y if hasattr(y, "lineno") else None if statements else sb)
    return None if a == b else (sa, sb)


def _bound_names(node) -> set[str]:
    """The names a top-level import, def or class binds."""
    import ast

    if isinstance(node, ast.Import):
        return {a.asname or a.name.split(".")[0] for a in node.names}
    if isinstance(node, ast.ImportFrom):
        return {a.asname or a.name for a in node.names}
    if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
        return {node.name}
    return set()


def _extra_refused(node, reference: list) -> str | None:
    """Why a top-level statement the shipped copy does not have may not be added (None: it may).

    Allowed: an import of names the harness does not use (or an import the shipped copy already
    makes, or ``import a.b`` where the copy imports ``a`` itself), a helper function of a new name
    without decorators, a string (a note).
    """
    import ast

    protected = {n.id for r in reference for n in ast.walk(r) if isinstance(n, ast.Name)}
    protected |= {name for r in reference for name in _bound_names(r)}
    if isinstance(node, (ast.Import, ast.ImportFrom)):
        if any(ast.dump(node) == ast.dump(r) for r in reference):
            return None  # the same import twice binds the same module
        imported = {(r.module, r.level, a.name, a.asname) for r in reference if isinstance(r, ast.ImportFrom)
                    for a in r.names}
        if isinstance(node, ast.ImportFrom) and any(a.name == "*" for a in node.names):
            return "a `*` import may rebind any name the harness uses"
        plain = {a.name.split(".")[0] for r in reference if isinstance(r, ast.Import) for a in r.names if not a.asname}
        clash = []
        for alias in node.names:
            bound = alias.asname or (alias.name.split(".")[0] if isinstance(node, ast.Import) else alias.name)
            same = (isinstance(node, ast.Import) and not alias.asname and bound in plain  # import torch.nn
                    or isinstance(node, ast.ImportFrom) and (node.module, node.level, alias.name, alias.asname) in imported)
            if bound in protected and not same:
                clash.append(bound)
        return None if not clash else f"it rebinds {', '.join(clash)}, which the harness uses"
    if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
        if node.name in protected:
            return f"it redefines {node.name}, which the harness uses"
        return "a helper may not have decorators" if node.decorator_list else None
    if isinstance(node, ast.Expr) and isinstance(node.value, ast.Constant):
        return None
    return "only imports and helper functions may be added outside the TODO"


def _same_kind(old, new) -> bool:
    if type(old) is not type(new):
        return False
    if isinstance(old, dict):
        return old.keys() == new.keys() and all(_same_kind(old[k], new[k]) for k in old)
    if isinstance(old, (list, tuple)):
        return len(old) == len(new) and all(_same_kind(x, y) for x, y in zip(old, new))
    return True


def harness_differences(source: str, reference: str, editable: tuple[str, ...] = ()) -> list[str]:
    """What differs between ``source`` and the shipped copy ``reference`` outside the answer regions,
    one sentence each (line numbers are ``source``'s), in the order of the file; [] when nothing does.

    ``editable``: names of top-level constants that may take another literal value of the same kind.
    """
    import ast
    import difflib

    tree, ref = parse_source(source), parse_source(reference)
    answers, editable_ = set(answer_functions(ref)), set(editable)
    mine, theirs = _statements(tree), _statements(ref)
    norm = {id(s): _normalized(s, answers, editable_) for s in (*mine, *theirs)}
    keys_theirs = [f"<region {i}>" if _is_region(s) else ast.dump(norm[id(s)]) for i, s in enumerate(theirs)]
    keys_mine = [ast.dump(norm[id(s)]) for s in mine]
    lines, ref_lines = source.splitlines(), reference.splitlines()

    def quote(text_lines: list[str], node) -> str:
        """The line of ``node``, cut to about 90 characters around the node itself."""
        line = text_lines[node.lineno - 1] if 0 < node.lineno <= len(text_lines) else ""
        start = len(line) - len(line.lstrip())
        if len(line) - start > 90:
            start = max(start, min(node.col_offset - 30, len(line) - 90))
        text = line[start:start + 90].rstrip()
        return f"`{'...' if start > len(line) - len(line.lstrip()) else ''}{text}{'...' if start + 90 < len(line.rstrip()) else ''}`"

    lost, added, free = [], [], set()  # statements of the shipped copy not found; statements of the learner's
    ops = difflib.SequenceMatcher(None, keys_theirs, keys_mine, autojunk=False).get_opcodes()
    for tag, i1, i2, j1, j2 in ops:
        if tag == "equal":
            continue
        lost += [s for s in theirs[i1:i2] if not _is_region(s)]
        added += mine[j1:j2]
        if any(_is_region(s) for s in theirs[i1:i2]):  # the learner's answer to a top-level TODO
            free |= {id(s) for s in mine[j1:j2]}
    found: list[tuple[int, str]] = []
    for r in lost:
        same = next((m for m in added if _label(m) == _label(r) and type(m) is type(r)), None)
        if same is None:
            found.append((0, f"{_label(r)} (line {r.lineno} of the course's copy, {quote(ref_lines, r)}) is missing"))
            continue
        added.remove(same)
        sa, sb = _diverge(norm[id(r)], norm[id(same)]) or (r, same)
        if sb is None:
            text = f"{_label(r)}: the course's line {sa.lineno}, {quote(ref_lines, sa)}, is missing from your file"
        elif sa is None:
            text = f"{_label(r)}: line {sb.lineno} of your file, {quote(lines, sb)}, is not in the course's copy"
        else:
            text = (f"{_label(r)} differs at line {sb.lineno} of your file ({quote(lines, sb)}; the course's line "
                    f"{sa.lineno} is {quote(ref_lines, sa)})")
        found.append(((sb or same).lineno, text))
    for m in added:
        why = None if id(m) in free else _extra_refused(m, theirs)
        if why:
            found.append((m.lineno, f"line {m.lineno} of your file, {quote(lines, m)}, is not in the course's copy ({why})"))
    for r in theirs:  # the editable constants: another literal of the same kind
        if not (isinstance(r, ast.Assign) and len(r.targets) == 1 and getattr(r.targets[0], "id", None) in editable_):
            continue
        for m in mine:
            if isinstance(m, ast.Assign) and [getattr(t, "id", None) for t in m.targets] == [r.targets[0].id]:
                try:
                    ok = _same_kind(ast.literal_eval(r.value), ast.literal_eval(m.value))
                except ValueError:
                    ok = False
                if not ok:
                    found.append((m.lineno, f"{r.targets[0].id} at line {m.lineno} of your file ({quote(lines, m)}) may "
                                            f"change, but must stay a plain value of the same kind as the course's "
                                            f"{quote(ref_lines, r)}"))
    return [text for _, text in sorted(found, key=lambda x: x[0])]


def check_harness(number: str, path: str | Path, editable: tuple[str, ...] = ()) -> Verdict:
    """Whether script ``path`` keeps exercise ``number``'s harness as shipped (see the notes above).

    Not ok, naming what differs, when it does not; ok with an empty message when it does; ok with a
    note for the grader's verdict when there is no shipped copy to compare with.
    """

    reference = exercise_reference(number, path)
    if reference is None:
        return Verdict(True, f"(Note: the part of the script outside the TODO was not compared with the course's "
                             f"exercise {number}: no solutions/exercises/ or lessons/exercises/ copy was found beside "
                             "the ddp_course package, so this verdict trusts the script's own harness.)")
    source = Path(path).read_text(encoding="utf-8")
    try:
        differences = harness_differences(source, reference.source, editable)
    except SyntaxError:
        return Verdict(True, "")  # the grader's run shows the error
    if not differences:
        return Verdict(True, "")
    names = [f"{n}()" for n in answer_functions(parse_source(reference.source))]
    keep = names[0] if len(names) == 1 else ", ".join(names[:-1]) + " and " + names[-1] if names else "the TODO"
    more = f" (and {len(differences) - 3} more)" if len(differences) > 3 else ""
    return Verdict(False, f"the part of {path} outside the TODO differs from the course's exercise, and the grader "
                          f"needs it as shipped: {'; '.join(differences[:3])}{more}. Restore the part of the file "
                          f"outside the TODO (copy it again from {reference.shown}) and keep your answer in {keep}, "
                          "then re-run the check.")
