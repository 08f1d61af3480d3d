"""A decoder's compute, one file per kind of layer: tensor-parallel linear layers, attention,
RoPE, the gated MLP, the mixture-of-experts FFN, and the hyper-connections option. None of them
sums: every sum a stage's output owes is left to its boundary."""
