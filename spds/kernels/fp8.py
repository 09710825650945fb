"""student.fp8_linear: the frozen student's linear layers in FP8 while training. Opt-in; not exact.

The student is frozen, so its weights are quantized once, when the model is built: each linear
layer of the decoder (attention projections, MLP) keeps two e4m3 copies of its weight in place of
the bf16 one (the same bytes in all), one scaled per output channel for the forward and one per
input channel for the backward, the only backward a frozen layer has (d(input) = d(output) @ W).
Activations and their gradients are quantized as they come, one scale per row (token; the
projections that read one input share its quantization), and every
product runs on torch._scaled_mm with those row and column scales, its accumulation in fp32 and
its output in the student's dtype. The embeddings, the norms, attention itself and the output
head (the loss's vocabulary-sized products) stay in the student's dtype.

What changes: every product of the student's linear layers carries e4m3's 3-bit mantissa (a
relative rounding of up to 2^-4 per element, averaged over thousands per product), in the online
teacher's forward as in the student's. The trained prompt is evaluated and exported on the bf16
student (spds eval and generate never quantize), so bench/RESULTS.md measures what the opt-in
costs in gap recovered and held-out KL, and what it buys in step speed, before anyone relies on
it. The exactness guarantees of the bf16 path (tests/test_reference.py) are not claimed here.
"""

from __future__ import annotations

import functools

import torch
from torch import nn

from spds.kernels.causal import triton_available

FP8 = torch.float8_e4m3fn
FP8_MAX = float(torch.finfo(FP8).max)  # 448
SMALLEST_SCALE = 1e-12  # an all-zero row keeps a finite scale (its quantized values are 0)


