"""Self-study's seed kinds, as a config names them (generate.self_study.kinds, seed_prompts):
the built-in kinds, the instruction each gives the teacher and the label its reply opens with.
The contract refuses an unknown kind before any work, and the corpus's slices leave room for a
recital's answer; spds/generation/self_study.py asks them."""

from __future__ import annotations

# The built-in seed kinds: the instruction the teacher reads after the chunk. Detail questions
# carry facts; the others vary what the answers do with them (docs/config.md: self-study).
SEED_PROMPTS = {
    "detail": (
        "Write one question that can be answered from the excerpt above. Ask about one specific "
        "detail in it (a name, a number, a date, a place or a property), and name what the question "
        "is about so that it makes sense on its own. Write only the question."
    ),
    "summary": (
        "Write one short request asking an assistant to summarize what the document says about the "
        "subject of the excerpt above. Name the subject. Write only the request."
    ),
    "use_case": (
        "Think of a person who needs the information in the excerpt above for a practical task. "
        "Write the one question they would ask an assistant. Write only the question."
    ),
    "comparison": (
        "Write one question asking how two things mentioned in the excerpt above differ or relate. "
        "Write only the question."
    ),
    "creative": (
        "Write one short creative request (a story, a poem or a slogan) about something in the "
        "excerpt above, naming it. Write only the request."
    ),
    "structure": (
        "Write one request asking an assistant to list the facts of the excerpt above as a bulleted "
        "list or a table. Write only the request."
    ),
}
# The label the teacher's reply starts with, so that what it writes next is the message itself.
# A kind named in seed_prompts keeps the opening of the built-in kind of its name; a new kind has
# none.
OPENINGS = {
    "detail": "Question:",
    "summary": "Request:",
    "use_case": "Question:",
    "comparison": "Question:",
    "creative": "Request:",
    "structure": "Request:",
}
RECITE = "recite"  # the built-in kind whose answer is the context's own text (Recital)
FACT = "fact"  # the built-in kind whose question is written from one line, after worked examples
UNINSTRUCTED = {  # built-in kinds with no instruction that seed_prompts could reword, and why
    FACT: "the teacher writes its question from one line after built-in worked examples",
    RECITE: "its answer is the context's own text, asked for from a line's first words",
}
BUILT_IN_KINDS = [*SEED_PROMPTS, *UNINSTRUCTED]
