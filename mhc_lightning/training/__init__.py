"""The training core: LitLM (the LightningModule) and what it needs to train: schedule, diagnostics, DDP and FSDP."""
