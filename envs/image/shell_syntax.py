"""The simple commands of a shell script, with where each pipeline starts and ends.

Enough of POSIX / bash syntax to find what a script *runs*, which is what the install scan
(``envs/image/installs.py``) needs, without executing anything:

- quoting (``'...'``, ``"..."``, ``$'...'``, backslashes, line continuations) is removed
  from words; expansions (``$VAR``, ``${...}``, ``$(...)``, backticks) stay as written;
- comments are dropped (a ``#`` that starts a word runs to the end of the line);
- here-document bodies are skipped (their text is data, not commands);
- redirections (``> f``, ``2>&1``, ``<<< w``) are taken off the words;
- reserved words (``if then else fi for while do done case esac ...``), ``!``, braces and
  parentheses separate commands; ``for NAME in ...`` and ``case WORD in`` headers are not
  commands; leading ``NAME=value`` assignments are kept apart from the words.

``pipelines(script)`` returns each pipeline (commands joined by ``|``) with its character
span in the script, so a caller can replace exactly that span (``rewrite``).
"""

from __future__ import annotations

import dataclasses
import re

_RESERVED = {"if", "then", "elif", "else", "fi", "do", "done", "while", "until", "for", "case", "esac",
             "in", "select", "function", "{", "}", "!", "[[", "]]", "time", "coproc"}
_ASSIGNMENT = re.compile(r"[A-Za-z_][A-Za-z0-9_]*(\[[^]]*\])?\+?=")
_REDIRECT = re.compile(r"(\d+|&|\{[A-Za-z_]\w*\})?(>>|>&|>\||<<<|<<-|<<|<&|<>|>|<)")
_OPERATORS = ("&&", "||", ";;", "|&", ";", "&", "|", "(", ")", "\n")


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


class ShellSyntaxError(ValueError):
    """The script cannot be tokenized (an unterminated quote or substitution)."""


class _Lexer:
    def __init__(self, text: str):
        self.text, self.i, self.heredocs = text, 0, []

    def error(self, what: str, at: int) -> ShellSyntaxError:
        """``what`` went wrong with the construct that starts at offset ``at``."""
        line = self.text.count("\n", 0, at) + 1
        return ShellSyntaxError(f"line {line}: {what}")

    def skip_blank(self) -> None:
        t = self.text
        while self.i < len(t):
            if t[self.i] in " \t":
                self.i += 1
            elif t.startswith("\\\n", self.i):
                self.i += 2
            elif t[self.i] == "#":
                end = t.find("\n", self.i)
                self.i = len(t) if end < 0 else end
            else:
                return

    def newline(self) -> None:
        """Past a newline: skip the bodies of the here-documents opened on that line."""
        self.i += 1
        for delimiter, strip_tabs in self.heredocs:
            while self.i < len(self.text):
                end = self.text.find("\n", self.i)
                end = len(self.text) if end < 0 else end
                line = self.text[self.i:end]
                self.i = min(end + 1, len(self.text))
                if (line.lstrip("\t") if strip_tabs else line) == delimiter:
                    break
        self.heredocs = []

    def balanced(self, open_: str, close: str) -> None:
        """From just past ``open_`` to just past its matching ``close`` (quotes respected)."""
        depth, t, start = 1, self.text, self.i - len(open_)
        while self.i < len(t):
            c = t[self.i]
            if c == "\\":
                self.i += 2
            elif c == "'" and open_ != "{":
                self.single_quoted()
            elif c == '"':
                self.i += 1
                self.double_quoted()
            elif c == "`":
                self.backticks()
            elif t.startswith(open_, self.i):
                depth, self.i = depth + 1, self.i + len(open_)
            elif t.startswith(close, self.i):
                depth, self.i = depth - 1, self.i + len(close)
                if depth == 0:
                    return
            else:
                self.i += 1
        raise self.error(f"unterminated {open_}", start)

    def single_quoted(self) -> str:
        end = self.text.find("'", self.i + 1)
        if end < 0:
            raise self.error("unterminated single quote", self.i)
        value, self.i = self.text[self.i + 1:end], end + 1
        return value

    def backticks(self) -> str:
        """A command substitution in backquotes, from its opening one, returned as written."""
        start = self.i
        self.i += 1
        while self.i < len(self.text):
            c = self.text[self.i]
            if c == "\\":
                self.i += 2
            elif c == "`":
                self.i += 1
                return self.text[start:self.i]
            else:
                self.i += 1
        raise self.error("unterminated backquote", start)

    def expansion(self) -> str:
        """``$...`` or a backquoted substitution at the cursor, returned as written."""
        return self.backticks() if self.text[self.i] == "`" else self.dollar()

    def dollar(self) -> str:
        """An expansion starting at ``$``, returned as written."""
        start, t = self.i, self.text
        if t.startswith("$((", self.i):
            self.i += 3
            self.balanced("((", "))")
        elif t.startswith("$(", self.i):
            self.i += 2
            self.balanced("(", ")")
        elif t.startswith("${", self.i):
            self.i += 2
            self.balanced("{", "}")
        else:
            self.i += 1
        return t[start:self.i]

    def double_quoted(self) -> str:
        out, t, start = [], self.text, self.i - 1
        while self.i < len(t):
            c = t[self.i]
            if c == '"':
                self.i += 1
                return "".join(out)
            if c == "\\" and self.i + 1 < len(t):
                nxt = t[self.i + 1]
                out.append("" if nxt == "\n" else nxt if nxt in '$`"\\' else c + nxt)
                self.i += 2
            elif c in "$`":
                out.append(self.expansion())
            else:
                out.append(c)
                self.i += 1
        raise self.error("unterminated double quote", start)

    def word(self) -> str:
        out, t = [], self.text
        while self.i < len(t):
            c = t[self.i]
            if c in " \t\n;&|()<>":
                break
            if c == "\\":
                if t.startswith("\\\n", self.i):
                    self.i += 2
                    continue
                out.append(t[self.i + 1:self.i + 2])
                self.i += 2
            elif c == "'":
                out.append(self.single_quoted())
            elif t.startswith("$'", self.i):
                self.i += 1
                out.append(self.single_quoted())
            elif c == '"':
                self.i += 1
                out.append(self.double_quoted())
            elif c in "$`":
                out.append(self.expansion())
            else:
                out.append(c)
                self.i += 1
        return "".join(out)

    def tokens(self):
        """(kind, value, start, end): kind "word", "op" or "redirect" (value: the target)."""
        t = self.text
        while True:
            self.skip_blank()
            if self.i >= len(t):
                return
            start = self.i
            if t[self.i] == "\n":
                self.newline()
                yield "op", "\n", start, start + 1
                continue
            redirect = _REDIRECT.match(t, self.i)
            if redirect:
                self.i = redirect.end()
                self.skip_blank()
                target = self.word()
                if redirect.group(2) in ("<<", "<<-"):
                    self.heredocs.append((target, redirect.group(2) == "<<-"))
                yield "redirect", target, start, self.i
                continue
            for op in _OPERATORS:
                if t.startswith(op, self.i):
                    self.i += len(op)
                    yield "op", op, start, self.i
                    break
            else:
                yield "word", self.word(), start, self.i


