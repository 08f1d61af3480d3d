"""The decoder every family specializes: the causal LM over one layer stack (`model`), its layers
(`layer`), where their norms sit (`designs`), the mixture-of-experts variant (`moe`) and FP8
reads (`quantized`)."""
