"""The kernels the student's attention and linear layers run, and which one runs.

attention     which attention kernel runs each forward (AttentionPlan), installed in the student
causal        the causal attention kernels (SDPA, FlashAttention-2 packed, FA4, flex, windowed)
shared_keys   attention over keys many queries share (a cached context, a shared prefix)
fp8           student.fp8_linear: the frozen linear layers in FP8
"""