def pipelines(script: str) -> list[Pipeline]:
    """Every pipeline of ``script`` in order (see the module docstring)."""
    out: list[Pipeline] = []
    current: list[Command] = []
    words, assignments, start, end = [], [], None, None
    header = None  # inside "for NAME in ..." / "case WORD in": not a command

    def end_command():
        nonlocal words, assignments, start, end
        if words or assignments:
            current.append(Command(words, assignments, start, end))
        words, assignments, start, end = [], [], None, None

    def end_pipeline():
        nonlocal current
        end_command()
        if current:
            out.append(Pipeline(current, current[0].start, current[-1].end))
        current = []

    for kind, value, s, e in _Lexer(script).tokens():
        if header is not None:
            if kind == "op" and value in ("\n", ";") and header == "for":
                header = None
            elif kind == "word" and value in ("in", "do") and header == "case":
                header = None
            elif kind == "word" and value == "do":
                header = None
            continue
        if kind == "op":
            if value == "|" or value == "|&":
                end_command()
            else:
                end_pipeline()
            continue
        if start is None:
            start = s
        end = e
        if kind == "redirect":
            continue
        if not words and not assignments and value in _RESERVED:
            if value in ("for", "select", "case"):
                header = "case" if value == "case" else "for"
            start = None
            continue
        if not words and _ASSIGNMENT.match(value):
            assignments.append(value)
            continue
        words.append(value)
    end_pipeline()
    return out


def commands(script: str) -> list[Command]:
    return [c for p in pipelines(script) for c in p.commands]


def rewrite(script: str, spans: list[tuple[int, int, str]]) -> str:
    """``script`` with each ``(start, end, replacement)`` span replaced (spans must not overlap)."""
    out, at = [], 0
    for start, end, replacement in sorted(spans):
        if start < at:
            raise ValueError(f"overlapping spans at {start}")
        out += [script[at:start], replacement]
        at = end
    return "".join(out) + script[at:]
