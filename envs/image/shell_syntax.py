"""The simple commands of a shell script, read with tree-sitter-bash, with where each
pipeline starts and ends.

What a script *runs* is what the install scan (``envs/image/installs.py``) needs, without
executing anything. The grammar is the maintained ``tree-sitter-bash`` (the one editors and
GitHub use); this file only turns its tree into words:

- quoting (``'...'``, ``"..."``, ``$'...'``, backslashes, line continuations) is removed
  from words; expansions (``$VAR``, ``${...}``, ``$(...)``, backticks) stay as written;
- words are split where bash splits them, also where tree-sitter-bash's tree says
  otherwise: an unquoted ``>`` is a redirection (``pip install torch>=2 numpy`` installs
  torch and numpy), ``python3 - <<EOF`` keeps its ``-``, ``$A/$B/*.log`` is one word;
- comments are not commands and here-document bodies are data, but command substitutions
  run, in words and in unquoted here-documents alike (``$(pip install x)``), so the
  commands in them are listed too;
- redirections are taken off the words; leading ``NAME=value`` assignments are kept apart;
- commands inside compound statements (``if``, ``for``, ``case``, functions, subshells)
  are found like any other; tests (``[ ... ]``, ``[[ ... ]]``) and arithmetic
  (``(( ... ))``) are not listed.

``pipelines(script)`` returns each pipeline (commands joined by ``|``) with its character
span in the script, so a caller can replace exactly that span (``rewrite``).

A script that tree-sitter cannot parse cleanly is checked by ``bash -n``: bash's verdict
decides (tree-sitter-bash misreads a few valid scripts, and then still finds their commands);
a script bash rejects raises ``ShellSyntaxError`` with bash's message.
"""

from __future__ import annotations

import dataclasses
import functools
import re
import shutil
import subprocess

import tree_sitter
import tree_sitter_bash

# nodes whose text is data to a command, not words of it
_REDIRECTS = {"file_redirect", "heredoc_redirect", "herestring_redirect"}
# nodes that keep their text as written inside a word
_EXPANSIONS = {"simple_expansion", "expansion", "command_substitution", "arithmetic_expansion",
               "process_substitution"}
_BLANKS_OR_WORD = re.compile(rb"(?:\\\n|[ \t\n])+|(?P<word>[^ \t\n]+)")
_DOUBLE_QUOTED_ESCAPE = re.compile(r"\\([$`\"\\\n])")
_BACKSLASH = re.compile(r"\\(.)", re.S)


@dataclasses.dataclass
class Command:
    """One simple command: ``words`` with quotes removed, ``assignments`` before them."""

    words: list[str]
    assignments: list[str]
    start: int
    end: int

    @property
    def name(self) -> str:
        return self.words[0] if self.words else ""


@dataclasses.dataclass
class Pipeline:
    commands: list[Command]
    start: int
    end: int


@dataclasses.dataclass
class _Token:
    """A word in the script that tree-sitter-bash has no node for."""

    type: str
    start_byte: int
    end_byte: int
    children: tuple = ()


class ShellSyntaxError(ValueError):
    """The script is not valid shell (bash says so)."""


@functools.cache
def _parser() -> tree_sitter.Parser:
    return tree_sitter.Parser(tree_sitter.Language(tree_sitter_bash.language()))


