"""spds smoke and spds train: the loop and what it owns.

train       the training loop, top-down
engine      DeepSpeed set-up and the exact update
sharded     the engine around a student sharded over the ranks (model/layout.py)
schedule    which records each update trains on, on which rank, and the learning rate
on_policy   loss.on_policy: a share of each update's rows answered by the student itself
checkpoint  checkpoints that resume bit-exactly and exist only once committed
records     what a run tells the world (run.json, metrics.jsonl, terminal.json)
identity    what a run is: the digests a checkpoint and the smoke evidence are bound to
"""
