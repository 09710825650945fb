"""The rows a run trains on: from candidate files to the packed store of exact tokens.

sources         candidate rows streamed from JSONL, parquet or a datasets directory
corpus          a corpus as the context: documents read by rule, cut into slices of the window
formats         documents in HTML, PDF and .docx read as text (the documents extra)
context         the context every verb reads: a text, a file, or a corpus (whole or truncated)
rows            every row rule, each refusal naming the file, line and rule
chat            where the soft prompt goes, from the tokenizer's own chat template
packed          the packed store: every record's exact ids, an index and a manifest
prepare         spds prepare: candidate files -> verified rows -> packed store
preflight       every check prepare makes from the config and the tokenizer alone, made before
                any generation or packing (validate, init, generate); the student's window
student_files   the student's tokenizer, read without torch
"""
