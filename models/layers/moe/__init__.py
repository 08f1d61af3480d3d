"""Mixture-of-experts layers: routers (`routing`, `deepseek_router`), the routed experts'
grouped matmuls (`experts`), the sparse FFN (`sparse`, `ffn`) and its FP8 form (`fp8`)."""
