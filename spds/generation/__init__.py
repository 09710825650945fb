"""The teacher writing rows: spds generate, its self-study questions, and the decoder.

generate      spds generate: the teacher answers each question with the context
self_study    the questions written from the context itself (generate.self_study)
decode        batched decoding with the context's keys and values computed once
teacher_window  what the teacher reads, checked against its position window before any work
batches       a run's batches shared by its ranks: the one-rank output bytes on any number of them
"""
