"""What uses a trained prompt: the pipeline's last stage, after training.

evaluate    spds eval: the held-out records and eval.questions scored floor / soft / ceiling in
            batches, the KL to the teacher, the greedy answers, eval.json
questions   eval.questions: the teacher's answers packed as held-out records, and the answers' scores
sample      spds sample: greedy answers by every view (bare, context, soft, oracle) in one batch
export      spds export: the prompt with its metadata, a PEFT adapter, composition of prompts
progress    where a long phase stands: rows, positions/s, time left
"""
