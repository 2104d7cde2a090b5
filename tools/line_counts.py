"""Count the library's lines by layer: every line, and code lines (no blank, comment or docstring line).

    python tools/line_counts.py            the package beside this script
    python tools/line_counts.py PATH       the package in checkout PATH (another commit's worktree)

A layer is the package directly under ``celery_lease/`` (``core`` for the modules at the top);
the Django admin app is counted apart from the rest of ``contrib``.
"""

from __future__ import annotations

import argparse
import ast
import io
import tokenize
from collections import defaultdict
from pathlib import Path

_SKIPPED = {tokenize.COMMENT, tokenize.NL, tokenize.NEWLINE, tokenize.INDENT, tokenize.DEDENT,
            tokenize.ENDMARKER}


def _docstring_lines(tree: ast.AST) -> set[int]:
    lines: set[int] = set()
    for node in ast.walk(tree):
        if isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)) and node.body:
            first = node.body[0]
            if (isinstance(first, ast.Expr) and isinstance(first.value, ast.Constant)
                    and isinstance(first.value.value, str)):
                lines.update(range(first.lineno, (first.end_lineno or first.lineno) + 1))
    return lines


def code_lines(text: str) -> int:
    """The number of lines of ``text`` that hold code (a docstring, comment or blank line is not code)."""
    docs = _docstring_lines(ast.parse(text))
    lines: set[int] = set()
    for token in tokenize.generate_tokens(io.StringIO(text).readline):
        if token.type not in _SKIPPED:
            lines.update(n for n in range(token.start[0], token.end[0] + 1) if n not in docs)
    return len(lines)


def layer_of(relative: Path) -> str:
    """The layer a module belongs to, from its path under ``celery_lease/``."""
    parts = relative.parts
    if parts[:3] == ("contrib", "django", "admin"):
        return "contrib/admin"
    return parts[0] if len(parts) > 1 else "core"


def counts(package: Path) -> dict[str, tuple[int, int]]:
    """``{layer: (lines, code lines)}`` for every module under ``package``."""
    found: dict[str, list[int]] = defaultdict(lambda: [0, 0])
    for path in sorted(package.rglob("*.py")):
        text = path.read_text(encoding="utf-8")
        row = found[layer_of(path.relative_to(package))]
        row[0] += text.count("\n")
        row[1] += code_lines(text)
    return {layer: (row[0], row[1]) for layer, row in sorted(found.items())}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("checkout", nargs="?", type=Path, default=Path(__file__).resolve().parent.parent)
    table = counts(parser.parse_args().checkout / "celery_lease")
    print(f"{'layer':14s} {'lines':>6s} {'code':>6s}")
    for layer, (lines, code) in table.items():
        print(f"{layer:14s} {lines:6d} {code:6d}")
    print(f"{'total':14s} {sum(r[0] for r in table.values()):6d} {sum(r[1] for r in table.values()):6d}")


if __name__ == "__main__":
    main()
