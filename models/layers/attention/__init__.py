"""Attention layers: grouped-query self-attention (`self_attention`), multi-head latent attention
(`latent`), their kernels (`attend`, `cudnn`), RoPE, KV caches and context parallelism."""
