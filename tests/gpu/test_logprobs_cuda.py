"""The CUDA log-prob and entropy function (its Triton passes, rlx.trainer.triton_logprobs) at a real
vocabulary, against fp64 autograd.

Skipped without a GPU. Run on the GPU machine:
    source .whl/install.sh && python3 -m pytest tests/gpu/test_logprobs_cuda.py -q -s

bf16 logits of a Qwen3-sized vocabulary (151,936) for 2 x 1024 positions, as the bf16 trainer
hands them over: values and the logits' gradient of a weighted sum of log-probs and entropies
against `log_softmax` in fp64 from the same bf16 values, and the memory the forward and backward
take beyond the logits and their gradient (the unfused chain kept several fp32 copies).
"""

from __future__ import annotations

import pytest
import torch
from helpers import megatron_world

from rlx.trainer.logprobs import logprobs_and_entropy

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")

B, L, V = 2, 1025, 151936


def test_triton_passes_match_fp64_and_keep_no_fp32_copy():
    gen = torch.Generator(device="cuda").manual_seed(0)
    logits = (torch.randn(B, L, V, device="cuda", generator=gen) * 2).bfloat16().requires_grad_()
    tokens = torch.randint(0, V, (B, L), device="cuda", generator=gen)
    w_logp, w_ent = torch.randn(2, B, L - 1, device="cuda", generator=gen).unbind(0)
    with megatron_world():
        for _ in range(2):  # the first call compiles the kernels
            logits.grad = None
            torch.cuda.synchronize()
            base = torch.cuda.memory_allocated()
            torch.cuda.reset_peak_memory_stats()
            logp, entropy = logprobs_and_entropy(logits[:, :-1], tokens[:, 1:], temperature=0.9)
            ((w_logp * logp).sum() + (w_ent * entropy).sum()).backward()
            torch.cuda.synchronize()
            extra = torch.cuda.max_memory_allocated() - base
    bf16_logits = logits.numel() * 2
    print(f"\npeak beyond the logits: {extra / bf16_logits:.2f}x the bf16 logits ({extra / 2**30:.2f} GiB)")
    # the gradient (bf16, as large as the logits) and its slice's backward copy; no fp32 [B, L, V]
    assert extra <= 2.5 * bf16_logits

    ref = logits.detach().double().requires_grad_()
    logsm = torch.log_softmax(ref[:, :-1] / 0.9, dim=-1)
    ref_logp = logsm.gather(-1, tokens[:, 1:].unsqueeze(-1)).squeeze(-1)
    ref_entropy = -(logsm.exp() * logsm).sum(-1)
    ((w_logp * ref_logp).sum() + (w_ent * ref_entropy).sum()).backward()
    for name, got, want in [("logp", logp, ref_logp), ("entropy", entropy, ref_entropy)]:
        err = (got.double() - want).abs().max().item()
        print(f"{name}: max |fused - fp64| {err:.2e}")
        assert err < 1e-4, name  # fp32 sums over 151,936 terms
    grad_err = (logits.grad.double() - ref.grad).abs()
    scale = ref.grad.abs().max().item()
    print(f"grad: max |fused - fp64| {grad_err.max().item():.2e} of max |grad| {scale:.2e}")
    assert grad_err.max().item() <= scale * 2**-8  # one bf16 rounding of the largest entry


def test_gradient_written_over_the_logits_takes_no_second_copy():
    """The trainer's way (`grad_over_logits`, whole logits that are not a leaf): the Triton
    backward writes the gradient into the logits' own storage, so the backward needs no second
    [B, L, V] tensor, and the gradient is the fp64 one within a bf16 rounding."""
    gen = torch.Generator(device="cuda").manual_seed(0)
    values = (torch.randn(B, L, V, device="cuda", generator=gen) * 2).bfloat16()
    target = torch.randint(0, V, (B, L), device="cuda", generator=gen)
    w_logp, w_ent = torch.randn(2, B, L - 1, device="cuda", generator=gen).unbind(0)
    ref = values.double().requires_grad_()
    logsm = torch.log_softmax(ref / 0.9, dim=-1)[:, :-1]
    ref_logp = logsm.gather(-1, target[:, :-1].unsqueeze(-1)).squeeze(-1)
    ((w_logp * ref_logp).sum() + (w_ent * -(logsm.exp() * logsm).sum(-1)).sum()).backward()
    ref_grad, ref = ref.grad, None
    base = torch.empty_like(values).requires_grad_()
    with megatron_world():
        for _ in range(2):  # the first call compiles the kernels
            base.grad = None
            with torch.no_grad():
                base.copy_(values)
            logits = base.view_as(base)  # contiguous and not a leaf, as an output layer's result
            torch.cuda.synchronize()
            before = torch.cuda.memory_allocated()
            torch.cuda.reset_peak_memory_stats()
            logp, entropy = logprobs_and_entropy(logits, target, temperature=0.9, grad_over_logits=True)
            ((w_logp * logp[:, :-1]).sum() + (w_ent * entropy[:, :-1]).sum()).backward()
            torch.cuda.synchronize()
            extra = torch.cuda.max_memory_allocated() - before
    bf16_logits = values.numel() * 2
    print(f"\npeak beyond the logits, gradient written over them: {extra / bf16_logits:.3f}x the bf16 logits")
    assert extra <= 0.25 * bf16_logits  # per-position numbers only, no [B, L, V] tensor
    err = (base.grad.double() - ref_grad).abs().max().item()
    assert err <= ref_grad.abs().max().item() * 2**-8  # one bf16 rounding of the largest entry
