"""What the verdict and the JSON keep of a long failure: every line's head (issue 32, point 4)."""

from __future__ import annotations

from pytest_kvprofile.plugin.recorder import cut_keeping_heads


def test_a_long_message_keeps_its_headline_and_says_what_was_cut():
    head = "persistent_memory_visible_at_closing: case c: builder 'b': 3,128 bytes invisible to KV sizing"
    lines = ["[check] rule", "backend b, case c:", f"- {head}. " + "re-creation; " * 1000, "- second " * 600]
    text = cut_keeping_heads(lines, 4000, 1500)
    assert head in text and "characters cut]" in text and len(text) < 4200
    assert text.startswith("[check] rule\nbackend b, case c:\n")


def test_a_message_with_many_lines_keeps_the_first_and_counts_the_rest():
    text = cut_keeping_heads([f"line {i} " + "x" * 90 for i in range(100)], 4000, 1500)
    assert text.startswith("line 0 ") and text.endswith("more line(s) cut]") and "line 99" not in text


def test_a_short_message_is_kept_whole():
    assert cut_keeping_heads(["a", "b"], 4000, 1500) == "a\nb"
