"""The models a step runs: the frozen student, the soft prompt spliced into it, its teacher.

student       the frozen student: its weights, its cost model, the prompt's starting value
soft_prompt   SoftPromptModel: the student plus one FP32 prompt parameter
kv_prompt     the kv form of the prompt: a key and value at every layer, spliced into its attention
build         the soft-prompt model as every command builds it
loss          the loss over hidden states, never materialising the logits
teacher       the distribution a KL objective matches (the student with the context, or top-k)
recompute     how many decoder layers recompute their activations in backward
layout        how the student's weights lie over the ranks: whole, FSDP2 or ZeRO-3
"""
