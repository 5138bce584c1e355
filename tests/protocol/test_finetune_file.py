"""protocol/finetune.py: a training file in OpenAI's fine-tuning JSONL is checked line by
line before anything trains; each problem names its line. The valid examples are OpenAI's
own documented shapes (chat with an optional per-message weight, prompt/completion)."""

from __future__ import annotations

import json

from protocol.finetune import Row, problems, rows


def chat(i: int, **extra) -> dict:
    return dict(messages=[dict(role="system", content="Marv is a sarcastic chatbot."),
                          dict(role="user", content=f"What is {i} + 1?"),
                          dict(role="assistant", content=f"{i + 1}, obviously.", **extra)])


def jsonl(*objs) -> list[bytes]:
    return [(o if isinstance(o, bytes) else json.dumps(o).encode()) + b"\n" for o in objs]


def test_openais_documented_examples_pass():
    weighted = dict(messages=[dict(role="user", content="hi"), dict(role="assistant", content="yo", weight=0),
                              dict(role="user", content="again"), dict(role="assistant", content="hello", weight=1)])
    got = list(rows(jsonl(*[chat(i) for i in range(9)], weighted)))
    assert all(isinstance(r, Row) and r.format == "chat" for r in got) and len(got) == 10
    assert [r.line for r in got if isinstance(r, Row)] == list(range(1, 11))
    completions = [dict(prompt=f"{i} + 1 =", completion=f" {i + 1}") for i in range(10)]
    assert problems(jsonl(*completions)) == []


def test_each_problem_names_its_line():
    lines = jsonl(chat(0), b"{not json", [1, 2], dict(messages=[]), dict(messages=[dict(role="user", content="x")]),
                  dict(messages=[dict(role="wizard", content="x"), dict(role="assistant", content="y")]),
                  chat(1, weight=2), dict(messages=[dict(role="user", content=3), dict(role="assistant", content="y")]),
                  dict(prompt="p"), dict(other=1), dict(messages=[dict(role="assistant", content="\u0000")]),
                  dict(messages=[dict(role="user", content="x"), dict(role="assistant", content="y", weight=0)]),
                  *[chat(i) for i in range(10)])
    got = {(e.line, e.code) for e in problems(lines)}
    assert got == {(2, "invalid_json_line"), (3, "invalid_json_line"), (4, "invalid_example"),
                   (5, "no_assistant_message"), (6, "invalid_role"), (7, "invalid_weight"), (8, "invalid_example"),
                   (9, "invalid_example"), (10, "invalid_example"), (11, "unsupported_character"),
                   (12, "nothing_to_train")}
    [role] = [e for e in problems(lines) if e.code == "invalid_role"]
    assert role.param == "messages[0].role" and "wizard" in role.message


def test_a_file_mixing_formats_or_too_short_is_refused():
    mixed = problems(jsonl(*[chat(i) for i in range(10)], dict(prompt="a", completion="b")))
    assert [(e.line, e.code) for e in mixed] == [(11, "mixed_formats")]
    short = problems(jsonl(*[chat(i) for i in range(3)]))
    assert [(e.line, e.code) for e in short] == [(0, "too_few_examples")]
    assert short[0].message == "Training file has 3 example(s), but must have at least 10 examples."
    assert problems(jsonl(*[chat(i) for i in range(3)]), min_examples=3) == []
    assert [e.code for e in problems([b"\n", b"  \n"])] == ["too_few_examples"]  # blank lines are not examples
