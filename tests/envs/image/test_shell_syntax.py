"""Where tree-sitter-bash's tree and bash's reading of a script differ, the words are bash's."""

import pytest

from envs.image import shell_syntax


def _words(script):
    return [c.words for c in shell_syntax.commands(script)]


def test_words_are_split_where_bash_splits_them():
    # an unquoted ``>`` is a redirection: ``pip install torch>=1.9 numpy`` installs torch and numpy
    assert _words("pip3 install -q torch>=1.9.0 transformers>=4.20 numpy\n") == [
        ["pip3", "install", "-q", "torch", "transformers", "numpy"]]
    assert _words("echo a > f b\n") == [["echo", "a", "b"]]
    assert _words("mv $SRC/*.log $DST/$DATE/\n") == [["mv", "$SRC/*.log", "$DST/$DATE/"]]
    # a word tree-sitter-bash leaves out of its tree before a here-document
    assert _words("python3 - <<'EOF'\nimport os\nEOF\necho a \\\n  b\n") == [["python3", "-"], ["echo", "a", "b"]]
    # multiple assignments end at the newline, as bash ends them
    script = "A=1 B=2\ncat <<EOF\n$(pip install from-a-heredoc)\nEOF\n"
    found = shell_syntax.commands(script)
    assert [(c.words, c.assignments) for c in found] == [
        (["cat"], []), (["pip", "install", "from-a-heredoc"], [])]
    assert script[found[0].start:found[0].end].startswith("cat <<EOF")


def test_spans_are_in_characters_and_nested_replacements_go_with_their_command():
    script = "echo 'é' && x=$(curl -s https://example.com | sh) && rm -rf /var/lib/apt/lists/$(date)\n"
    found = shell_syntax.commands(script)
    assert [script[c.start:c.end] for c in found] == [
        "echo 'é'", "curl -s https://example.com", "sh", "rm -rf /var/lib/apt/lists/$(date)", "date"]
    rm, date = found[3], found[4]
    assert shell_syntax.rewrite(script, [(rm.start, rm.end, "true"), (date.start, date.end, "true")]) == (
        "echo 'é' && x=$(curl -s https://example.com | sh) && true\n")


def test_bash_decides_what_tree_sitter_cannot_parse():
    # markdown fences left in a script: bash reads them as (empty) backquoted commands,
    # tree-sitter-bash as an error; bash is right, and the commands around them are found
    script = "apt-get install -y jq\n```\n```bash\npip install q\n"
    assert _words(script) == [["apt-get", "install", "-y", "jq"], ["bash"], ["pip", "install", "q"]]
    with pytest.raises(shell_syntax.ShellSyntaxError, match="^line 2: syntax error: unexpected end of file"):
        shell_syntax.commands("if true; then echo x\n")
