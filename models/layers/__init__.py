"""A decoder's compute, by kind of layer: attention (`attention/`), mixture of experts (`moe/`),
other sequence mixers (`mixers/`), and the shared pieces (tensor-parallel linear layers, MLPs,
activations, hyper-connections). None of them sums: every sum a stage's output owes is left to its
boundary."""
