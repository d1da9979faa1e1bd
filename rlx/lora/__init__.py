"""LoRA on the Megatron policy: the `train.lora` section (`config`), one adapter beside one
tensor-parallel linear layer (`adapter`), putting adapters on a built model (`apply`), and the
PEFT-format export of a trained run's adapters (`peft`)."""