def quantize_rows(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """x [M, K] as (e4m3 [M, K], fp32 scales [M, 1]) with x ~= q * scale, each row scaled so that
    its largest magnitude lands on e4m3's largest value. On CUDA one Triton kernel reads x once;
    elsewhere the same arithmetic in PyTorch (times the scale's fp32 reciprocal, rounded to nearest
    even, saturating)."""
    if x.is_cuda and triton_available():
        return quantize_rows_triton(x)
    scale = x.abs().amax(dim=-1, keepdim=True).float().clamp(min=SMALLEST_SCALE) / FP8_MAX
    return (x.float() * (1.0 / scale)).clamp(-FP8_MAX, FP8_MAX).to(FP8), scale


@functools.cache
def quantize_kernel():
    """The Triton kernel of quantize_rows: one program per row, the row read once."""
    import triton
    import triton.language as tl

    @triton.jit
    def quantize(x_ptr, q_ptr, scale_ptr, columns, row_stride, BLOCK: tl.constexpr):
        row = tl.program_id(0)
        offsets = tl.arange(0, BLOCK)
        inside = offsets < columns
        x = tl.load(x_ptr + row * row_stride + offsets, mask=inside, other=0.0).to(tl.float32)
        # div_rn: IEEE division, as PyTorch's (Triton's `/` on fp32 is an approximation); once per row
        scale = tl.math.div_rn(tl.maximum(tl.max(tl.abs(x), axis=0), 1e-12), 448.0)  # SMALLEST_SCALE, FP8_MAX
        q = tl.clamp(x * tl.math.div_rn(1.0, scale), -448.0, 448.0)
        tl.store(q_ptr + row * columns + offsets, q.to(tl.float8e4nv), mask=inside)
        tl.store(scale_ptr + row, scale)

    return quantize


def quantize_rows_triton(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    import triton

    rows, columns = x.shape
    if x.stride(-1) != 1:
        x = x.contiguous()
    q = torch.empty(rows, columns, dtype=FP8, device=x.device)
    scale = torch.empty(rows, 1, dtype=torch.float32, device=x.device)
    block = triton.next_power_of_2(columns)
    warps = min(32, max(4, block // 512))
    quantize_kernel()[(rows,)](x, q, scale, columns, x.stride(0), BLOCK=block, num_warps=warps)
    return q, scale


class SharedInput:
    """The quantized input of the projections that read one tensor (a layer's q, k and v; its
    MLP's gate and up): quantized by the first of them, reused by the others, dropped after the
    last, so that no quantized copy outlives its layer. A projection called with another tensor
    (or the same one changed in place) quantizes its own: sharing only ever skips a recomputation
    of the same values."""

    def __init__(self, readers: int):
        self.readers = readers
        self.entry: tuple | None = None  # (input, its version, e4m3 rows, scales)
        self.uses = 0

    def quantized(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        entry = self.entry
        if entry is None or entry[0] is not x or entry[1] != x._version:
            entry = self.entry = (x, x._version, *quantize_rows(x.reshape(-1, x.shape[-1])))
            self.uses = 0
        self.uses += 1
        if self.uses == self.readers:
            self.entry = None
        return entry[2], entry[3]


class FrozenFP8Linear(nn.Module):
    """A frozen nn.Linear whose products run in FP8 (see the module's docstring)."""

    def __init__(self, linear: nn.Linear, shared: SharedInput | None = None):
        super().__init__()
        self.shared = shared  # with the other projections of its input, or None
        weight = linear.weight.detach()
        self.in_features, self.out_features = linear.in_features, linear.out_features
        self.out_dtype = weight.dtype
        forward, forward_scale = quantize_rows(weight)  # [N, K], a scale per output channel
        backward, backward_scale = quantize_rows(weight.t())  # [K, N], a scale per input channel
        self.register_buffer("weight_fp8", forward, persistent=False)
        self.register_buffer("weight_scale", forward_scale.t().contiguous(), persistent=False)  # [1, N]
        self.register_buffer("weight_t_fp8", backward, persistent=False)
        self.register_buffer("weight_t_scale", backward_scale.t().contiguous(), persistent=False)  # [1, K]
        bias = linear.bias.detach() if linear.bias is not None else None
        self.register_buffer("bias", bias, persistent=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        shape = x.shape
        rows = x.reshape(-1, self.in_features)
        q, scale = self.shared.quantized(x) if self.shared is not None else quantize_rows(rows)
        y = FP8Product.apply(rows, self, q, scale).reshape(*shape[:-1], self.out_features)
        return y if self.bias is None else y + self.bias

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, e4m3"


class FP8Product(torch.autograd.Function):
    """x @ W^T in FP8; its backward d(x) = d(y) @ W in FP8 (the weight is frozen: no d(W))."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, layer: FrozenFP8Linear, q: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
        """x [M, K] (for autograd), quantized by the caller as (q, scale)."""
        ctx.layer = layer
        # _scaled_mm takes its second operand column-major: [N, K] row-major, transposed
        return torch._scaled_mm(q, layer.weight_fp8.t(), scale, layer.weight_scale, out_dtype=layer.out_dtype)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        layer = ctx.layer
        q, scale = quantize_rows(grad.contiguous())
        product = torch._scaled_mm(q, layer.weight_t_fp8.t(), scale, layer.weight_t_scale, out_dtype=grad.dtype)
        return product, None, None, None


def fp8_problem(device: torch.device) -> str | None:
    """Why student.fp8_linear cannot run on `device`, or None. On CUDA, torch._scaled_mm with a
    scale per row and per column needs Hopper's FP8 matrix units (compute capability 9.0 or later);
    the CPU runs the same products (slowly: for tests and the tiny example)."""
    if device.type != "cuda":
        return None
    major, minor = torch.cuda.get_device_capability(device)
    if major < 9:
        return (
            f"student.fp8_linear: this GPU's compute capability is {major}.{minor}; FP8 products with a scale "
            "per row and per column need 9.0 or later (Hopper, Blackwell): set it to false"
        )
    return None


# Projections of one module that transformers' decoders call on one input tensor, in this order
SHARED_INPUTS = (("q_proj", "k_proj", "v_proj"), ("gate_proj", "up_proj"))


def quantize_linears(student: nn.Module) -> int:
    """Every nn.Linear of the student's decoder (not its output head) as a FrozenFP8Linear, in place;
    returns how many. _scaled_mm needs both dimensions to be multiples of 16: a layer that is not
    stays as it is. The projections of SHARED_INPUTS share their input's quantization."""
    replaced = 0
    for parent in list(student.base_model.modules()):
        children = dict(parent.named_children())
        fits = {
            name
            for name, child in children.items()
            if type(child) is nn.Linear and child.in_features % 16 == 0 and child.out_features % 16 == 0
        }
        shared = {}
        for group in SHARED_INPUTS:
            members = [name for name in group if name in fits]
            if len(members) > 1:
                shared.update(dict.fromkeys(members, SharedInput(len(members))))
        for name in sorted(fits):
            setattr(parent, name, FrozenFP8Linear(children[name], shared.get(name)))
            replaced += 1
    return replaced