class _Reader:
    """Words and spans of one parsed script; offsets in characters, not tree-sitter's bytes."""

    def __init__(self, script: str):
        self.data = script.encode()
        self.chars = None  # byte offset -> character offset, where they differ
        if len(self.data) != len(script):
            self.chars = [i for i, c in enumerate(script) for _ in c.encode()] + [len(script)]

    def at(self, byte: int) -> int:
        return byte if self.chars is None else self.chars[byte]

    def text(self, node) -> str:
        return self.data[node.start_byte:node.end_byte].decode(errors="replace")

    def gap(self, left, right) -> str:
        return self.data[left.end_byte:right.start_byte].decode(errors="replace")

    def word(self, node) -> str:
        """The word ``node`` is after quote removal (expansions as written)."""
        kind = node.type
        if kind == "word":
            return _BACKSLASH.sub(lambda m: "" if m.group(1) == "\n" else m.group(1), self.text(node))
        if kind == "raw_string":
            return self.text(node)[1:-1]
        if kind == "ansi_c_string":
            return self.text(node)[2:-1]
        if kind in ("string", "translated_string"):
            return self.double_quoted(node)
        if kind == "concatenation":
            return "".join(self.word(c) for c in node.children)
        return self.text(node)

    def dropped(self, children) -> list[_Token]:
        """Words between ``children`` that tree-sitter-bash left out of its tree (the ``-`` of
        ``python3 - <<EOF``): anything but blanks and line continuations there."""
        out = []
        for left, right in zip(children, children[1:]):
            for found in _BLANKS_OR_WORD.finditer(self.data, left.end_byte, right.start_byte):
                if found.group("word"):
                    out.append(_Token("word", found.start(), found.end()))
        return out

    def words(self, nodes) -> list[str]:
        """Nodes that touch (no blank between them) are one word, as bash splits them:
        tree-sitter-bash cuts ``$A/$B/*.log`` in two at the glob."""
        out, last = [], None
        for node in nodes:
            if last is not None and last.end_byte == node.start_byte:
                out[-1] += self.word(node)
            else:
                out.append(self.word(node))
            last = node
        return out

    def double_quoted(self, node) -> str:
        """Inside ``"..."``: expansions as written, the rest with its escapes removed."""
        out, at = [], node.start_byte + (2 if node.type == "translated_string" else 1)
        for child in node.children:
            if child.type in _EXPANSIONS:
                out += [self.unescape(at, child.start_byte), self.text(child)]
                at = child.end_byte
        out.append(self.unescape(at, node.end_byte - 1))
        return "".join(out)

    def unescape(self, start: int, end: int) -> str:
        text = self.data[start:end].decode(errors="replace") if end > start else ""
        return _DOUBLE_QUOTED_ESCAPE.sub(lambda m: "" if m.group(1) == "\n" else m.group(1), text)

    def assignment(self, node) -> str:
        value = node.child_by_field_name("value")
        if value is None:
            return self.text(node)
        return self.data[node.start_byte:value.start_byte].decode(errors="replace") + self.word(value)

    def command(self, node, outer) -> Command:
        """A ``command`` node; ``outer`` is the node whose span it takes (its redirections too)."""
        children = [c for c in node.children if c.type != "comment"]
        if outer is not node:  # the statement's redirections: their stray words are the command's
            children = sorted(children + [c for c in outer.children if c.type in _REDIRECTS | {"ERROR"}],
                              key=lambda c: c.start_byte)
        # tree-sitter-bash joins ``A=1 B=2`` to the next line's command when that one has a
        # here-document; bash ends a command at an unescaped newline
        first = 0
        for i in range(1, len(children)):
            if children[i - 1].type == "variable_assignment" and "\n" in self.gap(children[i - 1], children[i]):
                first = i
        parts, assignments = [], []
        for child in children[first:]:
            if child.type == "variable_assignment" and not parts:
                assignments.append(self.assignment(child))
            elif child.type == "command_name":
                parts += child.children or [child]
            elif child.type == "file_redirect":
                # ``echo a > f b``: tree-sitter-bash reads ``b`` as a second target; it is a word
                parts += [c for c in child.named_children if c.type != "file_descriptor"][1:]
            elif child.type not in _REDIRECTS and child.type != "ERROR":
                parts.append(child)
        parts = sorted(parts + self.dropped(children[first:]), key=lambda c: c.start_byte)
        words = self.words(parts)
        start = children[first].start_byte if first else outer.start_byte
        return Command(words, assignments, self.at(start), self.at(outer.end_byte))

    def declaration(self, node) -> Command:
        """``export A=1 B``, ``local x``, ``unset Y``: a builtin and its words."""
        parts = [c for c in node.children if c.type not in _REDIRECTS and c.type != "comment"]
        words = [self.assignment(c) if c.type == "variable_assignment" else self.word(c) for c in parts]
        return Command(words, [], self.at(node.start_byte), self.at(node.end_byte))


def _body(node):
    """The statement a ``redirected_statement`` redirects; any other node itself."""
    if node.type == "redirected_statement":
        return node.child_by_field_name("body") or node.children[0]
    return node


def _stage(reader: _Reader, node) -> Command | None:
    """The simple command a pipeline stage is, or None (a compound statement)."""
    body = _body(node)
    if body.type == "command":
        return reader.command(body, node)
    if body.type in ("declaration_command", "unset_command"):
        return reader.declaration(body)
    return None


def _walk(reader: _Reader, node, out: list[Pipeline]) -> None:
    if node.type == "comment":
        return
    stages = [c for c in node.children if c.is_named and c.type != "comment"] if node.type == "pipeline" else [node]
    found = [(s, _stage(reader, s)) for s in stages]
    commands = [c for _, c in found if c is not None]
    if commands:
        out.append(Pipeline(commands, commands[0].start, commands[-1].end))
    elif node.type != "pipeline":
        for child in node.children:
            _walk(reader, child, out)
        return
    for stage, command in found:
        if command is None:
            _walk(reader, stage, out)
            continue
        # the substitutions in a simple command's words and here-documents run too
        parts = _body(stage).children + ([] if stage is _body(stage) else stage.children[1:])
        for part in parts:
            _walk(reader, part, out)


def _check(script: str, root) -> None:
    if not root.has_error:
        return
    bash = shutil.which("bash")
    if bash is None:
        bad = next(_errors(root))
        raise ShellSyntaxError(f"line {bad.start_point[0] + 1}: tree-sitter-bash cannot parse it (no bash to ask)")
    result = subprocess.run([bash, "-n"], input=script, capture_output=True, text=True)
    if result.returncode != 0:
        lines = result.stderr.strip().splitlines() or ["a syntax error"]
        raise ShellSyntaxError(re.sub(r"^\S*bash: ", "", lines[0]))
    # valid: a gap of tree-sitter-bash's, whose tree still holds the commands around it


def _errors(node):
    if node.type == "ERROR" or node.is_missing:
        yield node
    for child in node.children:
        yield from _errors(child)


def pipelines(script: str) -> list[Pipeline]:
    """Every pipeline of ``script`` in order (see the module docstring)."""
    tree = _parser().parse(script.encode())
    _check(script, tree.root_node)
    out: list[Pipeline] = []
    _walk(_Reader(script), tree.root_node, out)
    return sorted(out, key=lambda p: p.start)


def commands(script: str) -> list[Command]:
    return [c for p in pipelines(script) for c in p.commands]


def rewrite(script: str, spans: list[tuple[int, int, str]]) -> str:
    """``script`` with each ``(start, end, replacement)`` span replaced. A span inside one
    already replaced (a command in a replaced command's substitution) goes with it; spans
    that cross are an error."""
    out, at = [], 0
    for start, end, replacement in sorted(spans):
        if end <= at and start < at:
            continue
        if start < at:
            raise ValueError(f"overlapping spans at {start}")
        out += [script[at:start], replacement]
        at = end
    return "".join(out) + script[at:]
