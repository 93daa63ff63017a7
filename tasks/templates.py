"""Prompt templates of the tasks that wrap a question in the run's own words (`template` options)."""

from __future__ import annotations


def question_template(template: str) -> str:
    """`template` when `{question}` is its one format field (a literal brace written twice, e.g. `\\boxed{{}}`);
    ValueError saying what is wrong otherwise (a pydantic validator's message)."""
    try:
        filled = template.format(question="Q")
    except (IndexError, KeyError, ValueError) as e:
        raise ValueError(f"template must have {{question}} as its only field (write a literal brace twice, "
                         f"e.g. \\boxed{{{{}}}}): {e!r}") from None
    if filled == template:
        raise ValueError("template must contain {question}")
    return template
