"""The slower generic path: transformers' own model for families without a compact forward here
(DeepSeek-V3 and its MLA). Same scheduler and sampler, but no paged KV: every step runs each
scheduled sequence's whole prefix again (right-padded batch), so a step costs O(length^2).
Correct everywhere, fast nowhere: meant for tests and small models.
"""

from __future__ import annotations

import torch

from rlx.engine.config import EngineArgs
from rlx.engine.model_runner import EagerStep, ModelRunner, StepResult
from rlx.engine.models.weights import load_weights
from rlx.engine.sampler import Sampler
from rlx.engine.scheduler import ScheduledBatch
from rlx.engine.step_inputs import StepInputs


class HFRunner:
    graphs = None

    def __init__(self, args: EngineArgs, device: torch.device, dtype: torch.dtype, context_length: int):
        from transformers import AutoModelForCausalLM

        self.device, self.args = device, args
        self.model = (
            AutoModelForCausalLM.from_pretrained(
                args.model_path,
                dtype=dtype,
                local_files_only=True,
                attn_implementation=args.attn_implementation,
            )
            .to(device)
            .eval()
        )
        self.vocab_size = int(self.model.config.vocab_size)
        self.sampler = Sampler(args.random_seed, device)

    @torch.inference_mode()
    def run(self, batch: ScheduledBatch) -> StepResult:
        lengths = [s.num_computed + n for s, n in zip(batch.seqs, batch.num_new, strict=True)]
        width = max(lengths)
        ids = [s.token_ids[:n] + [0] * (width - n) for s, n in zip(batch.seqs, lengths, strict=True)]
        mask = [[1] * n + [0] * (width - n) for n in lengths]
        logits = self.model(
            input_ids=torch.tensor(ids, device=self.device),
            attention_mask=torch.tensor(mask, device=self.device),
        ).logits  # [rows, width, V]
        flat = logits.reshape(-1, logits.shape[-1])
        inputs = _inputs(batch, lengths, width, self.device)
        sample_logits = flat[inputs.sample_rows]
        values = ModelRunner._step_values(self, sample_logits, flat, inputs)
        return ModelRunner.collect_eager(self, EagerStep(inputs.sample_seqs, inputs.prompt_owners, values))

    def _prompt_logits(self, flat_logits: torch.Tensor, rows: torch.Tensor) -> torch.Tensor:
        return flat_logits[rows]

    def load_weights(self, path: str, require_all: bool = False) -> int:
        """In place by name; a checkpoint whose names differ from the module's (transformers
        fuses MoE experts) goes through `from_pretrained` into a scratch model first."""
        live = {name: p.data for name, p in self.model.state_dict(keep_vars=True).items()}
        try:
            return load_weights(live, path, require_all=require_all)
        except ValueError as exc:
            if "not a tensor of this model" not in str(exc):
                raise
        from transformers import AutoModelForCausalLM

        scratch, info = AutoModelForCausalLM.from_pretrained(
            path,
            config=self.model.config,
            generation_config=self.model.generation_config,  # buckets carry no generation_config.json
            dtype=self.model.dtype,
            local_files_only=True,
            output_loading_info=True,
        )
        if info.get("missing_keys") or info.get("unexpected_keys"):
            raise ValueError(f"checkpoint at {path} does not match the model: {info}")
        loaded = scratch.state_dict()
        for name, tensor in live.items():
            tensor.copy_(loaded[name])
        return len(loaded)


def _inputs(batch: ScheduledBatch, lengths: list[int], width: int, device) -> StepInputs:
    """Which flat [rows x width] positions give sampled tokens and prompt logprobs."""
    sample_rows, sample_seqs, prompt_rows, targets, owners = [], [], [], [], []
    for row, (seq, end) in enumerate(zip(batch.seqs, lengths, strict=True)):
        if end == seq.num_tokens:
            sample_rows.append(row * width + end - 1)
            sample_seqs.append(seq)
        if seq.wants_input_logprobs:
            first = seq.request.logprob_start_len + len(seq.input_logprobs) - 1
            for p in range(max(first, seq.num_computed), min(end, seq.num_prompt - 1)):
                prompt_rows.append(row * width + p)
                targets.append(seq.token_ids[p + 1])
                owners.append(seq)
    inputs = StepInputs(
        None, None, None, torch.tensor(sample_rows, dtype=torch.int64, device=device), sample_seqs
    )
    if prompt_rows:
        inputs.prompt_rows = torch.tensor(prompt_rows, device=device)
        inputs.prompt_targets = torch.tensor(targets, device=device)
        inputs.prompt_owners = owners
    return inputs
