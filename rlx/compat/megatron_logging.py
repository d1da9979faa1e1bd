"""megatron-core's Megatron-FSDP modules log at INFO when they are imported ("Using Megatron-FSDP
without Transformer Engine", "Detected Megatron Core, using Megatron-FSDP with Megatron"), which
every rlx process does (the driver builds Megatron's TransformerConfig to check a config), and
Hydra's logging shows INFO: three lines about a feature rlx does not use before every run's
output. Their loggers are set to WARNING before megatron is imported; warnings still show."""

from __future__ import annotations

import logging

CHATTY = ("megatron.core.distributed.fsdp",)  # the parent of the modules that log on import


def quiet_import_chatter() -> None:
    for name in CHATTY:
        logging.getLogger(name).setLevel(logging.WARNING)
