"""Training backends behind one interface (`base.TrainBackend`), chosen by `base.make_backend`: `torch`
(miles.model, FSDP2 across ranks) and `megatron` (megatron-core GPTModel with an HF weight mapping)."""
